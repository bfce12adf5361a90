"""The producer process of tests/gpu/check.py (run by it, never alone).

Holds, in a page-locked arena, CUDA tensors of every dtype and the load
benchmark's items; measures ecx's put from the GPU beside torch's own D2H
copy into pinned memory; and saves items through ECXConnector (ec_producer)
while the compute stream is busy. Prints one JSON line with what it found,
then serves until its stdin closes.

Every tensor is rand(dtype, n, seed) on the GPU: the consumer makes the
same ones to compare bytes.
"""
import ctypes
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# vLLM's base class as tests/python has it: the check is of ecx, not vLLM.
STUB = os.path.join(HERE, "..", "python", "vllm_stub")

TOKEN = "gpu-check"
MiB = 1 << 20
BENCH_BYTES = 32 * MiB
BENCH_ROUNDS = 15
# The connector's items: (seed, rows) of width 3584 bfloat16.
CONNECTOR_ITEMS = [(1000 + k, (529, 1369, 2691)[k % 3]) for k in range(9)]


def rand(torch, dtype, n, seed):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, device=dev).bool()
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(n, generator=g, device=dev).to(dtype)
    if dtype.is_floating_point:  # float8: from small floats
        return (torch.randn(n, generator=g, device=dev) * 4).to(dtype)
    return torch.randint(0, 100, (n,), generator=g, device=dev).to(dtype)


def connector_tensor(torch, seed, rows):
    return rand(torch, torch.bfloat16, rows * 3584, seed).view(rows, 3584)


def conn_id(seed):
    return f"{seed:064x}"


def sleep_cycles(torch, ms):
    """torch.cuda._sleep's cycles for about ms milliseconds here."""
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    e.synchronize()
    return int(20_000_000 / max(s.elapsed_time(e), 1e-3) * ms)


def main():
    sys.path.insert(0, STUB)
    import torch

    import ecx
    import ecx.cuda
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorRole)
    from ecx.vllm import ECXConnector

    out = {}
    p = ecx.Producer(capacity_bytes=1 << 30, bind_host="127.0.0.1",
                     registry_port=0, token=TOKEN)
    t0 = time.perf_counter()
    p.pin_for_cuda(required=True)
    out["pin_s"] = time.perf_counter() - t0
    base, size = p.arena()
    out["pin_ours"] = p._cuda_pinned.ours
    drv = ecx.cuda.driver()
    out["arena_flags"] = [drv.host_flags(base), drv.host_flags(base + size
                                                               - 1)]
    arena = torch.frombuffer((ctypes.c_char * size).from_address(base),
                             dtype=torch.uint8)
    out["arena_is_pinned"] = bool(arena.is_pinned())
    del arena
    out["registry"] = f"http://127.0.0.1:{p.registry_port}"

    # Every dtype, 1 MiB and a bit.
    out["dtypes"] = []
    for i, name in enumerate(ecx.DTYPES):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        p.put(f"dtype-{name}", rand(torch, dt, MiB // dt.itemsize + 3, i))
        out["dtypes"].append(name)

    # Saving: ecx's put from the GPU vs torch's D2H into pinned memory,
    # alternating, medians.
    n = BENCH_BYTES // 2
    src = rand(torch, torch.bfloat16, n, 77)
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    torch.cuda.synchronize()
    put_s, torch_s = [], []
    for r in range(BENCH_ROUNDS + 1):
        t0 = time.perf_counter()
        p.put(f"bench-save-{r}", src)
        t1 = time.perf_counter()
        pinned.copy_(src)
        t2 = time.perf_counter()
        p.remove(f"bench-save-{r}")
        if r:  # the first is a warm-up
            put_s.append(t1 - t0)
            torch_s.append(t2 - t1)
    out["save_ecx_gbps"] = BENCH_BYTES / statistics.median(put_s) / 1e9
    out["save_torch_gbps"] = BENCH_BYTES / statistics.median(torch_s) / 1e9
    for r in range(BENCH_ROUNDS + 1):
        p.put(f"bench-load-{r}", rand(torch, torch.bfloat16, n, 500 + r))

    # The connector's producer: save_caches while the compute stream is
    # busy returns at once, and publishes once the copy has completed.
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
        ec_role="ec_producer", ec_buffer_device="cuda",
        ec_connector_extra_config={"registry_http_port": 0,
                                   "bind_host": "127.0.0.1",
                                   "token": TOKEN,
                                   "capacity_bytes": "512MiB"}))
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    out["conn_registry"] = \
        f"http://127.0.0.1:{w._worker._producer.registry_port}"
    items = [(conn_id(s), connector_tensor(torch, s, rows))
             for s, rows in CONNECTOR_ITEMS]
    cur = torch.cuda.current_stream()
    torch.cuda._sleep(sleep_cycles(torch, 300))  # the encoder, still busy
    slowest = 0.0
    for h, t in items:
        t0 = time.perf_counter()
        w.save_caches({h: t}, h)
        slowest = max(slowest, time.perf_counter() - t0)
    out["save_caches_max_ms"] = slowest * 1e3
    out["save_caches_busy_after"] = not cur.query()
    out["saves_pending_while_busy"] = w._worker._saves.pending
    deadline = time.monotonic() + 10
    while w._worker._saves.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    out["saves_committed"] = w._worker._saves.committed
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    w.shutdown()
    p.close()


if __name__ == "__main__":
    main()
