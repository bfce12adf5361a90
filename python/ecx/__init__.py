"""ecx: encoder-cache exchange, a ctypes binding over libecx.

Producer keeps tensors and serves them; Consumer looks them up and loads
them, many at once, into tensors or arrays of its own; Client talks to
registries only (lookups, listings, publishing), with no data plane.
Tensors are torch tensors (CPU) or numpy arrays; dtype (bfloat16 included,
for torch) and shape travel with every item. C errors become EcxError (or a
subclass) with the C error's name and its one-line detail.

A token not given (None) is read from the ECX_TOKEN environment variable,
as the command line does; token="" means none. ../../docs/python.md is the
guide.
"""
import ctypes
import ctypes.util
import os
import threading
import weakref

__version__ = "0.1.0"
__all__ = ["Producer", "Consumer", "Client", "Item", "Load", "Found",
           "EcxError", "NotFound", "Timeout", "Corrupt", "load_library",
           "DTYPES", "__version__"]

# ---- the library ---------------------------------------------------------


def _candidates():
    env = os.environ.get("ECX_LIBRARY")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libecx.so", "libecx.so.0"):
        yield os.path.join(here, name)
    # A source checkout: python/ecx -> build/libecx.so
    yield os.path.join(here, "..", "..", "build", "libecx.so")
    found = ctypes.util.find_library("ecx")
    if found:
        yield found


def load_library():
    """Loads libecx and checks that its version is this binding's."""
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        lib.ecx_version.restype = ctypes.c_char_p
        version = lib.ecx_version().decode()
        if version != __version__:
            raise ImportError(
                f"libecx at {path} is version {version}, but this Python "
                f"binding is {__version__}: install matching versions (or "
                f"point ECX_LIBRARY at the right libecx.so)")
        return lib, path
    raise ImportError(
        "libecx not found: set ECX_LIBRARY to the path of libecx.so, put "
        "libecx.so next to the ecx package, or install it (make install)"
        + ("; tried: " + "; ".join(errors) if errors else ""))


_lib, LIBRARY_PATH = load_library()

# ---- C types ---------------------------------------------------------------

MAX_DIMS = 8
DTYPES = {  # torch's names -> (ecx enum value, item size)
    "float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4),
    "float64": (4, 8), "int8": (5, 1), "uint8": (6, 1), "int16": (7, 2),
    "int32": (8, 4), "int64": (9, 8), "bool": (10, 1),
    "float8_e4m3fn": (11, 1), "float8_e5m2": (12, 1),
}
_DTYPE_NAMES = {v[0]: k for k, v in DTYPES.items()}


class _Desc(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("ndim", ctypes.c_uint32),
                ("shape", ctypes.c_uint64 * MAX_DIMS),
                ("nbytes", ctypes.c_uint64)]


class _Item(ctypes.Structure):
    _fields_ = [("id", ctypes.c_char_p), ("status", ctypes.c_int),
                ("desc", _Desc), ("producer", ctypes.c_char * 256),
                ("epoch", ctypes.c_uint64), ("dst", ctypes.c_void_p),
                ("lease", ctypes.c_uint64)]


class _ProducerParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("capacity_bytes", ctypes.c_uint64),
                ("bind_host", ctypes.c_char_p),
                ("advertise_host", ctypes.c_char_p),
                ("zmq_port", ctypes.c_uint16),
                ("registry_port", ctypes.c_int),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("transport", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int),
                ("registry_ttl_s", ctypes.c_int),
                ("integrity", ctypes.c_int),
                ("lease_max_ms", ctypes.c_int),
                ("lease_share_pct", ctypes.c_int),
                ("idle_ms", ctypes.c_int)]


class _ConsumerParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int),
                ("recv_capacity", ctypes.c_uint64),
                ("transport", ctypes.c_char_p),
                ("bind_host", ctypes.c_char_p),
                ("regcache_max", ctypes.c_uint),
                ("integrity", ctypes.c_int)]


_PRODUCER_STATS = ["items", "bytes_used", "capacity", "pinned", "evictions",
                   "pulls", "items_served", "items_failed", "bytes_served",
                   "registrations", "connections", "leases", "leased_bytes",
                   "leases_granted", "leases_refused", "leases_expired",
                   "leases_released", "leases_used"]
_CONSUMER_STATS = ["lookups", "loads", "loaded", "failed", "bytes",
                   "registrations", "regcache_hits", "connections",
                   "pages_populated"]


class _ProducerStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in _PRODUCER_STATS]


class _ConsumerStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in _CONSUMER_STATS]


