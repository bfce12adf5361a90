"""A stand-in of upstream vLLM's Mooncake EC connector on the encoder side,
push mode, written from ../../../shared/reference/vllm/PUSH.md (sections
1, 2 and 5) alone, not from ecx's code: it imports nothing of ecx.

What it does, as PUSH.md says upstream's producer worker does:
- discovery: `peers` at the consumer's base address, every shard's address
  made by replacing the port, `event_port` of each; cached per base;
- REQ clients with send/receive timeouts of control_timeout_s, linger 0,
  one socket per (thread, address), thrown away after any error;
- a push: `reserve` (one item) or `reserve_batch` (several) on every shard
  at once; an item any shard failed is cancelled on every shard with
  abandon (its reservation_id, or "" where none came back; up to 2 tries);
  a shard reservation older than TTL/2 that is not ready, cached or
  cancelled is cancelled with abandon and refresh and reserved again;
  the bytes go to the shards that are writable (not cached, not
  cancelled, write true or absent) after checking the reply's nbytes;
  then one `complete_batch` per shard listing what was written, every
  entry completed:true; any failure cancels every known reservation of
  the batch with abandon.

How bytes move is pluggable: writer(dst_session, dst_ptr, data) (default:
ctypes.memmove to dst_ptr, for a consumer in this process). `extra` is
merged into every request (for ecx's token, which upstream never sends).
"""
import ctypes
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

TTL_S = 300.0


class ControlError(RuntimeError):
    """An ok:false reply, or no reply within the timeout."""


def memmove_writer(dst_session, dst_ptr, data):
    ctypes.memmove(dst_ptr, bytes(data), len(data))


def replace_port(addr, port):
    head = addr.rsplit(":", 1)[0]
    return f"{head}:{port}"


