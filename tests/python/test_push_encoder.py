"""ECXConnector as a push-mode encoder (upstream vLLM's wire), driven in
vLLM's order: its scheduler plans a push per item of a request whose
ec_transfer_params name consumer_zmq, its worker reserves before the
encoder runs, pushes when save_caches binds the output (never in the
step), completes with the item's hash, abandons on failure;
request_finished returns upstream's proxy map. Into upstream's consumer
side (tests/interop/upstream_consumer.py, behind mcwire's Mooncake
servers) and into an ecx consumer connector through upstream's proxy
flow (tests/interop/upstream_proxy.py); faults: a shard killed mid-push,
a failed push heard as an event within 1 s (not push_wait_timeout_s),
bytes changed in the producer's arena after put caught at the consumer.
Real sockets on 127.0.0.1, bytes checked."""
import ctypes
import json
import os
import pickle
import random
import threading
import time

import pytest
import torch

import ecx
import pushkit  # noqa: F401 - the vllm stub and tests/interop on the path
from test_push_connector import (HIDDEN, Request as PrefillRequest,
                                 mc_writer, prefill, push_item,  # noqa: F401
                                 wait_scheduled)
from upstream_consumer import Shard
from upstream_encoder import EventSubscriber, Item, UpstreamEncoder
from upstream_proxy import Proxy
from test_cuda import fake, fake_libcuda, gpu_config, standin  # noqa: F401
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.v1.outputs import ECConnectorOutput

from ecx.vllm import ECXConnector
from ecx.vllm.push.pusher import PushSpec, Pusher
from ecx.vllm.pushflow.encoder import REPORT_LAG_STEPS


class ModelConfig:
    """What upstream reads of vLLM's model config to plan a push."""

    def __init__(self, width=HIDDEN, dtype=torch.bfloat16):
        self.hf_config = None
        self.dtype = dtype
        self._width = width
        # what the stand-in of vLLM's metadata resolver reads
        self.placeholder_fields = {"image": {"image_grid_thw"}}

    def get_inputs_embeds_size(self):
        return self._width


class Pos:
    def __init__(self, offset, length):
        self.offset, self.length = offset, length


class Data:
    def __init__(self, **fields):
        self._fields = fields

    def get_data(self):
        return dict(self._fields)


class Feature:
    def __init__(self, identifier, tokens, offset, data=None):
        self.identifier = identifier
        self.mm_position = Pos(offset, tokens)
        self.modality = "image"
        self.data = data


class EncRequest:
    """An encoder request as upstream's proxy sends it: one feature per
    item (identifier = the item's uuid), ec_transfer_params from the
    proxy."""

    def __init__(self, rid, hashes_tokens, params, data=None):
        self.request_id = rid
        off, self.mm_features = 0, []
        for h, t in hashes_tokens:
            self.mm_features.append(Feature(h, t, off, data))
            off += t
        self.ec_transfer_params = params

    def get_num_encoder_embeds(self, index):
        return self.mm_features[index].mm_position.length


def xxh3_of(data):
    buf = ctypes.create_string_buffer(data, len(data))
    return ecx.xxh3(ctypes.addressof(buf), len(data))


def tensor_of(name, tokens):
    data = random.Random(name).randbytes(tokens * HIDDEN * 2)
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(
        tokens, HIDDEN), data


