"""ECXConnector in today's flow, driven step by step in the order vLLM's
scheduler and V2 model runner call it (../../shared/VLLM.md): a scheduler
instance and two worker ranks in this process, producers in processes of
their own publishing to a standalone `ecx registry`. Every scheduled remote
item must be in each rank's encoder_cache, byte-equal, in the step that
schedules it; nothing may raise, whatever the producers do."""
import functools
import hashlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.path.join(HERE, "vllm_stub")
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, STUB)

from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

from ecx.vllm import ECXConnector, ECXWorkerMetadata  # noqa: E402

SHAPES = [(32, 1024), (512, 1024), (1024, 1792)]  # 64 KiB, 1 MiB, 3.5 MiB


def mm_hash(name):
    return hashlib.sha256(name.encode()).hexdigest()


def shape_of(h):
    return SHAPES[int(h[:8], 16) % len(SHAPES)]


def expected(h):
    g = torch.Generator().manual_seed(int(h[:8], 16))
    return torch.randn(shape_of(h), generator=g).to(torch.bfloat16)


PRODUCER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {stub!r}); sys.path.insert(0, {here!r})
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from ecx.vllm import ECXConnector
    import test_vllm_steps as t
    registry, token, hashes = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_producer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={{"registry": registry, "token": token,
                                    "bind_host": "127.0.0.1",
                                    "capacity_bytes": "64MiB",
                                    "lease_share_pct": 100}}))
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    for h in hashes:
        w.save_caches({{h: t.expected(h)}}, h)
    print("ready", flush=True)
    sys.stdin.read()
    w.shutdown()
""")


class Producer:
    def __init__(self, registry, hashes, token="tok"):
        code = PRODUCER.format(stub=STUB, here=HERE)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, registry, token, *hashes],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        while line.startswith("["):  # UCX's own log lines
            line = self.proc.stdout.readline()
        assert line.startswith("ready"), line

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


@pytest.fixture
def producers():
    started = []

    def start(*a, **kw):
        p = Producer(*a, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.stop()


def config(url, **extra):
    return VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
        ec_role="ec_consumer", ec_buffer_device="cpu",
        ec_connector_extra_config={"remote_registry_url": url,
                                   "token": "tok", "timeout_ms": 2000,
                                   "load_timeout_s": 4,
                                   "recv_capacity_bytes": "48MiB",
                                   **extra}))


class Feature:
    def __init__(self, identifier):
        self.identifier = identifier


class Request:
    def __init__(self, rid, hashes):
        self.request_id = rid
        self.mm_features = [Feature(h) for h in hashes]
        self.remote = {}

    def get_num_encoder_embeds(self, index):
        return shape_of(self.mm_features[index].identifier)[0]


class Engine:
    """vLLM's step, in its order, with the checks its model would make."""

    def __init__(self, sched, workers):
        self.sched = sched
        self.workers = [(w, {}) for w in workers]
        self.waiting = []
        self.scheduled = {}  # rid -> step
        self.unavailable = {}  # rid -> seconds since added
        self.added = {}
        self.steps = 0
        # With idle_aware, each step's output says how many tokens it
        # scheduled (vLLM's total_num_scheduled_tokens; here a request's
        # one), so that the connector knows an idle step.
        self.idle_aware = False

    def add(self, req):
        self.waiting.append(req)
        self.added[req.request_id] = time.monotonic()

    def step(self, report=True):
        self.steps += 1
        now_scheduled = []
        for req in list(self.waiting):
            if not self.sched.ensure_cache_available(req, 0):
                continue
            for i, f in enumerate(req.mm_features):
                req.remote[f.identifier] = self.sched.has_cache_item(
                    f.identifier)
            for i in range(len(req.mm_features)):
                self.sched.update_state_after_alloc(req, i)
            self.waiting.remove(req)
            now_scheduled.append(req)
            self.scheduled[req.request_id] = self.steps
        out = types.SimpleNamespace(
            total_num_scheduled_tokens=len(now_scheduled)) \
            if self.idle_aware else object()
        blob = pickle.dumps(self.sched.build_connector_meta(out))
        metas = []
        for w, cache in self.workers:
            w.bind_connector_metadata(pickle.loads(blob))
            w.start_load_caches(cache)
            for req in now_scheduled:  # the model needs them now
                for h, remote in req.remote.items():
                    if remote:
                        assert h in cache, f"encoder cache miss: {h}"
                        assert torch.equal(cache[h].view(torch.uint8),
                                           expected(h).view(torch.uint8))
                    else:  # encoded here
                        cache[h] = expected(h)
            metas.append(pickle.loads(pickle.dumps(
                w.build_connector_worker_meta())))
            w.clear_connector_metadata()
        if report:
            agg = functools.reduce(lambda a, b: a.aggregate(b), metas)
            self.sched.update_connector_output(
                ECConnectorOutput(ec_connector_worker_meta=agg))
        for rid in self.sched.take_unavailable_requests():
            self.unavailable[rid] = time.monotonic() - self.added[rid]
            req = next(r for r in self.waiting if r.request_id == rid)
            self.waiting.remove(req)
            self.sched.request_finished(req)
        return now_scheduled

    def run(self, seconds, report=True):
        deadline = time.monotonic() + seconds
        while self.waiting and time.monotonic() < deadline:
            self.step(report)
            time.sleep(0.002)

    def finish(self, req):
        for i in range(len(req.mm_features)):
            self.sched.update_state_after_free(req, i)
        self.sched.request_finished(req)
        for _, cache in self.workers:  # vLLM frees its encoder cache
            for f in req.mm_features:
                cache.pop(f.identifier, None)