def _fn(name, restype, *argtypes):
    f = getattr(_lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


_P = ctypes.c_void_p
_strerror = _fn("ecx_strerror", ctypes.c_char_p, ctypes.c_int)
_err_name = _fn("ecx_err_name", ctypes.c_char_p, ctypes.c_int)
_last_error = _fn("ecx_last_error", ctypes.c_char_p)
_producer_create = _fn("ecx_producer_create", ctypes.c_int,
                       ctypes.POINTER(_ProducerParams),
                       ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_size_t)
_producer_put = _fn("ecx_producer_put", ctypes.c_int, _P, ctypes.c_char_p,
                    ctypes.POINTER(_Desc), ctypes.c_void_p)
_producer_put_stored = _fn("ecx_producer_put_stored", ctypes.c_int, _P,
                           ctypes.c_char_p, ctypes.POINTER(_Desc),
                           ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_producer_remove = _fn("ecx_producer_remove", ctypes.c_int, _P,
                       ctypes.c_char_p)
_producer_reserve = _fn("ecx_producer_reserve", ctypes.c_int, _P,
                        ctypes.c_char_p, ctypes.POINTER(_Desc),
                        ctypes.POINTER(ctypes.c_void_p))
_producer_commit = _fn("ecx_producer_commit", ctypes.c_int, _P,
                       ctypes.c_char_p)
_producer_cancel = _fn("ecx_producer_cancel", ctypes.c_int, _P,
                       ctypes.c_char_p)
_producer_arena = _fn("ecx_producer_arena", ctypes.c_void_p, _P,
                      ctypes.POINTER(ctypes.c_uint64))
_producer_stats = _fn("ecx_producer_stats_get", None, _P,
                      ctypes.POINTER(_ProducerStats))
_producer_address = _fn("ecx_producer_address", ctypes.c_char_p, _P)
_producer_registry_port = _fn("ecx_producer_registry_port", ctypes.c_uint16,
                              _P)
_producer_destroy = _fn("ecx_producer_destroy", None, _P)
_consumer_create = _fn("ecx_consumer_create", ctypes.c_int,
                       ctypes.POINTER(_ConsumerParams),
                       ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_size_t)
_consumer_lookup = _fn("ecx_consumer_lookup", ctypes.c_int, _P,
                       ctypes.POINTER(_Item), ctypes.c_size_t)
_consumer_lookup_lease = _fn("ecx_consumer_lookup_lease", ctypes.c_int, _P,
                             ctypes.POINTER(_Item), ctypes.c_size_t,
                             ctypes.c_int)
_consumer_release = _fn("ecx_consumer_release", ctypes.c_int, _P,
                        ctypes.POINTER(_Item), ctypes.c_size_t)
_consumer_load = _fn("ecx_consumer_load", ctypes.c_int, _P,
                     ctypes.POINTER(_Item), ctypes.c_size_t)
_consumer_stats = _fn("ecx_consumer_stats_get", None, _P,
                      ctypes.POINTER(_ConsumerStats))
_consumer_destroy = _fn("ecx_consumer_destroy", None, _P)
_consumer_alloc = _fn("ecx_consumer_alloc", ctypes.c_void_p, _P,
                      ctypes.c_size_t)
_consumer_free = _fn("ecx_consumer_free", None, _P, ctypes.c_void_p)
_consumer_arena = _fn("ecx_consumer_arena", ctypes.c_void_p, _P,
                      ctypes.POINTER(ctypes.c_uint64))
_consumer_load_start = _fn("ecx_consumer_load_start", ctypes.c_int, _P,
                           ctypes.POINTER(_Item), ctypes.c_size_t,
                           ctypes.POINTER(_P))
_load_test = _fn("ecx_load_test", ctypes.c_int, _P)
_load_wait = _fn("ecx_load_wait", ctypes.c_int, _P)


class _ClientParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int),
                ("connect_timeout_ms", ctypes.c_int),
                ("registry_ttl_s", ctypes.c_int),
                ("spin_us", ctypes.c_int)]


_LIST_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p,
                            ctypes.POINTER(_Item))


def _client_fns():
    """The registry client's functions, or None with a libecx built
    before them (the rest of the binding works without)."""
    if not hasattr(_lib, "ecx_client_create"):
        return None
    f = {}
    f["create"] = _fn("ecx_client_create", ctypes.c_int,
                      ctypes.POINTER(_ClientParams), ctypes.POINTER(_P),
                      ctypes.c_char_p, ctypes.c_size_t)
    f["destroy"] = _fn("ecx_client_destroy", None, _P)
    f["lookup"] = _fn("ecx_client_lookup", ctypes.c_int, _P,
                      ctypes.POINTER(_Item), ctypes.c_size_t)
    f["lookup_lease"] = _fn("ecx_client_lookup_lease", ctypes.c_int, _P,
                            ctypes.POINTER(_Item), ctypes.c_size_t,
                            ctypes.c_int)
    f["release"] = _fn("ecx_client_release", ctypes.c_int, _P,
                       ctypes.POINTER(_Item), ctypes.c_size_t)
    f["publish"] = _fn("ecx_client_publish", ctypes.c_int, _P,
                       ctypes.POINTER(_Item))
    f["remove"] = _fn("ecx_client_remove", ctypes.c_int, _P,
                      ctypes.c_char_p, ctypes.c_char_p)
    f["list"] = _fn("ecx_client_list", ctypes.c_int, _P, ctypes.c_char_p,
                    ctypes.c_size_t, _LIST_FN, ctypes.c_void_p,
                    ctypes.c_char_p, ctypes.c_size_t,
                    ctypes.POINTER(ctypes.c_uint64))
    f["health"] = _fn("ecx_client_health", ctypes.c_int, _P,
                      ctypes.POINTER(ctypes.c_uint64))
    f["connections"] = _fn("ecx_client_connections", ctypes.c_long, _P)
    f["to_json"] = _fn("ecx_item_to_json", ctypes.c_void_p,
                       ctypes.POINTER(_Item))
    f["from_json"] = _fn("ecx_item_from_json", ctypes.c_int,
                         ctypes.c_char_p, ctypes.c_size_t,
                         ctypes.POINTER(_Item), ctypes.c_char_p,
                         ctypes.c_size_t)
    f["free"] = _fn("ecx_free", None, ctypes.c_void_p)
    return f


_client = _client_fns()

# ---- errors ----------------------------------------------------------------


class EcxError(Exception):
    """A failure in libecx: `name` is the C error's name ("ENOTFOUND"),
    `code` its value, `detail` the one-line detail."""

    def __init__(self, code, detail=""):
        self.code = code
        self.name = _err_name(code).decode()
        self.detail = detail or _strerror(code).decode()
        super().__init__(f"{self.name}: {self.detail}")


class NotFound(EcxError):
    """ENOTFOUND: no registry has the id, or its producer no longer does."""


class Timeout(EcxError):
    """ETIMEDOUT: a peer did not answer within the timeout."""


class Corrupt(EcxError):
    """ECORRUPT: with integrity on, the loaded bytes differ from the
    producer's hash of them."""