class Encoder:
    """An encoder instance: the scheduler's connector and rank 0's, an ecx
    Producer behind it (embedded registry on a free port)."""

    def __init__(self, model=True, **extra):
        cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
            ec_role="ec_producer", ec_buffer_device="cpu",
            engine_id="push-enc",
            ec_connector_extra_config={
                "registry_http_port": 0, "bind_host": "127.0.0.1",
                "capacity_bytes": 64 << 20, "control_timeout_s": 1,
                **extra}))
        if model:
            cfg.model_config = ModelConfig()
        self.sched = ECXConnector(cfg, ECConnectorRole.SCHEDULER)
        self.worker = ECXConnector(cfg, ECConnectorRole.WORKER)
        self.cache = {}
        self.finished = set()

    def plan(self, req):
        """Scheduling of req and the worker's start of the step; returns
        the step's metadata as the worker got it."""
        assert self.sched.ensure_cache_available(req, 0)
        for i in range(len(req.mm_features)):
            assert not self.sched.has_cache_item(req.mm_features[i]
                                                 .identifier)
            self.sched.update_state_after_alloc(req, i)
        meta = pickle.loads(pickle.dumps(
            self.sched.build_connector_meta(object())))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_save_caches(encoder_cache=self.cache)
        return meta

    def encode(self, outputs):
        """The encoder ran: save_caches per output; the step's end."""
        for h, t in outputs.items():
            self.cache[h] = t
            t0 = time.monotonic()
            self.worker.save_caches(self.cache, h)
            assert time.monotonic() - t0 < 0.25, "save_caches blocked"
        self.end_step()

    def end_step(self):
        self.worker.get_finished(self.finished)
        self.finished = set()
        wm = pickle.loads(pickle.dumps(
            self.worker.build_connector_worker_meta()))
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(
            ECConnectorOutput(ec_connector_worker_meta=wm))
        return self.sched.take_unavailable_requests()

    def finish(self, req):
        self.finished.add(req.request_id)
        return self.sched.request_finished(req)

    def step(self):
        """A step with nothing scheduled (vLLM keeps stepping while
        has_pending_push_work)."""
        meta = pickle.loads(pickle.dumps(
            self.sched.build_connector_meta(object())))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_save_caches(encoder_cache=self.cache)
        self.end_step()

    def drain(self, timeout_s=5.0):
        """Steps until no push is pending; the seconds it took."""
        t0 = time.monotonic()
        while self.sched.has_pending_push_work():
            assert time.monotonic() - t0 < timeout_s, "pushes never ended"
            self.step()
            time.sleep(0.005)
        return time.monotonic() - t0

    def pushes(self):
        return self.worker._worker._pushes

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


