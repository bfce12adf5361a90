"""ecx: encoder-cache exchange, a ctypes binding over libecx.

Producer keeps tensors and serves them; Consumer looks them up and loads
them, many at once, into tensors or arrays of its own. Tensors are torch
tensors (CPU) or numpy arrays; dtype (bfloat16 included, for torch) and
shape travel with every item. C errors become EcxError (or a subclass) with
the C error's name and its one-line detail.
"""
import ctypes
import ctypes.util
import os
import weakref

__version__ = "0.1.0"
__all__ = ["Producer", "Consumer", "Item", "EcxError", "NotFound",
           "Timeout", "load_library", "DTYPES", "__version__"]

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
                ("epoch", ctypes.c_uint64), ("dst", ctypes.c_void_p)]


class _ProducerParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("capacity_bytes", ctypes.c_uint64),
                ("bind_host", ctypes.c_char_p),
                ("advertise_host", ctypes.c_char_p),
                ("zmq_port", ctypes.c_uint16),
                ("registry_port", ctypes.c_int),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("transport", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int)]


class _ConsumerParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int),
                ("recv_capacity", ctypes.c_uint64),
                ("transport", ctypes.c_char_p),
                ("bind_host", ctypes.c_char_p),
                ("regcache_max", ctypes.c_uint)]


_PRODUCER_STATS = ["items", "bytes_used", "capacity", "pinned", "evictions",
                   "pulls", "items_served", "items_failed", "bytes_served",
                   "registrations", "connections"]
_CONSUMER_STATS = ["lookups", "loads", "loaded", "failed", "bytes",
                   "registrations", "regcache_hits", "connections"]


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
_producer_remove = _fn("ecx_producer_remove", ctypes.c_int, _P,
                       ctypes.c_char_p)
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
_consumer_load = _fn("ecx_consumer_load", ctypes.c_int, _P,
                     ctypes.POINTER(_Item), ctypes.c_size_t)
_consumer_stats = _fn("ecx_consumer_stats_get", None, _P,
                      ctypes.POINTER(_ConsumerStats))
_consumer_destroy = _fn("ecx_consumer_destroy", None, _P)
_consumer_alloc = _fn("ecx_consumer_alloc", ctypes.c_void_p, _P,
                      ctypes.c_size_t)
_consumer_free = _fn("ecx_consumer_free", None, _P, ctypes.c_void_p)

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


_ERRORS = {-5: NotFound, -7: Timeout}


def _error(code, detail=None):
    if detail is None:
        detail = _last_error().decode()
    return _ERRORS.get(code, EcxError)(code, detail)


def _b(s):
    return s.encode() if isinstance(s, str) else s


# ---- tensors ---------------------------------------------------------------


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
    """What a lookup found: enough to load it anywhere (it pickles)."""
    __slots__ = ("id", "dtype", "shape", "nbytes", "producer", "epoch")

    def __init__(self, id, dtype, shape, nbytes, producer, epoch=0):
        self.id, self.dtype, self.shape = id, dtype, tuple(shape)
        self.nbytes, self.producer, self.epoch = nbytes, producer, epoch

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, s):
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


# ---- roles -----------------------------------------------------------------


