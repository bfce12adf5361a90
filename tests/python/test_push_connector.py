"""ECXConnector as a push-mode consumer (upstream vLLM's wire), driven step
by step in vLLM's order: the scheduler connector and the worker ranks in
this process, configured as upstream's consumer (no registry URL), and
upstream's encoder side (tests/interop/upstream_encoder.py, no ecx code)
pushing over Mooncake's TCP wire (tests/interop/mcwire.py) into the
workers' receive arenas. Every scheduled item must be in each rank's
encoder_cache, byte-equal, in the step that schedules it; nothing may
raise whatever the encoder does."""
import functools
import os
import pickle
import random
import sys
import time
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "vllm_stub"))

from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.config import ParallelConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

import pushkit  # noqa: E402,F401 - tests/interop on the path
import mcwire  # noqa: E402
from ref_producer import Writer  # noqa: E402
from upstream_encoder import Item, UpstreamEncoder  # noqa: E402

from ecx.vllm import ECXConnector  # noqa: E402

HIDDEN = 512


def mc_writer():
    w = Writer(lambda: mcwire.encode_segment("127.0.0.1:1", 1, []), 5.0)

    def write(session, ptr, data):
        ret, why = w.write(session, data, ptr)
        if ret != 0:
            raise OSError(why)
    return write


def push_item(name, tokens):
    """An Item with a fresh transfer_id (as the proxy makes per attempt)."""
    mm = f"mm-{name}".ljust(64, "x")
    data = random.Random(name).randbytes(tokens * HIDDEN * 2)
    return Item(os.urandom(16).hex(), mm, data, [tokens, HIDDEN], "bfloat16")


class Feature:
    def __init__(self, identifier):
        self.identifier = identifier


class Request:
    """A consumer request as the proxy sends it: ec_transfer_params with
    ec_items [{mm_hash, transfer_id}] in item order."""

    def __init__(self, rid, items):
        self.request_id = rid
        self.mm_features = [Feature(i.mm_hash) for i in items]
        self.ec_transfer_params = {"ec_items": [
            {"mm_hash": i.mm_hash, "transfer_id": i.transfer_id}
            for i in items]}
        self.items = items


class Engine:
    """vLLM's step in its order, with the checks its model would make."""

    def __init__(self, sched, workers):
        self.sched = sched
        self.workers = [(w, {}) for w in workers]
        self.waiting = []
        self.scheduled = {}  # rid -> step
        self.unavailable = set()
        self.steps = 0
        self.engine_frees = False  # an engine that does not say

    def add(self, req):
        self.waiting.append(req)

    def step(self, freed=()):
        """freed: what the engine frees this step, said in
        free_encoder_mm_hashes where engine_frees (as vLLM does)."""
        self.steps += 1
        now = []
        for req in list(self.waiting):
            if not self.sched.ensure_cache_available(req, 0):
                continue
            for f in req.mm_features:
                assert self.sched.has_cache_item(f.identifier)
            for i in range(len(req.mm_features)):
                self.sched.update_state_after_alloc(req, i)
            self.waiting.remove(req)
            now.append(req)
            self.scheduled[req.request_id] = self.steps
        out = types.SimpleNamespace(free_encoder_mm_hashes=list(freed)) \
            if self.engine_frees else object()
        blob = pickle.dumps(self.sched.build_connector_meta(out))
        metas = []
        for w, cache in self.workers:
            w.bind_connector_metadata(pickle.loads(blob))
            w.start_load_caches(cache)
            for req in now:
                for it in req.items:
                    assert it.mm_hash in cache, "encoder cache miss"
                    t = cache[it.mm_hash]
                    assert t.dtype == torch.bfloat16
                    assert list(t.shape) == it.shape
                    assert t.view(torch.uint8).numpy().tobytes() == it.data
            assert w.get_finished(set()) == (None, None)
            metas.append(pickle.loads(pickle.dumps(
                w.build_connector_worker_meta())))
            w.clear_connector_metadata()
        agg = functools.reduce(lambda a, b: a.aggregate(b), metas)
        self.sched.update_connector_output(
            ECConnectorOutput(ec_connector_worker_meta=agg))
        for rid in self.sched.take_unavailable_requests():
            self.unavailable.add(rid)
            req = next(r for r in self.waiting if r.request_id == rid)
            self.waiting.remove(req)
            self.sched.request_finished(req)
        return now

    def run(self, seconds):
        deadline = time.monotonic() + seconds
        while self.waiting and time.monotonic() < deadline:
            self.step()
            time.sleep(0.002)

    def finish(self, req):
        for i in range(len(req.mm_features)):
            self.sched.update_state_after_free(req, i)
        self.sched.request_finished(req)
        for _, cache in self.workers:
            for f in req.mm_features:
                cache.pop(f.identifier, None)