class Forked(EcxError):
    """EFORK: a Producer, Consumer or Client used in a process other than
    the one that created it (a forked child). The child must create its
    own; the parent's is unaffected."""


_ERRORS = {-5: NotFound, -7: Timeout, -19: Corrupt, -20: Forked}

EFORK = -20


def _forked(obj, kind):
    """Raises Forked when obj (with ._pid) was created in another process:
    before any call into C, whose state in a forked child is a copy of the
    parent's (UCX's shared-memory FIFOs are the parent's too)."""
    pid = os.getpid()
    if obj._pid != pid:
        raise Forked(EFORK, f"{kind} handle created in process {obj._pid}, "
                     f"used after fork in {pid}: create a new one in the "
                     f"child")


def _size(name, value):
    """value as a byte count for C: ctypes would wrap -1 to 2^64-1 (and cut
    what is above it), which the library then tries to map. Negative
    sizes, and sizes over this host's physical memory, are ValueError."""
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be a whole number of bytes, "
                         f"not {value}")
    v = int(value)
    if v < 0:
        raise ValueError(f"{name} must not be negative (got {v})")
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        phys = (1 << 64) - 1
    if v > min(phys, (1 << 64) - 1):
        raise ValueError(f"{name} of {v} bytes is more than this host's "
                         f"memory ({phys} bytes)")
    return v


def _error(code, detail=None):
    if detail is None:
        detail = _last_error().decode()
    return _ERRORS.get(code, EcxError)(code, detail)


def _b(s):
    return s.encode() if isinstance(s, str) else s


def _token(token):
    """token, or ECX_TOKEN when token is None; "" means none."""
    if token is None:
        token = os.environ.get("ECX_TOKEN") or None
    return token or None


# ---- tensors ---------------------------------------------------------------


def _is_cuda(t):
    return type(t).__module__.startswith("torch") and t.device.type == "cuda"


def _cuda_register(base, size, what, required):
    """Page-locks [base, base + size) for CUDA copies with the driver API
    (ecx.cuda.pin): an ecx.cuda.Pin, or None without CUDA. A refusal is
    logged with its code and returns None, or raises ecx.cuda.CudaError
    when required; it leaves no CUDA error set for later calls."""
    from . import cuda
    try:
        return cuda.pin(base, size, what)
    except (OSError, cuda.CudaError):
        if required:
            raise
        return None


def _cuda_unregister(pinned):
    """Undoes _cuda_register before the memory is unmapped (ecx.cuda.unpin:
    waits for the device, unregisters only what was ours, nothing at
    interpreter exit)."""
    try:
        from . import cuda
    except ImportError:
        return  # the interpreter is exiting
    cuda.unpin(pinned)


def _copy_into(dst, src):
    """dst (a CPU tensor in an arena) <- src, from any device; returns when
    the bytes are in place."""
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise ValueError(f"copy of {src.dtype}{tuple(src.shape)} into "
                         f"{dst.dtype}{tuple(dst.shape)}")
    dst.copy_(src)


def _describe(t):
    """(dtype name, shape, nbytes, data pointer, keepalive) of a CPU torch
    tensor or a numpy array, contiguous."""
    mod = type(t).__module__
    if mod.startswith("torch"):
        if t.device.type != "cpu":
            raise ValueError("ecx's Python binding takes CPU tensors for "
                             "now; copy to the CPU first (t.cpu())")
        t = t.contiguous()
        name = str(t.dtype).split(".")[-1]
        return name, tuple(t.shape), t.numel() * t.element_size(), \
            t.data_ptr(), t
    if mod.startswith("numpy"):
        import numpy as np
        a = np.ascontiguousarray(t)
        name = a.dtype.name
        if name not in DTYPES or a.dtype.byteorder == ">":
            raise ValueError(f"numpy dtype {a.dtype} has no ecx dtype "
                             f"(use a torch tensor for bfloat16 and float8)")
        return name, tuple(a.shape), a.nbytes, a.ctypes.data, a
    raise TypeError("expected a torch tensor or a numpy array, got "
                    f"{type(t).__name__}")


def _desc(name, shape):
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; ecx carries "
                         + ", ".join(DTYPES))
    if len(shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions")
    d = _Desc()
    d.dtype, size = DTYPES[name]
    d.ndim = len(shape)
    n = size
    for i, s in enumerate(shape):
        d.shape[i] = int(s)
        n *= int(s)
    d.nbytes = n
    return d


class Item:
    """What a lookup found: enough to load it anywhere (it pickles).

    lease: the lease a lookup with lease_ms took on it (0: none). A load of
    the item, in this process or another, names it and so ends it; so does
    release(), or its expiry."""
    __slots__ = ("id", "dtype", "shape", "nbytes", "producer", "epoch",
                 "lease")

    def __init__(self, id, dtype, shape, nbytes, producer, epoch=0,
                 lease=0):
        self.id, self.dtype, self.shape = id, dtype, tuple(shape)
        self.nbytes, self.producer, self.epoch = nbytes, producer, epoch
        self.lease = lease

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, s):
        self.lease = 0  # pickled before leases
        for k, v in s.items():
            setattr(self, k, v)

    def __repr__(self):
        return (f"Item({self.id!r}, {self.dtype}, {self.shape}, "
                f"{self.nbytes} bytes, {self.producer})")

    def empty(self, device="cpu"):
        """A torch tensor this item can load into."""
        import torch
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype),
                           device=device)

    def to_json(self):
        """The registry entry of this item, as the registry stores it
        ({"nbytes", "shape", "dtype", "producer_zmq", "ecx_epoch"})."""
        fns = _need_client()
        a = _Item()
        _fill(a, self, _b(self.id))
        ptr = fns["to_json"](ctypes.byref(a))
        if not ptr:
            raise ValueError(f"{self.id}: no registry entry for this item "
                             f"(bad descriptor?)")
        try:
            return ctypes.string_at(ptr).decode()
        finally:
            fns["free"](ptr)

    @classmethod
    def from_json(cls, id, text):
        """The Item a registry entry (JSON text or bytes) describes."""
        fns = _need_client()
        data = _b(text)
        a = _Item()
        why = ctypes.create_string_buffer(256)
        rc = fns["from_json"](data, len(data), ctypes.byref(a), why, 256)
        if rc != 0:
            raise _error(rc, why.value.decode())
        return _item_of(id, a)


