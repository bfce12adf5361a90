"""A stand-in for ecx.cuda.TorchCuda (the device interface), for tests on
machines without a GPU: every stream runs its work in order on a thread of
its own, a copy reads its source's bytes by address only when it runs (as
a DMA does, holding no reference to the tensor), and copies complete
`latency_s` late. The compute stream can be held busy (busy()), as a long
kernel holds a GPU's. "Device" tensors are CPU tensors it made.

It records what the rules of ecx.cuda forbid: `freed_early` lists copies
whose host tensor was freed before the copy ran; `cpu_waits` the events
the CPU waited for."""
import collections
import ctypes
import threading
import time
import weakref

import torch


class Event:
    def __init__(self, stream):
        self.stream = stream
        self.set = threading.Event()


class Stream:
    def __init__(self, dev, name):
        self.dev, self.name = dev, name
        self.ops = collections.deque()
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"standin-{name}")
        self.thread.start()

    def push(self, fn, wait_for=None):
        with self.cv:
            self.ops.append((fn, wait_for))
            self.cv.notify()

    def _run(self):
        while True:
            with self.cv:
                while not self.ops:
                    self.cv.wait()
                fn, wait_for = self.ops[0]
            if wait_for is not None:
                wait_for.set.wait()
            fn()
            with self.cv:
                self.ops.popleft()


class StandInCuda:
    def __init__(self, latency_s=0.05, index=0, count=1):
        self.latency_s = latency_s
        self.index, self.count = index, count
        self.compute = Stream(self, "compute")
        self.streams = [self.compute]
        self.freed_early = []
        self.cpu_waits = []
        self.copies = 0
        self.copied = 0  # copies completed
        self.log = []  # ("copy done", n) and what tests add
        self._lock = threading.Lock()
        self.fail_next_copy = None  # an exception to raise at the next copy

    # ---- the interface -----------------------------------------------

    def available(self):
        return True

    def current_device(self):
        return torch.device("cuda", self.index)

    def device_count(self):
        return self.count

    def use_device(self, device):
        self.used_device = device

    def owns(self, tensor):
        return getattr(tensor, "_standin", False)

    def pinned_host(self):
        return False  # torch here has no CUDA to page-lock with

    def new_stream(self, device):
        s = Stream(self, f"side-{len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self, device):
        return self.compute

    def record(self, stream):
        ev = Event(stream)
        stream.push(ev.set.set)
        return ev

    def done(self, event):
        return event.set.is_set()

    def wait(self, stream, event):
        stream.push(lambda: None, wait_for=event)

    def synchronize(self, event):
        self.cpu_waits.append(event.stream.name)
        event.set.wait()

    def to_device(self, t, device, stream):
        out = torch.empty_like(t)
        out._standin = True
        self._copy(out, t, stream)
        return out

    def to_host(self, dst, src, stream):
        self._copy(dst, src, stream)

    def keep_for(self, t, stream):
        pass

    # ---- what tests use ------------------------------------------------

    def tensor(self, t):
        """A "device" tensor with t's bytes."""
        out = t.clone()
        out._standin = True
        return out

    def busy(self):
        """Holds the compute stream busy until the returned Event is set
        (a long kernel); what waits for the compute stream waits too."""
        gate = threading.Event()
        self.compute.push(gate.wait)
        return gate

    def idle(self, timeout=10):
        """Waits (in the test, not in ecx) until every stream is empty."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(not s.ops for s in self.streams):
                return True
            time.sleep(0.005)
        return False

    def _copy(self, dst, src, stream):
        if self.fail_next_copy is not None:
            e, self.fail_next_copy = self.fail_next_copy, None
            raise e
        n = src.numel() * src.element_size()
        assert dst.numel() * dst.element_size() == n
        dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()
        alive = [True]
        weakref.finalize(src, alive.__setitem__, 0, False)
        keep_dst = dst  # the destination is the caller's to keep; held here
        self.copies += 1

        def run():
            time.sleep(self.latency_s)
            if not alive[0]:
                self.freed_early.append(n)
            ctypes.memmove(dst_ptr, src_ptr, n)
            del keep_dst_ref[:]
            with self._lock:
                self.copied += 1
                self.log.append(("copy done", n))

        keep_dst_ref = [keep_dst]
        stream.push(run)