def config(port, tp, rank, **extra):
    return VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
            ec_role="ec_consumer", ec_buffer_device="cpu",
            ec_ip="127.0.0.1", ec_port=port, ec_buffer_size=8 << 20,
            engine_id="push-test",
            ec_connector_extra_config={"control_timeout_s": 1, **extra}),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank))


class Prefill:
    """A consumer instance as upstream configures one: the scheduler's
    connector and tp workers' (each serving its shard)."""

    def __init__(self, tp=1, **extra):
        for _ in range(50):
            port = random.randint(20000, 60000 - tp)
            self.workers = []
            try:
                for r in range(tp):
                    self.workers.append(ECXConnector(
                        config(port, tp, r, **extra),
                        ECConnectorRole.WORKER))
                break
            except RuntimeError:  # a port in use: another one
                for w in self.workers:
                    w.shutdown()
        self.sched = ECXConnector(config(port, tp, 0, **extra),
                                  ECConnectorRole.SCHEDULER)
        self.base = f"tcp://127.0.0.1:{port}"
        self.engine = Engine(self.sched, self.workers)

    def shards(self):
        return [w._worker._push.shard for w in self.workers]

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()


@pytest.fixture
def prefill():
    made = []

    def make(**kw):
        p = Prefill(**kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


@pytest.fixture
def encoder():
    made = []

    def make():
        e = UpstreamEncoder(control_timeout_s=5, writer=mc_writer())
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def wait_scheduled(eng, rid, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while rid not in eng.scheduled and time.monotonic() < deadline:
        eng.step()
        time.sleep(0.002)
    return eng.scheduled.get(rid)


@pytest.mark.parametrize("tp", [1, 2])
def test_upstream_encoder_pushes_into_the_connector(prefill, encoder, tp):
    p = prefill(tp=tp)
    enc = encoder()
    items = [push_item(f"a{k}", t) for k, t in enumerate((4, 1024, 3584))]
    req = Request("r0", items)
    eng = p.engine
    eng.add(req)
    eng.step()  # asked before the push: waits
    assert not eng.scheduled
    assert enc.push(p.base, items) == []
    assert wait_scheduled(eng, "r0") is not None
    for w, cache in eng.workers:  # handed without a copy: arena bytes
        base, size = w._worker._push.pool.base, w._worker._push.pool.size
        for it in items:
            addr = cache[it.mm_hash].data_ptr()
            assert base <= addr < base + size
    # Freed by the engine: kept resident, so a second push of the same
    # mm_hash (a new transfer_id) is served from it with nothing written.
    eng.finish(req)
    eng.step()
    again = Item(os.urandom(16).hex(), items[0].mm_hash, items[0].data,
                 items[0].shape, "bfloat16")
    assert enc.push(p.base, [again]) == []
    assert all(r.get("cached") for r in again.shards.values())
    req2 = Request("r1", [again])
    eng.add(req2)
    assert wait_scheduled(eng, "r1") is not None
    assert not eng.unavailable
    eng.finish(req2)
    p.close()
    assert not p.sched.has_pending_push_work()


def test_push_before_the_request_is_ready_in_the_step_it_arrives(
        prefill, encoder):
    p = prefill(tp=2)
    enc = encoder()
    items = [push_item("early", 256)]
    assert enc.push(p.base, items) == []
    eng = p.engine
    # The scheduler hears the events whenever it next asks.
    deadline = time.monotonic() + 5
    while not p.sched.has_cache_item(items[0].mm_hash):
        eng.step()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    eng.add(Request("late", items))
    step = eng.steps + 1
    assert eng.step() and eng.scheduled["late"] == step


def push_on(enc, addr, it):
    """Reserve, write and complete it on one shard only."""
    it.shards = {}
    assert enc.reserve(None, [it], addrs=[addr])
    r = it.shards[addr]
    enc.writer(r["dst_session"], r["dst_ptr"], it.data)
    done = enc.client.call(addr, {"op": "complete",
                                  "transfer_id": it.transfer_id,
                                  "reservation_id": r["reservation_id"]})
    assert done["became_ready"]


def test_every_rank_must_report(prefill, encoder):
    p = prefill(tp=2)
    enc = encoder()
    it = push_item("one-rank", 64)
    (a0, _), (a1, _) = enc.shards(p.base)
    push_on(enc, a0, it)  # one event of two
    eng = p.engine
    eng.add(Request("half", [it]))
    for _ in range(30):
        eng.step()
        time.sleep(0.005)
    assert "half" not in eng.scheduled
    assert not p.sched.has_cache_item(it.mm_hash)
    push_on(enc, a1, it)  # rank 1 has it too: now it is ready
    assert wait_scheduled(eng, "half") is not None


def test_lost_event_makes_the_request_unavailable(prefill, encoder):
    p = prefill(tp=2, push_wait_timeout_s=0.5)
    enc = encoder()
    it = push_item("lost", 64)
    (a0, _), _ = enc.shards(p.base)
    push_on(enc, a0, it)  # rank 1's event never comes, nothing failed
    eng = p.engine
    t0 = time.monotonic()
    eng.add(Request("lost", [it]))
    eng.run(3)
    waited = time.monotonic() - t0
    assert eng.unavailable == {"lost"} and "lost" not in eng.scheduled
    assert 0.5 <= waited < 2.5
    # The engine lives: a request without ec_items (encoded here) is
    # scheduled at once.
    plain = Request("plain", [])
    plain.ec_transfer_params = None
    eng.add(plain)
    assert eng.step() == [plain]


def test_pool_full_is_upstreams_error_and_the_consumer_lives(
        prefill, encoder):
    p = prefill(tp=1)
    enc = encoder()
    big = [push_item(f"big{k}", 3072) for k in range(3)]  # 3 MiB each
    failed = enc.push(p.base, big)
    assert len(failed) == 1
    assert "EC consumer buffer pool is full" in failed[0].error
    eng = p.engine
    ok = [i for i in big if i.error is None]
    eng.add(Request("fits", ok))
    assert wait_scheduled(eng, "fits") is not None


def test_cancel_of_a_finished_request(prefill, encoder):
    p = prefill(tp=2)
    enc = encoder()
    it = push_item("never", 64)
    req = Request("gone", [it])
    eng = p.engine
    eng.add(req)
    eng.step()
    eng.waiting.remove(req)
    eng.finish(req)  # finished (aborted) before its push arrived
    deadline = time.monotonic() + 5
    while p.sched.has_pending_push_work():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Every shard holds a tombstone: upstream's encoder is refused.
    enc.reserve(p.base, [it])
    assert all(r.get("cancelled") for r in it.shards.values()) and \
        len(it.shards) == 2
    for s in p.shards():
        assert s.table.state(it.transfer_id) == "CANCELLED"
    eng.step()  # late events (none) and a dead record do nothing
    assert not eng.unavailable and "gone" not in eng.scheduled


def test_an_unasked_transfer_some_shards_reported_is_dropped(prefill,
                                                             encoder):
    """A transfer whose events came from some shards only, and that no
    request asks for, is dropped (and cancelled) before the shards' TTL
    as a ready one is, not kept for ever."""
    from ecx.vllm.pushflow.scheduler import AVAILABLE_MAX_S
    p = prefill(tp=2)
    enc = encoder()
    sched = p.sched._scheduler
    now = [time.monotonic()]
    sched._clock = lambda: now[0]
    it = push_item("unasked", 64)
    (a0, _), _ = enc.shards(p.base)
    push_on(enc, a0, it)  # one event of two, and no request
    assert pushkit.wait_for(lambda: not p.engine.step() and
                            it.transfer_id in sched._recs)
    now[0] += AVAILABLE_MAX_S + 1
    p.engine.step()
    assert it.transfer_id not in sched._recs
    assert pushkit.wait_for(lambda: p.shards()[0].table.state(
        it.transfer_id) == "CANCELLED")


def test_upstream_encoder_through_upstreams_proxy_flow(prefill, encoder):
    """The cross case as deployed: upstream's proxy (stand-in,
    tests/interop/upstream_proxy.py) gives upstream's encoder side
    (stand-in) its ec_transfer_params, the encoder pushes into an ecx
    prefill of two ranks, the proxy turns the encoder's response into the
    prefill request's ec_transfer_params, and the request is scheduled
    with every item byte-equal in each rank's encoder cache (Engine.step
    checks)."""
    from upstream_proxy import Proxy
    p = prefill(tp=2)
    enc = encoder()
    proxy = Proxy([p.base])
    datas = [(f"flow{k}".ljust(64, "f"), tokens) for k, tokens in
             enumerate((4, 1024, 3584))]
    media = [{"uuid": mm, "modality": "image"} for mm, _ in datas]
    params, _ = proxy.encoder_body(media)
    assert params["consumer_zmq"] == p.base
    items = [Item(e["transfer_id"], mm,
                  random.Random(mm).randbytes(tokens * HIDDEN * 2),
                  [tokens, HIDDEN], "bfloat16")
             for e, (mm, tokens) in zip(params["ec_items"], datas)]
    assert enc.push(params["consumer_zmq"], items) == []
    # what upstream's encoder returns from request_finished (PUSH.md 6)
    response = {it.mm_hash: {"metadata": {"image_grid_thw": [[1, 4, 4]]},
                             "transfer_id": it.transfer_id} for it in items}
    rewritten, cparams = proxy.consumer_body(media, params, response)
    assert [i["type"] for i in rewritten] == ["image_embeds"] * 3
    req = Request("via-proxy", items)
    req.ec_transfer_params = cparams  # the proxy's, not made here
    eng = p.engine
    eng.add(req)
    assert wait_scheduled(eng, "via-proxy") is not None
    assert not eng.unavailable
    eng.finish(req)


def plain(rid, items):
    """A request sent straight to the prefill (no ec_transfer_params):
    vLLM encodes its items here unless has_cache_item says otherwise."""
    req = Request(rid, items)
    req.ec_transfer_params = None
    return req


def pins(p, mm_hash):
    """Each rank's pins on its resident copy of mm_hash (None: none)."""
    out = []
    for s in p.shards():
        res = s.table.resident(mm_hash)
        out.append(None if res is None else res.pins)
    return out


@pytest.mark.parametrize("engine_frees", [False, True])
@pytest.mark.parametrize("first_done", ["A", "B"])
@pytest.mark.parametrize("same_step", [True, False])
def test_a_ready_push_goes_to_whichever_request_allocates_it_first(
        prefill, encoder, same_step, first_done, engine_frees):
    """Request A names the push of X; once X is ready, has_cache_item(X)
    is True for any request, so request B (no ec_transfer_params), asking
    for X before A takes it, is scheduled without encoding it: the ready
    push must be handed over for B (Engine.step checks X is in each rank's
    encoder_cache, byte-equal), A then finds it handed, and the copy stays
    pinned on the shards until both have let go, whichever finishes
    first (or, where the engine says what it frees, until it frees X)."""
    p = prefill(tp=2)
    enc = encoder()
    it = push_item("shared", 256)
    mm = it.mm_hash
    a = Request("A", [it])
    eng = p.engine
    eng.engine_frees = engine_frees
    eng.add(a)
    eng.step()  # A asks before the push: waits
    assert not eng.scheduled
    eng.waiting.remove(a)  # held back (its other items, the budget)
    assert enc.push(p.base, [it]) == []
    deadline = time.monotonic() + 5
    while not p.sched.has_cache_item(mm):
        eng.step()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    b = plain("B", [it])
    eng.add(b)
    if same_step:
        eng.add(a)  # after B: B allocates X first
        assert eng.step() == [b, a]
    else:
        assert eng.step() == [b]
        eng.add(a)
        assert eng.step() == [a]
    assert not eng.unavailable
    assert pins(p, mm) == [1, 1]
    first, second = (a, b) if first_done == "A" else (b, a)
    eng.finish(first)
    eng.step()
    assert pins(p, mm) == [1, 1]  # the other one still uses it
    eng.finish(second)
    eng.step([mm])  # vLLM frees X once no request uses it
    assert pins(p, mm) == [0, 0]  # retired, kept resident
    sched = p.sched._scheduler
    assert not sched._local and not sched._reqs and not sched._recs
    assert not sched._ready_hash and it.transfer_id in sched._tombs
    assert not p.sched.has_cache_item(mm)
    assert not p.sched.has_pending_push_work()  # nothing cancelled
    for s in p.shards():
        assert s.table.state(it.transfer_id) is None  # taken, not ended
    assert p.sched.stats()["push_items_taken"] == 1
    assert not eng.unavailable


def test_a_handed_item_stays_pinned_for_a_request_that_did_not_name_it(
        prefill, encoder):
    """X handed for A (its push); B (no ec_transfer_params) then gets X
    from the handed copy (has_cache_item True): with an engine that does
    not say what it frees, the copy is unpinned on the shards only once
    both have let go, not when A does while B still reads it."""
    p = prefill(tp=2)
    enc = encoder()
    it = push_item("handed", 64)
    a = Request("A", [it])
    eng = p.engine
    eng.add(a)
    assert enc.push(p.base, [it]) == []
    assert wait_scheduled(eng, "A") is not None
    b = plain("B", [it])
    eng.add(b)
    assert eng.step() == [b]
    eng.finish(a)
    eng.step()
    assert pins(p, it.mm_hash) == [1, 1]  # B still reads it
    eng.finish(b)
    eng.step()
    assert pins(p, it.mm_hash) == [0, 0]
    assert not p.sched._scheduler._local


def test_a_ready_push_goes_to_a_pull_request_beside_pulls(registry, prefill,
                                                          encoder):
    """Beside pulls, a request without ec_items goes through the pull flow;
    an item no producer holds is encoded here unless has_cache_item says
    yes, which a ready push for another request makes it say: the push is
    handed to it, and the pull flow is told of its end as before."""
    reg = registry()
    p = prefill(tp=2, remote_registry_url=reg.url, push=True, token="tok",
                timeout_ms=2000, load_timeout_s=4,
                recv_capacity_bytes="32MiB", push_fallback_ms=60000)
    enc = encoder()
    it = push_item("beside", 64)
    assert enc.push(p.base, [it]) == []  # for request A, not yet here
    eng = p.engine
    deadline = time.monotonic() + 5
    while not p.sched.has_cache_item(it.mm_hash):
        eng.step()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    b = plain("B", [it])
    eng.add(b)
    assert wait_scheduled(eng, "B") is not None  # looked up, not held
    a = Request("A", [it])
    eng.add(a)
    assert eng.step() == [a]
    eng.finish(b)
    eng.finish(a)
    eng.step()
    assert pins(p, it.mm_hash) == [0, 0]
    sched = p.sched._scheduler
    assert not sched._local and not sched._reqs and not sched._borrowed
    assert not sched._pull._reqs
    assert p.sched.stats()["push_items_taken"] == 1
    assert not eng.unavailable

def test_the_session_names_the_host_vllm_names(prefill, monkeypatch):
    """The Mooncake session a reservation names (what upstream's encoder
    writes to) carries advertise_host, else VLLM_HOST_IP, as upstream's
    engine names itself; it named the machine's first address that is
    not a loopback one even so, which a peer told 127.0.0.1 need not
    reach."""
    # Neither is libecx's default (this machine's first non-loopback
    # address, or 127.0.0.1): the receiver listens on every address.
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.9")
    assert prefill().shards()[0].pool.session.startswith("127.0.0.9:")
    assert prefill(advertise_host="127.0.0.7").shards()[0].pool.session \
        .startswith("127.0.0.7:")


@pytest.mark.parametrize("extra, bind, env, want", [
    ({"advertise_host": "10.1.1.1"}, "127.0.0.1", "10.2.2.2", "10.1.1.1"),
    ({}, "127.0.0.1", "10.2.2.2", None),  # libecx advertises the bind host
    ({}, "0.0.0.0", "10.2.2.2", "10.2.2.2"),
    ({}, "::", "10.2.2.2", "10.2.2.2"),
    ({}, None, "10.2.2.2", "10.2.2.2"),  # the consumer's: no bind host
    ({}, "0.0.0.0", None, None),  # libecx's default
])
def test_reach_host(monkeypatch, extra, bind, env, want):
    from ecx.vllm.config import Config
    if env is None:
        monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    else:
        monkeypatch.setenv("VLLM_HOST_IP", env)
    assert Config(dict(extra)).reach_host(bind) == want
