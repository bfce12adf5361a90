"""The reservation table of one control shard: upstream's state machine
(../../../../docs/protocol.md, "Reservations"), over a ReceivePool.

States (records.py, with the records): WRITING, READY, CANCEL_PENDING and
EXPIRE_PENDING (deferred: the writer still holds the memory), CANCELLED
and EXPIRED (tombstones, kept TTL seconds). A record either owns an
allocation (a writer, or a READY record it became), or follows a writer
(shares its destination, writes nothing), or holds a lease on a resident
copy (a buffer already loaded or completed for its mm_hash). Every method
takes the table's lock; the pool's methods and the callbacks are called
with it held.
"""
import collections
import logging
import threading

from .records import (CANCEL_PENDING, CANCELLED, DEFERRED, EXPIRE_PENDING,
                      EXPIRED, READY, WRITING, Reservation, Resident,
                      TombSpec, cancelled_reply)

TTL_S = 300.0            # reservations and tombstones (upstream's fixed value)
TOMBSTONE_LIMIT = 65536  # oldest dropped first

logger = logging.getLogger("ecx.vllm.push")


class Refused(ValueError):
    """An op the table refuses; its text goes into the error envelope."""


class ReservationTable:
    """The records of one shard. on_event(record dict) is called for every
    ready event (status fields plus transfer_id), on_reclaimed(mm_hash)
    for every resident copy evicted to make room, on_failed(record, why)
    for a writer whose ecx_fetch load runs when the reaper expires it (it
    can no longer become ready); clock() gives seconds."""

    def __init__(self, pool, clock, on_event, on_reclaimed=None,
                 ttl=TTL_S, tombstone_limit=TOMBSTONE_LIMIT, on_failed=None):
        self.pool = pool
        self.clock = clock
        self.ttl = float(ttl)
        self.tombstone_limit = int(tombstone_limit)
        self.lock = threading.RLock()
        self._on_event = on_event
        self._on_reclaimed = on_reclaimed or (lambda mm_hash: None)
        self._on_failed = on_failed or (lambda r, why: None)
        self._active = {}  # transfer_id -> Reservation, not ended
        self._tombs = collections.OrderedDict()  # transfer_id -> ended one
        self._writers = {}  # mm_hash -> the WRITING writer
        self._residents = collections.OrderedDict()  # mm_hash -> Resident
        self.shutting_down = False

    # ---- lookups ----

    def get(self, transfer_id):
        with self.lock:
            return (self._active.get(transfer_id)
                    or self._tombs.get(transfer_id))

    def state(self, transfer_id):
        r = self.get(transfer_id)
        return r.state if r else None

    def resident(self, mm_hash):
        with self.lock:
            return self._residents.get(mm_hash)

    def counts(self):
        """{state: records} over active records and tombstones."""
        with self.lock:
            c = collections.Counter(r.state for r in self._active.values())
            c.update(r.state for r in self._tombs.values())
            return dict(c)

    # ---- ops ----

    def reserve(self, s):
        """The reserve result for ReserveSpec s; Refused otherwise."""
        with self.lock:
            if self.shutting_down:
                raise Refused("EC consumer is shutting down")
            now = self.clock()
            r = self.get(s.transfer_id)
            if r is not None:
                if r.state == CANCELLED:
                    return cancelled_reply(s.nbytes)
                if r.state == EXPIRED:
                    del self._tombs[s.transfer_id]
                elif r.state == EXPIRE_PENDING:
                    raise Refused(f"transfer_id {s.transfer_id} still has "
                                  f"an active writer")
                else:
                    return self._again(r, s, now)
            res = self._residents.get(s.mm_hash)
            if res is not None:
                if (res.shape, res.dtype) != (s.shape, s.dtype):
                    raise Refused("conflicting cached tensor for mm_hash")
                r = Reservation(s, READY, now, self.ttl)
                self._lease(r, res)
                r.dst_session = self.pool.session
                self._active[r.transfer_id] = r
                self._emit(r)
                return self._reply(r, False)
            w = self._writers.get(s.mm_hash)
            if w is not None:
                if (w.shape, w.dtype) != (s.shape, s.dtype):
                    raise Refused("conflicting in-flight tensor for mm_hash")
                r = Reservation(s, WRITING, now, self.ttl)
                r.writer = w
                r.dst_ptr = w.dst_ptr
                r.dst_session = self.pool.session
                w.followers.append(r)
                self._active[r.transfer_id] = r
                return self._reply(r, False)
            addr = self._allocate(s.nbytes)
            if addr is None:
                raise Refused("EC consumer buffer pool is full")
            r = Reservation(s, WRITING, now, self.ttl)
            r.buf = r.dst_ptr = addr
            r.dst_session, r.dst_ptr = self.pool.open_write(r)
            r.open = True
            self._writers[r.mm_hash] = r
            self._active[r.transfer_id] = r
            return self._reply(r, True)

    def _again(self, r, s, now):
        """A reserve repeated for a record in WRITING, READY or
        CANCEL_PENDING: the same record, write:false."""
        if (r.mm_hash, r.shape, r.dtype) != (s.mm_hash, s.shape, s.dtype):
            raise Refused("conflicting reservation for transfer_id")
        if r.state == CANCEL_PENDING:
            return cancelled_reply(s.nbytes)
        if r.state == WRITING:
            r.expires_at = now + self.ttl
            if r.open:
                # the same range, a later deadline; hashed or not as the
                # first reserve said (a hash sent anyway is checked from
                # the arena at complete)
                self.pool.open_write(r)
        if r.state == READY:
            self._emit(r)
        return self._reply(r, False)

    def complete(self, transfer_id, reservation_id, verify=None):
        """(completed, became_ready). verify(addr, nbytes, xxh3), where
        given, is asked about a writer's bytes once its window is closed
        (xxh3: the pool's hash of them made as they landed, or None):
        False ends it CANCELLED (its followers too) and completes
        nothing."""
        with self.lock:
            r = self._active.get(transfer_id)
            if r is None or r.reservation_id != reservation_id:
                return False, False
            if r.state == READY:
                return True, False
            if r.writer is not None or r.buf is None or r.fetching:
                return False, False  # a follower writes nothing
            now = self.clock()
            landed_xxh3 = self._close(r)
            self._unwrite(r)
            if verify is not None and not verify(r.buf, r.nbytes,
                                                 landed_xxh3):
                self._end(r, CANCELLED, now)
                return False, False
            res = None
            if r.followers:
                res = self._retain(r)
                for f in r.followers:
                    f.writer = None
                    f.state = READY
                    f.expires_at = now + self.ttl
                    self._lease(f, res)
                    self._emit(f)
                r.followers = []
            if r.state in DEFERRED:
                self._end(r, CANCELLED if r.state == CANCEL_PENDING
                          else EXPIRED, now)
                return True, False
            r.state = READY
            r.expires_at = now + self.ttl
            if res is not None:
                self._lease(r, res)
            self._emit(r)
            return True, True

    def cancel(self, transfer_id, reservation_id, abandon=False,
               refresh=False):
        """cancelled (bool)."""
        with self.lock:
            now = self.clock()
            r = self.get(transfer_id)
            if r is None:
                t = Reservation(TombSpec(transfer_id), CANCELLED, now, 0.0)
                t.reservation_id = ""
                self._bury(t, now)
                return True
            if reservation_id and r.reservation_id != reservation_id:
                return False
            if r.state == CANCELLED:
                r.ended_at = now
                self._tombs.move_to_end(transfer_id)
                return True
            if refresh:
                if not abandon or r.state not in (WRITING, EXPIRE_PENDING):
                    return False
                self._end(r, EXPIRED, now)
                return True
            if r.writer is not None:
                self._end(r, CANCELLED, now)
                return True
            if r.state in DEFERRED and not abandon:
                return True
            if r.state == WRITING and not abandon:
                r.state = CANCEL_PENDING
                r.expires_at = now + self.ttl  # ecx: not forever (reap)
                self._close(r)
                self._unwrite(r)
                return True
            if r.state == EXPIRED:
                return False
            self._end(r, CANCELLED, now)
            return True

    def fetchable(self, transfer_id, reservation_id):
        """The writer (WRITING, owning its buffer, no fetch running) that
        an ecx_fetch entry names, now marked fetching; None otherwise."""
        with self.lock:
            r = self._active.get(transfer_id)
            if (r is None or r.reservation_id != reservation_id
                    or r.state != WRITING or r.writer is not None
                    or r.buf is None or r.fetching):
                return None
            r.fetching = True
            self._close(r)  # the pull fills it: no Mooncake write lands
            return r

    def fetch_done(self, r, landed, verify=None):
        """The end of r's fetch: (completed, became_ready) as complete
        where it landed (verify as complete's), else r ends CANCELLED.
        A record that ended while its fetch ran only frees its buffer
        now. The second value is, where it did not land, whether r was
        still live (so its failure is to be told)."""
        with self.lock:
            r.fetching = False
            if self._active.get(r.transfer_id) is not r:
                self._release(r)
                return False, False
            if landed:
                return self.complete(r.transfer_id, r.reservation_id, verify)
            self._end(r, CANCELLED, self.clock())
            return False, True

    def status(self, transfer_id):
        with self.lock:
            r = self._active.get(transfer_id)
            return r.status() if r else None

    def reap(self):
        """Ends what has expired: READY → EXPIRED, a WRITING follower →
        CANCELLED, a WRITING writer → EXPIRE_PENDING (its memory kept for
        complete or an abandoning cancel, one TTL more; one whose
        ecx_fetch runs is reported to on_failed, as its load's landing
        only ends it EXPIRED), and a deferred writer one TTL after it was
        deferred (ecx's bound; upstream keeps it until the shard stops):
        EXPIRE_PENDING → EXPIRED, CANCEL_PENDING → CANCELLED, its memory
        freed. Drops tombstones older than TTL. Returns the records it
        moved."""
        with self.lock:
            now = self.clock()
            moved = 0
            for r in list(self._active.values()):
                if r.expires_at is None or now < r.expires_at:
                    continue
                if r.state == READY:
                    self._end(r, EXPIRED, now)
                elif r.state == WRITING and r.writer is not None:
                    self._end(r, CANCELLED, now)
                elif r.state == WRITING:
                    r.state = EXPIRE_PENDING
                    r.expires_at = now + self.ttl  # ecx: one TTL more
                    self._close(r)
                    self._unwrite(r)
                    if r.fetching:
                        self._on_failed(r, "its reservation expired (TTL) "
                                           "while its ecx_fetch ran")
                elif r.state in DEFERRED:
                    # ecx: a writer that never came back (killed
                    # mid-write) holds its memory one TTL, not until the
                    # shard stops; its window is closed, so no byte can
                    # land in the memory once freed
                    self._end(r, CANCELLED if r.state == CANCEL_PENDING
                              else EXPIRED, now)
                else:
                    continue
                moved += 1
            while self._tombs:
                tid, t = next(iter(self._tombs.items()))
                if now - t.ended_at < self.ttl:
                    break
                del self._tombs[tid]
            return moved

    # ---- what the loader calls ----

    def take(self, transfer_id, mm_hash):
        """Hands a READY record's buffer to the engine: it becomes the
        pinned resident copy of mm_hash and the record is deleted (no
        tombstone). Returns (addr, nbytes, shape, dtype); Refused where the
        record is not READY or names another mm_hash."""
        with self.lock:
            r = self._active.get(transfer_id)
            if r is None or r.state != READY or r.mm_hash != mm_hash:
                raise Refused(f"transfer_id {transfer_id} is not ready for "
                              f"{mm_hash}")
            del self._active[transfer_id]
            if r.resident is not None:
                res, r.resident = r.resident, None  # the lease is the pin
            else:
                res = self._retain(r)
                res.pins += 1
            self._residents.move_to_end(res.mm_hash)
            return res.addr, res.nbytes, res.shape, res.dtype

    def release(self, mm_hash):
        """The engine no longer uses mm_hash: one pin less; at none the
        copy is retired (kept for a later reserve, evictable)."""
        with self.lock:
            res = self._residents.get(mm_hash)
            if res is not None and res.pins > 0:
                res.pins -= 1
                self._residents.move_to_end(mm_hash)

    def shutdown(self):
        """Refuses new reserves; READY records and followers end
        CANCELLED, writers become CANCEL_PENDING (their windows closed).
        Returns how many writers still hold memory."""
        with self.lock:
            self.shutting_down = True
            now = self.clock()
            for r in list(self._active.values()):
                if r.state == READY or r.writer is not None:
                    self._end(r, CANCELLED, now)
                elif r.state == WRITING:
                    r.state = CANCEL_PENDING
                    r.expires_at = now + self.ttl  # as cancel's
                    self._close(r)
                    self._unwrite(r)
            return self.writers_left()

    def writers_left(self):
        with self.lock:
            return sum(1 for r in self._active.values() if r.buf is not None
                       and r.state in (WRITING,) + DEFERRED)

    # ---- inside ----

    def _reply(self, r, write):
        return {"reservation_id": r.reservation_id,
                "dst_session": r.dst_session, "dst_ptr": r.dst_ptr,
                "nbytes": r.nbytes, "write": write,
                "ready": r.state == READY,
                "cached": r.resident is not None}  # it holds a lease

    def _emit(self, r):
        ev = r.status()
        ev["transfer_id"] = r.transfer_id
        self._on_event(ev)

    def _lease(self, r, res):
        r.resident = res
        r.dst_ptr = res.addr
        res.pins += 1
        self._residents.move_to_end(res.mm_hash)

    def _retain(self, r):
        """The resident copy of r's mm_hash made from r's buffer (or, where
        one exists already, that one, and r's buffer freed)."""
        res = self._residents.get(r.mm_hash)
        if res is None:
            res = self._residents[r.mm_hash] = Resident(r, r.buf)
        else:
            self.pool.free(r.buf)
        r.buf = None
        return res

    def _close(self, r):
        """Closes r's window if open; returns the pool's hash of what
        landed through it (close_write's), None when not open."""
        if r.open:
            r.open = False
            return self.pool.close_write(r)
        return None

    def _unwrite(self, r):
        if self._writers.get(r.mm_hash) is r:
            del self._writers[r.mm_hash]

    def _end(self, r, state, now):
        """r ends in state (CANCELLED or EXPIRED): its window closed, its
        memory freed or lease released; a writer's followers, which will
        now never be written, end CANCELLED."""
        self._close(r)
        self._unwrite(r)
        if r.writer is not None:
            r.writer.followers.remove(r)
            r.writer = None
        for f in r.followers:
            f.writer = None
            self._release(f)
            f.state = CANCELLED
            self._bury(f, now)
        r.followers = []
        self._release(r)
        r.state = state
        self._bury(r, now)

    def _release(self, r):
        if r.buf is not None and not r.fetching:  # else fetch_done frees it
            self.pool.free(r.buf)
            r.buf = None
        if r.resident is not None:
            r.resident.pins -= 1
            r.resident = None

    def _bury(self, r, now):
        self._active.pop(r.transfer_id, None)
        r.ended_at = now
        r.expires_at = None
        self._tombs[r.transfer_id] = r
        self._tombs.move_to_end(r.transfer_id)
        while len(self._tombs) > self.tombstone_limit:
            self._tombs.popitem(last=False)

    def _allocate(self, nbytes):
        addr = self.pool.allocate(nbytes)
        if addr is None:
            self.reap()
            addr = self.pool.allocate(nbytes)
        while addr is None:
            victim = next((m for m, res in self._residents.items()
                           if res.pins == 0), None)
            if victim is None:
                return None
            res = self._residents.pop(victim)
            self.pool.free(res.addr)
            logger.info("push: evicted the resident copy of %s for room",
                        victim)
            self._on_reclaimed(victim)
            addr = self.pool.allocate(nbytes)
        return addr
