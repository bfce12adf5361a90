"""Push mode end to end: tests/interop/upstream_encoder.py (a stand-in of
upstream's encoder side, written from PUSH.md alone) pushes into ecx's
control shards; bytes are checked in every shard's pool, and ready events
are read the way upstream's scheduler reads them (every shard must
report)."""
import ctypes
import json
import mmap
import os
import random
import subprocess
import sys

import pytest

from pushkit import FakeClock, HERE, start_shards
from ecx.vllm.push import CANCELLED, READY
from upstream_encoder import EventSubscriber, Item, UpstreamEncoder

TOKEN = "tok-123"


def payload(seed, tokens, hidden, size=2):
    return random.Random(seed).randbytes(tokens * hidden * size)


def items(n, tokens=16, hidden=64, prefix="t"):
    return [Item(f"{prefix}{k}" + "0" * 30, f"{prefix}mm{k}" * 8,
                 payload(k, tokens, hidden), [tokens, hidden], "bfloat16")
            for k in range(n)]


class Consumer:
    def __init__(self, tp=2, token=None, sizes=None, **kw):
        self.shards, self.clock = start_shards(tp=tp, token=token,
                                               sizes=sizes, **kw)
        self.base = self.shards[0].endpoint
        self.sub = None
        self.token = token

    def subscribe(self, topo):
        self.sub = EventSubscriber(topo, plain_password=self.token)
        return self.sub

    def bytes_of(self, it):
        """The bytes each shard holds for it (loading it)."""
        out = []
        for s in self.shards:
            addr, nbytes, shape, dtype = s.take(it.transfer_id, it.mm_hash)
            assert (list(shape), dtype) == (it.shape, it.dtype)
            out.append(s.pool.read(addr, nbytes))
        return out

    def states(self, tid):
        return [s.table.state(tid) for s in self.shards]

    def close(self):
        if self.sub:
            self.sub.close()
        for s in self.shards:
            s.stop(0)


