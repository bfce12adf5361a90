"""ArenaPool: a ReceivePool in an ecx Consumer's receive arena, written
over Mooncake's TCP wire by upstream's encoder (or anything that speaks
it): allocate and free are the arena's allocator (ecx_consumer_alloc),
and open_write/close_write are the C receiver's windows
(ecx_consumer_push_open/close), so a write lands only inside a WRITING
reservation's exact range and before its deadline; anything else is
refused on the wire with Mooncake's rejected status and writes nothing.
The receiver hashes a window as its bytes land (XXH3) where the
reservation says its writer will send a hash to check (ecx_hashed):
close_write returns that hash where every byte came once, in order.
"""
import ctypes
import threading
import time
from collections import OrderedDict

from .pool import ALIGN, ReceivePool

LANDED_KEPT = 1024


class ArenaPool(ReceivePool):
    """consumer: an ecx.Consumer with a receive arena (recv_capacity) and
    the Mooncake wire not off. clock: the shard's (expires_at is on it).
    size: at most this many bytes of the arena are handed out."""

    def __init__(self, consumer, clock=time.monotonic, size=None):
        self._c = consumer
        self.consumer = consumer  # ecx_fetch's loads land in its arena
        base, cap = consumer.arena()
        if not base or not cap:
            raise ValueError("ArenaPool needs a consumer with a receive "
                             "arena (recv_capacity > 0)")
        self.base, self.size = base, cap
        self._limit = cap if size is None else min(cap, int(size))
        self.session = consumer.mooncake_session()
        self._clock = clock
        self._lock = threading.Lock()
        self._used = {}  # addr -> rounded length
        self._windows = {}  # reservation_id -> window id
        # reservation_id -> bytes landed, at close_write: the newest
        # LANDED_KEPT only (for tests and debugging; a prefill runs for
        # weeks)
        self.landed = OrderedDict()

    @property
    def limit(self):
        return self._limit

    def _left(self, r):
        return max(0.0, r.expires_at - self._clock())

    def allocate(self, nbytes):
        want = max(ALIGN, (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
            if sum(self._used.values()) + want > self._limit:
                return None
            addr = self._c.alloc(want)
            if addr:
                self._used[addr] = want
            return addr or None

    def free(self, addr):
        with self._lock:
            self._used.pop(addr)
        self._c.free(addr)

    def used_bytes(self):
        with self._lock:
            return sum(self._used.values())

    def open_write(self, r):
        with self._lock:
            wid = self._windows.get(r.reservation_id)
        if wid is not None:
            self._c.push_renew(wid, self._left(r))
        else:
            wid = self._c.push_open(r.dst_ptr, r.nbytes, self._left(r),
                                    hashed=r.hashed)
            with self._lock:
                self._windows[r.reservation_id] = wid
        return self.session, r.dst_ptr

    def close_write(self, r):
        with self._lock:
            wid = self._windows.pop(r.reservation_id, None)
        if wid is None:
            return None
        landed, xxh3 = self._c.push_close_hashed(wid)
        self.landed[r.reservation_id] = landed
        while len(self.landed) > LANDED_KEPT:
            self.landed.popitem(last=False)
        return xxh3

    def is_open(self, reservation_id):
        with self._lock:
            return reservation_id in self._windows

    def read(self, addr, nbytes):
        """A copy of nbytes at addr (inside the arena)."""
        if addr < self.base or addr + nbytes > self.base + self.size:
            raise ValueError("range outside the arena")
        return ctypes.string_at(addr, nbytes)
