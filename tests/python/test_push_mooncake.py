"""Push mode with bytes on Mooncake's TCP wire: control shards over
ArenaPools (each in an ecx Consumer's receive arena, behind the C
receiver's windows), upstream's encoder side (tests/interop/
upstream_encoder.py, written from PUSH.md) writing with a Mooncake-wire
writer written from Mooncake's source (tests/interop/mcwire.py), neither
of which imports ecx. Bytes are checked in the arena; writes outside an
open window are refused on the wire and change nothing."""
import random
import time

import pytest

import ecx
from pushkit import start_shards
from ecx.vllm.push import ArenaPool, ControlShard
from upstream_encoder import EventSubscriber, Item, UpstreamEncoder
import mcwire
from ref_producer import Writer

ARENA = 8 << 20


def payload(seed, n):
    return random.Random(seed).randbytes(n)


def item(k, tokens, hidden=512, prefix="mc"):
    return Item(f"{prefix}{k}".ljust(32, "0"), f"{prefix}mm{k}".ljust(64, "x"),
                payload(k, tokens * hidden * 2), [tokens, hidden], "bfloat16")


def mc_writer():
    """writer(dst_session, dst_ptr, data) over Mooncake's wire: the P2P
    handshake once per session, then one acknowledged WRITE each."""
    w = Writer(lambda: mcwire.encode_segment("127.0.0.1:1", 1, []), 5.0)

    def write(session, ptr, data):
        ret, why = w.write(session, data, ptr)
        if ret != 0:
            raise OSError(why)
    return write


class Prefill:
    """tp shards, each over the arena of its own ecx Consumer (as each rank
    of a prefill instance has its own)."""

    def __init__(self, registry_url, tp=1, ttl=300.0, clock=time.monotonic,
                 token=None):
        self.consumers = [ecx.Consumer(registry_url, recv_capacity=ARENA)
                          for _ in range(tp)]
        self.pools = [ArenaPool(c, clock=clock) for c in self.consumers]
        for _ in range(50):
            port = random.randint(20000, 60000 - tp)
            self.shards = []
            try:
                for r, pool in enumerate(self.pools):
                    self.shards.append(ControlShard(
                        pool, ec_port=port, tp_size=tp, tp_rank=r,
                        clock=clock, ttl=ttl, token=token).start())
                break
            except RuntimeError:
                for s in self.shards:
                    s.stop(0)
        self.base = self.shards[0].endpoint

    def bytes_of(self, it):
        out = []
        for s in self.shards:
            addr, nbytes, _, _ = s.take(it.transfer_id, it.mm_hash)
            out.append(s.pool.read(addr, nbytes))
        return out

    def close(self):
        for s in self.shards:
            s.stop(0)
        for c in self.consumers:
            c.close()