@pytest.fixture
def encoder():
    made = []

    def make(**kw):
        e = Encoder(**kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def upstream_consumer(tp, slab=8 << 20):
    for _ in range(50):
        port, shards = random.randint(20000, 60000 - tp), []
        try:
            for r in range(tp):
                shards.append(Shard(port, tp, r, slab))
            return shards
        except Exception:
            for s in shards:
                s.stop()
    raise RuntimeError("no free ports")


@pytest.mark.parametrize("model", [True, False])
def test_encoder_connector_into_upstream_consumer(encoder, model):
    shards = upstream_consumer(2)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder(model=model)
        proxy = Proxy([base])
        names = [(f"enc-{model}-{k}".ljust(64, "u"), t)
                 for k, t in enumerate((16, 2048))]
        params, _ = proxy.encoder_body([{"uuid": h} for h, _ in names])
        req = EncRequest("e0", names, params)
        meta = enc.plan(req)
        tids = [e["transfer_id"] for e in params["ec_items"]]
        assert [p.transfer_id for p in meta.pushes] == tids
        assert enc.sched.has_pending_push_work()
        if model:  # reserved before the encoder runs, on every shard
            assert pushkit.wait_for(lambda: all(
                t in sh.records for sh in shards for t in tids))
            for sh in shards:
                assert [r["op"] for r in sh.requests
                        if r["op"].startswith("reserve")] == ["reserve_batch"]
                assert all(sh.records[t]["state"] == "WRITING" for t in tids)
        sub = EventSubscriber(enc.pushes().pusher.shards(base))
        outs = {h: tensor_of(h, t) for h, t in names}
        enc.encode({h: t for h, (t, _) in outs.items()})
        ok, items = enc.finish(req)
        assert ok is False
        assert items == {h: {"metadata": {}, "transfer_id": tid}
                         for (h, _), tid in zip(names, tids)}
        enc.drain()
        assert sub.wait_ready(tids)
        for sh in shards:
            for (h, _), tid in zip(names, tids):
                rec = sh.records[tid]
                assert rec["state"] == "READY" and rec["mm_hash"] == h
                data = outs[h][1]
                assert sh.read(sh.addr + rec["off"], len(data)) == data
            # without the integrity key no hash rides in complete_batch
            # (test_integrity_key_pushes_the_hash_made_at_put)
            done = [r for r in sh.requests if r["op"] == "complete_batch"]
            assert {e["transfer_id"] for r in done
                    for e in r["items"]} >= set(tids)
            assert not any("ecx_xxh3" in e for r in done
                           for e in r["items"])
        assert enc.pushes().done[-2:] and all(
            e is None for _, e in enc.pushes().done)
        assert enc.sched.stats()["pushes_planned"] == 2
        assert enc.worker.stats()["pushes_done"] == 2
        sub.close()
    finally:
        for s in shards:
            s.stop()


def test_request_without_ec_transfer_params_is_pulled_as_before(encoder):
    enc = encoder()
    h = "plain".ljust(64, "p")
    req = EncRequest("p0", [(h, 8)], None)
    meta = enc.plan(req)
    assert meta.pushes == []
    t, data = tensor_of(h, 8)
    enc.encode({h: t})
    assert enc.finish(req) == (False, None)
    assert not enc.sched.has_pending_push_work()
    url = f"http://127.0.0.1:{enc.worker._worker._producer.registry_port}"
    with ecx.Consumer(url) as c:
        found = c.lookup([h])[0]
        out = found.empty()
        assert c.load_into([(found, out)]) == [None]
        assert out.view(torch.uint8).numpy().tobytes() == data


@pytest.mark.parametrize("token,integrity", [(None, False), ("s3cret", False),
                                             (None, True)])
def test_whole_flow_through_the_proxy(encoder, prefill, token, integrity):
    """With the integrity key the ecx_fetch entries carry the hash made at
    put, which each shard checks against the bytes it pulled; without it
    nothing is hashed (as for pulls), except with a token, whose shards
    check every push (Mooncake's wire carries no token)."""
    extra = {"push_token": token} if token else {}
    p = prefill(tp=2, **extra)
    enc = encoder(**extra, **({"integrity": True} if integrity else {}))
    checked = []
    for sh in p.shards():
        def spy(addr, nbytes, f=sh.pool.xxh3):
            h = f(addr, nbytes)
            checked.append(h)
            return h
        sh.pool.xxh3 = spy
    proxy = Proxy([p.base])
    names = [(f"flow{k}".ljust(64, "f"), t) for k, t in
             enumerate((4, 1024, 3584))]
    media = [{"uuid": h, "modality": "image"} for h, _ in names]
    params, _ = proxy.encoder_body(media)
    grid = Data(image_grid_thw=torch.tensor([[1, 4, 4]]),
                pixel_values=torch.zeros(16, 8))
    req = EncRequest("enc-1", names, params, data=grid)
    enc.plan(req)
    outs = {h: tensor_of(h, t) for h, t in names}
    enc.encode({h: t for h, (t, _) in outs.items()})
    _, response = enc.finish(req)  # the chat response's ec_transfer_params
    for e in response.values():  # vLLM's placeholder fields, as lists
        assert e["metadata"] == {"image_grid_thw": [[1, 4, 4]]}
    rewritten, cparams = proxy.consumer_body(media, params, response)
    assert [i["type"] for i in rewritten] == ["image_embeds"] * 3
    assert rewritten[0]["image_embeds"] == {"image_grid_thw": [[1, 4, 4]]}
    assert "consumer_zmq" not in cparams
    # The prefill request, sent once every encoder response is back (the
    # pushes may still be in flight).
    items = [Item(e["transfer_id"], e["mm_hash"], outs[e["mm_hash"]][1],
                  [t, HIDDEN], "bfloat16")
             for e, (_, t) in zip(cparams["ec_items"], names)]
    preq = PrefillRequest("pd-1", items)
    preq.ec_transfer_params = cparams
    eng = p.engine
    eng.add(preq)
    enc.drain()
    assert wait_scheduled(eng, "pd-1") is not None  # bytes checked there
    assert not eng.unavailable
    for sh in p.shards():  # ecx into ecx: fetched over UCX, every window
        assert len(sh.pool.landed) == 3  # closed with nothing from
        assert set(sh.pool.landed.values()) == {0}  # Mooncake's wire
    want = sorted(xxh3_of(outs[h][1]) for h, _ in names) * 2  # two ranks
    assert sorted(checked) == (sorted(want) if integrity or token else [])
    eng.finish(preq)


def test_shard_killed_mid_push(encoder):
    shards = upstream_consumer(2)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder()
        h = "killed".ljust(64, "k")
        params, _ = Proxy([base]).encoder_body([{"uuid": h}])
        tid = params["ec_items"][0]["transfer_id"]
        req = EncRequest("k0", [(h, 2048)], params)
        enc.plan(req)
        assert pushkit.wait_for(lambda: all(tid in s.records
                                            for s in shards))
        shards[1].stop()  # reserved, then gone before the write
        t0 = time.monotonic()
        enc.encode({h: tensor_of(h, 2048)[0]})
        assert time.monotonic() - t0 < 0.5  # the step did not wait
        enc.finish(req)
        took = enc.drain(timeout_s=10)
        assert took < 6  # write and control timeouts, each bounded
        assert not enc.sched.has_pending_push_work()
        assert enc.worker.stats()["pushes_failed"] == 1
        (_, why), = enc.pushes().done
        assert why
        assert shards[0].records[tid]["state"] == "CANCELLED"
        assert shards[0].allocs == {}
        aband = [r for r in shards[0].requests if r["op"] == "cancel"]
        assert aband and all(r.get("abandon") is True for r in aband)
    finally:
        shards[0].stop()


def test_unbound_push_is_abandoned_when_its_request_finishes(encoder):
    shards = upstream_consumer(1)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder()
        h = "never".ljust(64, "n")
        params, _ = Proxy([base]).encoder_body([{"uuid": h}])
        tid = params["ec_items"][0]["transfer_id"]
        req = EncRequest("n0", [(h, 64)], params)
        enc.plan(req)
        enc.end_step()  # the encoder output never comes
        enc.finish(req)
        enc.drain()
        assert shards[0].records[tid]["state"] == "CANCELLED"
        assert shards[0].allocs == {}
    finally:
        shards[0].stop()


def test_failed_push_reaches_the_consumer_at_once(encoder, prefill):
    # push_wait_timeout_s is 60 s; the failure must be heard within 1 s.
    p = prefill(tp=2, push_wait_timeout_s=60)
    enc = encoder()
    h = "toobig".ljust(64, "b")
    tokens = (9 << 20) // (HIDDEN * 2)  # 9 MiB: more than the 8 MiB pool
    params, _ = Proxy([p.base]).encoder_body([{"uuid": h}])
    tid = params["ec_items"][0]["transfer_id"]
    req = EncRequest("b0", [(h, tokens)], params)
    preq = PrefillRequest("pd-b", [Item(tid, h, b"", [tokens, HIDDEN],
                                        "bfloat16")])
    eng = p.engine
    eng.add(preq)
    eng.step()
    t0 = time.monotonic()
    enc.plan(req)  # refused by every shard: abandoned at once
    while "pd-b" not in eng.unavailable and time.monotonic() - t0 < 5:
        eng.step()
        time.sleep(0.002)
    heard = time.monotonic() - t0
    assert eng.unavailable == {"pd-b"} and "pd-b" not in eng.scheduled
    assert heard < 1.0
    # A request that asks after the failure fails at its first ask.
    late = PrefillRequest("pd-late", [Item(tid, h, b"", [tokens, HIDDEN],
                                           "bfloat16")])
    eng.add(late)
    eng.step()
    assert "pd-late" in eng.unavailable
    enc.encode({h: tensor_of(h, tokens)[0]})
    enc.finish(req)
    enc.drain()
    assert enc.worker.stats()["pushes_failed"] == 1


def test_upstream_encoder_failure_reaches_the_consumer_at_once(
        prefill):  # noqa: F811
    p = prefill(tp=2, push_wait_timeout_s=60)
    # 2 s: the dead shard's reserve times out, while a live shard's
    # answers and the abandon still come in time on a loaded machine
    enc = UpstreamEncoder(control_timeout_s=2.0, writer=mc_writer())
    it = push_item("half-gone", 64)
    enc.shards(p.base)
    p.shards()[1].stop(0)  # rank 1's shard killed: the push fails
    eng = p.engine
    eng.add(PrefillRequest("gone", [it]))
    eng.step()
    t0 = time.monotonic()
    # upstream's pusher (in the background, as its worker runs it)
    # abandons on rank 0 once the reserve on rank 1 has timed out
    th = threading.Thread(target=enc.push, args=(p.base, [it]))
    th.start()
    while "gone" not in eng.unavailable and time.monotonic() - t0 < 10:
        eng.step()
        time.sleep(0.002)
    took = time.monotonic() - t0
    th.join()
    enc.close()
    assert it.error and eng.unavailable == {"gone"}
    # the reserve's timeout (2 s), then heard at once: far below
    # push_wait_timeout_s (60 s)
    assert 2.0 <= took < 2.0 + 2.0, took


def test_bytes_changed_after_put_fail_the_item(prefill):
    p = prefill(tp=2, push_wait_timeout_s=60)
    prod = ecx.Producer(capacity_bytes=8 << 20, bind_host="127.0.0.1",
                        registry_port=0, integrity=True)
    pusher = Pusher(prod, control_timeout_s=2, fetch=False)  # the wire's
    told = []  # what each window's close gave: the receiver's hash
    for sh in p.shards():
        def spy(r, f=sh.pool.close_write):
            told.append(f(r))
            return told[-1]
        sh.pool.close_write = spy
    try:
        h = "flipped".ljust(64, "x")
        t, data = tensor_of(h, 512)
        prod.put(h, t)
        put_hash = prod.item_xxh3(h)
        base, cap = prod.arena()
        arena = (ctypes.c_char * cap).from_address(base)
        off = bytes(arena).find(data)
        assert off >= 0
        arena[off + 1000] = bytes([data[1000] ^ 0x40])  # after put
        assert prod.item_xxh3(h) == put_hash  # the put's, kept
        tid = os.urandom(16).hex()
        eng = p.engine
        eng.add(PrefillRequest("pd-x", [Item(tid, h, data, [512, HIDDEN],
                                             "bfloat16")]))
        eng.step()
        spec = PushSpec(tid, h, len(data), [512, HIDDEN], "bfloat16")
        t0 = time.monotonic()
        assert pusher.push(p.base, [spec]) == [spec]
        assert "completed" in spec.error
        while "pd-x" not in eng.unavailable and time.monotonic() - t0 < 5:
            eng.step()
            time.sleep(0.002)
        assert eng.unavailable == {"pd-x"} and "pd-x" not in eng.scheduled
        assert time.monotonic() - t0 < 1.0
        for sh in p.shards():
            assert sh.table.state(tid) == "CANCELLED"
            assert sh.pool.used_bytes() == 0
        changed = bytearray(data)
        changed[1000] ^= 0x40
        # each rank's window hashed as the bytes landed (ecx_hashed)
        assert told == [xxh3_of(bytes(changed))] * 2
        # Clean bytes with their hash pass.
        h2 = "clean".ljust(64, "c")
        t2, data2 = tensor_of(h2, 64)
        prod.put(h2, t2)
        tid2 = os.urandom(16).hex()
        eng.add(PrefillRequest("pd-c", [Item(tid2, h2, data2, [64, HIDDEN],
                                             "bfloat16")]))
        spec2 = PushSpec(tid2, h2, len(data2), [64, HIDDEN], "bfloat16")
        assert pusher.push(p.base, [spec2]) == [], spec2.error
        assert wait_scheduled(eng, "pd-c") is not None
    finally:
        pusher.close()
        prod.close()


def test_item_xxh3_without_integrity_hashes_the_bytes():
    with ecx.Producer(capacity_bytes=4 << 20, bind_host="127.0.0.1",
                      registry_port=0) as prod:
        t, data = tensor_of("plainhash", 32)
        prod.put("plainhash", t)
        assert prod.item_xxh3("plainhash") == xxh3_of(data)
        with pytest.raises(ecx.NotFound):
            prod.item_xxh3("absent")


def test_failure_event_and_hash_field_on_the_shard():
    shards, _ = pushkit.start_shards(tp=1)
    sh = shards[0]
    try:
        ctl = pushkit.Ctl(sh.endpoint)
        sub = pushkit.pull(sh.event_endpoint)
        res = ctl.result("reserve", **pushkit.item("t1"))
        bad = ctl.call("complete", transfer_id="t1",
                       reservation_id=res["reservation_id"],
                       ecx_xxh3="not-a-hash")
        assert bad["ok"] is False and "ecx_xxh3" in bad["error"]
        assert sh.table.state("t1") == "WRITING"  # nothing done
        wrong = ctl.result("complete", transfer_id="t1",
                           reservation_id=res["reservation_id"],
                           ecx_xxh3="0123456789abcdef")
        assert wrong == {"completed": False, "became_ready": False}
        assert sh.table.state("t1") == "CANCELLED"
        ctl.result("reserve", **pushkit.item("t2", mm="n" * 64))
        assert ctl.result("cancel", transfer_id="t2", reservation_id="",
                          abandon=True) == {"cancelled": True}
        evs = pushkit.recv_events(sub, 2)
        assert [(e["transfer_id"], e["ready"]) for e in evs] == [
            ("t1", False), ("t2", False)]
        for e in evs:
            assert e["ecx_failed"] and e["shard"] == sh.port
        assert evs[1]["mm_hash"] == "n" * 64
        # A writer abandoned with a follower: both fail.
        w = ctl.result("reserve", **pushkit.item("t4", mm="f" * 64))
        ctl.result("reserve", **pushkit.item("t5", mm="f" * 64))
        ctl.result("cancel", transfer_id="t4",
                   reservation_id=w["reservation_id"], abandon=True)
        evs2 = pushkit.recv_events(sub, 2)
        assert sorted((e["transfer_id"], e["ready"]) for e in evs2) == [
            ("t4", False), ("t5", False)]
        # A plain cancel (the consumer's own) and a refresh send none.
        ctl.result("reserve", **pushkit.item("t3", mm="o" * 64))
        ctl.result("cancel", transfer_id="t3", reservation_id="")
        w = ctl.result("reserve", **pushkit.item("t6", mm="r" * 64))
        ctl.result("cancel", transfer_id="t6",
                   reservation_id=w["reservation_id"], abandon=True,
                   refresh=True)
        assert pushkit.recv_events(sub, 1, timeout_s=0.3) == []
        # Upstream's scheduler skips it: no ready:true.
        assert not json.loads(json.dumps(evs[0])).get("ready")
        sub.close(0)
        ctl.close()
    finally:
        sh.stop(0)


def test_a_device_save_is_pushed_once_committed(registry, standin):
    # The output is on the (stand-in) GPU: save_caches queues its copy to
    # the arena on a side stream behind the encoder's kernels; the push
    # waits for that commit, off the step, then writes.
    shards = upstream_consumer(1)
    cfg = gpu_config(registry().url, role="ec_producer",
                     control_timeout_s=3)
    sched = ECXConnector(cfg, ECConnectorRole.SCHEDULER)
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    try:
        sh = shards[0]
        assert w._worker._saves is not None
        base = f"tcp://127.0.0.1:{sh.port}"
        h = "ondevice".ljust(64, "g")
        params, _ = Proxy([base]).encoder_body([{"uuid": h}])
        tid = params["ec_items"][0]["transfer_id"]
        req = EncRequest("g0", [(h, 64)], params)
        assert sched.ensure_cache_available(req, 0)
        sched.update_state_after_alloc(req, 0)
        w.bind_connector_metadata(pickle.loads(pickle.dumps(
            sched.build_connector_meta(object()))))
        w.start_save_caches(encoder_cache={})
        cpu, data = tensor_of(h, 64)
        src = standin.tensor(cpu)
        busy = standin.busy()  # the encoder's kernels, still running
        t0 = time.monotonic()
        w.save_caches({h: src}, h)
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.3)
        assert not any(r["op"] == "complete_batch" for r in sh.requests)
        assert w.build_connector_worker_meta().pushes_pending == 1
        busy.set()
        assert pushkit.wait_for(
            lambda: sh.records.get(tid, {}).get("state") == "READY")
        rec = sh.records[tid]
        assert sh.read(sh.addr + rec["off"], len(data)) == data
        assert pushkit.wait_for(
            lambda: w.build_connector_worker_meta().pushes_pending == 0)
    finally:
        w.shutdown()
        sched.shutdown()
        sh.stop()


