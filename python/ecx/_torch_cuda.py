"""The device interface of ecx.cuda's ToDevice and Saves on torch.cuda
(ecx.cuda.TorchCuda); tests give them a stand-in with the same methods
(tests/python/cuda_standin.py)."""


class TorchCuda:
    """The device interface of ToDevice and Saves, on torch.cuda. A test
    gives them a stand-in with these methods instead."""

    def __init__(self):
        import torch
        self._torch = torch

    def available(self):
        return self._torch.cuda.is_available()

    def current_device(self):
        """This rank's device (vLLM sets it per worker before the
        connector starts)."""
        t = self._torch
        return t.device("cuda", t.cuda.current_device())

    def device_count(self):
        return self._torch.cuda.device_count()

    def use_device(self, device):
        """Makes device current in the calling thread (a new thread's
        CUDA calls would otherwise start the runtime on device 0)."""
        self._torch.cuda.set_device(device)

    def owns(self, tensor):
        """True for a tensor on a CUDA device."""
        return getattr(tensor, "is_cuda", False)

    def pinned_host(self):
        """Whether host tensors can be made page-locked (pin_memory)."""
        return True

    def new_stream(self, device):
        return self._torch.cuda.Stream(device)

    def current_stream(self, device):
        return self._torch.cuda.current_stream(device)

    def record(self, stream):
        ev = self._torch.cuda.Event()
        ev.record(stream)
        return ev

    def done(self, event):
        return event.query()

    def wait(self, stream, event):
        """stream waits for event, on the device; the CPU goes on."""
        stream.wait_event(event)

    def synchronize(self, event):
        event.synchronize()

    def to_device(self, t, device, stream):
        with self._torch.cuda.stream(stream):
            return t.to(device, non_blocking=True)

    def to_host(self, dst, src, stream):
        with self._torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep_for(self, t, stream):
        """t's device memory is not reused before stream's work so far."""
        t.record_stream(stream)
