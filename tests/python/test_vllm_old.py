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