def test_a_transfer_id_pushed_elsewhere_is_refused(encoder):
    shards = upstream_consumer(1)
    try:
        from ecx.vllm.metadata import ECXPushSpec
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder()
        pushes = enc.pushes()
        tid = os.urandom(16).hex()
        a = ECXPushSpec("a".ljust(64, "a"), tid, base, "ra", (4, HIDDEN),
                        "bfloat16")
        b = ECXPushSpec("b".ljust(64, "b"), tid, base, "rb", (4, HIDDEN),
                        "bfloat16")
        pushes.plan([a])
        pushes.plan([b])  # the same transfer_id for another item
        # failed as upstream's failed saves: unavailable on the encoder
        assert enc.end_step() == {"rb"}
        assert enc.sched.has_pending_push_work()  # a's, still unbound
        enc.finished = {"ra"}  # a's request ends before its output
        enc.drain()
        assert shards[0].records[tid]["state"] == "CANCELLED"
    finally:
        shards[0].stop()


def test_a_late_report_never_undoes_a_newer_one(encoder):
    """Reports reach the scheduler late (vLLM's asynchronous scheduling
    builds the next step's metadata first) and, through a pipeline's
    stages, out of order: has_pending_push_work follows the newest, plus
    what was planned after it."""
    shards = upstream_consumer(1)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder()

        def report():
            enc.worker.get_finished(set())
            wm = pickle.loads(pickle.dumps(
                enc.worker.build_connector_worker_meta()))
            enc.worker.clear_connector_metadata()
            return ECConnectorOutput(ec_connector_worker_meta=wm)

        # Step 1 plans nothing; its report (nothing pending) comes after
        # step 2, which plans a push, was built.
        enc.step()
        meta = pickle.loads(pickle.dumps(
            enc.sched.build_connector_meta(object())))
        enc.worker.bind_connector_metadata(meta)
        early = report()
        assert early.ec_connector_worker_meta.pushes_pending == 0
        h = "late".ljust(64, "l")
        params, _ = Proxy([base]).encoder_body([{"uuid": h}])
        req = EncRequest("l0", [(h, 8)], params)
        enc.plan(req)  # step 3's metadata: the push
        assert enc.sched.has_pending_push_work()
        enc.sched.update_connector_output(early)
        assert enc.sched.has_pending_push_work()  # planned after it
        pending = report()  # step 3's: the push, unbound
        assert pending.ec_connector_worker_meta.pushes_pending == 1
        enc.sched.update_connector_output(pending)
        assert enc.sched.has_pending_push_work()
        # Bound, pushed, ended: step 4's report says none is pending.
        enc.encode({h: tensor_of(h, 8)[0]})
        enc.finish(req)
        assert pushkit.wait_for(lambda: enc.pushes().pending() == 0)
        enc.step()
        assert not enc.sched.has_pending_push_work()
        # Step 3's report again, late: older than step 4's, ignored.
        enc.sched.update_connector_output(pending)
        assert not enc.sched.has_pending_push_work()
        assert enc.pushes().done == [
            (params["ec_items"][0]["transfer_id"], None)]
    finally:
        shards[0].stop()


