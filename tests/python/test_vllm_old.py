"""ECXConnector on an older vLLM, whose EC connector base class has none of
today's hooks (vllm_stub_old): in a process of its own, since a process
imports one vLLM. The connector must pick the synchronous flow by itself,
load in start_load_caches, and raise RuntimeError there for an item that
cannot be loaded (what docs/vllm.md says older vLLM gets)."""
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, {stub!r})
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector import base
    assert not hasattr(base.ECConnectorBase, "ensure_cache_available")
    import ecx
    from ecx import vllm as ev

    assert not ev.VLLM_HAS_ASYNC_HOOKS
    p = ecx.Producer(capacity_bytes=8 << 20, bind_host="127.0.0.1",
                     registry_port=0)
    url = "http://127.0.0.1:%d" % p.registry_port
    t = torch.randn(100, 64).to(torch.bfloat16)
    p.put("old-1", t)
    p.put("old-2", t + 1)

    def cfg(**extra):
        return VllmConfig(ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_role="ec_consumer",
            ec_buffer_device="cpu",
            ec_connector_extra_config=dict(remote_registry_url=url,
                                           timeout_ms=2000,
                                           recv_capacity_bytes="4MiB",
                                           **extra)))

    try:
        ev.ECXConnector(cfg(async_load=True), base.ECConnectorRole.WORKER)
        raise SystemExit("async_load on an old vLLM must be refused")
    except ValueError as e:
        assert "ensure_cache_available" in str(e)

    sched = ev.ECXConnector(cfg(), base.ECConnectorRole.SCHEDULER)
    worker = ev.ECXConnector(cfg(), base.ECConnectorRole.WORKER)

    class F:
        def __init__(self, h):
            self.identifier = h

    class R:
        mm_features = [F("old-1"), F("old-2"), F("not-there")]
        def get_num_encoder_embeds(self, i):
            return 100

    def step():
        hits = [sched.has_cache_item(f.identifier) for f in R.mm_features]
        for i in range(3):
            sched.update_state_after_alloc(R(), i)
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(None)))
        return hits, meta

    hits, meta = step()
    assert hits == [True, True, False], hits
    assert [s.mm_hash for s in meta.loads] == ["old-1", "old-2"]
    worker.bind_connector_metadata(meta)
    cache = {{}}
    worker.start_load_caches(cache)
    assert torch.equal(cache["old-1"], t)
    assert torch.equal(cache["old-2"], t + 1)

    # An item gone between the step's lookup and its load: it raises.
    hits, meta = step()
    p.remove("old-2")
    worker.bind_connector_metadata(meta)
    try:
        worker.start_load_caches({{}})
        raise SystemExit("a failed load must raise on an old vLLM")
    except RuntimeError as e:
        assert "old-2" in str(e) and "could not be loaded" in str(e), e
    worker.shutdown(); sched.shutdown(); p.close()
    print("old vLLM: ok")