def connectors(url, ranks=2, **extra):
    sched = ECXConnector(config(url, **extra), ECConnectorRole.SCHEDULER)
    workers = [ECXConnector(config(url, **extra), ECConnectorRole.WORKER)
               for _ in range(ranks)]
    return sched, workers


def shutdown(sched, workers):
    for w in workers:
        w.shutdown()
    sched.shutdown()


def test_remote_items_load_in_the_background(registry, producers):
    reg = registry()
    hashes = [mm_hash(f"img-{i}") for i in range(24)]
    assert {shape_of(h) for h in hashes} == set(SHAPES)
    producers(reg.url, hashes)
    sched, workers = connectors(reg.url)
    eng = Engine(sched, workers)
    reqs = [Request(f"r{k}", hashes[k * 4:(k + 1) * 4]) for k in range(6)]
    nobody = mm_hash("never-saved")
    local = Request("local", [nobody])
    for r in reqs + [local]:
        eng.add(r)
    first = eng.step()
    # Nothing remote to wait for: scheduled at once, encoded here.
    assert [r.request_id for r in first] == ["local"]
    assert local.remote == {nobody: False}
    eng.run(10)
    assert not eng.waiting and not eng.unavailable
    assert all(all(r.remote.values()) for r in reqs)
    st = sched.stats()
    assert st["lookups"] == 25 and st["items_ready"] == 24
    # Each hit was leased at lookup, and released once every rank held it.
    assert st["leases"] == 24 and st["leases_released"] == 24
    # Looked up once: the waiting steps asked nobody.
    assert sched._scheduler._client.connections == 1
    assert st["bytes_remote"] == sum(expected(h).numel() * 2 for h in hashes)
    for w in workers:
        assert w.stats()["bytes_loaded"] == st["bytes_remote"]
    # has_cache_item answers from memory.
    t0 = time.perf_counter()
    for _ in range(1000):
        assert sched.has_cache_item(hashes[0])
    assert (time.perf_counter() - t0) / 1000 < 50e-6
    # Finished requests give their items back, on every rank.
    for r in reqs + [local]:
        eng.finish(r)
    eng.step()
    assert all(not w._worker._held for w in workers)
    assert not sched._scheduler._items and not sched._scheduler._reqs
    shutdown(sched, workers)