class Found(list):
    """What lookup returns: a list with an Item, or None, for each id asked,
    in order; .ids are those ids (so a load of a None can name it)."""

    def __init__(self, ids, items):
        super().__init__(items)
        self.ids = list(ids)

    def missing(self):
        """The ids that were not found."""
        return [i for i, it in zip(self.ids, self) if it is None]


def _item_of(id, a):
    d = a.desc
    return Item(id, _DTYPE_NAMES[d.dtype],
                tuple(d.shape[k] for k in range(d.ndim)), d.nbytes,
                a.producer.decode(), a.epoch, a.lease)


def _fill(a, item, idb):
    """Fills the C item a from an Item (id bytes kept alive by the
    caller)."""
    a.id = idb
    a.desc = _desc(item.dtype, item.shape)
    a.producer = _b(item.producer)
    a.epoch = item.epoch
    a.lease = getattr(item, "lease", 0)


def _lookup_array(ids):
    """A C item array for ids, and the id bytes it points at."""
    arr = (_Item * len(ids))()
    keep = [_b(i) for i in ids]
    for a, i in zip(arr, keep):
        a.id = i
    return arr, keep


def _found(ids, arr):
    return Found(ids, [_item_of(i, a) if a.status == 0 else None
                       for i, a in zip(ids, arr)])


def _release_array(items):
    """The C item array of the Items (None skipped) that hold a lease, and
    those Items, and the id bytes the array points at."""
    held = [it for it in items if it is not None and it.lease]
    arr = (_Item * len(held))()
    keep = []
    for a, it in zip(arr, held):
        idb = _b(it.id)
        keep.append(idb)
        a.id = idb
        a.producer = _b(it.producer)
        a.lease = it.lease
    return arr, held, keep


def _check_items(items, ids=None):
    """Raises NotFound for a None among items (what lookup gives for an id
    it did not find), naming the id when lookup's answer says it."""
    ids = ids if ids is not None else getattr(items, "ids", None)
    for k, it in enumerate(items):
        if it is None:
            name = repr(ids[k]) if ids is not None and k < len(ids) \
                else f"at position {k}"
            raise NotFound(-5, f"item {name} was not found by lookup "
                           f"(None in place of an Item): nothing to load")


def _need_client():
    if _client is None:
        raise EcxError(-17, f"the libecx at {LIBRARY_PATH} has no registry "
                       f"client (ecx_client_*): build a newer libecx")
    return _client


# ---- roles -----------------------------------------------------------------


