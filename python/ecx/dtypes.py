"""dtypes and tensors: DTYPES is built at load from the library's own
table (ecx_dtype_name, ecx_dtype_size), so no dtype number is written
here; the helpers turn torch tensors and numpy arrays into
ecx_tensor_desc."""
from . import _cdefs as C

MAX_DIMS = C.MAX_DIMS


def _read_dtypes():
    """{torch's name: (ecx enum value, item size)} for every dtype the
    library names (1 up to the first value it does not)."""
    table = {}
    dt = 1
    while True:
        name = C.ecx_dtype_name(dt)
        if name is None:
            return table
        table[name.decode()] = (dt, C.ecx_dtype_size(dt))
        dt += 1


DTYPES = _read_dtypes()  # torch's names -> (ecx enum value, item size)
NAMES = {v[0]: k for k, v in DTYPES.items()}


# Descs already made, by (dtype name, shape): the library only reads them,
# and an encoder saves item after item of a few shapes, so each is built
# once (docs/bench.md, "Small saves"). Bounded: cleared when full.
_DESCS = {}
_DESCS_MAX = 256


def desc(name, shape):
    """The ecx_tensor_desc of dtype name and shape (nbytes computed), to
    be read only: one made before for the same name and shape may be
    returned."""
    key = (name, shape if type(shape) is tuple else tuple(shape))
    d = _DESCS.get(key)
    if d is not None:
        return d
    d = _make_desc(name, shape)
    if len(_DESCS) >= _DESCS_MAX:
        _DESCS.clear()
    _DESCS[key] = d
    return d


def _make_desc(name, shape):
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; ecx carries "
                         + ", ".join(DTYPES))
    if len(shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions")
    d = C.ecx_tensor_desc()
    d.dtype, size = DTYPES[name]
    d.ndim = len(shape)
    n = size
    for i, s in enumerate(shape):
        d.shape[i] = int(s)
        n *= int(s)
    d.nbytes = n
    return d


_NP_NAMES = {}  # numpy dtype -> its name
_TORCH_NAMES = {}  # torch dtype -> its name (torch.bfloat16: "bfloat16")


def _np_name(dt):
    """dt.name, remembered per dtype: numpy builds the name anew on each
    read (about 15 us here, as long as the rest of a load's Python)."""
    name = _NP_NAMES.get(dt)
    if name is None:
        name = dt.name
        if name in DTYPES:  # only those: the rest are refused anyway
            _NP_NAMES[dt] = name
    return name


def torch_name(dt):
    """A torch dtype's name (torch.bfloat16: "bfloat16"), remembered per
    dtype."""
    name = _TORCH_NAMES.get(dt)
    if name is None:
        name = _TORCH_NAMES[dt] = str(dt).split(".")[-1]
    return name


def describe(t):
    """(dtype name, shape, nbytes, data pointer, keepalive) of a CPU torch
    tensor or a numpy array, contiguous."""
    mod = type(t).__module__
    if mod.startswith("torch"):
        if t.device.type != "cpu":
            raise ValueError("ecx's Python binding takes CPU tensors for "
                             "now; copy to the CPU first (t.cpu())")
        t = t.contiguous()
        return torch_name(t.dtype), tuple(t.shape), t.nbytes, \
            t.data_ptr(), t
    if mod.startswith("numpy"):
        import numpy as np
        a = np.ascontiguousarray(t)
        name = _np_name(a.dtype)
        if name not in DTYPES or a.dtype.byteorder == ">":
            raise ValueError(f"numpy dtype {a.dtype} has no ecx dtype "
                             f"(use a torch tensor for bfloat16 and float8)")
        return name, tuple(a.shape), a.nbytes, a.ctypes.data, a
    raise TypeError("expected a torch tensor or a numpy array, got "
                    f"{type(t).__name__}")


def is_cuda(t):
    return type(t).__module__.startswith("torch") and t.device.type == "cuda"


def copy_into(dst, src):
    """dst (a CPU tensor in an arena) <- src, from any device; returns when
    the bytes are in place."""
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise ValueError(f"copy of {src.dtype}{tuple(src.shape)} into "
                         f"{dst.dtype}{tuple(dst.shape)}")
    dst.copy_(src)


def cuda_register(base, size, what, required):
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


def cuda_unregister(pinned):
    """Undoes cuda_register before the memory is unmapped (ecx.cuda.unpin:
    waits for the device, unregisters only what was ours, nothing at
    interpreter exit)."""
    try:
        from . import cuda
    except ImportError:
        return  # the interpreter is exiting
    cuda.unpin(pinned)
