"""benchkit: what the Python benchmarks here share (import it from a
script in bench/, whose folder is on sys.path when it runs)."""
import os


def uptime():
    """The machine's load line, as uptime prints it, for a header."""
    return os.popen("uptime").read().strip()


def put_random(prod, name, n):
    """Puts n random bytes, a uint8 tensor, into producer prod under name
    padded with "x" to an mm_hash's 64 characters; returns that id."""
    import torch
    mm = name.ljust(64, "x")
    prod.put(mm, torch.frombuffer(bytearray(os.urandom(n)),
                                  dtype=torch.uint8))
    return mm
