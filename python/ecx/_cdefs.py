"""The C declarations of include/ecx/ecx.h that the binding uses, and only
here: structs (named as their C typedefs), the field_mask bits of the
params structs as named flags, and the functions' prototypes (named as the
C functions). tests/python/test_abi.py compares every struct's size and
field offsets, and every flag, with what the C compiler makes of ecx.h.
"""
import ctypes
import enum

from ._lib import lib

MAX_DIMS = 8      # ECX_MAX_DIMS
ADDR_MAX = 256    # ECX_ADDR_MAX: ecx_item.producer


class ProducerParam(enum.IntFlag):
    """ECX_PRODUCER_PARAM_*: the fields of ecx_producer_params set."""
    CAPACITY = 1 << 0
    BIND_HOST = 1 << 1
    ADVERTISE_HOST = 1 << 2
    ZMQ_PORT = 1 << 3
    REGISTRY_PORT = 1 << 4
    REGISTRY = 1 << 5
    TOKEN = 1 << 6
    TRANSPORT = 1 << 7
    TIMEOUT = 1 << 8
    REGISTRY_TTL = 1 << 9
    INTEGRITY = 1 << 10
    LEASE_MAX_MS = 1 << 11
    LEASE_SHARE = 1 << 12
    IDLE = 1 << 13
    STARTING = 1 << 14
    MOONCAKE = 1 << 15


class ConsumerParam(enum.IntFlag):
    """ECX_CONSUMER_PARAM_*: the fields of ecx_consumer_params set."""
    REGISTRY = 1 << 0
    TOKEN = 1 << 1
    TIMEOUT = 1 << 2
    RECV_CAPACITY = 1 << 3
    TRANSPORT = 1 << 4
    BIND_HOST = 1 << 5
    REGCACHE_MAX = 1 << 6
    INTEGRITY = 1 << 7
    MOONCAKE = 1 << 8
    MOONCAKE_HOST = 1 << 9


# ECX_EPOCH_REFERENCE: the epoch of an item whose entry is in the
# reference's shape (its producer speaks only the reference's protocol).
EPOCH_REFERENCE = (1 << 64) - 1


class ClientParam(enum.IntFlag):
    """ECX_CLIENT_PARAM_*: the fields of ecx_client_params set."""
    REGISTRY = 1 << 0
    TOKEN = 1 << 1
    TIMEOUT = 1 << 2
    CONNECT_TIMEOUT = 1 << 3
    REGISTRY_TTL = 1 << 4
    SPIN = 1 << 5


# The flag classes and the C prefix of their members (for the ABI test).
PARAM_FLAGS = {"ECX_PRODUCER_PARAM_": ProducerParam,
               "ECX_CONSUMER_PARAM_": ConsumerParam,
               "ECX_CLIENT_PARAM_": ClientParam}


class ecx_tensor_desc(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("ndim", ctypes.c_uint32),
                ("shape", ctypes.c_uint64 * MAX_DIMS),
                ("nbytes", ctypes.c_uint64)]


class ecx_item(ctypes.Structure):
    _fields_ = [("id", ctypes.c_char_p), ("status", ctypes.c_int),
                ("desc", ecx_tensor_desc),
                ("producer", ctypes.c_char * ADDR_MAX),
                ("epoch", ctypes.c_uint64), ("dst", ctypes.c_void_p),
                ("lease", ctypes.c_uint64)]


class ecx_producer_params(ctypes.Structure):
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
                ("idle_ms", ctypes.c_int),
                ("starting", ctypes.c_int),
                ("mooncake", ctypes.c_int)]


class ecx_consumer_params(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int),
                ("recv_capacity", ctypes.c_uint64),
                ("transport", ctypes.c_char_p),
                ("bind_host", ctypes.c_char_p),
                ("regcache_max", ctypes.c_uint),
                ("integrity", ctypes.c_int),
                ("mooncake", ctypes.c_char_p),
                ("mooncake_host", ctypes.c_char_p)]


class ecx_client_params(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64),
                ("registry", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int),
                ("connect_timeout_ms", ctypes.c_int),
                ("registry_ttl_s", ctypes.c_int),
                ("spin_us", ctypes.c_int)]


PRODUCER_STATS = ["items", "bytes_used", "capacity", "pinned", "evictions",
                  "pulls", "items_served", "items_failed", "bytes_served",
                  "registrations", "connections", "leases", "leased_bytes",
                  "leases_granted", "leases_refused", "leases_expired",
                  "leases_released", "leases_used"]
CONSUMER_STATS = ["lookups", "loads", "loaded", "failed", "bytes",
                  "registrations", "regcache_hits", "connections",
                  "pages_populated", "mc_pulls", "mc_bytes",
                  "mc_rej_range", "mc_rej_expired", "mc_rej_read",
                  "mc_rej_header", "mc_hs_refused"]


class ecx_producer_stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in PRODUCER_STATS]


class ecx_consumer_stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in CONSUMER_STATS]


class ecx_push_item(ctypes.Structure):
    _fields_ = [("id", ctypes.c_char_p), ("dst_session", ctypes.c_char_p),
                ("dst_ptr", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("status", ctypes.c_int)]


# Every struct above, for the ABI test.
STRUCTS = [ecx_tensor_desc, ecx_item, ecx_producer_params,
           ecx_consumer_params, ecx_client_params, ecx_producer_stats,
           ecx_consumer_stats, ecx_push_item]

ecx_list_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p,
                               ctypes.POINTER(ecx_item))

# ---- prototypes --------------------------------------------------------

