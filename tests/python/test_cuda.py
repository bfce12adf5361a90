"""The CUDA side of ecx (python/ecx/cuda.py) without a GPU.

Pinning goes through ecx.cuda.Driver's own ctypes code, loaded over a
stand-in libcuda built here from fake_libcuda.c (the driver's names and C
signatures over a table of registered ranges). The ordering of copies
goes through the stand-in device of cuda_standin.py, whose copies read
their sources by address only when they run, late, and whose compute
stream can be held busy: a host range freed before its copy ran, or a step
that waits for the compute stream, shows there. tests/gpu/check.sh runs
the same paths on a real GPU."""
import ctypes
import gc
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_vllm_steps as steps  # noqa: E402 - puts the vLLM stand-in first
from test_vllm_steps import producers  # noqa: E402,F401 - a fixture

from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

import ecx  # noqa: E402
import ecx.cuda  # noqa: E402
import ecx.vllm  # noqa: E402
from cuda_standin import StandInCuda  # noqa: E402
from ecx.vllm import ECXConnector  # noqa: E402

MiB = 1 << 20


# ---- the stand-in driver ---------------------------------------------------


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    out = tmp_path_factory.mktemp("cuda") / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out),
                    os.path.join(HERE, "fake_libcuda.c")], check=True)
    return str(out)


class Fake:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)  # the same handle the Driver opens
        self.lib.fake_reset()
        self.drv = ecx.cuda.Driver(path)

    def get(self, name):
        return ctypes.c_int.in_dll(self.lib, f"fake_{name}").value

    def set(self, name, value):
        ctypes.c_int.in_dll(self.lib, f"fake_{name}").value = value

    @property
    def log(self):
        return (ctypes.c_char * 256).in_dll(self.lib, "fake_log").value \
            .decode()

    def registered(self, base, size):
        return bool(self.lib.fake_registered(ctypes.c_void_p(base),
                                             ctypes.c_size_t(size)))

    def preregister(self, base, size):
        assert self.lib.fake_preregister(ctypes.c_void_p(base),
                                         ctypes.c_size_t(size)) == 0


@pytest.fixture
def fake(fake_libcuda, monkeypatch):
    f = Fake(fake_libcuda)
    monkeypatch.setattr(ecx.cuda, "driver", lambda: f.drv)
    yield f
    f.lib.fake_reset()


def buffer(n=1 * MiB):
    b = ctypes.create_string_buffer(n)
    return b, ctypes.addressof(b), n


def test_pin_is_portable_and_unpin_waits_then_unregisters(fake):
    b, base, n = buffer()
    p = ecx.cuda.pin(base, n)
    assert p.ours and fake.get("last_flags") == 1  # PORTABLE
    assert fake.registered(base, n)
    assert fake.drv.host_flags(base) == 1
    assert fake.drv.host_flags(base + n) is None
    ecx.cuda.unpin(p)
    # The device's work ends before the range is unregistered.
    assert fake.log == "RSU"
    assert not fake.registered(base, n)


def test_already_registered_is_pinned_not_ours(fake, caplog):
    b, base, n = buffer()
    fake.preregister(base, n)  # as UCX's cuda_copy does at ucp_mem_map
    with caplog.at_level(logging.INFO, logger="ecx"):
        p = ecx.cuda.pin(base, n)
    assert not p.ours and p.code == 712
    assert "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, 712" in caplog.text
    ecx.cuda.unpin(p)
    assert fake.log == "RS" and fake.registered(base, n)  # never ours


def test_a_refused_pin_raises_its_code(fake, caplog):
    b, base, n = buffer()
    fake.set("force_register", 2)
    with pytest.raises(ecx.cuda.CudaError) as e:
        ecx.cuda.pin(base, n)
    assert e.value.code == 2 and e.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in caplog.text
    # 712 over memory that is not page-locked is no pin either.
    fake.set("force_register", 712)
    with pytest.raises(ecx.cuda.CudaError) as e:
        ecx.cuda.pin(base, n)
    assert e.value.code == 712


