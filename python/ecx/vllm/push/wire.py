"""The control wire: envelopes, dtype names, and the checks on every
request field (../../../../docs/protocol.md, "Push mode: the control
shard"). Each check raises BadRequest with a one-line reason; the shard
turns it into upstream's error envelope {"ok": false, "error": reason}
before anything is reserved, completed or cancelled."""
import json

# torch's dtype attribute names (what upstream accepts) -> item size.
DTYPE_SIZES = {
    "float32": 4, "float": 4, "float64": 8, "double": 8,
    "float16": 2, "half": 2, "bfloat16": 2,
    "complex32": 4, "chalf": 4, "complex64": 8, "cfloat": 8,
    "complex128": 16, "cdouble": 16,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "short": 2, "int32": 4, "int": 4,
    "int64": 8, "long": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}

MAX_FRAME = 4 << 20       # bytes; a longer frame is dropped by ZeroMQ
MAX_BATCH = 4096          # items in one reserve_batch or complete_batch
MAX_ID = 256              # characters of a transfer_id or reservation_id
MAX_HASH = 1024           # characters of an mm_hash
MAX_DIMS = 8
TOKEN_FIELD = "ecx_token"
HASH_FIELD = "ecx_xxh3"     # a complete item's hash of the bytes (ecx)
HASHED_FIELD = "ecx_hashed"  # a reserve's: hash the bytes as they land
FAILED_FIELD = "ecx_failed"  # a failure event's reason (ecx)
FETCH_FIELD = "ecx_fetch"    # the fetch advert, asked and told (ecx)
LEASE_FIELD = "ecx_lease"    # a fetch entry's lease at its producer (ecx)
MAX_LEASE = (1 << 53) - 1    # lease numbers JSON carries exactly
MAX_ADDR = 255               # characters of a producer's address


class BadRequest(ValueError):
    """A request the shard refuses before acting on it."""


def ok(result):
    return {"ok": True, "result": result}


def error(text):
    return {"ok": False, "error": str(text)}