@pytest.mark.parametrize("lease_ms", [0, 30000])
def test_producer_killed_after_publishing(registry, producers, lease_ms):
    reg = registry()
    good = [mm_hash(f"good-{i}") for i in range(3)]
    doomed = [mm_hash(f"doomed-{i}") for i in range(3)]
    producers(reg.url, good)
    p = producers(reg.url, doomed)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    sched, workers = connectors(reg.url, load_timeout_s=3,
                                lease_ms=lease_ms)
    eng = Engine(sched, workers)
    eng.add(Request("ok", good))
    dead = Request("dead", doomed)
    mixed = Request("mixed", [good[0], doomed[1]])
    eng.add(dead)
    eng.add(mixed)
    t0 = time.monotonic()
    eng.run(3 + 2)
    if lease_ms:
        # A lease asks the producer itself: the dead one's items are
        # misses at lookup (within its 500 ms connect bound), encoded
        # here, and nobody waits for them.
        assert time.monotonic() - t0 < 3
        assert set(eng.scheduled) == {"ok", "dead", "mixed"}
        assert not eng.unavailable
        assert dead.remote == {h: False for h in doomed}
        assert mixed.remote == {good[0]: True, doomed[1]: False}
        st = sched.stats()
        assert st["leases"] == 3 and st["leases_released"] == 3
        shutdown(sched, workers)
        return
    assert set(eng.scheduled) == {"ok"}
    assert set(eng.unavailable) == {"dead", "mixed"}
    print("unavailable after", eng.unavailable)
    assert max(eng.unavailable.values()) < 3 + 1
    assert sched.stats()["requests_unavailable"] == 2
    shutdown(sched, workers)


def test_one_rank_failing_fails_the_request(registry, producers):
    reg = registry()
    hashes = [mm_hash(f"rank-{i}") for i in range(4)]
    producers(reg.url, hashes)
    sched = ECXConnector(config(reg.url), ECConnectorRole.SCHEDULER)
    good = ECXConnector(config(reg.url), ECConnectorRole.WORKER)
    bad = ECXConnector(config(reg.url, token="wrong"),  # EAUTH on pulls
                       ECConnectorRole.WORKER)
    eng = Engine(sched, [good, bad])
    eng.add(Request("r", hashes))
    eng.run(5)
    assert eng.unavailable.keys() == {"r"} and not eng.scheduled
    assert eng.unavailable["r"] < 3
    eng.step()  # the release reaches the ranks
    assert not good._worker._held and not bad._worker._held
    # Merging: held where every rank holds, failed where any failed.
    a = ECXWorkerMetadata(held={("x", 1), ("y", 2)}, failed={})
    b = ECXWorkerMetadata(held={("x", 1)}, failed={("y", 2): "EAUTH"})
    m = a.aggregate(b)
    assert m.held == {("x", 1)} and m.failed == {("y", 2): "EAUTH"}
    shutdown(sched, [good, bad])


def test_no_worker_news_within_the_deadline(registry, producers):
    """The workers never report (a stuck rank): the request is given up at
    load_timeout_s, not held forever, and never scheduled."""
    reg = registry()
    hashes = [mm_hash("slow-0")]
    producers(reg.url, hashes)
    sched, workers = connectors(reg.url, load_timeout_s=1)
    eng = Engine(sched, workers)
    eng.add(Request("stuck", hashes))
    eng.run(3, report=False)
    assert "stuck" in eng.unavailable and not eng.scheduled
    assert 1 <= eng.unavailable["stuck"] < 2
    shutdown(sched, workers)


def test_registry_down_means_local_encoding(registry):
    reg = registry()
    sched, workers = connectors(reg.url)
    reg.stop()
    eng = Engine(sched, workers)
    eng.add(Request("r", [mm_hash("a"), mm_hash("b")]))
    t0 = time.monotonic()
    eng.step()
    assert time.monotonic() - t0 < 2.5
    assert eng.scheduled == {"r": 1}
    assert sched.stats()["lookup_errors"] == 1
    shutdown(sched, workers)


