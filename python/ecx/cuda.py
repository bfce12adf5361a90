"""ecx.cuda: the CUDA side of the binding and of the vLLM connector.

Two small interfaces hold everything that touches CUDA, so that the rules
below are code that a test can drive on a CPU with stand-ins:

- Driver: page-locking host memory with the CUDA driver API
  (cuMemHostRegister, PORTABLE) through ctypes on libcuda. A failed call
  of the driver API returns its code and leaves nothing behind; the
  runtime's cudaHostRegister (torch.cuda.cudart()) leaves the thread's
  last error set, and the next kernel launch in that thread then fails
  with an error that names the kernel, not the registration.
- TorchCuda: streams, events and non-blocking copies, through torch.cuda.

On top of them:

- pin(): page-locks an arena. 712 (CUDA_ERROR_HOST_MEMORY_ALREADY_
  REGISTERED: a UCX built with CUDA registers what ucp_mem_map allocates)
  means pinned by someone else: usable, and never unregistered here.
- ToDevice: host -> device copies on a side stream that does not wait for
  the compute stream; the compute stream waits for them on the device. The
  host tensor (a range of the receive arena) is kept until an event
  recorded after its copy has completed, found by poll() each step: torch
  records no such event for memory it did not allocate, so a range freed
  at once could take the next load's bytes before the DMA reads it.
- Saves: device -> arena copies for a producer: reserved at once, copied on
  a side stream after one wait for the compute stream (the work that made
  the tensor), committed from a thread of their own once an event recorded
  after the copy has completed. Committing right after a non-blocking copy
  would publish bytes the device has not written yet.
"""
import collections
import ctypes
import logging
import sys
import threading
import time

from . import _torch_cuda

TorchCuda = _torch_cuda.TorchCuda  # the device interface on torch.cuda

logger = logging.getLogger("ecx")

CUDA_SUCCESS = 0
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
CU_MEMHOSTREGISTER_PORTABLE = 0x01
LIBCUDA = "libcuda.so.1"


class CudaError(RuntimeError):
    """A CUDA driver call failed: .code is its CUresult, .name its name
    (CUDA_ERROR_...)."""

    def __init__(self, code, name, what):
        super().__init__(f"{what}: {name} ({code})")
        self.code, self.name = code, name


# ---- the driver ------------------------------------------------------------

_c = ctypes
# name -> (argument types); each returns a CUresult (int). The versioned
# name is what cuda.h maps the plain one to; an older libcuda has only the
# plain one.
_FUNCTIONS = {
    "cuInit": [_c.c_uint],
    "cuGetErrorName": [_c.c_int, _c.POINTER(_c.c_char_p)],
    "cuDeviceGet": [_c.POINTER(_c.c_int), _c.c_int],
    "cuCtxGetCurrent": [_c.POINTER(_c.c_void_p)],
    "cuDevicePrimaryCtxRetain": [_c.POINTER(_c.c_void_p), _c.c_int],
    "cuDevicePrimaryCtxRelease_v2": [_c.c_int],
    "cuCtxPushCurrent_v2": [_c.c_void_p],
    "cuCtxPopCurrent_v2": [_c.POINTER(_c.c_void_p)],
    "cuCtxSynchronize": [],
    "cuMemHostRegister_v2": [_c.c_void_p, _c.c_size_t, _c.c_uint],
    "cuMemHostUnregister": [_c.c_void_p],
    "cuMemHostGetFlags": [_c.POINTER(_c.c_uint), _c.c_void_p],
}