class Producer:
    """Keeps tensors in a registered arena and serves them (ecx_producer).

    registry_port: embedded registry port (default 9018; 0 picks one; None
    for none, with `registry` given). registry: a remote registry URL to
    publish to instead.
    """

    def __init__(self, capacity_bytes=None, bind_host=None,
                 advertise_host=None, zmq_port=None, registry_port=9018,
                 registry=None, token=None, transport=None, timeout_ms=None):
        p = _ProducerParams()
        m = 0
        if capacity_bytes is not None:
            p.capacity_bytes, m = int(capacity_bytes), m | 1
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
        if token:
            p.token, m = _b(token), m | 64
        if transport is not None:
            p.transport, m = _b(transport), m | 128
        if timeout_ms is not None:
            p.timeout_ms, m = int(timeout_ms), m | 256
        p.field_mask = m
        self._keep = p
        h = _P()
        why = ctypes.create_string_buffer(256)
        rc = _producer_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise _error(rc, why.value.decode())
        self._h = h

    def put(self, id, tensor):
        """Copies the tensor into the arena and publishes it under id."""
        name, shape, nbytes, ptr, keep = _describe(tensor)
        d = _desc(name, shape)
        rc = _producer_put(self._handle(), _b(id), ctypes.byref(d), ptr)
        del keep
        if rc != 0:
            raise _error(rc)

    def remove(self, id):
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
        return self._h

    def close(self):
        """Unpublishes everything and stops serving."""
        if getattr(self, "_h", None) is not None:
            _producer_destroy(self._h)
            self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Consumer:
    """Looks items up and loads them (ecx_consumer).

    registry: one URL or several (a list, or comma-separated).
    recv_capacity: the receive arena ecx_consumer_alloc uses; the binding
    loads into your tensors, so it defaults to 0 here.
    """

    def __init__(self, registry, token=None, timeout_ms=5000,
                 recv_capacity=0, transport=None, bind_host=None):
        if not registry:
            raise ValueError("a consumer needs a registry URL")
        if not isinstance(registry, str):
            registry = ",".join(registry)
        p = _ConsumerParams()
        p.field_mask = 1 | 4 | 8
        p.registry = _b(registry)
        p.timeout_ms = int(timeout_ms)
        p.recv_capacity = int(recv_capacity)
        if token:
            p.token, p.field_mask = _b(token), p.field_mask | 2
        if transport is not None:
            p.transport, p.field_mask = _b(transport), p.field_mask | 16
        if bind_host is not None:
            p.bind_host, p.field_mask = _b(bind_host), p.field_mask | 32
        self._keep = p
        self._arena = recv_capacity > 0
        self._live = 0          # arena tensors alive
        self._closing = False
        h = _P()
        why = ctypes.create_string_buffer(256)
        rc = _consumer_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise _error(rc, why.value.decode())
        self._h = h

    def lookup(self, ids):
        """Looks ids up in one round trip per registry: a list with an Item
        for each id found and None for each missing. Raises EcxError when
        a registry could not be asked."""
        ids = [ids] if isinstance(ids, str) else list(ids)
        if not ids:
            return []
        arr = (_Item * len(ids))()
        keep = [_b(i) for i in ids]
        for a, i in zip(arr, keep):
            a.id = i
        rc = _consumer_lookup(self._handle(), arr, len(ids))
        if rc != 0:
            raise _error(rc)
        out = []
        for i, a in zip(ids, arr):
            if a.status != 0:
                out.append(None)
                continue
            d = a.desc
            out.append(Item(i, _DTYPE_NAMES[d.dtype],
                            tuple(d.shape[k] for k in range(d.ndim)),
                            d.nbytes, a.producer.decode(), a.epoch))
        return out

    def load_into(self, pairs):
        """Loads each (Item, tensor) pair in one batched call (one pull per
        producer). Returns a list with None for each item that loaded and an
        EcxError for each that did not."""
        pairs = list(pairs)
        if not pairs:
            return []
        arr = (_Item * len(pairs))()
        keep = []
        for a, (item, t) in zip(arr, pairs):
            name, shape, nbytes, ptr, k = _describe(t)
            if nbytes != item.nbytes:
                raise ValueError(f"{item.id}: the tensor has {nbytes} "
                                 f"bytes, the item {item.nbytes}")
            keep.append(k)
            idb = _b(item.id)
            keep.append(idb)
            a.id = idb
            a.desc = _desc(item.dtype, item.shape)
            a.producer = _b(item.producer)
            a.epoch = item.epoch
            a.dst = ptr
        _consumer_load(self._handle(), arr, len(pairs))
        return [None if a.status == 0 else
                _error(a.status, f"{item.id} from {item.producer}: "
                       f"{_strerror(a.status).decode()}")
                for a, (item, _) in zip(arr, pairs)]

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
        items = list(items)
        outs = []
        for it in items:
            t = self.arena_tensor(it) if self._arena else None
            outs.append(t if t is not None else it.empty("cpu"))
        errs = self.load_into(zip(items, outs))
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
        return self._h

    def close(self):
        """Closes the consumer; while arena tensors are alive the arena
        stays mapped, and goes when the last of them is freed."""
        if getattr(self, "_h", None) is None:
            return
        if self._live > 0:
            self._closing = True
            return
        self._destroy()

    def _destroy(self):
        _consumer_destroy(self._h)
        self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
