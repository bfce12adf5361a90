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

The modules: _lib (finds and loads libecx), _cdefs (the C declarations of
ecx.h), errors, dtypes, item (Item, Found), producer, consumer (Consumer,
Load), client (Client, and the lookup path it shares with Consumer), cuda
(page-locking and device copies), vllm (the vLLM connector).
"""
import ctypes  # noqa: F401 - names the binding has always had
import os  # noqa: F401
import threading  # noqa: F401
import weakref  # noqa: F401

from ._lib import LIBRARY_PATH, __version__, load_library  # noqa: F401
from .client import Client
from .consumer import Consumer, Load
from ._cdefs import EPOCH_REFERENCE  # noqa: F401
from .dtypes import DTYPES, MAX_DIMS  # noqa: F401
from .errors import (EFORK, Corrupt, EcxError, Forked,  # noqa: F401
                     NotFound, Timeout)
from .item import Found, Item
from .producer import Producer



def xxh3(addr, nbytes):
    """The XXH3 (XXH3_64bits, no seed; what integrity uses) of nbytes at
    address addr of this process, as an int."""
    from . import _cdefs
    return _cdefs.ecx_xxh3(int(addr), int(nbytes))


__all__ = ["Producer", "Consumer", "Client", "Item", "Load", "Found",
           "EcxError", "NotFound", "Timeout", "Corrupt", "load_library",
           "DTYPES", "__version__", "xxh3"]
