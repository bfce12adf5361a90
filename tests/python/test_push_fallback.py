"""Push mode beside pulls (remote_registry_url and push: true): an item
whose push has not come push_fallback_ms after its request asked is looked
up in the registry and pulled from the ecx producer that holds it, so a
lost push costs a pull, not a failed request (bytes checked in every
rank's encoder_cache by the Engine of test_push_connector); one that
neither a push nor a producer brings fails after push_wait_timeout_s, as
before; _fallback (the failed push's path) pulls at once."""
import os
import time

import torch

import test_push_connector as pc
import test_vllm_steps as steps
from test_push_connector import Request, prefill  # noqa: F401 - fixture
from test_vllm_steps import producers  # noqa: F401 - a fixture
from upstream_encoder import Item

SCALE = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))


def held_item(h):
    """The push Item of an id an ecx producer holds (steps.expected's
    bytes), with a transfer_id that nobody will push."""
    t = steps.expected(h)
    return Item(os.urandom(16).hex(), h, t.view(torch.uint8).numpy().tobytes(),
                list(t.shape), "bfloat16")


def beside_pulls(prefill, url, tp=1, **extra):  # noqa: F811
    return prefill(tp=tp, remote_registry_url=url, push=True, token="tok",
                   timeout_ms=2000, load_timeout_s=4,
                   recv_capacity_bytes="32MiB", **extra)


def test_a_push_that_never_comes_is_pulled(registry, producers,  # noqa: F811
                                           prefill):  # noqa: F811
    reg = registry()
    # Two of each size (64 KiB, 1 MiB, 3.5 MiB).
    names = (steps.mm_hash(f"fb-{i}") for i in range(200))
    hashes = []
    for h in names:
        if sum(steps.shape_of(x) == steps.shape_of(h) for x in hashes) < 2:
            hashes.append(h)
    hashes = sorted(hashes[:6], key=steps.shape_of)
    assert len(hashes) == 6
    producers(reg.url, hashes)
    for tp in (1, 2):
        p = beside_pulls(prefill, reg.url, tp=tp, push_fallback_ms=50)
        eng = p.engine
        for k in range(0, len(hashes), 3):
            items = [held_item(h) for h in hashes[k:k + 3]]
            rid = f"tp{tp}-{k}"
            req = Request(rid, items)
            t0 = time.monotonic()
            eng.add(req)
            eng.step()
            assert rid not in eng.scheduled  # waits for the push first
            assert pc.wait_scheduled(eng, rid, 5 * SCALE) is not None
            took = time.monotonic() - t0
            # The grace, then a lookup and a pull (push_wait_timeout_s is
            # 60 s: nothing but the pull made it schedulable).
            assert 0.05 <= took < 0.05 + 1.5 * SCALE, took
            eng.finish(req)
        st = p.sched.stats()
        assert st["push_fallbacks"] == len(hashes), st
        assert st["items_adopted"] == len(hashes)
        assert not eng.unavailable
        p.close()


def test_nothing_to_pull_fails_as_before(registry, prefill):  # noqa: F811
    reg = registry()
    p = beside_pulls(prefill, reg.url, push_fallback_ms=50,
                     push_wait_timeout_s=0.6)
    eng = p.engine
    it = pc.push_item("nobody", 64)  # neither pushed nor held
    t0 = time.monotonic()
    eng.add(Request("none", [it]))
    eng.run(3 * SCALE)
    waited = time.monotonic() - t0
    assert eng.unavailable == {"none"} and "none" not in eng.scheduled
    assert 0.6 <= waited < 0.6 + 1.5 * SCALE, waited
    st = p.sched.stats()
    assert st.get("push_fallbacks", 0) == 0
    assert st["lookups"] >= 2  # looked up again while it waited


def test_a_push_that_comes_is_not_pulled(registry, prefill):  # noqa: F811
    reg = registry()
    p = beside_pulls(prefill, reg.url, push_fallback_ms=50)
    enc = pc.UpstreamEncoder(control_timeout_s=5, writer=pc.mc_writer())
    try:
        it = pc.push_item("comes", 64)
        assert enc.push(p.base, [it]) == []
        eng = p.engine
        deadline = time.monotonic() + 5 * SCALE
        while not p.sched.has_cache_item(it.mm_hash):  # its events heard
            eng.step()
            assert time.monotonic() < deadline
            time.sleep(0.002)
        eng.add(Request("pushed", [it]))
        assert eng.step() and "pushed" in eng.scheduled
        st = p.sched.stats()
        assert st.get("push_fallbacks", 0) == 0
        assert st.get("lookups", 0) == 0
    finally:
        enc.close()


def test_fallback_pulls_at_once(registry, producers, prefill):  # noqa: F811
    """_fallback, as a failed push's event calls it: no grace."""
    reg = registry()
    h = steps.mm_hash("fb-now")
    producers(reg.url, [h])
    p = beside_pulls(prefill, reg.url, push_fallback_ms=60000)
    eng = p.engine
    it = held_item(h)
    req = Request("now", [it])
    eng.add(req)
    eng.step()
    push = p.sched._scheduler
    t0 = time.monotonic()
    assert push._fallback(req, [h]) == []
    assert pc.wait_scheduled(eng, "now", 3 * SCALE) is not None
    assert time.monotonic() - t0 < 1.0 * SCALE
    # An id nobody holds is handed back, to be failed or waited for.
    gone = steps.mm_hash("fb-nobody")
    assert push._fallback(Request("x", [pc.push_item("x", 8)]),
                          [gone]) == [gone]


def test_a_failed_push_is_pulled_at_once(registry, producers,  # noqa: F811
                                         prefill):  # noqa: F811
    """The writer abandons its reservation (upstream's failure path): the
    shard's failure event makes the request pull the item now, not after
    push_fallback_ms (60 s here) nor push_wait_timeout_s."""
    reg = registry()
    h = steps.mm_hash("fb-failed")
    producers(reg.url, [h])
    p = beside_pulls(prefill, reg.url, push_fallback_ms=60000)
    enc = pc.UpstreamEncoder(control_timeout_s=5, writer=pc.mc_writer())
    try:
        it = held_item(h)
        eng = p.engine
        req = Request("failed", [it])
        eng.add(req)
        eng.step()
        assert "failed" not in eng.scheduled
        assert enc.reserve(p.base, [it]) == [it]
        t0 = time.monotonic()
        enc.abandon(p.base, [it])
        assert pc.wait_scheduled(eng, "failed", 3 * SCALE) is not None
        assert time.monotonic() - t0 < 1.0 * SCALE
        assert not eng.unavailable
        st = p.sched.stats()
        assert st["push_items_failed_events"] == 1, st
        assert st["push_fallbacks"] == 1, st
        eng.finish(req)
    finally:
        enc.close()


def test_a_failed_push_nobody_holds_fails_at_once(registry,  # noqa: F811
                                                  prefill):  # noqa: F811
    reg = registry()
    p = beside_pulls(prefill, reg.url, push_fallback_ms=60000)
    enc = pc.UpstreamEncoder(control_timeout_s=5, writer=pc.mc_writer())
    try:
        it = pc.push_item("lost", 64)
        eng = p.engine
        eng.add(Request("lost", [it]))
        eng.step()
        assert enc.reserve(p.base, [it]) == [it]
        t0 = time.monotonic()
        enc.abandon(p.base, [it])
        deadline = t0 + 3 * SCALE
        while "lost" not in eng.unavailable:
            eng.step()
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert time.monotonic() - t0 < 1.0 * SCALE
        assert "lost" not in eng.scheduled
    finally:
        enc.close()