def decode(frames):
    """The request object of one received message (a list of frames), or
    BadRequest: one frame, UTF-8, a JSON object with a string "op"."""
    if len(frames) != 1:
        raise BadRequest("malformed control request")
    try:
        req = json.loads(bytes(frames[0]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("malformed control request") from None
    if not isinstance(req, dict):
        raise BadRequest("malformed control request: not a JSON object")
    if "op" not in req:
        raise BadRequest("malformed control request: no 'op'")
    if not isinstance(req["op"], str):
        raise BadRequest("malformed control request: 'op' is not a string")
    return req


def encode(reply):
    return json.dumps(reply, separators=(",", ":")).encode()


def field(req, name, kind, default=None, required=True):
    """req[name] checked against kind ('str', 'int', 'bool', 'list');
    absent: BadRequest if required, else default."""
    if name not in req:
        if required:
            raise BadRequest(f"missing field {name!r}")
        return default
    v = req[name]
    good = {"str": isinstance(v, str),
            "int": isinstance(v, int) and not isinstance(v, bool),
            "bool": isinstance(v, bool),
            "list": isinstance(v, list)}[kind]
    if not good:
        raise BadRequest(f"field {name!r} must be a {_KIND[kind]}, got "
                         f"{type(v).__name__}")
    return v


_KIND = {"str": "string", "int": "integer", "bool": "boolean",
         "list": "list"}


def _ident(req, name, limit, empty=False):
    v = field(req, name, "str")
    if not v and not empty:
        raise BadRequest(f"field {name!r} is empty")
    if len(v) > limit:
        raise BadRequest(f"field {name!r} is longer than {limit} "
                         f"characters")
    return v


class ReserveSpec:
    """A checked reserve request: transfer_id, mm_hash, nbytes, shape
    (tuple), dtype, and hashed (ecx: its writer will send the bytes'
    XXH3 with its complete, so a pool that can hashes them as they land)."""
    __slots__ = ("transfer_id", "mm_hash", "nbytes", "shape", "dtype",
                 "hashed")

    def __init__(self, transfer_id, mm_hash, nbytes, shape, dtype,
                 hashed=False):
        self.transfer_id = transfer_id
        self.mm_hash = mm_hash
        self.nbytes = nbytes
        self.shape = tuple(shape)
        self.dtype = dtype
        self.hashed = hashed


def reserve_spec(item, pool_size, hashed=False):
    """The ReserveSpec of one reserve request (or reserve_batch item),
    hashed as the request said (hashed()); BadRequest on a missing or
    mistyped field, an unknown dtype, a shape whose size is not nbytes,
    or nbytes the pool could never hold."""
    if not isinstance(item, dict):
        raise BadRequest("a reserve item must be a JSON object")
    tid = _ident(item, "transfer_id", MAX_ID)
    mm = _ident(item, "mm_hash", MAX_HASH)
    nbytes = field(item, "nbytes", "int")
    shape = field(item, "shape", "list")
    dtype = field(item, "dtype", "str")
    if not 1 <= len(shape) <= MAX_DIMS:
        raise BadRequest(f"shape must have 1 to {MAX_DIMS} dimensions")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise BadRequest("shape must be a list of positive integers")
    if dtype not in DTYPE_SIZES:
        raise BadRequest(f"unknown dtype {dtype[:64]!r}")
    if nbytes < 1:
        raise BadRequest("nbytes must be positive")
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    if n != nbytes:
        raise BadRequest("shape and dtype do not match nbytes")
    if nbytes > pool_size:
        raise BadRequest(f"nbytes {nbytes} is larger than the receive pool "
                         f"({pool_size} bytes)")
    return ReserveSpec(tid, mm, nbytes, shape, dtype, hashed)


def hashed(req):
    """Whether a reserve (or reserve_batch, for all its items) says its
    writer will send "ecx_xxh3" ("ecx_hashed": true; false or absent:
    not)."""
    v = req.get(HASHED_FIELD, False)
    if not isinstance(v, bool):
        raise BadRequest(f"{HASHED_FIELD} must be true or false")
    return v


def complete_args(item):
    if not isinstance(item, dict):
        raise BadRequest("a complete item must be a JSON object")
    return (_ident(item, "transfer_id", MAX_ID),
            _ident(item, "reservation_id", MAX_ID))


def complete_hash(item):
    """An ecx writer's XXH3 of the bytes it wrote ("ecx_xxh3": 16 hex
    digits), as an int; None where absent (upstream's writer)."""
    v = field(item, HASH_FIELD, "str", None, required=False)
    if v is None:
        return None
    if len(v) != 16 or any(c not in "0123456789abcdefABCDEF" for c in v):
        raise BadRequest(f"field {HASH_FIELD!r} must be 16 hex digits")
    return int(v, 16)


def fetch_source(req):
    """(producer address, epoch) of an ecx_fetch request: "ecx_producer"
    (the producer_zmq, 1..255 characters) and "ecx_epoch" (an integer in
    0..2**64-1, 0 when absent: any)."""
    producer = _ident(req, "ecx_producer", MAX_ADDR)
    epoch = field(req, "ecx_epoch", "int", 0, required=False)
    if not 0 <= epoch < 1 << 64:
        raise BadRequest("field 'ecx_epoch' must be in 0..2**64-1")
    return producer, epoch


def fetch_lease(item):
    """The lease an ecx_fetch entry names at its producer ("ecx_lease": an
    integer in 1..2**53-1, which the pull carries so the producer ends it
    once the pull holds the item); 0 (none) where absent (an older
    encoder)."""
    v = field(item, LEASE_FIELD, "int", 0, required=False)
    if not 0 <= v <= MAX_LEASE:
        raise BadRequest(f"field {LEASE_FIELD!r} must be in 0..2**53-1")
    return v


def cancel_args(req):
    return (_ident(req, "transfer_id", MAX_ID),
            _ident(req, "reservation_id", MAX_ID, empty=True),
            field(req, "abandon", "bool", False, required=False),
            field(req, "refresh", "bool", False, required=False))


def batch_items(req):
    items = field(req, "items", "list")
    if len(items) > MAX_BATCH:
        raise BadRequest(f"at most {MAX_BATCH} items in one batch")
    return items


def host_for_url(ip):
    """ec_ip as it goes in a tcp:// endpoint: IPv6 in brackets."""
    ip = ip.strip()
    if ip.startswith("[") and ip.endswith("]"):
        return ip
    return f"[{ip}]" if ":" in ip else ip