""")


def test_older_vllm_gets_the_synchronous_flow():
    code = SCRIPT.format(stub=os.path.join(HERE, "vllm_stub_old"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "old vLLM: ok" in r.stdout


PRESSURE = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, {stub!r})
    from vllm.config import ECTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector import base
    import ecx
    from ecx import vllm as ev

    KiB = 1 << 10
    # 16 items of 512 KiB fit; leases may take half of it (8 items).
    p = ecx.Producer(capacity_bytes=8 << 20, bind_host="127.0.0.1",
                     registry_port=0)
    url = "http://127.0.0.1:%d" % p.registry_port

    def cfg(rank, lease_ms):
        return VllmConfig(
            ec_transfer_config=ECTransferConfig(
                ec_connector="ECXConnector", ec_role="ec_consumer",
                ec_buffer_device="cpu",
                ec_connector_extra_config=dict(
                    remote_registry_url=url, timeout_ms=2000,
                    recv_capacity_bytes="4MiB", lease_ms=lease_ms)),
            parallel_config=ParallelConfig(tensor_parallel_size=2,
                                           rank=rank))

    class F:
        def __init__(self, h):
            self.identifier = h

    class R:
        def __init__(self, rid, h):
            self.request_id = rid
            self.mm_features = [F(h)]
        def get_num_encoder_embeds(self, i):
            return 512

    def blob(k):
        return torch.full((512 * KiB,), k % 251, dtype=torch.uint8)

    n = 0
    def put():
        global n
        p.put("it-%d" % n, blob(n))
        n += 1

    lease_ms = {lease_ms}
    sched = ev.ECXConnector(cfg(0, lease_ms), base.ECConnectorRole.SCHEDULER)
    workers = [ev.ECXConnector(cfg(r, lease_ms), base.ECConnectorRole.WORKER)
               for r in range(2)]
    for _ in range(4):
        put()
    hits = loads = 0
    # An older vLLM calls neither update_state_after_free nor
    # request_finished here: each lease must end with its load.
    for step in range(30):
        put()
        k = n - 3  # saved three puts ago: held, near the young end
        h = "it-%d" % k
        granted = p.stats()["leases_granted"]
        first = sched.has_cache_item(h)
        once = p.stats()["leases_granted"] - granted
        again = sched.has_cache_item(h)  # the same id, the same step
        if lease_ms and first:
            # One lease per rank, taken once in the step.
            twice = p.stats()["leases_granted"] - granted
            assert (once, twice) == (2, 2), (once, twice)
        if not (first and again):
            print("miss at step", step, p.stats())
            continue
        hits += 1
        req = R("r%d" % step, h)
        sched.update_state_after_alloc(req, 0)
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(None)))
        assert [s.mm_hash for s in meta.loads] == [h]
        for w in workers:
            # Between the lookup and each rank's load the producer saves
            # a whole arena's worth: only a lease keeps the item.
            for _ in range(16):
                put()
            w.bind_connector_metadata(meta)
            cache = {{}}
            try:
                w.start_load_caches(cache)
            except RuntimeError as e:
                raise SystemExit("a hit failed to load: %s" % e)
            assert torch.equal(cache[h], blob(k)), h
            w.clear_connector_metadata()
        loads += 1
    st = p.stats()
    print("hits", hits, "loads", loads, st)
    assert hits == 30, (hits, st)
    # Every lease ended at its rank's pull: none is left.
    assert st["leases"] == 0 and st["leases_used"] == 2 * loads, st

    # A hit whose request is freed before any load: its leases end at the
    # next step's metadata.
    h = "it-%d" % (n - 1)
    assert sched.has_cache_item(h)
    req = R("early", h)
    sched.update_state_after_alloc(req, 0)
    sched.build_connector_meta(None)
    assert p.stats()["leases"] == 2, p.stats()
    sched.request_finished(req)
    sched.build_connector_meta(None)
    assert p.stats()["leases"] == 0, p.stats()
    for w in workers:
        w.shutdown()
    sched.shutdown(); p.close()
    print("pressure: ok")
""")


def run_pressure(lease_ms):
    code = PRESSURE.format(stub=os.path.join(HERE, "vllm_stub_old"),
                           lease_ms=lease_ms)
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))


def test_sync_flow_leases_end_at_their_loads_under_eviction():
    """The synchronous flow of an older vLLM (no update_state_after_free,
    no request_finished), two tensor-parallel ranks, a producer that
    saves an arena's worth between a lookup and each rank's load: every
    lookup of a held item is a hit, asking twice in a step takes no second
    lease, every hit loads on both ranks, and no lease is left once the
    loads are done (each rank's pull ends its own); a request freed before
    its loads releases its leases."""
    r = run_pressure(30000)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pressure: ok" in r.stdout


def test_sync_flow_without_leases_fails_under_eviction():
    """The same run with lease_ms 0: the window the leases close is real
    (a hit is evicted before its load, and the load raises)."""
    r = run_pressure(0)
    assert r.returncode != 0
    assert "a hit failed to load" in r.stdout + r.stderr, r.stdout + r.stderr