@pytest.fixture
def prefill(registry):
    made = []
    url = registry().url

    def make(**kw):
        p = Prefill(url, **kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


@pytest.fixture
def encoder():
    made = []

    def make(**kw):
        e = UpstreamEncoder(control_timeout_s=5, writer=mc_writer(), **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def test_upstream_encoder_pushes_into_two_ranks(prefill, encoder):
    p = prefill(tp=2)
    enc = encoder()
    sub = EventSubscriber(enc.shards(p.base))
    batch = [item(0, 4), item(1, 1024), item(2, 3584)]  # 4 KiB .. 3.5 MiB
    single = [item(3, 128)]
    assert enc.push(p.base, batch) == []
    assert enc.push(p.base, single) == []
    ids = [i.transfer_id for i in batch + single]
    assert sub.wait_ready(ids)
    for pool in p.pools:  # every byte came whole through a window
        assert sorted(pool.landed.values()) == sorted(
            len(i.data) for i in batch + single)
        assert not any(pool.is_open(r) for r in pool.landed)
    for it in batch + single:
        assert p.bytes_of(it) == [it.data, it.data]
    sub.close()


def session_of(p):
    """The data port's host and the segment descriptor of rank 0."""
    seg = mcwire.fetch_segment(p.pools[0].session,
                               mcwire.encode_segment("127.0.0.1:1", 1, []),
                               5.0)
    return mcwire.parse_session(seg["name"])[0], seg


def test_writes_outside_open_windows_are_refused(prefill, encoder):
    p = prefill()
    enc = encoder()
    it = item(0, 64)
    assert enc.push(p.base, [it]) == []
    r = it.shards[p.base]
    host, seg = session_of(p)
    # The segment advertises the arena, as Mooncake's does its buffers.
    assert any(a <= r["dst_ptr"] < a + n for a, n in seg["buffers"])
    port, ver = seg["tcp_data_port"], seg["tcp_proto_version"]
    # Closed at complete: the same range takes no more bytes.
    why = mcwire.write(host, port, ver, b"\xff" * 256, r["dst_ptr"], 5.0)
    assert why is not None and "rejected" in why
    # Memory of the arena that no reservation holds.
    spare = p.consumers[0].alloc(4096)
    before = p.pools[0].read(spare, 4096)
    why = mcwire.write(host, port, ver, b"\xee" * 4096, spare, 5.0)
    assert why is not None and "rejected" in why
    assert p.pools[0].read(spare, 4096) == before
    p.consumers[0].free(spare)
    assert p.bytes_of(it) == [it.data]


def test_a_window_closes_at_its_deadline(prefill):
    p = prefill(ttl=0.4)
    ctl_pool = p.pools[0]
    from pushkit import Ctl
    ctl = Ctl(p.base)
    res = ctl.result("reserve", transfer_id="d" * 32, mm_hash="m" * 64,
                     nbytes=1024, shape=[1, 512], dtype="bfloat16")
    assert res["write"] and ctl_pool.is_open(res["reservation_id"])
    host, seg = session_of(p)
    time.sleep(0.6)
    why = mcwire.write(host, seg["tcp_data_port"], seg["tcp_proto_version"],
                       b"\x01" * 1024, res["dst_ptr"], 5.0)
    assert why is not None and "rejected" in why
    assert ctl_pool.read(res["dst_ptr"], 1024) != b"\x01" * 1024
    ctl.close()


def test_a_write_past_the_range_is_refused(prefill):
    p = prefill()
    from pushkit import Ctl
    ctl = Ctl(p.base)
    res = ctl.result("reserve", transfer_id="e" * 32, mm_hash="n" * 64,
                     nbytes=1024, shape=[1, 512], dtype="bfloat16")
    host, seg = session_of(p)
    args = (host, seg["tcp_data_port"], seg["tcp_proto_version"])
    why = mcwire.write(*args, b"\x02" * 1025, res["dst_ptr"], 5.0)
    assert why is not None and "rejected" in why
    assert mcwire.write(*args, b"\x03" * 1024, res["dst_ptr"], 5.0) is None
    assert ctl.result("complete", transfer_id="e" * 32,
                      reservation_id=res["reservation_id"])["became_ready"]
    assert p.pools[0].landed[res["reservation_id"]] == 1024
    ctl.close()


def test_mooncake_off_is_said(registry):
    c = ecx.Consumer(registry().url, recv_capacity=1 << 20, mooncake="off")
    with pytest.raises(ecx.EcxError, match="Mooncake wire off"):
        ArenaPool(c)
    c.close()
    c = ecx.Consumer(registry().url, recv_capacity=1 << 20)
    for hashed in (True, False):
        with pytest.raises(ecx.EcxError, match="not inside one allocation"):
            c.push_open(1 << 40, 16, 1.0, hashed=hashed)
    c.close()


def xxh3_of(data):
    import ctypes
    buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
    return ecx.xxh3(ctypes.addressof(buf), len(data))


def test_landed_bytes_are_hashed_as_they_come(prefill):
    """A writer's ecx_xxh3 is checked against the receiver's hash, made as
    the bytes came in order (none made again at the complete) where its
    reserve said ecx_hashed; where they came out of order, or the reserve
    did not say it (an older ecx writer), the shard hashes the range
    itself; a hash that does not match cancels either way."""
    p = prefill()
    pool = p.pools[0]
    told = []
    close = pool.close_write

    def spy(r):
        h = close(r)
        told.append(h)
        return h
    pool.close_write = spy
    from pushkit import Ctl
    ctl = Ctl(p.base)
    host, seg = session_of(p)
    args = (host, seg["tcp_data_port"], seg["tcp_proto_version"])
    n = 96 << 10
    data = payload(7, n)

    def reserve(k, hashed=True):
        return ctl.result("reserve", transfer_id=f"h{k}".ljust(32, "0"),
                          mm_hash=f"hm{k}".ljust(64, "x"), nbytes=n,
                          shape=[n // 1024, 512], dtype="bfloat16",
                          **({"ecx_hashed": True} if hashed else {}))

    def complete(k, res, h):
        return ctl.result("complete", transfer_id=f"h{k}".ljust(32, "0"),
                          reservation_id=res["reservation_id"],
                          ecx_xxh3=f"{h:016x}")
    # In order, in one write: the receiver's hash is the one checked.
    res = reserve(0)
    assert mcwire.write(*args, data, res["dst_ptr"], 5.0) is None
    assert complete(0, res, xxh3_of(data))["became_ready"]
    assert told == [xxh3_of(data)]
    # The second half first: no receiver's hash, the shard's matches.
    res = reserve(1)
    half = n // 2
    assert mcwire.write(*args, data[half:], res["dst_ptr"] + half,
                        5.0) is None
    assert mcwire.write(*args, data[:half], res["dst_ptr"], 5.0) is None
    assert complete(1, res, xxh3_of(data))["became_ready"]
    assert told[1] is None
    assert pool.read(res["dst_ptr"], n) == data
    # A hash that is not the bytes': cancelled, in order or not.
    res = reserve(2)
    assert mcwire.write(*args, data, res["dst_ptr"], 5.0) is None
    got = complete(2, res, xxh3_of(data) ^ 1)
    assert not got["completed"] and not got["became_ready"]
    assert told[2] == xxh3_of(data)
    # Not asked for: the receiver spent nothing, the shard hashed.
    for k, h, ok in ((3, xxh3_of(data), True), (4, xxh3_of(data) ^ 1, False)):
        res = reserve(k, hashed=False)
        assert mcwire.write(*args, data, res["dst_ptr"], 5.0) is None
        got = complete(k, res, h)
        assert got["completed"] is ok and got["became_ready"] is ok
        assert told[-1] is None
    # reserve_batch: its top-level ecx_hashed is each item's.
    for k, hashed in ((5, True), (6, False)):
        got = ctl.result("reserve_batch", items=[dict(
            transfer_id=f"h{k}".ljust(32, "0"),
            mm_hash=f"hm{k}".ljust(64, "x"), nbytes=n,
            shape=[n // 1024, 512], dtype="bfloat16")],
            **({"ecx_hashed": True} if hashed else {}))
        res = got["items"][0]["result"]
        assert mcwire.write(*args, data, res["dst_ptr"], 5.0) is None
        assert complete(k, res, xxh3_of(data))["became_ready"]
        assert told[-1] == (xxh3_of(data) if hashed else None)
    ctl.close()


def test_what_landed_is_kept_for_the_newest_windows_only(prefill, encoder,
                                                         monkeypatch):
    """A prefill runs for weeks: the pool's record of what landed in each
    window (kept for tests) holds only the newest LANDED_KEPT, as the
    encoder's record of its cancels holds only the newest CANCELS_KEPT."""
    from ecx.vllm.push import arena
    from ecx.vllm.push import pusher
    monkeypatch.setattr(arena, "LANDED_KEPT", 3)
    p = prefill()
    enc = encoder()
    items = [item(k, 4) for k in range(5)]
    for it in items:
        assert enc.push(p.base, [it]) == []
    kept = list(p.pools[0].landed)
    assert len(kept) == 3
    assert kept == [it.shards[p.base]["reservation_id"] for it in items[2:]]
    ecx_pusher = pusher.Pusher(ecx.Producer(capacity_bytes=1 << 20,
                                            registry_port=0),
                               control_timeout_s=1.0)
    try:
        assert ecx_pusher.cancels.maxlen == pusher.CANCELS_KEPT
    finally:
        ecx_pusher.producer.close()
        ecx_pusher.close()


def test_a_strangers_write_never_becomes_ready_with_a_token(prefill):
    """Mooncake's wire carries no token: a peer without it that reaches
    the data port learns the arena from the handshake and can write into
    a window its writer has open. With a token every window is hashed as
    it lands and every complete must carry its writer's hash, so such
    bytes end the transfer CANCELLED (its failure event sent), never
    READY."""
    import ctypes
    from pushkit import Ctl, pull, recv_events
    token = "s3cret"
    p = prefill(token=token)
    ctl = Ctl(p.base, {"ecx_token": token})
    sub = pull(p.shards[0].event_endpoint, password=token)
    data = payload(7, 4096)
    buf = ctypes.create_string_buffer(data, len(data))
    want = f"{ecx.xxh3(ctypes.addressof(buf), len(data)):016x}"
    res = ctl.result("reserve", transfer_id="s" * 32, mm_hash="m" * 64,
                     nbytes=4096, shape=[2048], dtype="bfloat16")
    assert p.pools[0].is_open(res["reservation_id"])
    host, seg = session_of(p)  # no token asked: the stranger's view
    port, ver = seg["tcp_data_port"], seg["tcp_proto_version"]
    assert mcwire.write(host, port, ver, data, res["dst_ptr"], 5.0) is None
    assert mcwire.write(host, port, ver, b"EVIL", res["dst_ptr"],
                        5.0) is None  # the stranger, after the writer
    # without the hash the complete is refused and nothing changes
    reply = ctl.call("complete", transfer_id="s" * 32,
                     reservation_id=res["reservation_id"])
    assert reply["ok"] is False and "ecx_xxh3" in reply["error"]
    assert ctl.result("status", transfer_id="s" * 32)["ready"] is False
    assert p.pools[0].is_open(res["reservation_id"])  # still writing
    done = ctl.result("complete", transfer_id="s" * 32,
                      reservation_id=res["reservation_id"], ecx_xxh3=want)
    assert done == {"completed": False, "became_ready": False}
    assert ctl.result("status", transfer_id="s" * 32) is None  # CANCELLED
    ev = recv_events(sub, 1)
    assert [(e["transfer_id"], e["ready"]) for e in ev] == [("s" * 32,
                                                            False)]
    # the writer's own bytes alone complete, as always
    res = ctl.result("reserve", transfer_id="g" * 32, mm_hash="n" * 64,
                     nbytes=4096, shape=[2048], dtype="bfloat16")
    assert mcwire.write(host, port, ver, data, res["dst_ptr"], 5.0) is None
    done = ctl.result("complete", transfer_id="g" * 32,
                      reservation_id=res["reservation_id"], ecx_xxh3=want)
    assert done == {"completed": True, "became_ready": True}
    sub.close(0)
    ctl.close()


def test_a_reserve_above_the_pools_limit_is_never_full():
    """An arena larger than the pool's size (recv_capacity_bytes above
    ec_buffer_size): a reserve the pool can never hold is refused as
    too large, not as "full" (which a writer may wait out)."""
    from pushkit import Ctl, start_pool_shards
    cons = ecx.Consumer(None, recv_capacity=1 << 20)
    try:
        (sh,) = start_pool_shards([ArenaPool(cons, size=64 << 10)])
        ctl = Ctl(sh.endpoint)
        reply = ctl.call("reserve", transfer_id="l" * 32, mm_hash="m" * 64,
                         nbytes=128 << 10, shape=[64 << 10],
                         dtype="bfloat16")
        assert reply["ok"] is False
        assert "larger than the receive pool (65536 bytes)" in \
            reply["error"], reply
        assert ctl.result("reserve", transfer_id="s" * 32, mm_hash="n" * 64,
                          nbytes=64 << 10, shape=[32 << 10],
                          dtype="bfloat16")["write"] is True
        ctl.close()
        sh.stop(0)
    finally:
        cons.close()


KILLED_WRITER = r"""
import socket, sys, time
sys.path.insert(0, sys.argv[1])
import mcwire
host, port, ver = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print("up", flush=True)
dst, n = map(int, sys.stdin.readline().split())  # once reserved
s = socket.create_connection((host, port))
op = mcwire.OP_WRITE | (mcwire.OP_V2 if ver >= 2 else 0)
s.sendall(mcwire.HEADER.pack(n, dst, op))
s.sendall(b"\x5a" * (n // 2))  # half the body, then killed
print("half", flush=True)
time.sleep(60)
"""


def test_a_writer_killed_mid_write_never_becomes_ready(prefill):
    """A writer process SIGKILLed with half its WRITE sent: the half that
    came is never made READY (no ready event; nothing completes it), at
    the TTL the record is EXPIRE_PENDING with its window closed (no whole
    write landed in it), and one TTL later (ecx's bound; upstream keeps
    it until the shard stops) EXPIRED with its memory freed."""
    import os
    import signal
    import subprocess
    import sys
    from pushkit import Ctl, pull, recv_events
    p = prefill(ttl=1.0)
    sh, pool = p.shards[0], p.pools[0]
    ctl = Ctl(p.base)
    sub = pull(sh.event_endpoint)
    n = 4 << 20
    host, seg = session_of(p)
    here = os.path.dirname(os.path.abspath(__file__))
    # the writer started (an interpreter: slow on a busy machine) before
    # the reserve, whose TTL (1 s here) runs from then
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER,
         os.path.join(here, "..", "interop"), host,
         str(seg["tcp_data_port"]), str(seg["tcp_proto_version"])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        res = ctl.result("reserve", transfer_id="k" * 32, mm_hash="m" * 64,
                         nbytes=n, shape=[n // 2], dtype="bfloat16")
        child.stdin.write(f"{res['dst_ptr']} {n}\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "half"
        time.sleep(0.1)  # the half in the receiver
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert sh.table.state("k" * 32) == "WRITING"
    assert ctl.result("status", transfer_id="k" * 32)["ready"] is False
    deadline = time.monotonic() + 5
    while sh.table.state("k" * 32) == "WRITING" and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert sh.table.state("k" * 32) == "EXPIRE_PENDING"
    assert pool.used_bytes() >= n  # kept one TTL more
    # its first bytes are in the arena, but no whole write landed
    assert pool.read(res["dst_ptr"], 4096) == b"\x5a" * 4096
    assert pool.landed[res["reservation_id"]] == 0
    while sh.table.state("k" * 32) == "EXPIRE_PENDING" and \
            time.monotonic() < deadline + 5:
        time.sleep(0.05)
    assert sh.table.state("k" * 32) == "EXPIRED"
    assert pool.used_bytes() == 0
    assert recv_events(sub, 1, 0.2) == []
    sub.close(0)
    ctl.close()