def test_without_a_current_context_the_primary_one_is_pushed(fake):
    b, base, n = buffer()
    fake.set("current_ctx", 0)
    p = ecx.cuda.pin(base, n)
    assert p.ours and fake.log == "PRp"
    # The primary context stays retained while the range is pinned: one
    # nobody holds would be destroyed, and the registration with it.
    assert fake.get("retained") == 1 and fake.get("pushed") == 0
    ecx.cuda.unpin(p)
    assert fake.log == "PRpPSpPUp" and not fake.registered(base, n)
    assert fake.get("retained") == 0


def test_unpin_does_nothing_while_the_interpreter_exits(fake, monkeypatch):
    b, base, n = buffer()
    p = ecx.cuda.pin(base, n)
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    ecx.cuda.unpin(p)
    assert fake.log == "R"


def test_a_library_that_is_no_driver_is_refused(monkeypatch, caplog):
    with pytest.raises(OSError, match="no cuInit"):
        ecx.cuda.Driver(ecx.LIBRARY_PATH)  # libecx: no CUDA functions

    def broken():
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(ecx.cuda, "driver", broken)
    prod = ecx.Producer(capacity_bytes=4 * MiB, bind_host="127.0.0.1",
                        registry_port=0)
    assert not prod.pin_for_cuda()  # logged, not raised
    assert "did not load" in caplog.text
    with pytest.raises(OSError):
        prod.pin_for_cuda(required=True)
    prod.close()


def test_the_binding_pins_its_arenas(fake, caplog):
    prod = ecx.Producer(capacity_bytes=4 * MiB, bind_host="127.0.0.1",
                        registry_port=0)
    base, size = prod.arena()
    assert prod.pin_for_cuda() and fake.registered(base, size)
    assert prod.pin_for_cuda() and fake.get("registers") == 1  # once
    prod.close()
    assert not fake.registered(base, size)
    # Pinned by someone else: used, kept registered at close.
    cons = ecx.Consumer("http://127.0.0.1:1", recv_capacity=4 * MiB)
    cbase, csize = cons.arena()
    fake.preregister(cbase, csize)
    assert cons.pin_for_cuda()
    cons.close()
    assert fake.registered(cbase, csize)
    # Refused: False, logged with the code, not tried at every put; or
    # raised when required.
    fake.set("force_register", 2)
    prod = ecx.Producer(capacity_bytes=4 * MiB, bind_host="127.0.0.1",
                        registry_port=0)
    registers = fake.get("registers")
    assert not prod.pin_for_cuda()
    assert not prod.pin_for_cuda()
    assert fake.get("registers") == registers + 1
    assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in caplog.text
    with pytest.raises(ecx.cuda.CudaError):
        prod.pin_for_cuda(required=True)
    prod.close()


# ---- ordering: copies to the device ----------------------------------------


def test_copies_keep_their_ranges_and_never_wait_for_compute():
    dev = StandInCuda(latency_s=0.05)
    busy = dev.busy()  # a long kernel on the compute stream
    copies = ecx.cuda.ToDevice(dev, torch.device("cuda", 0))
    srcs = [torch.randn(1000 + k) for k in range(4)]
    want = [s.clone() for s in srcs]
    t0 = time.perf_counter()
    outs = copies.copy(srcs)
    assert time.perf_counter() - t0 < 0.02  # queued, not waited for
    del srcs  # what a caller does once the copy is queued
    assert copies.poll() == 1  # the ranges are kept meanwhile
    deadline = time.monotonic() + 5
    while copies.poll() and time.monotonic() < deadline:
        time.sleep(0.005)
    # They completed while the compute stream stayed busy: the side
    # stream does not wait for it.
    assert copies.kept == 0 and dev.copied == 4
    assert not dev.freed_early and not dev.cpu_waits
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    busy.set()


@pytest.fixture
def standin(monkeypatch, fake):
    dev = StandInCuda(latency_s=0.05)
    monkeypatch.setattr(ecx.vllm.worker, "_device_api", lambda: dev)
    return dev