def test_an_engine_that_returns_no_reports_stops_stepping(encoder):
    """vLLM 0.32's V1 model runner drops a producer's EC connector output,
    so its reports never come: pending pushes then count only in the step
    that sends them, or the engine steps at full speed for ever (seen in
    real vLLM: 100% of a core after the first push)."""
    shards = upstream_consumer(1)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder()
        h = "deaf".ljust(64, "d")
        params, _ = Proxy([base]).encoder_body([{"uuid": h}])
        enc.plan(EncRequest("d0", [(h, 8)], params))
        assert enc.sched.has_pending_push_work()
        steps = 0
        while enc.sched.has_pending_push_work():
            steps += 1
            assert steps < 10, "still pending after 10 steps with no report"
            enc.sched.build_connector_meta(object())  # no report comes
        assert steps == REPORT_LAG_STEPS
    finally:
        shards[0].stop()


def test_worker_reports_merge_to_the_oldest_pusher():
    from ecx.vllm.metadata import ECXWorkerMetadata
    a = ECXWorkerMetadata(pushes_pending=2, pushes_seq=7)
    b = ECXWorkerMetadata(pushes_pending=1, pushes_seq=5)
    none = ECXWorkerMetadata()  # a rank that does not push
    m = a.aggregate(none).aggregate(b)
    assert (m.pushes_pending, m.pushes_seq) == (3, 5)
    assert none.aggregate(ECXWorkerMetadata()).pushes_seq == -1


