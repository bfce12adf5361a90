"""Deterministic item bytes for the interop peers: they depend only on a seed
and the item's id, so a consumer given the same seed checks every byte.
Nothing here is ecx's (ecx's synthetic items are made another way)."""
import hashlib

import numpy as np

# Bytes per element of the torch dtype names the reference registry
# carries (str(tensor.dtype) without "torch.").
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "float32": 4, "int64": 8, "float64": 8,
}


def item_bytes(seed, mm_hash, nbytes):
    """nbytes pseudo-random bytes for (seed, mm_hash): PCG64 seeded with the
    first 8 bytes of SHA-256 of 'seed:mm_hash'."""
    key = hashlib.sha256(f"{seed}:{mm_hash}".encode()).digest()[:8]
    gen = np.random.Generator(np.random.PCG64(int.from_bytes(key, "little")))
    return gen.bytes(nbytes)


def parse_spec(text):
    """'ID:AxB:DTYPE' -> (id, shape tuple, dtype, nbytes)."""
    try:
        mm_hash, shape, dtype = text.rsplit(":", 2)
        dims = tuple(int(d) for d in shape.split("x"))
    except ValueError:
        raise ValueError(f"item {text!r}: want ID:AxB...:DTYPE") from None
    if dtype not in ITEMSIZE:
        raise ValueError(f"item {text!r}: unknown dtype {dtype!r}")
    if not mm_hash or any(d <= 0 for d in dims):
        raise ValueError(f"item {text!r}: empty id or a dimension <= 0")
    nbytes = ITEMSIZE[dtype]
    for d in dims:
        nbytes *= d
    return mm_hash, dims, dtype, nbytes
