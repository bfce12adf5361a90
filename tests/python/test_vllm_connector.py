"""ECXConnector's synchronous flow (what an older vLLM gets, and
async_load: false), driven as vLLM drives it: a producer connector in
another process saves encoder outputs; a consumer's scheduler instance
finds them, its metadata is pickled to worker instances (two
tensor-parallel ranks), which load them. Uses vLLM when it is installed,
the stand-in otherwise. test_vllm_steps.py drives today's flow."""
import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ecx

try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "vllm_stub"))

from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)

from ecx.vllm import ECXConnector, ECXConnectorMetadata  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ITEMS = {  # id -> (tokens, width, dtype)
    "a" * 64: (16, 3584, "bfloat16"),
    "lora1:" + "b" * 64: (529, 3584, "bfloat16"),
    "c" * 64: (3, 128, "float32"),
    "d" * 64: (1369, 1024, "float16"),
}


def expected(mm_hash):
    tokens, width, dtype = ITEMS[mm_hash]
    g = torch.Generator().manual_seed(sum(map(ord, mm_hash)))
    return (torch.randn((tokens, width), generator=g) * 2).to(
        getattr(torch, dtype))


PRODUCER = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {stub!r})
    sys.path.insert(0, {here!r})
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from ecx.vllm import ECXConnector
    import test_vllm_connector as t
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
        ec_role="ec_producer", ec_buffer_device="cpu",
        ec_connector_extra_config={{"registry_http_port": 0,
                                    "bind_host": "127.0.0.1",
                                    "capacity_bytes": 64 << 20}}))
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    for h in t.ITEMS:
        w.save_caches({{h: t.expected(h)}}, h)
    print("ready", w._worker._producer.registry_port, flush=True)
    sys.stdin.read()
    w.shutdown()