@pytest.mark.parametrize("integrity", [True, False])
def test_integrity_key_pushes_the_hash_made_at_put(encoder, integrity):
    """integrity: true turns on the encoder Producer's integrity, and a
    push asks for a hashed window and sends the hash made at put (which an
    ecx consumer checks: test_bytes_changed_after_put_fail_the_item; this
    one is upstream's stand-in, which checks nothing); without it (the
    default, as for pulls) a push sends no hash and asks for none."""
    shards = upstream_consumer(1)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = encoder(**({"integrity": True} if integrity else {}))
        prod = enc.worker._worker._producer
        h = f"integrity-{integrity}".ljust(64, "i")
        t, data = tensor_of(h, 64)
        enc.worker.save_caches({h: t}, h)  # encoded before it is planned
        addr, cap = prod.arena()
        arena = (ctypes.c_char * cap).from_address(addr)
        off = bytes(arena).find(data)
        assert off >= 0
        arena[off + 100] = bytes([data[100] ^ 0x01])
        changed = bytearray(data)
        changed[100] ^= 0x01
        want = xxh3_of(data) if integrity else xxh3_of(bytes(changed))
        assert prod.item_xxh3(h) == want
        params, _ = Proxy([base]).encoder_body([{"uuid": h}])
        tid = params["ec_items"][0]["transfer_id"]
        req = EncRequest("i0", [(h, 64)], params)
        enc.plan(req)  # its output is saved: pushed at once
        enc.end_step()
        enc.finish(req)
        enc.drain()
        sent = {e["transfer_id"]: e.get("ecx_xxh3")
                for r in shards[0].requests if r["op"] == "complete_batch"
                for e in r["items"]}
        assert sent == {tid: f"{want:016x}" if integrity else None}
        asked = [r.get("ecx_hashed") for r in shards[0].requests
                 if r["op"].startswith("reserve")]
        assert asked and all(a is (True if integrity else None)
                             for a in asked)
    finally:
        shards[0].stop()


