"""The records of a control shard's reservation table (table.py): the
states of upstream's state machine (../../../../docs/protocol.md,
"Reservations"), a transfer_id's Reservation, the Resident copy of an
mm_hash, and the reply a cancelled transfer_id gets.
"""
import uuid

WRITING = "WRITING"
READY = "READY"
CANCEL_PENDING = "CANCEL_PENDING"
EXPIRE_PENDING = "EXPIRE_PENDING"
CANCELLED = "CANCELLED"
EXPIRED = "EXPIRED"
DEFERRED = (CANCEL_PENDING, EXPIRE_PENDING)
ENDED = (CANCELLED, EXPIRED)


class Reservation:
    """One transfer_id's record. The data plane reads dst_ptr, nbytes,
    transfer_id, reservation_id and expires_at (the shard's clock)."""
    __slots__ = ("transfer_id", "mm_hash", "nbytes", "shape", "dtype",
                 "reservation_id", "state", "expires_at", "dst_session",
                 "dst_ptr", "buf", "writer", "followers", "resident",
                 "open", "ended_at", "fetching", "told", "hashed")

    def __init__(self, spec, state, now, ttl):
        self.transfer_id = spec.transfer_id
        self.mm_hash = spec.mm_hash
        self.nbytes = spec.nbytes
        self.shape = spec.shape
        self.dtype = spec.dtype
        self.reservation_id = uuid.uuid4().hex
        self.state = state
        self.expires_at = now + ttl
        self.dst_session = ""
        self.dst_ptr = 0
        self.buf = None         # the address of an allocation it owns
        self.writer = None      # the writer it follows
        self.followers = []     # its followers, while it writes
        self.resident = None    # the Resident it holds a lease on
        self.open = False       # between open_write and close_write
        self.ended_at = None
        self.fetching = False   # an ecx_fetch load writes its buffer
        self.told = False       # a failure event went out for it (ecx)
        # its writer sends a hash: the pool hashes the bytes as they land
        self.hashed = spec.hashed

    def status(self):
        return {"mm_hash": self.mm_hash, "ready": self.state == READY,
                "reservation_id": self.reservation_id,
                "nbytes": self.nbytes, "shape": list(self.shape),
                "dtype": self.dtype}


class Resident:
    """A buffer kept for mm_hash after it was completed for followers or
    loaded: pinned while pins > 0 (leases and the engine's use), retired
    (evictable, least recently used first) at 0."""
    __slots__ = ("mm_hash", "addr", "nbytes", "shape", "dtype", "pins")

    def __init__(self, rec, addr):
        self.mm_hash = rec.mm_hash
        self.addr = addr
        self.nbytes = rec.nbytes
        self.shape = rec.shape
        self.dtype = rec.dtype
        self.pins = 0


def cancelled_reply(nbytes):
    return {"reservation_id": "", "dst_session": "", "dst_ptr": 0,
            "nbytes": nbytes, "write": False, "ready": False,
            "cancelled": True}


class TombSpec:
    """The fields of a tombstone for a transfer_id never reserved."""

    def __init__(self, transfer_id):
        self.transfer_id = transfer_id
        self.mm_hash = ""
        self.nbytes = 0
        self.shape = ()
        self.dtype = ""
        self.hashed = False
