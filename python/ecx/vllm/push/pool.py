"""The receive pool a control shard reserves in, and the interface the
data plane implements.

A shard needs five things of its pool (ReceivePool names them): where the
memory starts and how big it is, the data-plane session it advertises,
allocate/free of byte ranges, and two hooks, open_write and close_write,
that bracket the time a writer may put bytes into one reservation's exact
range. The Mooncake TCP receiver implements them in C later; BufferPool
here is the same interface over memory this process holds (a bytearray, a
numpy array, an mmap), with the receiver's rule emulated by receive().
"""
import bisect
import ctypes
import threading

ALIGN = 256  # sizes are rounded up to this, as upstream's allocator does


class ReceivePool:
    """What a ControlShard calls. Attributes: base (int, the absolute
    address of the pool's first byte), size (int, bytes), limit (the most
    bytes it lends at once, at most size: a reserve above it can never
    be served), session (str, the dst_session a reply carries where
    nothing is written: followers, resident copies). Every method is
    called by the shard with its table lock held, so none may call back
    into the shard."""

    base = 0
    size = 0
    session = ""

    @property
    def limit(self):
        return self.size

    def allocate(self, nbytes):
        """An absolute address of nbytes free bytes (inside
        [base, base+size)), or None when no range is free. Never waits."""
        raise NotImplementedError

    def free(self, addr):
        """Gives back the range allocate returned at addr. The shard frees
        a range only after close_write for every writer of it."""
        raise NotImplementedError

    def open_write(self, reservation):
        """Called when reservation (a Reservation: dst_ptr, nbytes,
        transfer_id, reservation_id, expires_at on the shard's clock, and
        hashed: its writer will send a hash, so a pool that can hashes
        the bytes as they land)
        enters WRITING as the owner of a fresh allocation, and again, with
        the same range, when a repeated reserve moves its expires_at.
        From then until close_write, writes into exactly [dst_ptr,
        dst_ptr+nbytes) before expires_at may land. Returns (dst_session,
        dst_ptr), the pair the reserve reply advertises."""
        raise NotImplementedError

    def close_write(self, reservation):
        """Called once when reservation leaves WRITING (complete, cancel,
        refresh, the reaper, shutdown). After it returns no write into its
        range may land, so the shard can hand the bytes to a reader or
        free them. Returns the XXH3 of the range where the pool made it
        as the bytes landed (a hashed reservation, each byte once, in
        order: ArenaPool), else
        None (the shard then hashes the range, xxh3())."""
        raise NotImplementedError

    def xxh3(self, addr, nbytes):
        """The XXH3 of nbytes at addr (inside the pool), which a writer's
        "ecx_xxh3" is checked against. Memory of this process: ecx_xxh3."""
        from ... import xxh3
        return xxh3(addr, nbytes)


class BufferPool(ReceivePool):
    """A ReceivePool over a writable buffer of this process (anything
    ctypes can take the address of: bytearray, numpy array, mmap).
    First-fit allocation in ALIGN-byte steps from the first ALIGN-aligned
    byte of buffer (size: the whole ALIGN-byte steps after it). receive()
    is the receiver's rule: bytes land only inside a range between
    open_write and close_write and before its deadline (clock() <
    expires_at); anything else raises PermissionError and writes
    nothing. clock: the shard's (None: no deadline checked). size: at
    most this many bytes of buffer are used."""

    def __init__(self, buffer, session, clock=None, size=None):
        self._buffer = buffer  # kept alive: the addresses point into it
        whole = (ctypes.c_char * len(memoryview(buffer).cast("B"))
                 ).from_buffer(buffer)
        start = ctypes.addressof(whole)
        skip = -start % ALIGN  # the first ALIGN-aligned byte is base
        self.size = max(0, len(whole) - skip) // ALIGN * ALIGN
        if size is not None:
            self.size = min(self.size, int(size) // ALIGN * ALIGN)
        self._raw = (ctypes.c_char * self.size).from_buffer(buffer, skip)
        self.base = start + skip
        self.session = session
        self._clock = clock
        self._lock = threading.Lock()
        self._free = [(0, self.size)] if self.size else []  # (off, len)
        self._used = {}  # offset -> rounded length
        self._open = {}  # reservation_id -> (lo, hi, reservation)
        self.opened = []  # reservation_ids, in open_write order (tests)
        self.closed = []  # reservation_ids, in close_write order (tests)

    # ---- allocation ----

    def allocate(self, nbytes):
        want = max(ALIGN, (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= want:
                    if length == want:
                        del self._free[i]
                    else:
                        self._free[i] = (off + want, length - want)
                    self._used[off] = want
                    return self.base + off
        return None

    def free(self, addr):
        off = addr - self.base
        with self._lock:
            length = self._used.pop(off)
            i = bisect.bisect(self._free, (off, 0))
            if i < len(self._free) and off + length == self._free[i][0]:
                length += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                off, prev = self._free.pop(i - 1)
                length += prev
                i -= 1
            self._free.insert(i, (off, length))

    def used_bytes(self):
        with self._lock:
            return sum(self._used.values())

    # ---- the writer's window ----

    def open_write(self, reservation):
        with self._lock:
            lo = reservation.dst_ptr
            self._open[reservation.reservation_id] = (
                lo, lo + reservation.nbytes, reservation)
            self.opened.append(reservation.reservation_id)
        return self.session, reservation.dst_ptr

    def close_write(self, reservation):
        with self._lock:
            if self._open.pop(reservation.reservation_id, None):
                self.closed.append(reservation.reservation_id)
        return None

    def is_open(self, reservation_id):
        with self._lock:
            return reservation_id in self._open

    def receive(self, dst_ptr, data):
        """Writes data at dst_ptr as the receiver would: only where one
        open range holds all of it, before that range's deadline. Raises
        PermissionError otherwise (nothing written)."""
        data = memoryview(data).cast("B")
        with self._lock:
            for lo, hi, res in self._open.values():
                if lo <= dst_ptr and dst_ptr + len(data) <= hi:
                    if self._clock and self._clock() >= res.expires_at:
                        raise PermissionError(
                            f"the window of {res.reservation_id} closed "
                            f"at its deadline")
                    ctypes.memmove(dst_ptr, bytes(data), len(data))
                    return
        raise PermissionError(
            f"{len(data)} bytes at {dst_ptr:#x}: no open reservation holds "
            f"that range")

    def read(self, addr, nbytes):
        """A copy of nbytes at addr (inside the pool)."""
        off = addr - self.base
        if off < 0 or off + nbytes > self.size:
            raise ValueError("range outside the pool")
        return bytes(memoryview(self._raw).cast("B")[off:off + nbytes])