def test_integrity_key_is_a_boolean():
    from ecx.vllm.config import Config
    assert Config({}).integrity is False
    assert Config({"integrity": True}).integrity is True
    with pytest.raises(ValueError, match="integrity"):
        Config({"integrity": "yes"})


def test_plans_bind_saved_outputs_even_if_one_is_evicted_meanwhile(
        monkeypatch):
    """A step plans pushes of two outputs saved before; binding the first
    evicts the second from the remembered outputs (SAVED_MAX): both are
    bound all the same (the plan took both outputs at once; it raised
    KeyError on the second before)."""
    from ecx.vllm.metadata import ECXPushSpec
    from ecx.vllm.pushflow import pushes as P

    class Stats:
        def add(self, *a):
            pass

    prod = ecx.Producer(capacity_bytes=8 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    ep = P.EncoderPushes(prod, control_timeout_s=0.5, token=None,
                         stats=Stats())
    try:
        ep.bind("a", ((4,), "float32"))
        ep.bind("b", ((4,), "float32"))
        monkeypatch.setattr(P, "SAVED_MAX", 1)
        ep.plan([ECXPushSpec(h, f"t-{h}", "tcp://127.0.0.1:1", f"r-{h}",
                             (4,), "float32") for h in ("a", "b")])
        with ep._lock:
            live = list(ep._live.values())
            assert len(live) == 2 and all(x.bound for x in live)
            assert not ep._unbound
    finally:
        ep.close()
        prod.close()