def test_ec_both_instances_share_through_a_registry(registry):
    """Two ec_both instances: what one encodes, the other loads."""
    reg = registry()

    def both():
        return VllmConfig(ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_role="ec_both",
            ec_buffer_device="cpu",
            ec_connector_extra_config={"registry": reg.url, "token": "tok",
                                       "bind_host": "127.0.0.1",
                                       "capacity_bytes": "16MiB",
                                       "recv_capacity_bytes": "16MiB"}))
    a_worker = ECXConnector(both(), ECConnectorRole.WORKER)
    h = mm_hash("both-0")
    a_worker.save_caches({h: expected(h)}, h)
    sched = ECXConnector(both(), ECConnectorRole.SCHEDULER)
    b_worker = ECXConnector(both(), ECConnectorRole.WORKER)
    eng = Engine(sched, [b_worker])
    eng.add(Request("r", [h, mm_hash("both-1")]))
    eng.run(5)
    assert eng.scheduled and eng.workers[0][1][h] is not None
    assert eng.waiting == [] and not eng.unavailable
    shutdown(sched, [b_worker, a_worker])


def test_an_item_two_requests_share_stays_until_both_let_go(registry,
                                                             producers):
    reg = registry()
    h = mm_hash("shared-0")
    producers(reg.url, [h])
    sched, workers = connectors(reg.url)
    eng = Engine(sched, workers)
    a, b = Request("a", [h]), Request("b", [h])
    eng.add(a)
    eng.run(5)
    assert "a" in eng.scheduled
    lookups = sched.stats()["lookups"]
    # b finds it held already: schedulable at once, no lookup, no pull.
    assert sched.ensure_cache_available(b, 0)
    assert sched.stats()["lookups"] == lookups
    eng.finish(a)  # a lets go in the step b is scheduled in
    eng.add(b)
    eng.step()  # the Engine checks b's item is in every rank's cache
    assert eng.scheduled["b"] == eng.steps
    assert all(w._worker._held for w in workers)
    eng.finish(b)
    eng.step()
    assert all(not w._worker._held for w in workers) and not sched._scheduler._items
    shutdown(sched, workers)


def test_a_hit_loads_under_eviction_pressure(registry, lease_ms=30000):
    """The leases issue's case through the connector: a producer saving
    without pause into an arena that holds about a third of what it
    cycles through, and requests for items saved a while ago (near the
    eviction end). A request whose lookup found its items (a hit) must
    load them: none may come out of take_unavailable_requests, and the
    Engine checks every scheduled remote item is in the cache. (With
    lease_ms=0 two or so requests of fifty come out unavailable here.)"""
    import threading
    reg = registry()
    pool = [mm_hash(f"press-{i}") for i in range(48)]
    tensors = {h: expected(h) for h in pool}
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_producer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={"registry": reg.url, "token": "tok",
                                   "bind_host": "127.0.0.1",
                                   "capacity_bytes": "24MiB"}))
    prod = ECXConnector(cfg, ECConnectorRole.WORKER)
    stop = threading.Event()
    saved = []

    def save():
        k = 0
        while not stop.is_set():
            h = pool[k % len(pool)]
            prod.save_caches({h: tensors[h]}, h)
            saved.append(h)
            k += 1
            time.sleep(0.002)

    t = threading.Thread(target=save)
    t.start()
    sched, workers = connectors(reg.url, ranks=1, lease_ms=lease_ms)
    eng = Engine(sched, workers)
    try:
        while len(saved) < 20:
            time.sleep(0.01)
        deadline = time.monotonic() + 4
        n = 0
        while time.monotonic() < deadline:
            ids = list(dict.fromkeys(saved[-12:-8]))
            req = Request(f"p{n}", ids)
            eng.add(req)
            eng.run(3)
            if req.request_id in eng.scheduled:
                eng.finish(req)
            n += 1
    finally:
        stop.set()
        t.join()
    hits = sum(1 for r in range(n) if f"p{r}" in eng.scheduled)
    assert not eng.unavailable, eng.unavailable
    assert hits == n and n >= 10
    remote = sched.stats()
    assert remote.get("items_remote", 1) > 0
    shutdown(sched, workers)
    prod.shutdown()