""")


@pytest.fixture
def producer():
    code = PRODUCER.format(stub=os.path.join(HERE, "vllm_stub"), here=HERE)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    line = p.stdout.readline()
    while line.startswith("["):  # UCX's own log lines
        line = p.stdout.readline()
    assert line.startswith("ready"), line
    port = int(line.split()[1])
    yield p, f"http://127.0.0.1:{port}"
    if p.poll() is None:
        p.stdin.close()
        p.wait(10)


def consumer_config(url, **extra):
    extra.setdefault("async_load", False)
    return VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
        ec_role="ec_consumer", ec_buffer_device="cpu",
        ec_connector_extra_config={"remote_registry_url": url,
                                   "timeout_ms": 2000,
                                   "recv_capacity_bytes": 16 << 20,
                                   **extra}))


class Feature:
    def __init__(self, identifier):
        self.identifier = identifier


class Request:
    """The two things update_state_after_alloc reads of a request."""

    def __init__(self, hashes):
        self.mm_features = [Feature(h) for h in hashes]

    def get_num_encoder_embeds(self, index):
        h = self.mm_features[index].identifier
        return ITEMS[h][0] if h in ITEMS else 7


def schedule(sched, hashes):
    """One scheduler step: check, allocate, build the metadata."""
    req = Request(hashes)
    hits = [sched.has_cache_item(h) for h in hashes]
    for i in range(len(hashes)):  # vLLM calls it for local encodes too
        sched.update_state_after_alloc(req, i)
    meta = sched.build_connector_meta(scheduler_output=object())
    return hits, pickle.loads(pickle.dumps(meta))


def test_connector_end_to_end(producer):
    _, url = producer
    sched = ECXConnector(consumer_config(url), ECConnectorRole.SCHEDULER)
    hashes = list(ITEMS) + ["e" * 64]  # the last one is encoded locally
    hits, meta = schedule(sched, hashes)
    assert hits == [True] * len(ITEMS) + [False]
    assert isinstance(meta, ECXConnectorMetadata)
    assert [s.mm_hash for s in meta.loads] == list(ITEMS)
    assert meta.loads[1].num_token == 529
    # Tensor parallel: every rank's worker loads the same items.
    for rank in range(2):
        worker = ECXConnector(consumer_config(url), ECConnectorRole.WORKER)
        worker.bind_connector_metadata(meta)
        cache = {}
        worker.start_load_caches(cache)
        worker.clear_connector_metadata()
        assert set(cache) == set(ITEMS)
        for h, t in cache.items():
            want = expected(h)
            assert t.dtype == want.dtype and t.shape == want.shape
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))
        # Items already in the cache are not loaded again.
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(cache)
        worker.save_caches(cache, list(ITEMS)[0])  # a consumer ignores it
        worker.shutdown()
    # The next step starts clean.
    _, meta2 = schedule(sched, [])
    assert meta2.loads == []
    sched.shutdown()


def test_producer_gone(producer):
    proc, url = producer
    sched = ECXConnector(consumer_config(url), ECConnectorRole.SCHEDULER)
    hits, meta = schedule(sched, list(ITEMS)[:2])
    assert hits == [True, True]
    proc.kill()
    proc.wait()
    # has_cache_item: False, quickly (its registry went with it).
    t0 = time.monotonic()
    assert not sched.has_cache_item(list(ITEMS)[0])
    assert time.monotonic() - t0 < 1.0
    # A load scheduled before it died fails with a clear error, in time.
    worker = ECXConnector(consumer_config(url), ECConnectorRole.WORKER)
    worker.bind_connector_metadata(meta)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        worker.start_load_caches({})
    assert time.monotonic() - t0 < 2.0 + 1.0
    assert "could not be loaded" in str(e.value)
    assert list(ITEMS)[0] in str(e.value)
    worker.shutdown()
    sched.shutdown()


def test_has_cache_item_is_cheap_and_persistent(producer):
    _, url = producer
    sched = ECXConnector(consumer_config(url), ECConnectorRole.SCHEDULER)
    h = list(ITEMS)[2]
    assert sched.has_cache_item(h)
    t0 = time.monotonic()
    for _ in range(200):
        sched.build_connector_meta(None)  # a new step asks again
        assert sched.has_cache_item(h)
        assert sched.has_cache_item(h)  # the same step: no second lookup
        assert not sched.has_cache_item("f" * 64)
    per_call = (time.monotonic() - t0) / 600
    assert per_call < 0.01  # a bound, not a benchmark: see bench/
    # One persistent registry connection, reused.
    assert sched._scheduler._client.connections == 1
    assert sched.stats()["lookups"] == 401
    sched.shutdown()


def test_misconfiguration_is_an_error_at_construction():
    # No registry URL is upstream's push-mode consumer; with push off it
    # has nothing to serve.
    with pytest.raises(ValueError, match="remote_registry_url"):
        ECXConnector(consumer_config("", push=False),
                     ECConnectorRole.SCHEDULER)
    # Push mode needs today's hooks.
    with pytest.raises(ValueError, match="ensure_cache_available"):
        ECXConnector(consumer_config(""), ECConnectorRole.SCHEDULER)
    with pytest.raises(ValueError, match="ec_buffer_size"):
        ECXConnector(VllmConfig(ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_role="ec_consumer",
            ec_buffer_size=1.5)), ECConnectorRole.SCHEDULER)
    with pytest.raises(ValueError, match="push_wait_timeout_s"):
        ECXConnector(consumer_config("", async_load="auto",
                                     push_wait_timeout_s=0),
                     ECConnectorRole.SCHEDULER)
    with pytest.raises(ValueError, match="ec_port"):
        ECXConnector(VllmConfig(ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_role="ec_consumer",
            ec_port=65536)), ECConnectorRole.SCHEDULER)
    for port in ("abc", True, 14579.5):
        with pytest.raises(ValueError, match="ec_port is a port number"):
            ECXConnector(VllmConfig(ec_transfer_config=ECTransferConfig(
                ec_connector="ECXConnector", ec_role="ec_consumer",
                ec_port=port)), ECConnectorRole.SCHEDULER)
    # each wrong type named by its key, never a bare Python error
    for key, value in (("push_token", 12345), ("push", 1),
                       ("control_timeout_s", True),
                       ("push_wait_timeout_s", "soon"),
                       ("push_fallback_ms", "100")):
        with pytest.raises(ValueError, match=key):
            ECXConnector(consumer_config("", async_load="auto",
                                         **{key: value}),
                         ECConnectorRole.SCHEDULER)
    bad = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_observer"))
    with pytest.raises(ValueError, match="unknown ec_role"):
        ECXConnector(bad, ECConnectorRole.WORKER)


def test_reference_keys_are_understood(producer, caplog):
    _, url = producer
    c = ECXConnector(consumer_config(url, mooncake_protocol="rdma",
                                     registry_http_port=9018),
                     ECConnectorRole.SCHEDULER)
    assert c._cfg.registry == url and c._cfg.transport is None
    assert "mooncake_protocol" in caplog.text
    c2 = ECXConnector(consumer_config([url, "http://127.0.0.1:1"],
                                      mooncake_protocol="tcp"),
                      ECConnectorRole.SCHEDULER)
    assert c2._cfg.registry == url + ",http://127.0.0.1:1"
    assert c2._cfg.transport == "tcp"
    assert c2.has_cache_item(list(ITEMS)[0])
    c.shutdown()
    c2.shutdown()


def test_sizes_take_units_and_default_from_ec_buffer_size():
    from ecx.vllm.config import Config as _Config, parse_size
    assert parse_size("8GiB", "k") == 8 << 30
    assert parse_size("1.5 MiB", "k") == 3 << 19
    assert parse_size("2GB", "k") == 2 * 10 ** 9
    assert parse_size("64K", "k") == 64 << 10  # as the command line reads K
    assert parse_size(1e9, "k") == 10 ** 9 and parse_size(7, "k") == 7
    for bad in ("8 parsecs", "-1", "", "GiB", True, [1], -5):
        with pytest.raises(ValueError) as e:
            parse_size(bad, "capacity_bytes")
        assert "capacity_bytes" in str(e.value)
    c = _Config({"capacity_bytes": "8GiB"}, buffer_size=1e9)
    assert c.capacity_bytes == 8 << 30 and c.recv_capacity_bytes == 10 ** 9
    c = _Config({}, buffer_size=2e8)
    assert c.capacity_bytes == c.recv_capacity_bytes == 2 * 10 ** 8
    with pytest.raises(ValueError, match="recv_capacity_bytes"):
        _Config({"recv_capacity_bytes": "lots"})


def test_a_registry_url_needs_its_scheme():
    for url in ("10.0.0.2:9018", ["http://a:1", "b:2"], "tcp://x:1"):
        with pytest.raises(ValueError, match="remote_registry_url") as e:
            ECXConnector(consumer_config(url), ECConnectorRole.SCHEDULER)
        assert "http://HOST:PORT" in str(e.value)
    with pytest.raises(ValueError, match="'registry'"):
        ECXConnector(VllmConfig(ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_role="ec_producer",
            ec_connector_extra_config={"registry": "localhost:9018"})),
            ECConnectorRole.WORKER)


def test_a_sentinel_url_keeps_its_commas():
    from ecx.vllm.config import Config as _Config, split_urls
    urls = "redis+sentinel://:pw@a:1, b:2,c/m,http://d:3 ,REDIS://e:4"
    assert [u.strip() for u in split_urls(urls)] == [
        "redis+sentinel://:pw@a:1, b:2,c/m", "http://d:3", "REDIS://e:4"]
    c = _Config({"registry": ["redis+sentinel://a:1,b:2/m", "http://d:3"]})
    assert c.registry == "redis+sentinel://a:1,b:2/m,http://d:3"
    # Other URLs still end at their first comma.
    with pytest.raises(ValueError, match="'b:2'"):
        _Config({"registry": "http://a:1,b:2"})


def test_producer_arena_is_made_at_construction(monkeypatch):
    monkeypatch.setenv("ECX_TOKEN", "from-env")
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_producer",
        ec_buffer_device="cpu", ec_buffer_size=3 << 20,
        ec_connector_extra_config={"registry_http_port": 0,
                                   "bind_host": "127.0.0.1"}))
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    assert w._worker._producer is not None  # before any save_caches
    assert w._worker._producer.stats()["capacity"] == 3 << 20  # ec_buffer_size
    w.save_caches({"x": torch.ones(4)}, "x")
    url = f"http://127.0.0.1:{w._worker._producer.registry_port}"
    # The token came from ECX_TOKEN: a pull without it is refused.
    with ecx.Consumer(url, token="") as c:
        it = c.lookup(["x"])[0]
        assert c.load_into([(it, it.empty())])[0].name == "EAUTH"
    with ecx.Consumer(url) as c:
        assert torch.equal(c.load(c.lookup(["x"]))[0], torch.ones(4))
    w.shutdown()
