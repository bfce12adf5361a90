"""benchkit: what the Python benchmarks here share (import it from a
script in bench/, whose folder is on sys.path when it runs)."""
import os
import time


def uptime():
    """The time and the load averages, for a header. Read from /proc, not
    from uptime(1): a command started with the sanitizer's LD_PRELOAD of
    the tests' environment can hang (ctest bench.push_breakdown did,
    under make asan)."""
    with open("/proc/loadavg") as f:
        load = ", ".join(f.read().split()[:3])
    now = time.strftime("%H:%M:%S UTC", time.gmtime())
    return f"{now}, load average: {load}"


def put_random(prod, name, n):
    """Puts n random bytes, a uint8 tensor, into producer prod under name
    padded with "x" to an mm_hash's 64 characters; returns that id."""
    import torch
    mm = name.ljust(64, "x")
    prod.put(mm, torch.frombuffer(bytearray(os.urandom(n)),
                                  dtype=torch.uint8))
    return mm
