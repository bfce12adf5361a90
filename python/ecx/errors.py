"""Errors: libecx's codes become EcxError, or the subclass kept for the
code's name (ecx_err_name). No code is written here as a number: CODES is
read from the library's table at load."""
import ctypes
import os

from . import _cdefs as C


def _read_codes():
    """{name: code} of the library's error table (0 down to the first
    value it does not name)."""
    codes = {}
    for code in range(0, -1000, -1):
        name = C.ecx_err_name(code).decode()
        if name == "UNKNOWN":
            break
        codes[name] = code
    return codes


CODES = _read_codes()
EINVAL = CODES["EINVAL"]
ENOTFOUND = CODES["ENOTFOUND"]
EUNSUPPORTED = CODES["EUNSUPPORTED"]
EFORK = CODES["EFORK"]


def mask_urls(text):
    """text with the password of every URL in it replaced by three
    asterisks (libecx's ecx_url_mask: what the library's log and the ecx
    command print); for any message or log line that may quote a
    registry URL."""
    raw = str(text).encode()
    buf = ctypes.create_string_buffer(len(raw) + 64)
    C.ecx_url_mask(raw, buf, len(buf))
    return buf.value.decode(errors="replace")


class EcxError(Exception):
    """A failure in libecx: `name` is the C error's name ("ENOTFOUND"),
    `code` its value, `detail` the one-line detail (URL passwords
    masked)."""

    def __init__(self, code, detail=""):
        self.code = code
        self.name = C.ecx_err_name(code).decode()
        self.detail = mask_urls(detail or C.ecx_strerror(code).decode())
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


# The subclasses, by the name ecx_err_name gives their code.
CLASSES = {"ENOTFOUND": NotFound, "ETIMEDOUT": Timeout,
           "ECORRUPT": Corrupt, "EFORK": Forked}


def error(code, detail=None):
    """The exception for code, with detail (default: ecx_last_error)."""
    if detail is None:
        detail = C.ecx_last_error().decode()
    cls = CLASSES.get(C.ecx_err_name(code).decode(), EcxError)
    return cls(code, detail)


def strerror(code):
    return C.ecx_strerror(code).decode()


def check_fork(obj, kind):
    """Raises Forked when obj (with ._pid) was created in another process:
    before any call into C, whose state in a forked child is a copy of the
    parent's (UCX's shared-memory FIFOs are the parent's too)."""
    pid = os.getpid()
    if obj._pid != pid:
        raise Forked(EFORK, f"{kind} handle created in process {obj._pid}, "
                     f"used after fork in {pid}: create a new one in the "
                     f"child")


def closed(kind):
    """The error of a call on a closed handle."""
    return EcxError(EINVAL, f"the {kind} is closed")
