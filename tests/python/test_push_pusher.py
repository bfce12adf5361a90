"""The encoder side of push mode in ecx (ecx.vllm.push.pusher driving an
ecx Producer, bytes on Mooncake's TCP wire from the C writer) into ecx's
own ControlShards over ArenaPools, and into a stand-in of upstream's
consumer side (tests/interop/upstream_consumer.py, written from PUSH.md,
behind mcwire's Mooncake servers). Bytes checked; faults each bounded and
ending in cancels with abandon. Real sockets on 127.0.0.1."""
import os
import random
import threading
import time

import pytest
import zmq

import ecx
import pushkit  # noqa: F401  (the vllm stub and tests/interop on sys.path)
from ecx.vllm.push import ArenaPool
from ecx.vllm.push.pusher import (ControlError, PushSpec, Pusher,
                                  finished_map, specs_from_params)
from pushkit import start_pool_shards
from upstream_consumer import Shard
from upstream_encoder import EventSubscriber

HIDDEN = 512


SCALE = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))


def payload(seed, n):
    return random.Random(seed).randbytes(n)


@pytest.fixture
def producer(local_producer):
    return local_producer(64 << 20, mooncake=True)


def hold(producer, k, tokens, prefix="pp"):
    """Puts an item in the producer; its PushSpec (bfloat16 [tokens,
    512])."""
    import torch
    data = payload(k, tokens * HIDDEN * 2)
    mm = f"{prefix}mm{k}".ljust(64, "x")
    t = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(
        tokens, HIDDEN)
    producer.put(mm, t)
    spec = PushSpec(uuid_hex(prefix, k), mm, len(data), [tokens, HIDDEN],
                    "bfloat16", metadata={"k": k})
    return spec, data


def uuid_hex(prefix, k):
    return f"{prefix}{k}".encode().hex().ljust(32, "0")[:32]


def free_port(tp):
    return random.randint(20000, 60000 - tp)


def upstream_consumer(tp, slab=8 << 20):
    for _ in range(50):
        port, shards = free_port(tp), []
        try:
            for r in range(tp):
                shards.append(Shard(port, tp, r, slab))
            return shards
        except Exception:
            for s in shards:
                s.stop()
    raise RuntimeError("no free ports")


