"""Python arguments as C ones: strings as bytes, the token's default, byte
counts checked before ctypes would wrap them."""
import os


def b(s):
    return s.encode() if isinstance(s, str) else s


def token(token):
    """token, or ECX_TOKEN when token is None; "" means none."""
    if token is None:
        token = os.environ.get("ECX_TOKEN") or None
    return token or None


def size(name, value):
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