P = ctypes.c_void_p  # any handle
_int, _str, _size_t, _u64 = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                             ctypes.c_uint64)
_ptr = ctypes.POINTER


def _proto(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    globals()[name] = f


_proto("ecx_strerror", _str, _int)
_proto("ecx_err_name", _str, _int)
_proto("ecx_last_error", _str)
_proto("ecx_dtype_name", _str, _int)
_proto("ecx_dtype_size", _size_t, _int)
_proto("ecx_producer_create", _int, _ptr(ecx_producer_params), _ptr(P),
       _str, _size_t)
_proto("ecx_producer_put", _int, P, _str, _ptr(ecx_tensor_desc),
       ctypes.c_void_p)
_proto("ecx_producer_put_stored", _int, P, _str, _ptr(ecx_tensor_desc),
       ctypes.c_void_p, _ptr(_int))
_proto("ecx_producer_remove", _int, P, _str)
_proto("ecx_producer_reserve", _int, P, _str, _ptr(ecx_tensor_desc),
       _ptr(ctypes.c_void_p))
_proto("ecx_producer_commit", _int, P, _str)
_proto("ecx_producer_cancel", _int, P, _str)
_proto("ecx_producer_arena", ctypes.c_void_p, P, _ptr(_u64))
_proto("ecx_producer_stats_get", None, P, _ptr(ecx_producer_stats))
_proto("ecx_producer_address", _str, P)
_proto("ecx_producer_registry_port", ctypes.c_uint16, P)
_proto("ecx_producer_destroy", None, P)
_proto("ecx_producer_push", _int, P, _str, _str, _u64, _u64, _u64)
_proto("ecx_producer_push_batch", _int, P, ctypes.c_void_p, _size_t, _u64)
_proto("ecx_producer_item_xxh3", _int, P, _str, _ptr(_u64))
_proto("ecx_producer_lease", _int, P, _str, _int, _ptr(_u64))
_proto("ecx_producer_lease_end", _int, P, _u64)
_proto("ecx_xxh3", _u64, ctypes.c_void_p, _size_t)
_proto("ecx_size_parse", _int, _str, _ptr(_u64), _str, _size_t)
_proto("ecx_url_mask", None, _str, _str, _size_t)
_proto("ecx_consumer_create", _int, _ptr(ecx_consumer_params), _ptr(P),
       _str, _size_t)
_proto("ecx_consumer_lookup", _int, P, _ptr(ecx_item), _size_t)
_proto("ecx_consumer_lookup_lease", _int, P, _ptr(ecx_item), _size_t, _int)
_proto("ecx_consumer_release", _int, P, _ptr(ecx_item), _size_t)
_proto("ecx_consumer_load", _int, P, _ptr(ecx_item), _size_t)
_proto("ecx_consumer_stats_get", None, P, _ptr(ecx_consumer_stats))
_proto("ecx_consumer_destroy", None, P)
_proto("ecx_consumer_alloc", ctypes.c_void_p, P, _size_t)
_proto("ecx_consumer_free", None, P, ctypes.c_void_p)
_proto("ecx_consumer_arena", ctypes.c_void_p, P, _ptr(_u64))
_proto("ecx_consumer_mooncake_session", _int, P, _ptr(ctypes.c_char_p))
_proto("ecx_consumer_push_open", _int, P, ctypes.c_void_p, _u64, _u64,
       _ptr(_u64))
_proto("ecx_consumer_push_open_unhashed", _int, P, ctypes.c_void_p, _u64,
       _u64, _ptr(_u64))
_proto("ecx_consumer_push_renew", _int, P, _u64, _u64)
_proto("ecx_consumer_push_close", _int, P, _u64, _ptr(_u64))
_proto("ecx_consumer_push_close_hashed", _int, P, _u64, _ptr(_u64),
       _ptr(_u64), _ptr(_int))
_proto("ecx_consumer_load_start", _int, P, _ptr(ecx_item), _size_t, _ptr(P))
_proto("ecx_load_test", _int, P)
_proto("ecx_consumer_load_notify", _int, P, _ptr(ecx_item), _size_t, _int,
       ctypes.c_char_p, _size_t, _ptr(P))
_proto("ecx_load_wait", _int, P)

# The registry client: absent from a libecx built before it (the rest of
# the binding works without; item.need_client says so).
HAS_CLIENT = hasattr(lib, "ecx_client_create")
if HAS_CLIENT:
    _proto("ecx_client_create", _int, _ptr(ecx_client_params), _ptr(P),
           _str, _size_t)
    _proto("ecx_client_destroy", None, P)
    _proto("ecx_client_lookup", _int, P, _ptr(ecx_item), _size_t)
    _proto("ecx_client_lookup_lease", _int, P, _ptr(ecx_item), _size_t,
           _int)
    _proto("ecx_client_release", _int, P, _ptr(ecx_item), _size_t)
    _proto("ecx_client_publish", _int, P, _ptr(ecx_item))
    _proto("ecx_client_remove", _int, P, _str, _str)
    _proto("ecx_client_list", _int, P, _str, _size_t, ecx_list_fn,
           ctypes.c_void_p, _str, _size_t, _ptr(_u64))
    _proto("ecx_client_health", _int, P, _ptr(_u64))
    _proto("ecx_client_connections", ctypes.c_long, P)
    _proto("ecx_item_to_json", ctypes.c_void_p, _ptr(ecx_item))
    _proto("ecx_item_from_json", _int, _str, _size_t, _ptr(ecx_item), _str,
           _size_t)
    _proto("ecx_free", None, ctypes.c_void_p)