def gpu_config(url, role="ec_consumer", device="cuda", **extra):
    return VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
        ec_role=role, ec_buffer_device=device,
        ec_connector_extra_config={
            "remote_registry_url": url, "registry": url, "token": "tok",
            "timeout_ms": 2000, "load_timeout_s": 4,
            "bind_host": "127.0.0.1", "capacity_bytes": "16MiB",
            "recv_capacity_bytes": "8MiB", **extra}))


def step(sched, w, cache, waiting):
    """One step in vLLM's order; returns the requests scheduled."""
    scheduled = []
    for req in list(waiting):
        if not sched.ensure_cache_available(req, 0):
            continue
        for f in req.mm_features:
            req.remote[f.identifier] = sched.has_cache_item(f.identifier)
        for i in range(len(req.mm_features)):
            sched.update_state_after_alloc(req, i)
        waiting.remove(req)
        scheduled.append(req)
    w.bind_connector_metadata(pickle.loads(pickle.dumps(
        sched.build_connector_meta(object()))))
    w.start_load_caches(cache)
    wm = pickle.loads(pickle.dumps(w.build_connector_worker_meta()))
    w.clear_connector_metadata()
    sched.update_connector_output(ECConnectorOutput(
        ec_connector_worker_meta=wm))
    assert not sched.take_unavailable_requests()
    return scheduled


@pytest.mark.parametrize("async_load", [True, False])
def test_connector_on_a_busy_device(registry, producers, standin,
                                    async_load):
    """Requests one after another through an 8 MiB receive arena (its
    ranges are reused), every step while the compute stream is busy:
    no step may wait for it, no range may be freed before its copy ran,
    and every tensor handed to vLLM gets its item's bytes."""
    reg = registry()
    hashes = [steps.mm_hash(f"gpu-{i}") for i in range(10)]
    producers(reg.url, hashes)
    cfg = gpu_config(reg.url, async_load=async_load)
    sched = ECXConnector(cfg, ECConnectorRole.SCHEDULER)
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    assert w._worker._copies is not None and w._worker._consumer._cuda_pinned
    busy = standin.busy()
    handed = {}
    slowest = 0.0
    try:
        for k, h in enumerate(hashes):
            req = steps.Request(f"r{k}", [h])
            cache, waiting = {}, [req]
            deadline = time.monotonic() + 10
            while waiting and time.monotonic() < deadline:
                t0 = time.perf_counter()
                step(sched, w, cache, waiting)
                slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(0.002)
            assert not waiting and req.remote == {h: True}
            assert h in cache and standin.owns(cache[h])
            handed[h] = cache.pop(h)  # vLLM's cache lets go of it
            for i in range(len(req.mm_features)):
                sched.update_state_after_free(req, i)
            sched.request_finished(req)
        step(sched, w, {}, [])  # the releases reach the worker
        assert slowest < 1.0, f"a step took {slowest:.2f} s"
        assert not standin.cpu_waits
        deadline = time.monotonic() + 10
        while standin.copied < standin.copies and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        assert standin.copied == standin.copies == len(hashes)
        assert not standin.freed_early, standin.freed_early
        for h, t in handed.items():
            assert torch.equal(t.view(torch.uint8),
                               steps.expected(h).view(torch.uint8)), h
        step(sched, w, {}, [])
        assert w._worker._copies.kept == 0  # let go at the next step's poll
    finally:
        busy.set()
        w.shutdown()
        sched.shutdown()


def test_shutdown_ends_copies_before_unpinning(registry, producers,
                                               standin, fake, monkeypatch):
    reg = registry()
    h = steps.mm_hash("gpu-shutdown")
    producers(reg.url, [h])
    cfg = gpu_config(reg.url)
    sched = ECXConnector(cfg, ECConnectorRole.SCHEDULER)
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    standin.latency_s = 0.3
    seen = []
    unregister = fake.drv.unregister
    monkeypatch.setattr(fake.drv, "unregister", lambda *a: (
        seen.append(standin.copies - standin.copied), unregister(*a))[1])
    cache, waiting = {}, [steps.Request("r", [h])]
    deadline = time.monotonic() + 10
    while waiting and time.monotonic() < deadline:
        step(sched, w, cache, waiting)
    assert standin.copies == 1 and standin.copied == 0
    base, size = w._worker._consumer.arena()
    w.shutdown()
    assert standin.copied == 1  # drained before anything was closed
    cache.clear()
    gc.collect()  # the arena goes with its last tensor
    assert seen == [0] and not fake.registered(base, size)
    sched.shutdown()