class ControlClient:
    """REQ clients, one per (thread, address)."""

    def __init__(self, control_timeout_s=30.0, extra=None):
        self.timeout_ms = max(1, int(-(-control_timeout_s * 1000 // 1)))
        self.extra = dict(extra or {})
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._all = []
        self._lock = threading.Lock()

    def _socket(self, addr):
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        s = socks.get(addr)
        if s is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.IPV6, 1)
            s.linger = 0
            s.sndtimeo = self.timeout_ms
            s.rcvtimeo = self.timeout_ms
            s.connect(addr)
            socks[addr] = s
            with self._lock:
                self._all.append(s)
        return s

    def _drop(self, addr):
        s = self._local.socks.pop(addr, None)
        if s is not None:
            s.close(0)

    def call(self, addr, request):
        """The result of one op; ControlError on ok:false or a timeout."""
        request = dict(request, **self.extra)
        s = self._socket(addr)
        try:
            s.send(json.dumps(request).encode())
            reply = json.loads(s.recv())
        except zmq.Again:
            self._drop(addr)
            raise ControlError(f"{request['op']} to {addr}: timed out")
        except (zmq.ZMQError, ValueError) as e:
            self._drop(addr)
            raise ControlError(f"{request['op']} to {addr}: {e}")
        if not reply.get("ok"):
            raise ControlError(str(reply.get("error")))
        return reply.get("result")

    def close(self):
        with self._lock:
            for s in self._all:
                s.close(0)
            self._all = []
        self._ctx.term()


class Item:
    """One push: transfer_id, mm_hash, the bytes, shape and dtype name."""

    def __init__(self, transfer_id, mm_hash, data, shape, dtype):
        self.transfer_id = transfer_id
        self.mm_hash = mm_hash
        self.data = bytes(data)
        self.shape = list(shape)
        self.dtype = dtype
        self.shards = {}   # shard address -> reservation dict
        self.reserved_at = {}  # shard address -> clock() of that reserve
        self.error = None

    def request(self):
        return {"transfer_id": self.transfer_id, "mm_hash": self.mm_hash,
                "nbytes": len(self.data), "shape": self.shape,
                "dtype": self.dtype}


class UpstreamEncoder:
    def __init__(self, control_timeout_s=30.0, writer=memmove_writer,
                 clock=time.monotonic, extra=None):
        self.client = ControlClient(control_timeout_s, extra)
        self.writer = writer
        self.clock = clock
        self._topologies = {}
        self._pool = ThreadPoolExecutor(8)
        self.cancels = []  # (shard, cancel request) sent, for tests

    def close(self):
        self._pool.shutdown()
        self.client.close()

    # ---- discovery ----

    def shards(self, consumer_zmq):
        """[(shard address, event port)] of the consumer at consumer_zmq."""
        topo = self._topologies.get(consumer_zmq)
        if topo is None:
            ports = self.client.call(consumer_zmq, {"op": "peers"})["ports"]
            addrs = [replace_port(consumer_zmq, p) for p in ports]
            topo = [(a, int(self.client.call(a, {"op": "event_port"})))
                    for a in addrs]
            self._topologies[consumer_zmq] = topo
        return topo

    # ---- reserve ----

    def _reserve_on(self, addr, items):
        """[(ok, reservation or error text)] of items on one shard."""
        if len(items) == 1:
            try:
                return [(True, self.client.call(
                    addr, dict(op="reserve", **items[0].request())))]
            except ControlError as e:
                return [(False, str(e))]
        try:
            res = self.client.call(addr, {
                "op": "reserve_batch",
                "items": [i.request() for i in items]})["items"]
        except ControlError as e:
            return [(False, str(e))] * len(items)
        return [(bool(r.get("ok")), r.get("result") if r.get("ok")
                 else r.get("error")) for r in res]

    def reserve(self, consumer_zmq, items, addrs=None):
        """Reserves items on every shard at once (or on addrs). An item
        that any shard fails is cancelled with abandon everywhere and gets
        .error. Returns the items that hold a reservation on every
        shard."""
        try:
            addrs = addrs or [a for a, _ in self.shards(consumer_zmq)]
        except ControlError as e:
            for i in items:
                i.error = f"no topology: {e}"
            return []
        futs = {a: self._pool.submit(self._reserve_on, a, items)
                for a in addrs}
        replies = {a: f.result() for a, f in futs.items()}
        good = []
        for k, item in enumerate(items):
            for a in addrs:
                okay, r = replies[a][k]
                if okay:
                    item.shards[a] = r
                    item.reserved_at[a] = self.clock()
                elif item.error is None:
                    item.error = f"reserve on {a}: {r}"
            if item.error is None:
                good.append(item)
            else:
                self.abandon(consumer_zmq, [item])
        return good

    def abandon(self, consumer_zmq, items):
        addrs = [a for a, _ in self._topologies.get(consumer_zmq, [])]
        for item in items:
            for a in addrs or list(item.shards):
                r = item.shards.get(a) or {}
                self._cancel(a, {"op": "cancel",
                                 "transfer_id": item.transfer_id,
                                 "reservation_id": r.get("reservation_id",
                                                         ""),
                                 "abandon": True})

    def _cancel(self, addr, req):
        self.cancels.append((addr, req))
        for _ in range(2):
            try:
                return self.client.call(addr, req)["cancelled"]
            except ControlError:
                continue
        return None

    # ---- the push ----

    def _refresh(self, consumer_zmq, item):
        now = self.clock()
        stale = [a for a, r in item.shards.items()
                 if now - item.reserved_at[a] >= TTL_S / 2
                 and not r.get("ready") and not r.get("cached")
                 and not r.get("cancelled")]
        if not stale:
            return True
        for a in stale:
            self._cancel(a, {"op": "cancel", "transfer_id": item.transfer_id,
                             "reservation_id":
                             item.shards[a]["reservation_id"],
                             "abandon": True, "refresh": True})
            del item.shards[a]
        return bool(self.reserve(consumer_zmq, [item], addrs=stale))

    def push(self, consumer_zmq, items):
        """Reserves (where not yet), writes and completes items; returns
        the list of items that failed (each with .error), having cancelled
        their reservations with abandon."""
        fresh = [i for i in items if not i.shards]
        if fresh:
            self.reserve(consumer_zmq, fresh)
        live = [i for i in items if i.error is None]
        try:
            for item in live:
                if not self._refresh(consumer_zmq, item):
                    raise ControlError(item.error or "refresh failed")
            writes = {}  # shard address -> [(item, reservation)]
            for item in live:
                for a, r in item.shards.items():
                    if (r.get("cached") or r.get("cancelled")
                            or not r.get("write", True)):
                        continue
                    if r["nbytes"] != len(item.data):
                        raise ControlError(
                            f"{a} reserved {r['nbytes']} bytes for "
                            f"{len(item.data)}")
                    writes.setdefault(a, []).append((item, r))
            sessions = {}
            for a, entries in writes.items():
                for item, r in entries:
                    sessions.setdefault(r["dst_session"], []).append(
                        (r["dst_ptr"], item.data))
            futs = [self._pool.submit(self._write_session, s, w)
                    for s, w in sessions.items()]
            for f in futs:
                f.result()
            futs = {a: self._pool.submit(self.client.call, a, {
                "op": "complete_batch",
                "items": [{"transfer_id": i.transfer_id,
                           "reservation_id": r["reservation_id"]}
                          for i, r in entries]})
                for a, entries in writes.items()}
            for a, f in futs.items():
                for done in f.result()["items"]:
                    if not done.get("completed"):
                        raise ControlError(f"complete on {a} not completed")
        except Exception as e:
            for item in live:
                if item.error is None:
                    item.error = f"{type(e).__name__}: {e}"
            self.abandon(consumer_zmq, live)
        return [i for i in items if i.error is not None]

    def _write_session(self, session, writes):
        for dst_ptr, data in writes:
            self.writer(session, dst_ptr, data)


class EventSubscriber:
    """upstream's consumer scheduler's event side: one PULL connected to
    every shard's event port; a transfer is ready once every shard has
    reported it (told apart by "shard"). plain_password: connect as a
    ZeroMQ PLAIN client (what ecx's token asks of a subscriber)."""

    def __init__(self, shards, host="127.0.0.1", plain_password=None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.linger = 0
        if plain_password is not None:
            self.sock.plain_username = b"ecx"
            self.sock.plain_password = plain_password.encode()
        self.nshards = len(shards)
        for _, port in shards:
            self.sock.connect(f"tcp://{host}:{port}")
        self.seen = {}  # transfer_id -> {shard: event}
        self.frames = []

    def drain(self, wait_s=0.0):
        """Reads what has arrived (waiting up to wait_s for the first)."""
        if wait_s and not self.sock.poll(int(wait_s * 1000)):
            return
        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.frames.append(raw)
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("ready") is True:
                self.seen.setdefault(ev["transfer_id"], {})[ev["shard"]] = ev

    def ready(self, transfer_id):
        return len(self.seen.get(transfer_id, {})) == self.nshards

    def wait_ready(self, transfer_ids, timeout_s=5.0):
        deadline = time.monotonic() + timeout_s
        while not all(self.ready(t) for t in transfer_ids):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.drain(min(left, 0.05))
        return True

    def close(self):
        self.sock.close(0)
        self.ctx.term()
