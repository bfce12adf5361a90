"""Helpers of the push-mode tests: control shards on free 127.0.0.1 ports
over BufferPools, a clock the test moves, and a REQ client that returns
whole replies."""
import json
import os
import random
import sys
import time

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "vllm_stub"))
sys.path.insert(0, os.path.join(HERE, "..", "interop"))

from ecx.vllm.push import BufferPool, ControlShard  # noqa: E402

SESSION = "127.0.0.1:17777"


class FakeClock:
    """Seconds that move only when the test says."""

    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += s


def start_pool_shards(pools, dp=0, ip="127.0.0.1", **kw):
    """A shard per pool (rank r over pools[r]) of DP replica dp, on
    consecutive free ports; retried on a port taken."""
    tp = len(pools)
    for _ in range(50):
        ec_port = random.randint(20000, 60000 - tp * (dp + 1))
        shards = []
        try:
            for r, pool in enumerate(pools):
                shards.append(ControlShard(
                    pool, ec_ip=ip, ec_port=ec_port, dp_rank=dp, tp_size=tp,
                    tp_rank=r, **kw).start())
            return shards
        except RuntimeError:
            for s in shards:
                s.stop(0)
    raise RuntimeError("no free ports for the shards")


def start_shards(tp=1, dp=0, pool_size=1 << 20, sizes=None, clock=None,
                 ip="127.0.0.1", **kw):
    """tp shards of DP replica dp on consecutive free ports; pool i of
    sizes[i] bytes (pool_size each unless given)."""
    clock = clock or FakeClock()
    pools = []
    for r in range(tp):
        size = sizes[r] if sizes else pool_size
        pools.append(BufferPool(bytearray(size + 256), SESSION, clock,
                                size=size))
    return start_pool_shards(pools, dp=dp, ip=ip, clock=clock, **kw), clock


class Ctl:
    """A REQ client of one shard: call() returns the whole reply."""

    def __init__(self, addr, extra=None, timeout_ms=5000):
        self.addr = addr
        self.extra = dict(extra or {})
        self.timeout_ms = timeout_ms
        self.ctx = zmq.Context()
        self._open()

    def _open(self):
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.linger = 0
        self.sock.rcvtimeo = self.timeout_ms
        self.sock.sndtimeo = self.timeout_ms
        self.sock.connect(self.addr)

    def send_frames(self, frames):
        """The reply frames to a raw message; None on no reply (then a
        fresh socket)."""
        self.sock.send_multipart(frames)
        try:
            return self.sock.recv_multipart()
        except zmq.Again:
            self.sock.close(0)
            self._open()
            return None

    def call(self, op, **fields):
        req = dict({"op": op}, **self.extra)
        req.update(fields)
        frames = self.send_frames([json.dumps(req).encode()])
        assert frames is not None, f"no reply to {op}"
        assert len(frames) == 1, f"{len(frames)} frames in the reply"
        return json.loads(frames[0])

    def result(self, op, **fields):
        reply = self.call(op, **fields)
        assert reply["ok"] is True, reply
        assert set(reply) == {"ok", "result"}, reply
        return reply["result"]

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def item(tid, mm="m" * 64, tokens=4, hidden=8, dtype="bfloat16", size=2):
    return {"transfer_id": tid, "mm_hash": mm,
            "nbytes": tokens * hidden * size, "shape": [tokens, hidden],
            "dtype": dtype}


def pull(endpoint, password=None, timeout_ms=2000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.IPV6, 1)
    s.linger = 0
    s.rcvtimeo = timeout_ms
    if password is not None:
        s.plain_username = b"ecx"
        s.plain_password = password.encode()
    s.connect(endpoint)
    return s


def recv_events(sock, n, timeout_s=3.0):
    """Up to n events from sock within timeout_s."""
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        if sock.poll(50):
            out.append(json.loads(sock.recv()))
    return out


def wait_for(pred, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()