class Driver:
    """The few CUDA driver calls ecx makes, through ctypes on libcuda
    (path: the library to open; tests give a stand-in built from C).
    Every call runs with a context current: the thread's own, or else
    the primary context of device `ordinal`, pushed for the call. Raises
    OSError when the library cannot be opened (or lacks a function),
    CudaError when cuInit fails."""

    def __init__(self, path=LIBCUDA):
        self.path = path
        lib = ctypes.CDLL(path)
        self._f = {}
        for name, args in _FUNCTIONS.items():
            f = getattr(lib, name, None)
            if f is None and name.endswith("_v2"):
                f = getattr(lib, name[:-3], None)
            if f is None:
                raise OSError(f"{path} has no {name}: not a CUDA driver")
            f.restype = ctypes.c_int
            f.argtypes = args
            self._f[name.split("_v2")[0]] = f
        self._check(self._f["cuInit"](0), "cuInit")

    def error_name(self, code):
        s = ctypes.c_char_p()
        if self._f["cuGetErrorName"](code, ctypes.byref(s)) != 0 or \
                not s.value:
            return "CUDA_ERROR_UNKNOWN"
        return s.value.decode()

    def _check(self, rc, what):
        if rc != CUDA_SUCCESS:
            raise CudaError(rc, self.error_name(rc), what)

    def _call(self, ordinal, name, *args):
        """Calls name(*args) with a context current; returns its code."""
        f = self._f
        ctx = ctypes.c_void_p()
        if f["cuCtxGetCurrent"](ctypes.byref(ctx)) == 0 and ctx.value:
            return f[name](*args)
        dev = ctypes.c_int()
        self._check(f["cuDeviceGet"](ctypes.byref(dev), int(ordinal)),
                    f"cuDeviceGet({ordinal})")
        self._check(f["cuDevicePrimaryCtxRetain"](ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain")
        try:
            self._check(f["cuCtxPushCurrent"](ctx), "cuCtxPushCurrent")
            try:
                return f[name](*args)
            finally:
                f["cuCtxPopCurrent"](ctypes.byref(ctypes.c_void_p()))
        finally:
            f["cuDevicePrimaryCtxRelease"](dev)

    def retain_primary(self, ordinal=0):
        """Retains device ordinal's primary context (the one the CUDA
        runtime, and so torch, uses): a registration made in it lives as
        long as the context, and a context nobody retains is destroyed
        with its registrations. Undone by release_primary."""
        f = self._f
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check(f["cuDeviceGet"](ctypes.byref(dev), int(ordinal)),
                    f"cuDeviceGet({ordinal})")
        self._check(f["cuDevicePrimaryCtxRetain"](ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain")

    def release_primary(self, ordinal=0):
        dev = ctypes.c_int()
        if self._f["cuDeviceGet"](ctypes.byref(dev), int(ordinal)) == 0:
            self._f["cuDevicePrimaryCtxRelease"](dev)

    def register(self, base, size, ordinal=0):
        """cuMemHostRegister(base, size, PORTABLE): returns its code (0,
        712 for memory already registered, or another failure)."""
        return self._call(ordinal, "cuMemHostRegister",
                          ctypes.c_void_p(base), ctypes.c_size_t(size),
                          CU_MEMHOSTREGISTER_PORTABLE)

    def unregister(self, base, ordinal=0):
        """cuMemHostUnregister(base): returns its code."""
        return self._call(ordinal, "cuMemHostUnregister",
                          ctypes.c_void_p(base))

    def host_flags(self, address, ordinal=0):
        """cuMemHostGetFlags of address: its flags where the address is
        page-locked for CUDA, None where it is not."""
        flags = ctypes.c_uint()
        rc = self._call(ordinal, "cuMemHostGetFlags", ctypes.byref(flags),
                        ctypes.c_void_p(address))
        return flags.value if rc == CUDA_SUCCESS else None

    def synchronize(self, ordinal=0):
        """cuCtxSynchronize: waits for all work of the context."""
        return self._call(ordinal, "cuCtxSynchronize")


_driver = None
_driver_lock = threading.Lock()


def driver():
    """The process's Driver, or None where torch has no CUDA device (or is
    not installed). Raises OSError/CudaError where torch has CUDA but
    libcuda cannot be opened or initialized."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                import torch
            except ImportError:
                return None
            if not torch.cuda.is_available():
                return None
            _driver = Driver()
        return _driver


class Pin:
    """A page-locked range: ours is False where someone else (UCX) had
    registered it, which ecx then never unregisters."""
    __slots__ = ("base", "size", "ours", "code", "seconds", "ordinal",
                 "retained")

    def __init__(self, base, size, ours, code, seconds, ordinal,
                 retained=False):
        self.base, self.size, self.ours = base, size, ours
        self.code, self.seconds, self.ordinal = code, seconds, ordinal
        # The primary context of ordinal, retained while the range is
        # page-locked (Driver.retain_primary).
        self.retained = retained

    def __repr__(self):
        return (f"Pin({self.base:#x}, {self.size}, "
                f"{'ours' if self.ours else 'already registered'})")


def pin(base, size, what="arena", drv=None, ordinal=None):
    """Page-locks [base, base + size) for CUDA copies (cuMemHostRegister,
    PORTABLE: for every context). Returns a Pin, or None where there is
    no CUDA (drv None and driver() None). A range already registered
    (712) is checked with cuMemHostGetFlags at both ends and returned
    with ours=False. Raises CudaError, with the code, for any other
    failure (logged too): nothing is left set in CUDA's per-thread error
    state by it."""
    if drv is None:
        try:
            drv = driver()
        except (OSError, CudaError) as e:
            logger.warning("ecx: cannot page-lock the %s for CUDA: the CUDA "
                           "driver (%s) did not load: %s", what, LIBCUDA, e)
            raise
    if drv is None or not base or not size:
        return None
    if ordinal is None:
        ordinal = _current_ordinal()
    t0 = time.perf_counter()
    # Pinned before torch's first CUDA call, the registration would be made
    # in a primary context that nobody holds, and go with it.
    drv.retain_primary(ordinal)
    try:
        rc = drv.register(base, size, ordinal)
    except BaseException:
        drv.release_primary(ordinal)
        raise
    seconds = time.perf_counter() - t0
    if rc == CUDA_SUCCESS:
        logger.info("ecx: page-locked the %s for CUDA (%d MiB) in %.2f s",
                    what, size >> 20, seconds)
        return Pin(base, size, True, rc, seconds, ordinal, True)
    name = drv.error_name(rc)
    if rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED and \
            drv.host_flags(base, ordinal) is not None and \
            drv.host_flags(base + size - 1, ordinal) is not None:
        logger.info("ecx: the %s (%d MiB) was page-locked already (%s, "
                    "%d: by UCX's CUDA support?); used as it is and never "
                    "unregistered here", what, size >> 20, name, rc)
        return Pin(base, size, False, rc, seconds, ordinal, True)
    drv.release_primary(ordinal)
    logger.warning("ecx: cannot page-lock the %s (%d MiB at %#x) for CUDA: "
                   "cuMemHostRegister returned %s (%d)", what, size >> 20,
                   base, name, rc)
    raise CudaError(rc, name, f"cuMemHostRegister of the {what} "
                    f"({size} bytes)")


def unpin(p, drv=None):
    """Undoes a Pin before its memory is unmapped: waits for the device's
    work (a copy may still read the range), then unregisters it if it is
    ours. Does nothing while the interpreter exits (CUDA may be torn down
    already; the process's end releases both) and never raises."""
    if p is None or sys.is_finalizing():
        return
    try:
        drv = drv if drv is not None else driver()
        if drv is None:
            return
        drv.synchronize(p.ordinal)
        if p.ours:
            rc = drv.unregister(p.base, p.ordinal)
            if rc not in (CUDA_SUCCESS, CUDA_ERROR_DEINITIALIZED):
                logger.warning("ecx: cuMemHostUnregister returned %s (%d)",
                               drv.error_name(rc), rc)
        if p.retained:
            p.retained = False
            drv.release_primary(p.ordinal)
    except Exception as e:  # noqa: BLE001 - a close must not raise
        logger.warning("ecx: unpinning the arena failed: %s", e)


def _current_ordinal():
    try:
        import torch
        return torch.cuda.current_device()
    except Exception:  # noqa: BLE001 - the primary context of 0 will do
        return 0


# ---- streams, events, copies ----------------------------------------------


class ToDevice:
    """Copies host tensors to a device on a side stream (see the module's
    docstring): copy() returns the device tensors, poll() lets go of the
    host tensors whose copies have completed, drain() waits for all."""

    def __init__(self, api, device):
        self._api = api
        self._device = device
        self._side = None
        self._kept = collections.deque()  # (event, host tensors), in order

    def copy(self, tensors):
        api = self._api
        if self._side is None:
            self._side = api.new_stream(self._device)
        cur = api.current_stream(self._device)
        # No wait for cur: the destinations are new memory of the side
        # stream's, and keep_for stops cur's use of them from being
        # reused early.
        outs = [api.to_device(t, self._device, self._side) for t in tensors]
        ev = api.record(self._side)
        api.wait(cur, ev)
        for g in outs:
            api.keep_for(g, cur)
        self._kept.append((ev, list(tensors)))
        return outs

    def poll(self):
        """Lets go of the host tensors whose copies have completed; returns
        how many copies are still kept. Never waits."""
        while self._kept and self._api.done(self._kept[0][0]):
            self._kept.popleft()
        return len(self._kept)

    def drain(self):
        """Waits for every copy (before the host memory goes)."""
        while self._kept:
            self._api.synchronize(self._kept[0][0])
            self._kept.popleft()

    @property
    def kept(self):
        return len(self._kept)


class Saves:
    """Device tensors into a producer's arena without the step waiting
    (see the module's docstring). save() returns True when the tensor was
    reserved and its copy queued, False when the producer holds the id
    already (or its save is under way). Commits happen in order, from a
    thread started at the first save; a failed commit is logged (the
    consumers encode the item)."""

    def __init__(self, producer, api, device, poll_s=0.0002):
        self._producer = producer
        self._api = api
        self._device = device
        self._poll_s = poll_s
        self._side = None
        self._queue = collections.deque()  # (event, id, src, dst)
        self._ids = set()
        self._cv = threading.Condition()
        self._thread = None
        self._stop = False
        # Set by a close that gave up waiting, under _commit_lock: no
        # commit runs after it (the producer is destroyed next).
        self._abandoned = False
        self._commit_lock = threading.Lock()
        self.committed = 0
        self.failed = 0

    def save(self, id, tensor):
        api = self._api
        with self._cv:
            if id in self._ids:
                return False
        name = str(tensor.dtype).split(".")[-1]
        dst = self._producer.reserve(id, name, tuple(tensor.shape))
        if dst is None:
            return False
        try:
            if self._side is None:
                self._side = api.new_stream(self._device)
            api.wait(self._side,
                     api.record(api.current_stream(self._device)))
            api.to_host(dst, tensor, self._side)
            api.keep_for(tensor, self._side)
            ev = api.record(self._side)
        except BaseException:
            self._producer.cancel(id)
            raise
        with self._cv:
            self._queue.append((ev, id, tensor, dst))
            self._ids.add(id)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ecx-commit", daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    @property
    def pending(self):
        with self._cv:
            return len(self._queue)

    def wait_for(self, id, timeout_s):
        """Waits until id's save (if one is queued) has committed or
        failed, at most timeout_s; True when it is no longer queued."""
        with self._cv:
            return self._cv.wait_for(lambda: id not in self._ids, timeout_s)

    def _run(self):
        self._api.use_device(self._device)
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                ev, id, _, _ = self._queue[0]
            while not self._api.done(ev):
                if self._abandoned:
                    return
                time.sleep(self._poll_s)
            with self._commit_lock:
                if self._abandoned:
                    return
                try:
                    self._producer.commit(id)
                    self.committed += 1
                except Exception as e:  # noqa: BLE001 - logged, not raised
                    self.failed += 1
                    logger.warning("ECXConnector: not saving %s: %s", id,
                                   e)
            with self._cv:
                self._queue.popleft()
                self._ids.discard(id)
                self._cv.notify_all()

    def close(self, timeout_s=10.0):
        """Commits what is queued, waiting at most timeout_s for its
        copies, and stops the thread; returns how many saves were still
        queued then (their room stays reserved: the producer is closing).
        Past timeout_s no commit runs any more, so the producer can go."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                with self._commit_lock:
                    self._abandoned = True
        return self.pending