# ---- the producer's saves --------------------------------------------------


def test_saves_commit_once_their_copies_completed(registry, standin):
    reg = registry()
    w = ECXConnector(gpu_config(reg.url, role="ec_producer"),
                     ECConnectorRole.WORKER)
    assert w._worker._saves is not None and w._worker._producer._cuda_pinned
    client = ecx.Client(reg.url, token="tok")
    h = steps.mm_hash("saved-0")
    src = standin.tensor(steps.expected(h))
    busy = standin.busy()  # the encoder's kernels, still running
    t0 = time.perf_counter()
    w.save_caches({h: src}, h)
    w.save_caches({h: src}, h)  # again while under way: nothing more
    assert time.perf_counter() - t0 < 0.1
    time.sleep(0.3)
    # The copy waits for the compute stream: nothing is published yet.
    assert client.lookup([h])[0] is None
    assert w._worker._saves.pending == 1 and standin.copied == 0
    busy.set()
    deadline = time.monotonic() + 5
    while client.lookup([h])[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    it = client.lookup([h])[0]
    assert it is not None and standin.copies == 1
    with ecx.Consumer(reg.url, token="tok") as c:
        (got,) = c.load([it])
    assert torch.equal(got.view(torch.uint8),
                       steps.expected(h).view(torch.uint8))
    client.close()
    w.shutdown()


def test_save_caches_never_raises(registry, standin, caplog):
    reg = registry()
    w = ECXConnector(gpu_config(reg.url, role="ec_producer"),
                     ECConnectorRole.WORKER)
    client = ecx.Client(reg.url, token="tok")
    odd = steps.mm_hash("complex")
    w.save_caches({odd: torch.zeros(4, dtype=torch.complex64)}, odd)
    assert "not saving" in caplog.text and "complex64" in caplog.text
    h = steps.mm_hash("cuda-error")
    src = standin.tensor(steps.expected(h))
    standin.fail_next_copy = RuntimeError("CUDA error: an illegal memory "
                                          "access was encountered")
    w.save_caches({h: src}, h)
    assert "illegal memory access" in caplog.text
    w.save_caches({h: src}, h)  # its reservation was given back
    deadline = time.monotonic() + 5
    while client.lookup([h])[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.lookup([h])[0] is not None
    assert client.lookup([odd])[0] is None
    client.close()
    w.shutdown()


# ---- where tensors go, and a start that fails ------------------------------


def test_each_rank_uses_its_own_gpu(registry, standin, caplog):
    reg = registry()
    standin.index = 1  # this rank's device
    w = ECXConnector(gpu_config(reg.url, device="cuda:0"),
                     ECConnectorRole.WORKER)
    assert w._worker._buffer_device == torch.device("cuda", 1)
    assert "runs on cuda:1" in caplog.text
    w.shutdown()
    w = ECXConnector(gpu_config(reg.url, device="cuda"),
                     ECConnectorRole.WORKER)
    assert w._worker._buffer_device == torch.device("cuda", 1)
    w.shutdown()


def test_cpu_buffers_are_refused_where_the_model_runs_on_cuda(registry):
    reg = registry()
    cfg = gpu_config(reg.url, device="cpu")
    cfg.device_config = types.SimpleNamespace(device_type="cuda")
    with pytest.raises(ValueError, match="model runs on CUDA"):
        ECXConnector(cfg, ECConnectorRole.WORKER)
    cfg.device_config = types.SimpleNamespace(device_type="cpu")
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    assert w._worker._buffer_device == torch.device("cpu") and w._worker._copies is None
    w.shutdown()


def test_a_failed_pin_fails_the_start(registry, standin, fake):
    reg = registry()
    fake.set("force_register", 2)
    for role in ("ec_consumer", "ec_producer"):
        with pytest.raises(RuntimeError, match=r"CUDA_ERROR_OUT_OF_MEMORY "
                           r"\(2\)"):
            ECXConnector(gpu_config(reg.url, role=role),
                         ECConnectorRole.WORKER)


def test_cuda_without_a_device_fails_the_start(registry, monkeypatch):
    reg = registry()
    api = StandInCuda()
    api.available = lambda: False
    monkeypatch.setattr(ecx.vllm.worker, "_device_api", lambda: api)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ECXConnector(gpu_config(reg.url), ECConnectorRole.WORKER)


GPU_DIR = os.path.join(HERE, "..", "gpu")


def run_check(**env):
    return subprocess.run(["bash", os.path.join(GPU_DIR, "check.sh")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_the_check_skips_cleanly_without_a_gpu():
    """tests/gpu/check.sh exits 77 (a skip) where no GPU is, and its
    Python compiles."""
    if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi"):
        pytest.skip("a GPU is here: gpu.check runs for real")
    r = run_check()
    assert r.returncode == 77, r.stdout + r.stderr
    assert r.stdout.startswith("skipped: no GPU here")
    for f in os.listdir(GPU_DIR):
        if f.endswith(".py"):
            subprocess.run([sys.executable, "-m", "py_compile",
                            os.path.join(GPU_DIR, f)], check=True)


def test_the_check_fails_where_a_gpu_is_but_torch_cannot_use_it():
    """A GPU here (ECX_GPU_PRESENT=1 stands for one) with no interpreter,
    no torch, an old torch, or a torch without CUDA is a failure with a
    message that says what to do, never a skip."""
    r = run_check(ECX_GPU_PRESENT="1", ECX_PYTHON="/nonexistent/python")
    assert r.returncode == 1 and "not an interpreter" in r.stdout
    sys.path.insert(0, GPU_DIR)
    try:
        import check
    finally:
        sys.path.remove(GPU_DIR)
    if check.torch_problem(torch) is not None:  # else it would run for real
        r = run_check(ECX_GPU_PRESENT="1", ECX_PYTHON=sys.executable)
        assert r.returncode == 1, r.stdout
        assert r.stdout == f"FAIL: {check.torch_problem(torch)}\n"
    old = types.SimpleNamespace(__version__="2.0.1",
                                bfloat16=types.SimpleNamespace())
    assert "older than 2.1" in check.torch_problem(old)
    cpu = types.SimpleNamespace(
        __version__="2.4.0+cpu", bfloat16=types.SimpleNamespace(itemsize=2),
        float8_e4m3fn=object(), version=types.SimpleNamespace(cuda=None),
        cuda=types.SimpleNamespace(is_available=lambda: False))
    assert "cannot use it" in check.torch_problem(cpu)
    cpu.cuda.is_available = lambda: True
    assert check.torch_problem(cpu) is None


def test_threads_left():
    """The commit threads of the saves above have ended."""
    gc.collect()
    assert not [t for t in threading.enumerate()
                if t.name == "ecx-commit" and t.is_alive()]


def test_a_close_that_gives_up_commits_nothing_after(registry, standin):
    # shutdown destroys the producer once Saves.close returns: a commit
    # after it would use a freed producer.
    reg = registry()
    w = ECXConnector(gpu_config(reg.url, role="ec_producer"),
                     ECConnectorRole.WORKER)
    saves = w._worker._saves
    h = steps.mm_hash("late-0")
    busy = standin.busy()  # its copy waits for the compute stream
    w.save_caches({h: standin.tensor(steps.expected(h))}, h)
    assert saves.close(timeout_s=0.2) == 1
    busy.set()
    deadline = time.monotonic() + 2
    while standin.copied == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert standin.copied == 1 and saves.committed == 0
    # The commit thread ran on the saving device, not on device 0.
    assert standin.used_device == w._worker._saves._device
    w.shutdown()
