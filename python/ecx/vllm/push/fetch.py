"""Fetches: the loads a control shard runs for ecx's `ecx_fetch` op
(../../../../docs/protocol.md, "Push mode: fetches over UCX (ecx)").

An ecx encoder that the shard told it can fetch ("ecx_fetch": true in a
reservation) sends, instead of writing over Mooncake's wire, the address
of the producer that holds the items; the shard pulls each item, as a
consumer's load does (UCX, cross-memory attach on one host), from that
producer straight into its reservation's range of the receive arena.
Each load is started from the shard's loop with Consumer.load_notify, so
the shard answers at once: the pulls go from that call where the
producer is connected (should the connection fail in between, the call
makes the handshake itself, within the consumer's timeout_ms), else from
a thread of libecx's that makes it, and libecx says the load's end on a datagram socket that the
loop polls (fileno()); no Python thread has to win the interpreter's lock
for a fetch to start or to land (a thread per load did: 0.2-0.4 ms each
way on two cores). The loop then settles its reservations (landed()).
Each item's pull names the lease its encoder holds it by ("ecx_lease"),
which the producer ends once the pull holds the item; a failed load ends
the leases it did not use (on a thread of its own: a round trip).
Everything but pause() and resume() is called from the shard's loop.
"""
import collections
import ctypes
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from ... import Item
from ...dtypes import DTYPES

# A load whose end was not said (the message lost: the socket full) is
# looked at directly once it is this old, and again each time this much
# later (seconds).
UNSAID_S = 0.5


class Fetches:
    """consumer: the ecx.Consumer whose receive arena the pool hands
    out."""

    def __init__(self, consumer):
        self.consumer = consumer
        self._r, self._w = socket.socketpair(socket.AF_UNIX,
                                             socket.SOCK_DGRAM)
        self._r.setblocking(False)
        self._seq = 0
        self._inflight = {}  # seq -> (load, entries, producer, look at)
        self._paused = False
        self._held = collections.deque()  # (producer, entries, pairs)
        self._releases = ThreadPoolExecutor(1, thread_name_prefix=
                                            "ecx-fetch-release")

    def fileno(self):
        """The descriptor that turns readable when a load has ended (or
        resume() was called)."""
        return self._r.fileno()

    def pause(self):
        """Loads started from now on wait, not started, until resume()
        (tests: an accepted fetch whose pull has not reached the
        producer)."""
        self._paused = True

    def resume(self):
        self._paused = False
        try:
            self._w.send(b"")  # wakes the loop, which starts them
        except OSError:
            pass

    def start(self, producer, epoch, entries, leases=None):
        """Starts one load of entries ([(Reservation, hash or None)]) from
        producer (its producer_zmq) into each record's buffer; leases: per
        entry, the lease its encoder took on the item (0: none), which the
        pull names so the producer ends it once the pull holds the item.
        ValueError where an entry cannot be loaded, the library's error
        where the load cannot start."""
        import numpy as np
        pairs = []
        leases = leases or [0] * len(entries)
        for (r, _), lease in zip(entries, leases):
            if r.dtype not in DTYPES:
                raise ValueError(f"dtype {r.dtype!r} has no ecx dtype")
            dst = np.ctypeslib.as_array(
                (ctypes.c_uint8 * r.nbytes).from_address(r.buf))
            pairs.append((Item(r.mm_hash, r.dtype, r.shape, r.nbytes,
                               producer, epoch, lease), dst))
        if self._paused:
            self._held.append((producer, entries, pairs))
            return
        self._go(producer, entries, pairs)

    def _go(self, producer, entries, pairs):
        self._seq += 1
        load = self.consumer.load_notify(pairs, self._w,
                                         struct.pack("<Q", self._seq))
        self._inflight[self._seq] = (load, entries, producer,
                                     time.monotonic() + UNSAID_S)

    def _end(self, seq):
        load, entries, producer, _ = self._inflight.pop(seq)
        errors = load.wait()  # at once where it has ended
        # A failed pull that never held its item leaves the encoder's
        # lease on it: ended (a round trip, bounded by the consumer's
        # timeout), so the item is evictable before its expiry.
        held = [it for it, err in zip(load.items, errors)
                if err is not None and it.lease]
        if held:
            self._releases.submit(self._release, held)
        return entries, errors, producer

    def _release(self, items):
        try:
            self.consumer.release(items)
        except Exception:  # noqa: BLE001 - the lease then expires
            pass

    def landed(self):
        """[(entries, errors, producer)] of every load that has ended
        since the last call (errors: None or an exception per entry)."""
        out = []
        while self._held and not self._paused:
            producer, entries, pairs = self._held.popleft()
            try:
                self._go(producer, entries, pairs)
            except Exception as e:  # every entry then fails with it
                out.append((entries, [e] * len(entries), producer))
                held = [it for it, _ in pairs if it.lease]
                if held:
                    self._releases.submit(self._release, held)
        while True:
            try:
                msg = self._r.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            if len(msg) >= 8:
                seq = struct.unpack("<Q", msg[:8])[0]
                if seq in self._inflight:
                    out.append(self._end(seq))
        now = time.monotonic()
        for seq, (load, entries, producer, due) in list(
                self._inflight.items()):
            if now < due:
                continue
            if load.test():
                out.append(self._end(seq))
            else:  # looked at again UNSAID_S later, not every pass
                self._inflight[seq] = (load, entries, producer,
                                       now + UNSAID_S)
        return out

    def close(self):
        """Starts what waits, waits for the loads still running (each
        bounded by the consumer's timeout); returns them as landed()
        does."""
        self._paused = False
        out = self.landed()
        for seq in list(self._inflight):
            out.append(self._end(seq))
        self._releases.shutdown(wait=True)
        self._r.close()
        self._w.close()
        return out
