"""Finds and loads libecx, and checks that its version is this binding's.

The one place the binding touches the shared object: every other module
reaches the library through `lib` (and the prototypes of _cdefs).
"""
import ctypes
import ctypes.util
import os
import re


def _header_version():
    """The version in the ecx.h this binding was written against.

    The version lives only in include/ecx/ecx.h; in a source checkout the
    binding reads it from there. A copy of the package without the header
    (libecx.so next to it) takes the library's version as its own.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "include", "ecx", "ecx.h")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    parts = [re.search(rf"^#define ECX_VERSION_{p} (\d+)$", text, re.M)
             for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return None
    return ".".join(m.group(1) for m in parts)


__version__ = _header_version()


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
    global __version__
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
        if __version__ is None:
            __version__ = version
        elif version != __version__:
            raise ImportError(
                f"libecx at {path} is version {version}, but this Python "
                f"binding is {__version__}: install matching versions (or "
                f"point ECX_LIBRARY at the right libecx.so)")
        return lib, path
    raise ImportError(
        "libecx not found: set ECX_LIBRARY to the path of libecx.so, put "
        "libecx.so next to the ecx package, or install it (make install)"
        + ("; tried: " + "; ".join(errors) if errors else ""))


lib, LIBRARY_PATH = load_library()