@pytest.fixture
def pusher(producer):
    made = []

    def make(**kw):
        kw.setdefault("control_timeout_s", 2.0)
        p = Pusher(producer, **kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


class EcxPrefill:
    def __init__(self, url, tp, token=None):
        self.consumers = [ecx.Consumer(url, recv_capacity=16 << 20)
                          for _ in range(tp)]
        self.pools = [ArenaPool(c) for c in self.consumers]
        self.shards = start_pool_shards(self.pools, token=token)
        self.base = self.shards[0].endpoint

    def close(self):
        for s in self.shards:
            s.stop(0)
        for c in self.consumers:
            c.close()


def test_ecx_encoder_into_ecx_prefill(registry, producer, pusher):
    pre = EcxPrefill(registry().url, tp=2)
    try:
        enc = pusher()
        sub = EventSubscriber(enc.shards(pre.base))
        held = [hold(producer, k, t) for k, t in
                enumerate([4, 1024, 3584])]
        specs = [s for s, _ in held]
        assert enc.push(pre.base, specs) == []
        assert sub.wait_ready([s.transfer_id for s in specs])
        for shard in pre.shards:
            for spec, data in held:
                addr, n, _, _ = shard.take(spec.transfer_id, spec.mm_hash)
                assert n == len(data)
                assert shard.pool.read(addr, n) == data
        sub.close()
    finally:
        pre.close()


def test_token(registry, producer, pusher):
    pre = EcxPrefill(registry().url, tp=1, token="s3cret")
    try:
        spec, data = hold(producer, 7, 64, "tok")
        bare = pusher(control_timeout_s=1.0, fetch=False)
        assert bare.push(pre.base, [spec]) == [spec]  # refused: no token
        assert pre.pools[0].landed == {}
        spec2 = PushSpec(uuid_hex("tok2", 7), spec.mm_hash, spec.nbytes,
                         spec.shape, spec.dtype)
        enc = pusher(token="s3cret", fetch=False)  # over Mooncake's wire
        assert enc.push(pre.base, [spec2]) == [], spec2.error
        addr, n, _, _ = pre.shards[0].take(spec2.transfer_id, spec.mm_hash)
        assert pre.shards[0].pool.read(addr, n) == data
    finally:
        pre.close()


def test_ecx_encoder_into_upstream_consumer(producer, pusher):
    shards = upstream_consumer(2)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher()
        sub = EventSubscriber(enc.shards(base))
        # The proxy's request to the encoder, matched by position.
        held = [hold(producer, k, t, "up") for k, t in
                enumerate([8, 2048])]
        params = {"consumer_zmq": base,
                  "ec_items": [{"transfer_id": s.transfer_id}
                               for s, _ in held]}
        consumer, specs = specs_from_params(params, [
            (s.mm_hash, s.nbytes, s.shape, s.dtype, s.metadata)
            for s, _ in held])
        assert consumer == base and len(specs) == 2
        assert enc.push(consumer, specs) == []
        assert sub.wait_ready([s.transfer_id for s in specs])
        for sh in shards:
            for spec, data in held:
                rec = sh.records[spec.transfer_id]
                assert rec["state"] == "READY"
                assert sh.read(sh.addr + rec["off"], spec.nbytes) == data
            # one reserve_batch and one complete_batch each, every entry
            ops = [r["op"] for r in sh.requests]
            assert ops.count("reserve_batch") == 1
            assert ops.count("complete_batch") == 1
        assert finished_map(specs) == {
            s.mm_hash: {"metadata": s.metadata, "transfer_id":
                        s.transfer_id} for s, _ in held}
        # A second push of the same items: write:false, nothing written.
        again = [PushSpec(s.transfer_id, s.mm_hash, s.nbytes, s.shape,
                          s.dtype) for s, _ in held]
        writes = shards[0].data.writes
        assert enc.push(consumer, again) == []
        assert shards[0].data.writes == writes
        sub.close()
    finally:
        for s in shards:
            s.stop()


def abandons(enc, tid):
    return [a for a, r in enc.cancels
            if r["transfer_id"] == tid and r.get("abandon") is True]


def test_shard_killed_mid_push(producer, pusher):
    shards = upstream_consumer(2)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher(control_timeout_s=0.5, write_timeout_s=1.0)
        spec, _ = hold(producer, 1, 2048, "kill")
        assert enc.reserve(base, [spec]) == [spec]
        shards[1].stop()  # after the reserve, before the write
        t0 = time.monotonic()
        failed = enc.push(base, [spec])
        took = time.monotonic() - t0
        assert failed == [spec] and spec.error
        assert took < 4.0
        assert shards[0].records[spec.transfer_id]["state"] == "CANCELLED"
        assert shards[0].allocs == {}
        assert len(abandons(enc, spec.transfer_id)) == 2
    finally:
        shards[0].stop()


def test_pool_full(producer, pusher):
    shards = upstream_consumer(2, slab=1 << 20)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher()
        spec, _ = hold(producer, 2, 2048, "full")  # 2 MiB > 1 MiB slab
        t0 = time.monotonic()
        failed = enc.push(base, [spec])
        assert time.monotonic() - t0 < 1.0  # no waiting for room
        assert failed == [spec] and "pool is full" in spec.error
        for sh in shards:
            assert sh.data.writes == 0
            assert sh.records[spec.transfer_id]["state"] == "CANCELLED"
        assert len(abandons(enc, spec.transfer_id)) == 2
    finally:
        for s in shards:
            s.stop()


def test_conflicting_transfer_id(producer, pusher):
    shards = upstream_consumer(2)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher()
        spec, _ = hold(producer, 3, 16, "conf")
        # shard 1 already holds the id for another item
        shards[1].reserve(dict(spec.request(), mm_hash="other".ljust(64)))
        failed = enc.push(base, [spec])
        assert failed == [spec] and "conflicting" in spec.error
        assert shards[0].records[spec.transfer_id]["state"] == "CANCELLED"
        assert shards[0].data.writes == 0
        assert len(abandons(enc, spec.transfer_id)) == 2
    finally:
        for s in shards:
            s.stop()


def test_write_refused_by_receiver(producer, pusher):
    shards = upstream_consumer(2)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher()
        spec, _ = hold(producer, 4, 64, "ref")
        shards[1].refuse_writes = True
        failed = enc.push(base, [spec])
        assert failed == [spec]
        assert "refused" in spec.error.lower() or \
            "reject" in spec.error.lower(), spec.error
        assert shards[1].data.rejected >= 1
        for sh in shards:
            assert sh.records[spec.transfer_id]["state"] == "CANCELLED"
            assert not any(r["op"] == "complete_batch"
                           for r in sh.requests)
    finally:
        for s in shards:
            s.stop()


def test_hashes_not_behind_control_calls(producer, pusher):
    """Every thread of the pusher's pool blocked in a control call to a
    shard that never answers (as another push's to a dead consumer): a
    push's hashes do not wait for those calls' timeouts."""
    shards = upstream_consumer(1)
    ctx = zmq.Context()
    mute = ctx.socket(zmq.REP)  # takes requests, never answers
    mute.linger = 0
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    mute_addr = f"tcp://127.0.0.1:{port}"
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher(control_timeout_s=4.0, threads=2)
        spec, data = hold(producer, 8, 512, "mute")
        assert enc.reserve(base, [spec]) == [spec]
        stuck = [enc.pool.submit(enc.ctl.call, mute_addr, {"op": "peers"})
                 for _ in range(2)]
        t0 = time.monotonic()
        assert enc.push(base, [spec]) == [], spec.error
        took = time.monotonic() - t0
        assert took < 2.0, f"the push waited {took:.2f} s for its hash"
        assert not any(f.done() for f in stuck)  # blocked all along
        assert spec.xxh3 == producer.item_xxh3(spec.mm_hash)
        rec = shards[0].records[spec.transfer_id]
        assert rec["state"] == "READY"
        assert shards[0].read(shards[0].addr + rec["off"], spec.nbytes) \
            == data
        for f in stuck:
            with pytest.raises(ControlError, match="no reply"):
                f.result()
    finally:
        for s in shards:
            s.stop()
        mute.close(0)
        ctx.term()


def test_write_error_not_masked_by_hash_error(producer, pusher,
                                              monkeypatch):
    """The write raises and a hash raises too: the write's error is the
    one each item fails with, and every hash has ended before the push
    returns (the one that raised first, then a slow one)."""
    shards = upstream_consumer(1)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        enc = pusher()
        specs = [hold(producer, k, 64, "mask")[0] for k in range(2)]
        real, ended = producer.item_xxh3, []
        real_push = producer.push_batch

        def item_xxh3(mm_hash):
            try:
                if mm_hash == specs[0].mm_hash:
                    raise RuntimeError("the hash broke")
                time.sleep(1.0)
                return real(mm_hash)
            finally:
                ended.append(mm_hash)

        def push_batch(writes, timeout_s=None):
            raise OSError("the write broke")
        monkeypatch.setattr(producer, "item_xxh3", item_xxh3)
        monkeypatch.setattr(producer, "push_batch", push_batch)
        assert enc.push(base, specs) == specs
        for s in specs:
            assert s.error == "OSError: the write broke", s.error
        assert sorted(ended) == sorted(s.mm_hash for s in specs)
        for s in specs:
            assert shards[0].records[s.transfer_id]["state"] == "CANCELLED"
            assert len(abandons(enc, s.transfer_id)) == 1
        assert shards[0].data.writes == 0

        # The write good, a hash bad: that hash's error, nothing completed.
        monkeypatch.setattr(producer, "push_batch", real_push)
        again = [PushSpec(uuid_hex("mask2", k), s.mm_hash, s.nbytes,
                          s.shape, s.dtype) for k, s in enumerate(specs)]
        ended.clear()
        assert enc.push(base, again) == again
        assert sorted(ended) == sorted(s.mm_hash for s in again)
        for s in again:
            assert s.error == "RuntimeError: the hash broke", s.error
            assert shards[0].records[s.transfer_id]["state"] == "CANCELLED"
        assert not any(r["op"] == "complete_batch"
                       for r in shards[0].requests)
    finally:
        for s in shards:
            s.stop()


def test_refresh_after_half_ttl(producer, pusher):
    shards = upstream_consumer(1)
    try:
        base = f"tcp://127.0.0.1:{shards[0].port}"
        now = [1000.0]
        enc = pusher(clock=lambda: now[0])
        spec, data = hold(producer, 5, 32, "ttl")
        assert enc.reserve(base, [spec]) == [spec]
        first = spec.shards[next(iter(spec.shards))]["reservation_id"]
        now[0] += 151.0
        assert enc.push(base, [spec]) == []
        sh = shards[0]
        refresh = [r for r in sh.requests if r["op"] == "cancel"]
        assert refresh and refresh[0]["refresh"] is True
        assert refresh[0]["abandon"] is True
        assert refresh[0]["reservation_id"] == first
        rec = sh.records[spec.transfer_id]
        assert rec["rid"] != first and rec["state"] == "READY"
        assert sh.read(sh.addr + rec["off"], spec.nbytes) == data
    finally:
        for s in shards:
            s.stop()


def test_specs_from_params():
    feats = [("h0", 4, [1, 2], "bfloat16", {"a": 1}),
             ("h1", 4, [1, 2], "bfloat16", None)]
    assert specs_from_params({}, feats) == (None, [])
    c, specs = specs_from_params({"consumer_zmq": "tcp://h:1", "ec_items": [
        {"transfer_id": "t0"}]}, feats)
    assert c == "tcp://h:1"
    assert [(s.mm_hash, s.transfer_id) for s in specs] == [("h0", "t0")]


def test_a_wrong_consumer_address_is_the_specs_error(producer):
    """A mistyped consumer_zmq (no tcp://, no port), or an address where
    something else answers, fails the push's specs with a message that
    says so, at once; it never raises out of push."""
    p = Pusher(producer, control_timeout_s=2.0)
    ctx = zmq.Context()
    other = ctx.socket(zmq.REP)  # answers, but not as an EC consumer
    port = other.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        if other.poll(2000):
            other.recv()
            other.send(b'{"ok": true, "result": {}}')
    try:
        for addr, why in (("127.0.0.1:14579", "tcp://HOST:PORT"),
                          ("tcp://127.0.0.1", "tcp://HOST:PORT"),
                          (f"tcp://127.0.0.1:{port}",
                           "not an EC consumer's answer")):
            spec = PushSpec(uuid_hex("bad", 0), "x" * 64, 16, [16], "uint8")
            t0 = time.monotonic()
            if "not an" in why:
                th = threading.Thread(target=answer)
                th.start()
            assert p.push(addr, [spec]) == [spec]
            if "not an" in why:
                th.join()
            assert why in spec.error, spec.error
            assert time.monotonic() - t0 < 1.5 * SCALE
    finally:
        p.close()
        other.close(0)
        ctx.term()


def test_a_silent_shard_costs_a_push_two_timeouts_not_three(producer):
    """A shard that answered discovery and then went silent (stopped,
    wedged): a push of three items waits control_timeout_s for the
    reserve and once more for the abandon's first cancel, and neither
    tries it again (upstream's 2 tries would make it three timeouts) nor
    sends the other items' cancels to it one timeout each."""
    p = Pusher(producer, control_timeout_s=1.0)
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"

    def discovery():
        for reply in (b'{"ok": true, "result": {"ports": [%d]}}' % port,
                      b'{"ok": true, "result": 40001}'):
            assert rep.poll(2000)
            rep.recv()
            rep.send(reply)
    th = threading.Thread(target=discovery)
    th.start()
    try:
        assert p.shards(addr) == [(addr, 40001)]
        th.join()
        specs = [hold(producer, k, 4, prefix="silent")[0]
                 for k in range(3)]
        t0 = time.monotonic()
        assert p.push(addr, specs) == specs
        took = time.monotonic() - t0
        assert all("no reply within 1000 ms" in s.error for s in specs)
        assert 1.9 < took < 2.0 + 0.8 * SCALE, took
        # the first cancel found the shard silent: the others not sent
        assert [r["op"] for _, r in p.cancels] == ["cancel"]
    finally:
        p.close()
        rep.close(0)
        ctx.term()


def test_consumer_restarted_with_fewer_ranks(registry, producer, pusher):
    """The prefill restarts on the same ports with one rank where it had
    two: the first push after it waits for the gone rank once (the
    reserve's timeout, then one cancel's), fails and is abandoned, and
    makes the Pusher ask the topology again, so the next push finds the
    one rank and lands."""
    from ecx.vllm.push import ControlShard
    url = registry().url
    pre = EcxPrefill(url, tp=2)
    base, port = pre.base, pre.shards[0].port
    enc = pusher(control_timeout_s=1.0)
    first, _ = hold(producer, 0, 64, "rst")
    assert enc.push(base, [first]) == [], first.error
    assert len(enc.shards(base)) == 2
    pre.close()
    cons = ecx.Consumer(url, recv_capacity=16 << 20)
    sh = ControlShard(ArenaPool(cons), ec_port=port).start()
    try:
        lost, _ = hold(producer, 1, 64, "rst")
        t0 = time.monotonic()
        assert enc.push(base, [lost]) == [lost]
        assert "no reply within 1000 ms" in lost.error
        assert time.monotonic() - t0 < 2.0 + 0.8 * SCALE
        assert sh.table.state(lost.transfer_id) in (None, "CANCELLED")
        spec, data = hold(producer, 2, 64, "rst")
        assert enc.push(base, [spec]) == [], spec.error
        assert enc.shards(base) == [(base, sh.event_port)]
        deadline = time.monotonic() + 5 * SCALE  # a fetch lands later
        while sh.table.state(spec.transfer_id) != "READY" and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        addr, n, _, _ = sh.take(spec.transfer_id, spec.mm_hash)
        assert sh.pool.read(addr, n) == data
    finally:
        sh.stop(0)
        cons.close()