@pytest.fixture
def consumer():
    made = []

    def make(**kw):
        c = Consumer(**kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


@pytest.fixture
def encoder():
    made = []

    def make(**kw):
        e = UpstreamEncoder(control_timeout_s=5, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def test_push_batch_and_single_into_two_shards(consumer, encoder):
    c = consumer()
    enc = encoder()
    topo = enc.shards(c.base)
    assert [a for a, _ in topo] == [s.endpoint for s in c.shards]
    sub = c.subscribe(topo)
    batch = items(3)
    b0 = batch[0]  # the same item again, as a later request's
    single = [Item("s" + "0" * 31, b0.mm_hash, b0.data, b0.shape, b0.dtype)]
    assert enc.push(c.base, batch) == []
    assert enc.push(c.base, single) == []
    ids = [i.transfer_id for i in batch + single]
    assert sub.wait_ready(ids)
    for it in batch + single:
        assert c.bytes_of(it) == [it.data, it.data]


def test_writes_land_only_in_open_windows(consumer, encoder):
    c = consumer(tp=1)
    pool = c.shards[0].pool
    enc = encoder(writer=lambda session, ptr, data: pool.receive(ptr, data))
    it = items(1)[0]
    assert enc.push(c.base, [it]) == []
    r = it.shards[c.base]
    with pytest.raises(PermissionError):  # closed at complete
        pool.receive(r["dst_ptr"], b"x")
    with pytest.raises(PermissionError):  # never opened
        pool.receive(pool.base + pool.size - 256, b"x")
    assert c.bytes_of(it) == [it.data]


def test_a_failed_write_abandons_every_shard(consumer, encoder):
    c = consumer()
    good, bad = c.shards[0].pool, c.shards[1].pool

    def writer(session, ptr, data):
        if bad.base <= ptr < bad.base + bad.size:
            raise OSError("the wire broke")
        good.receive(ptr, data)
    enc = encoder(writer=writer)
    sub = c.subscribe(enc.shards(c.base))
    batch = items(2)
    failed = enc.push(c.base, batch)
    assert failed == batch and "the wire broke" in failed[0].error
    for it in batch:
        assert c.states(it.transfer_id) == [CANCELLED, CANCELLED]
    assert [s.pool.used_bytes() for s in c.shards] == [0, 0]
    sub.drain(0.3)
    assert sub.seen == {}
    assert all(req["abandon"] for _, req in enc.cancels)


def test_a_shard_that_cannot_reserve_fails_the_item_everywhere(consumer,
                                                               encoder):
    c = consumer(sizes=[1 << 20, 4096])
    enc = encoder()
    small, big = items(1, tokens=16, hidden=64)[0], \
        items(1, tokens=64, hidden=64, prefix="b")[0]  # 2 KiB, 8 KiB
    failed = enc.push(c.base, [small, big])
    assert failed == [big] and "larger than the receive pool" in big.error
    assert c.states(big.transfer_id) == [CANCELLED, CANCELLED]
    assert c.shards[0].pool.used_bytes() == 2048  # small's only
    assert c.states(small.transfer_id) == [READY, READY]


def test_refresh_of_a_reservation_older_than_half_the_ttl(consumer, encoder):
    c = consumer()
    clock = FakeClock()
    enc = encoder(clock=clock)
    it = items(1)[0]
    assert enc.reserve(c.base, [it]) == [it]
    old = {a: r["reservation_id"] for a, r in it.shards.items()}
    clock.advance(151)
    sub = c.subscribe(enc.shards(c.base))
    assert enc.push(c.base, [it]) == []
    refreshes = [req for _, req in enc.cancels if req.get("refresh")]
    assert len(refreshes) == 2
    for a, r in it.shards.items():
        assert r["reservation_id"] != old[a]
    assert sub.wait_ready([it.transfer_id])
    assert c.bytes_of(it) == [it.data, it.data]


def test_followers_and_resident_copies_need_no_write(consumer, encoder):
    c = consumer()
    writes = []

    def writer(session, ptr, data):
        writes.append(ptr)
        for s in c.shards:
            if s.pool.base <= ptr < s.pool.base + s.pool.size:
                s.pool.receive(ptr, data)
    enc = encoder(writer=writer)
    sub = c.subscribe(enc.shards(c.base))
    a = items(1)[0]
    twin = Item("twin" + "0" * 28, a.mm_hash, a.data, a.shape, a.dtype)
    assert enc.push(c.base, [a, twin]) == []
    assert len(writes) == 2  # one per shard: the twin follows
    assert sub.wait_ready([a.transfer_id, twin.transfer_id])
    assert c.bytes_of(a) == [a.data, a.data]
    for s in c.shards:
        s.release(a.mm_hash)
    again = Item("again" + "0" * 27, a.mm_hash, a.data, a.shape, a.dtype)
    assert enc.push(c.base, [again]) == []
    assert len(writes) == 2
    assert all(r["cached"] for r in again.shards.values())
    assert sub.wait_ready([again.transfer_id])


def test_with_a_token(consumer, encoder):
    """A shard with a token serves a client that adds the field; as
    Mooncake's wire carries no token, it completes only entries that also
    carry their writer's hash (ecx_xxh3), which upstream's encoder side
    never sends: its push fails and is abandoned, nothing becomes ready.
    ecx's Pusher sends both (test_push_encoder.py, the proxy flow with a
    token)."""
    c = consumer(token=TOKEN)
    enc = encoder(extra={"ecx_token": TOKEN})
    batch = items(2)
    assert enc.push(c.base, batch) == batch
    assert all("ecx_xxh3" in i.error for i in batch)
    for i in batch:
        assert c.states(i.transfer_id) == ["CANCELLED", "CANCELLED"]
    stranger = encoder()
    other = items(1, prefix="x")
    assert stranger.push(c.base, other) == other
    assert "unauthorized" in other[0].error
    assert c.states(other[0].transfer_id) == [None, None]


CHILD = r"""
import json, mmap, random, sys
sys.path.insert(0, sys.argv[1])
from upstream_encoder import Item, UpstreamEncoder
base_addr, path, size, consumer = int(sys.argv[2]), sys.argv[3], \
    int(sys.argv[4]), sys.argv[5]
f = open(path, "r+b")
m = mmap.mmap(f.fileno(), size)
def writer(session, ptr, data):
    m[ptr - base_addr:ptr - base_addr + len(data)] = data
enc = UpstreamEncoder(control_timeout_s=5, writer=writer)
its = [Item(f"p{k}" + "0" * 30, f"pm{k}" * 8,
            random.Random(k).randbytes(4096), [32, 64], "bfloat16")
       for k in range(4)]
failed = enc.push(consumer, its)
print(json.dumps([i.error for i in failed]))
enc.close()
"""


def test_encoder_in_another_process_over_shared_memory(tmp_path):
    path = tmp_path / "pool"
    size = 1 << 20
    path.write_bytes(b"\0" * size)
    f = open(path, "r+b")
    m = mmap.mmap(f.fileno(), size)
    from ecx.vllm.push import BufferPool, ControlShard
    from pushkit import SESSION
    pool = BufferPool(m, SESSION)
    shard = None
    for _ in range(20):
        try:
            shard = ControlShard(pool, ec_port=random.randint(20000, 60000))
            shard.start()
            break
        except RuntimeError:
            shard = None
    assert shard is not None
    try:
        sub = EventSubscriber([(shard.endpoint, shard.event_port)])
        # the child maps the whole file: addresses are offsets from here
        first = ctypes.addressof(ctypes.c_char.from_buffer(m))
        out = subprocess.run(
            [sys.executable, "-c", CHILD, os.path.join(HERE, "..",
                                                       "interop"),
             str(first), str(path), str(size), shard.endpoint],
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == []
        ids = [f"p{k}" + "0" * 30 for k in range(4)]
        assert sub.wait_ready(ids)
        for k, tid in enumerate(ids):
            addr, nbytes, _, _ = shard.take(tid, f"pm{k}" * 8)
            assert pool.read(addr, nbytes) == random.Random(k).randbytes(
                4096)
        sub.close()
    finally:
        shard.stop(0)
        del pool
