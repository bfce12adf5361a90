"""Fetches: the loads a control shard runs for ecx's `ecx_fetch` op
(../../../../docs/protocol.md, "Push mode: fetches over UCX (ecx)").

An ecx encoder that the shard told it can fetch ("ecx_fetch": true in a
reservation) sends, instead of writing over Mooncake's wire, the address
of the producer that holds the items; the shard pulls each item, as a
consumer's load does (Consumer.load_into: UCX, cross-memory attach on one
host), from that producer straight into its reservation's range of the
receive arena. The loads run on a few threads of their own (each blocked
in libecx, the interpreter's lock released), so the shard answers at
once, handshakes with a new producer included; each ended load is queued
and the shard's loop woken (wake), which then settles its reservations
(landed()). Each item's pull names the lease its encoder holds it by
("ecx_lease"), which the producer ends once the pull holds the item; a
failed load ends the leases it did not use.
"""
import collections
import ctypes
from concurrent.futures import ThreadPoolExecutor

from ... import Item
from ...dtypes import DTYPES

THREADS = 4


class Fetches:
    """consumer: the ecx.Consumer whose receive arena the pool hands
    out; wake(): called after each load ends."""

    def __init__(self, consumer, wake):
        self.consumer = consumer
        self._wake = wake
        self._ended = collections.deque()
        self._pool = ThreadPoolExecutor(THREADS,
                                        thread_name_prefix="ecx-fetch")

    def start(self, producer, epoch, entries, leases=None):
        """Starts one load of entries ([(Reservation, hash or None)]) from
        producer (its producer_zmq) into each record's buffer; leases: per
        entry, the lease its encoder took on the item (0: none), which the
        pull names so the producer ends it once the pull holds the item.
        ValueError where an entry cannot be loaded."""
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
        self._pool.submit(self._load, producer, entries, pairs)

    def _load(self, producer, entries, pairs):
        try:
            errors = self.consumer.load_into(pairs)
        except Exception as e:  # every entry then fails with it
            errors = [e] * len(entries)
        self._ended.append((entries, errors, producer))
        self._wake()
        # A failed pull that never held its item leaves the encoder's
        # lease on it: ended here (one round trip, bounded by the
        # consumer's timeout), so the item is evictable before its expiry.
        held = [it for (it, _), err in zip(pairs, errors)
                if err is not None and it.lease]
        if held:
            try:
                self.consumer.release(held)
            except Exception:  # noqa: BLE001 - the lease then expires
                pass

    def landed(self):
        """[(entries, errors, producer)] of every load that has ended
        since the last call (errors: None or an exception per entry)."""
        out = []
        while self._ended:
            out.append(self._ended.popleft())
        return out

    def close(self):
        """Waits for the loads still running (each bounded by the
        consumer's timeout); returns them as landed() does."""
        self._pool.shutdown(wait=True)
        return self.landed()