class Producer:
    """Keeps tensors in a registered arena and serves them (ecx_producer).

    registry_port: embedded registry port (default 9018; 0 picks one; None
    for none, with `registry` given). registry: a remote registry URL to
    publish to instead. token: None reads ECX_TOKEN. integrity: hash
    each item at put (XXH3) for consumers that check it. registry_ttl_s:
    the lease of this producer's registry entries (default 30). idle_ms:
    a consumer connection with no pull for this long is closed and its
    memory unmapped (default 15000; a live consumer reconnects by itself).

    The arena (capacity_bytes) is mapped and touched here, so construction
    takes as long as populating it (seconds for GiBs); puts never do.
    """

    def __init__(self, capacity_bytes=None, bind_host=None,
                 advertise_host=None, zmq_port=None, registry_port=9018,
                 registry=None, token=None, transport=None, timeout_ms=None,
                 integrity=False, lease_max_ms=None, lease_share_pct=None,
                 registry_ttl_s=None, idle_ms=None):
        p = _ProducerParams()
        m = 0
        if capacity_bytes is not None:
            p.capacity_bytes = _size("capacity_bytes", capacity_bytes)
            m |= 1
        if bind_host is not None:
            p.bind_host, m = _b(bind_host), m | 2
        if advertise_host is not None:
            p.advertise_host, m = _b(advertise_host), m | 4
        if zmq_port is not None:
            p.zmq_port, m = int(zmq_port), m | 8
        if registry:
            p.registry, m = _b(registry), m | 32
        elif registry_port is not None:
            p.registry_port, m = int(registry_port), m | 16
        token = _token(token)
        if token:
            p.token, m = _b(token), m | 64
        if transport is not None:
            p.transport, m = _b(transport), m | 128
        if timeout_ms is not None:
            p.timeout_ms, m = int(timeout_ms), m | 256
        if integrity:
            p.integrity, m = 1, m | 1024
        if lease_max_ms is not None:
            p.lease_max_ms, m = int(lease_max_ms), m | 2048
        if lease_share_pct is not None:
            p.lease_share_pct, m = int(lease_share_pct), m | 4096
        if registry_ttl_s is not None:
            p.registry_ttl_s, m = int(registry_ttl_s), m | 512
        if idle_ms is not None:
            p.idle_ms, m = int(idle_ms), m | 8192
        p.field_mask = m
        self._keep = p
        self._h = None
        self._pid = os.getpid()
        self._cuda_pinned = None  # an ecx.cuda.Pin; False: refused
        h = _P()
        why = ctypes.create_string_buffer(256)
        rc = _producer_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise _error(rc, why.value.decode())
        self._h = h

    def put(self, id, tensor):
        """Copies the tensor into the arena and publishes it under id.

        Returns True when the item was stored, False when id was already
        held with the same dtype and shape: ids are content hashes, so the
        bytes held are kept as they are and the tensor given is NOT copied
        (put("a", zeros(4)) then put("a", ones(4)) leaves the zeros). To
        replace an item, remove(id) first. The same id with another dtype or
        shape raises EcxError EINVAL.

        A tensor is copied once, straight into its place in the arena: a
        contiguous CPU tensor or array by libecx (one call; large items with
        stores that bypass the cache), any other torch tensor by copy_
        between reserve and commit; the first CUDA one page-locks the arena
        (cuMemHostRegister) so that copy is a DMA.
        """
        if type(tensor).__module__.startswith("torch") and (
                tensor.device.type != "cpu" or not tensor.is_contiguous()):
            if _is_cuda(tensor):
                self.pin_for_cuda()
            name = str(tensor.dtype).split(".")[-1]
            dst = self.reserve(id, name, tuple(tensor.shape))
            if dst is None:
                return False
            try:
                _copy_into(dst, tensor)
            except BaseException:
                self.cancel(id)
                raise
            self.commit(id)
            return True
        name, shape, nbytes, ptr, keep = _describe(tensor)
        d = _desc(name, shape)
        stored = ctypes.c_int()
        rc = _producer_put_stored(self._handle(), _b(id), ctypes.byref(d),
                                  ptr, ctypes.byref(stored))
        del keep
        if rc != 0:
            raise _error(rc)
        return bool(stored.value)

    def reserve(self, id, dtype, shape):
        """Takes room for id and returns a torch tensor over it, in the
        arena, for the caller to fill (t.copy_(src), from any device);
        then commit(id) publishes it, or cancel(id) gives the room back.
        Until then id is invisible to consumers. Returns None when id is
        already held with this dtype and shape (nothing to fill)."""
        import torch
        d = _desc(dtype, tuple(shape))
        dst = ctypes.c_void_p()
        rc = _producer_reserve(self._handle(), _b(id), ctypes.byref(d),
                               ctypes.byref(dst))
        if rc != 0:
            raise _error(rc)
        if not dst.value:
            return None
        n = int(d.nbytes)
        if n == 0:
            return torch.empty(tuple(shape), dtype=getattr(torch, dtype))
        buf = (ctypes.c_char * n).from_address(dst.value)
        t = torch.frombuffer(buf, dtype=torch.uint8)
        return t.view(getattr(torch, dtype)).view(tuple(shape))

    def commit(self, id):
        """Publishes a reserved id (see reserve)."""
        rc = _producer_commit(self._handle(), _b(id))
        if rc != 0:
            raise _error(rc)

    def cancel(self, id):
        """Gives a reserved id's room back (see reserve)."""
        rc = _producer_cancel(self._handle(), _b(id))
        if rc != 0:
            raise _error(rc)

    def pin_for_cuda(self, required=False):
        """Page-locks the arena for CUDA (cuMemHostRegister, PORTABLE,
        through the driver API), once; put does it at its first CUDA
        tensor, which for GiBs takes seconds: call it up front. True when
        the arena is page-locked (by this call, or already, e.g. by UCX:
        then it is never unregistered here); False without CUDA, or when
        the driver refuses (logged with its code), or raises
        ecx.cuda.CudaError for that (OSError where libcuda does not
        load) when required."""
        if self._cuda_pinned:
            return True
        if self._cuda_pinned is False and not required:
            return False  # tried before (and logged)
        base, size = self.arena()
        pinned = _cuda_register(base, size, "producer's arena", required)
        self._cuda_pinned = pinned if pinned is not None else False
        return pinned is not None

    def arena(self):
        """(address, size) of the arena."""
        cap = ctypes.c_uint64()
        base = _producer_arena(self._handle(), ctypes.byref(cap))
        return base, cap.value

    def remove(self, id):
        """Unpublishes id and frees its space once no pull reads it;
        NotFound when it is not held."""
        rc = _producer_remove(self._handle(), _b(id))
        if rc != 0:
            raise _error(rc)

    def stats(self):
        s = _ProducerStats()
        _producer_stats(self._handle(), ctypes.byref(s))
        return {n: getattr(s, n) for n in _PRODUCER_STATS}

    @property
    def address(self):
        """The producer_zmq address it publishes."""
        return _producer_address(self._handle()).decode()

    @property
    def registry_port(self):
        return _producer_registry_port(self._handle())

    def _handle(self):
        if self._h is None:
            raise EcxError(-1, "the producer is closed")
        _forked(self, "producer")
        return self._h

    def close(self):
        """Unpublishes everything and stops serving. In a forked child it
        only forgets the parent's producer (which is left as it is)."""
        if getattr(self, "_h", None) is not None:
            if self._pid != os.getpid():
                self._h = None
                return
            if self._cuda_pinned:
                _cuda_unregister(self._cuda_pinned)
                self._cuda_pinned = None
            _producer_destroy(self._h)
            self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Consumer:
    """Looks items up and loads them (ecx_consumer).

    registry: one URL or several (a list, or comma-separated). token: None
    reads ECX_TOKEN. recv_capacity: the receive arena (arena_tensor, and
    load/load_start when given Items); 0 (the default here) for none.
    integrity: check every loaded item against its producer's hash (a
    mismatch is Corrupt; a producer without integrity fails the item).
    """

    def __init__(self, registry, token=None, timeout_ms=5000,
                 recv_capacity=0, transport=None, bind_host=None,
                 integrity=False):
        if not registry:
            raise ValueError("a consumer needs a registry URL")
        if not isinstance(registry, str):
            registry = ",".join(registry)
        p = _ConsumerParams()
        p.field_mask = 1 | 4 | 8
        p.registry = _b(registry)
        p.timeout_ms = int(timeout_ms)
        p.recv_capacity = recv_capacity = _size("recv_capacity",
                                                recv_capacity)
        token = _token(token)
        if token:
            p.token, p.field_mask = _b(token), p.field_mask | 2
        if transport is not None:
            p.transport, p.field_mask = _b(transport), p.field_mask | 16
        if bind_host is not None:
            p.bind_host, p.field_mask = _b(bind_host), p.field_mask | 32
        if integrity:
            p.integrity, p.field_mask = 1, p.field_mask | 128
        self._keep = p
        self._pid = os.getpid()
        self._arena = recv_capacity > 0
        self._live = 0          # arena tensors alive
        self._closing = False
        self._h = None
        self._cuda_pinned = None  # an ecx.cuda.Pin; False: refused
        self._loads = weakref.WeakSet()  # loads in flight
        h = _P()
        why = ctypes.create_string_buffer(256)
        rc = _consumer_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise _error(rc, why.value.decode())
        self._h = h

    def lookup(self, ids, lease_ms=None):
        """Looks ids up in one round trip per registry: a list with an Item
        for each id found and None for each missing. Raises EcxError when
        a registry could not be asked.

        With lease_ms (0: the default, 30 s), each item found is also
        leased: its producer pins it for that long (or its own maximum), so
        the load that follows cannot miss it to eviction ("a hit will
        load"; taken in the lookup itself by a producer's embedded
        registry, else one round trip per producer). An item whose lease is
        refused (the producer's lease share is taken, it no longer holds
        the item, it does not answer) is None, as a miss. Item.lease holds
        the lease; a load of the item ends it, release() ends it sooner."""
        ids = [ids] if isinstance(ids, str) else list(ids)
        if not ids:
            return Found([], [])
        arr, keep = _lookup_array(ids)
        if lease_ms is None:
            rc = _consumer_lookup(self._handle(), arr, len(ids))
        else:
            rc = _consumer_lookup_lease(self._handle(), arr, len(ids),
                                        int(lease_ms))
        if rc != 0:
            raise _error(rc)
        return _found(ids, arr)

    def release(self, items):
        """Ends the leases of items (Items from lookup with lease_ms; None
        and Items without a lease are skipped), one round trip per
        producer, and sets their lease to 0. A lease that has ended already
        is no error. Raises EcxError when a producer could not be told (its
        leases then end at their expiry)."""
        arr, held, keep = _release_array(list(items))
        if not held:
            return
        rc = _consumer_release(self._handle(), arr, len(held))
        for it in held:
            it.lease = 0
        del keep
        if rc != 0:
            raise _error(rc)

    def _pairs_array(self, pairs):
        """The C item array for (Item, tensor) pairs, and what must stay
        alive while a load uses it."""
        items = [it for it, _ in pairs]
        _check_items(items, getattr(pairs, "ids", None))
        arr = (_Item * len(pairs))()
        keep = []
        for a, (item, t) in zip(arr, pairs):
            name, shape, nbytes, ptr, k = _describe(t)
            if nbytes != item.nbytes:
                raise ValueError(f"{item.id}: the tensor has {nbytes} "
                                 f"bytes, the item {item.nbytes}")
            if k is not t:
                raise ValueError(f"{item.id}: load into a contiguous "
                                 f"tensor or array (this one would be "
                                 f"copied, and the copy loaded)")
            if getattr(getattr(t, "flags", None), "writeable", True) \
                    is False:
                raise ValueError(f"{item.id}: the array is read-only")
            keep.append(k)
            idb = _b(item.id)
            keep.append(idb)
            _fill(a, item, idb)
            a.dst = ptr
        return arr, keep

    @staticmethod
    def _errors(arr, items):
        for a, item in zip(arr, items):
            if a.status == 0 and getattr(item, "lease", 0):
                item.lease = 0  # its pull ended it
        return [None if a.status == 0 else
                _error(a.status, f"{item.id} from {item.producer}: "
                       f"{_strerror(a.status).decode()}")
                for a, item in zip(arr, items)]

    def load_into(self, pairs):
        """Loads each (Item, tensor) pair in one batched call (one pull per
        producer). Returns a list with None for each item that loaded and an
        EcxError for each that did not. A None in place of an Item (an id
        lookup did not find) raises NotFound naming it."""
        pairs = list(pairs)
        if not pairs:
            return []
        arr, keep = self._pairs_array(pairs)
        rc = _consumer_load(self._handle(), arr, len(pairs))
        if rc == EFORK:
            raise _error(rc)
        del keep
        return self._errors(arr, [it for it, _ in pairs])

    def load_start(self, items):
        """Starts loading, without waiting: items are Items (from lookup;
        each gets a new tensor, in the receive arena while it has room) or
        (Item, tensor) pairs. Returns a Load; its .test() says whether it
        has ended, .wait() waits for it (bounded by the consumer's
        timeout_ms from the start). The Load keeps the items and tensors
        alive until it ends. A None in place of an Item raises NotFound
        naming the id."""
        items = list(items) if not isinstance(items, Found) else items
        if all(isinstance(x, tuple) for x in items) and items:
            pairs = [(it, t) for it, t in items]
        else:
            _check_items(items)
            pairs = [(it, self._new_tensor(it)) for it in items]
        return Load(self, pairs)

    def _new_tensor(self, it):
        t = self.arena_tensor(it) if self._arena else None
        return t if t is not None else it.empty("cpu")

    def arena_tensor(self, item):
        """A torch tensor for item inside the receive arena (registered
        once, shared-memory mapped: the fastest place to load into), or
        None when the arena has no room. Its space returns to the arena
        when the tensor is freed."""
        import torch
        n = max(int(item.nbytes), 1)
        ptr = _consumer_alloc(self._handle(), n)
        if not ptr:
            return None
        self._live += 1
        buf = (ctypes.c_char * n).from_address(ptr)
        # The arena outlives its tensors: each holds the consumer alive.
        weakref.finalize(buf, Consumer._arena_free, self, ptr)
        t = torch.frombuffer(buf, dtype=torch.uint8)[:item.nbytes]
        return t.view(getattr(torch, item.dtype)).view(item.shape)

    @staticmethod
    def _arena_free(consumer, ptr):
        if consumer._h is None:
            return
        _consumer_free(consumer._h, ptr)
        consumer._live -= 1
        if consumer._closing and consumer._live == 0:
            consumer._destroy()

    def load(self, items, device="cpu"):
        """Loads Items (from lookup) into new torch tensors (in the receive
        arena while it has room); raises the first item's error if any
        failed."""
        _check_items(items)
        items = list(items)
        outs = [self._new_tensor(it) for it in items]
        errs = self.load_into(list(zip(items, outs)))
        for e in errs:
            if e is not None:
                raise e
        if device != "cpu":
            outs = [o.to(device) for o in outs]
        return outs

    def stats(self):
        s = _ConsumerStats()
        _consumer_stats(self._handle(), ctypes.byref(s))
        return {n: getattr(s, n) for n in _CONSUMER_STATS}

    def _handle(self):
        if self._h is None:
            raise EcxError(-1, "the consumer is closed")
        _forked(self, "consumer")
        return self._h

    def close(self):
        """Closes the consumer; while arena tensors are alive the arena
        stays mapped, and goes when the last of them is freed. In a forked
        child it only forgets the parent's consumer (which is left as it
        is: its loads, arena and connections are the parent's)."""
        if getattr(self, "_h", None) is None:
            return
        if self._pid != os.getpid():
            self._h = None
            return
        for load in list(getattr(self, "_loads", ())):
            load.wait()  # ecx_consumer_destroy needs none in flight
        if self._live > 0:
            self._closing = True
            return
        self._destroy()

    def _destroy(self):
        if self._cuda_pinned:
            _cuda_unregister(self._cuda_pinned)
            self._cuda_pinned = None
        _consumer_destroy(self._h)
        self._h = None

    def arena(self):
        """(address, size) of the receive arena; (None, 0) without one."""
        cap = ctypes.c_uint64()
        base = _consumer_arena(self._handle(), ctypes.byref(cap))
        return base, cap.value

    def pin_for_cuda(self, required=False):
        """Page-locks the receive arena for CUDA (cuMemHostRegister,
        PORTABLE, through the driver API), once, so copies from arena
        tensors to a GPU are DMAs that can run on a side stream
        (t.to("cuda", non_blocking=True)). True when it is page-locked (by
        this call, or already, e.g. by UCX: then never unregistered here);
        False without CUDA or an arena, or when the driver refuses (logged
        with its code), or raises ecx.cuda.CudaError for that (OSError
        where libcuda does not load) when required."""
        if self._cuda_pinned:
            return True
        if self._cuda_pinned is False and not required:
            return False  # tried before (and logged)
        base, size = self.arena()
        if not base:
            return False
        pinned = _cuda_register(base, size, "receive arena", required)
        self._cuda_pinned = pinned if pinned is not None else False
        return pinned is not None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Load:
    """A load in flight (Consumer.load_start). .items and .tensors are what
    it loads into; both, and the C items, stay alive here until it ends.
    .test() returns True once it has ended (it does not wait for the
    pulls; but see test() on failover); .wait() blocks
    until it ends, at most the consumer's timeout_ms from the start, and
    returns .errors: None for each item that loaded, an EcxError for each
    that did not (ETIMEDOUT for what was still missing at the deadline)."""

    def __init__(self, consumer, pairs):
        self.items = [it for it, _ in pairs]
        self.tensors = [t for _, t in pairs]
        self.errors = None
        self._consumer = consumer
        self._lock = threading.Lock()
        self._h = None
        self._arr, self._keep = consumer._pairs_array(pairs) if pairs \
            else ((_Item * 0)(), [])
        h = _P()
        rc = _consumer_load_start(consumer._handle(), self._arr,
                                  len(pairs), ctypes.byref(h))
        if rc != 0:
            raise _error(rc)
        self._h = h
        consumer._loads.add(self)

    @property
    def done(self):
        return self._h is None

    @property
    def ok(self):
        """True once it ended with every item loaded."""
        return self.done and not any(self.errors or ())

    def test(self):
        """True when the load has ended (its per-item .errors are then
        set), False while it runs. It does not wait for pulls; but when
        the load ended with items whose holder is gone, finishing it tries
        their other holders first (ecx_load_wait's failover), which can
        take up to the rest of the load's deadline."""
        with self._lock:
            if self._h is None:
                return True
            _forked(self._consumer, "consumer")
            if _load_test(self._h) != 0:
                return False
            self._finish()
            return True

    def wait(self):
        """Waits for the end (bounded by the consumer's timeout) and
        returns .errors."""
        with self._lock:
            if self._h is not None:
                _forked(self._consumer, "consumer")
                self._finish()
            return self.errors

    def _finish(self):
        _load_wait(self._h)  # frees the C load; returns at once when done
        self._h = None
        self.errors = Consumer._errors(self._arr, self.items)
        self._keep = None
        self._consumer._loads.discard(self)

    def __del__(self):
        if getattr(self, "_h", None) is not None:
            if self._consumer._pid != os.getpid():
                return  # a forked child's copy: the parent's to end
            self.wait()

    def __repr__(self):
        state = "running" if self._h is not None else (
            f"{sum(e is None for e in self.errors)} of {len(self.items)} "
            f"loaded")
        return f"<ecx.Load of {len(self.items)} items, {state}>"


class Client:
    """A registry client (ecx_client): lookups, listings, publishing and
    health of one or several registries, with no data plane (no UCX, no
    threads, nothing connected until the first call). Each registry keeps
    one persistent connection; one that fails is skipped for a back-off
    (500 ms doubling to 10 s) instead of costing its timeout every call.

    registry: one URL or several (a list, or comma-separated), each
    http://HOST:PORT or redis://[:password@]HOST[:PORT][/DB]; anything else
    raises EcxError EINVAL now. token: None reads ECX_TOKEN. spin_us: how
    long a request polls its connection for the answer before sleeping
    (None: the library's 200 us; 0 sleeps at once). Safe to share between
    threads (calls are serialized).
    """

    def __init__(self, registry, token=None, timeout_ms=5000,
                 connect_timeout_ms=None, registry_ttl_s=None, spin_us=None):
        self._h = None
        self._pid = os.getpid()
        fns = _need_client()
        if not registry:
            raise ValueError("a client needs a registry URL")
        if not isinstance(registry, str):
            registry = ",".join(registry)
        p = _ClientParams()
        p.field_mask = 1 | 4
        p.registry = _b(registry)
        p.timeout_ms = int(timeout_ms)
        token = _token(token)
        if token:
            p.token, p.field_mask = _b(token), p.field_mask | 2
        if connect_timeout_ms is not None:
            p.connect_timeout_ms = int(connect_timeout_ms)
            p.field_mask |= 8
        if registry_ttl_s is not None:
            p.registry_ttl_s = int(registry_ttl_s)
            p.field_mask |= 16
        if spin_us is not None:
            p.spin_us = int(spin_us)
            p.field_mask |= 32
        self._keep = p
        self._fns = fns
        self._lock = threading.Lock()
        self.registry = registry
        self.last_total = None
        h = _P()
        why = ctypes.create_string_buffer(256)
        rc = fns["create"](ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise _error(rc, why.value.decode())
        self._h = h

    def _handle(self):
        if self._h is None:
            raise EcxError(-1, "the client is closed")
        _forked(self, "client")
        return self._h

    def lookup(self, ids, lease_ms=None):
        """Looks ids up, one round trip per registry (ids missing from one
        are asked of the next): a Found list with an Item for each id found
        and None for each missing. When a registry could not be asked it
        raises EcxError whose .found holds what the others answered.
        lease_ms: as Consumer.lookup (where the registry is not the
        producer's own, the client also talks to the producers' ZeroMQ
        sockets): each Item found is leased, and a
        Consumer in any process that loads it ends the lease."""
        ids = [ids] if isinstance(ids, str) else list(ids)
        if not ids:
            return Found([], [])
        arr, keep = _lookup_array(ids)
        with self._lock:
            if lease_ms is None:
                rc = self._fns["lookup"](self._handle(), arr, len(ids))
            else:
                rc = self._fns["lookup_lease"](self._handle(), arr,
                                               len(ids), int(lease_ms))
            err = _error(rc) if rc != 0 else None
        found = _found(ids, arr)
        if err is not None:
            err.found = found
            raise err
        return found

    def release(self, items):
        """Ends the leases of items, as Consumer.release."""
        arr, held, keep = _release_array(list(items))
        if not held:
            return
        with self._lock:
            rc = self._fns["release"](self._handle(), arr, len(held))
        for it in held:
            it.lease = 0
        del keep
        if rc != 0:
            raise _error(rc)

    def publish(self, item):
        """Writes item's entry (id, dtype, shape, producer, epoch) to the
        first registry."""
        idb = _b(item.id)
        a = _Item()
        _fill(a, item, idb)
        with self._lock:
            rc = self._fns["publish"](self._handle(), ctypes.byref(a))
            if rc != 0:
                raise _error(rc)

    def remove(self, id, producer=None):
        """Deletes id's entry from the first registry; with producer, only
        if the entry is that producer's. NotFound when nothing was
        removed."""
        with self._lock:
            rc = self._fns["remove"](self._handle(), _b(id),
                                     _b(producer) if producer else None)
            if rc != 0:
                raise _error(rc)

    def list(self, after="", limit=500):
        """Yields every Item of the first registry whose id sorts after
        `after`, in id order, asking `limit` (1 to 1000) at a time.
        .last_total is the registry's count of entries as of the last
        page."""
        limit = int(limit)
        if not 1 <= limit <= 1000:
            raise ValueError("limit is 1 to 1000")
        cursor = after or ""
        while True:
            page, cursor = self._list_page(cursor, limit)
            yield from page
            if not cursor:
                return

    def _list_page(self, after, limit):
        page = []
        failure = []

        def one(arg, item):
            try:
                x = item.contents
                page.append(_item_of(x.id.decode(), x))
                return 0
            except BaseException as e:  # noqa: BLE001 - re-raised below
                failure.append(e)
                return 1

        cb = _LIST_FN(one)
        nxt = ctypes.create_string_buffer(256)
        total = ctypes.c_uint64()
        with self._lock:
            rc = self._fns["list"](self._handle(), _b(after), limit, cb,
                                   None, nxt, 256, ctypes.byref(total))
            err = _error(rc) if rc != 0 and not failure else None
        if failure:
            raise failure[0]
        if err is not None:
            raise err
        self.last_total = total.value
        return page, nxt.value.decode()

    def health(self):
        """Asks the first registry whether it serves; returns its epoch
        (it changes at each start of an HTTP registry; 0 for Redis)."""
        epoch = ctypes.c_uint64()
        with self._lock:
            rc = self._fns["health"](self._handle(), ctypes.byref(epoch))
            if rc != 0:
                raise _error(rc)
        return epoch.value

    @property
    def connections(self):
        """Connections opened so far, over all registries."""
        return self._fns["connections"](self._handle())

    def close(self):
        if getattr(self, "_h", None) is not None:
            if self._pid == os.getpid():  # a forked child's: forgotten
                self._fns["destroy"](self._h)
            self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
