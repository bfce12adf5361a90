"""GPU tensors through ecx, one copy each side, where a CUDA device is.

Producer: put() of a CUDA tensor copies it from the device straight into
its place in the page-locked arena (reserve, copy_, commit). Consumer: the
load lands in the page-locked receive arena, then goes to the device with
non_blocking=True on a side stream, awaited before the tensor is read.
Every dtype round-trips byte for byte; then GB/s of save and load, each
beside torch's own copy through pinned memory of the same bytes, measured
in the same run, alternating. Exits 77 ("skipped: no CUDA device") where
there is none, so ctest reports a skip, not a pass.
"""
import statistics
import sys
import time

import torch

import ecx

if not torch.cuda.is_available():
    print("skipped: no CUDA device (torch.cuda.is_available() is False)")
    sys.exit(77)

dev = torch.device("cuda")
side = torch.cuda.Stream()
MiB = 1 << 20


def to_device(t):
    """Arena tensor -> device, on the side stream, awaited."""
    with torch.cuda.stream(side):
        g = t.to(dev, non_blocking=True)
    side.synchronize()
    return g


def rand(dtype, n, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, device=dev).bool()
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(n, generator=g, device=dev).to(dtype)
    return torch.randint(0, 100, (n,), generator=g, device=dev).to(dtype)


p = ecx.Producer(capacity_bytes=1 << 30, bind_host="127.0.0.1",
                 registry_port=0)
c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}",
                 recv_capacity=512 << 20)
assert c.pin_for_cuda(), "cudaHostRegister of the receive arena failed"

bad = 0
for i, name in enumerate(ecx.DTYPES):
    dt = getattr(torch, name, None)
    if dt is None:
        continue
    src = rand(dt, (1 << 20) // dt.itemsize + 3, i)
    assert p.put(f"gpu-{name}", src)
    (got,) = c.load(c.lookup([f"gpu-{name}"]))
    back = to_device(got)
    same = torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    print(f"{'ok' if same else 'FAIL'} - {name} round trip, "
          f"{src.numel() * dt.itemsize} bytes")
    bad += not same


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


size = 7 * MiB
src = rand(torch.bfloat16, size // 2, 99)
pinned = torch.empty(size // 2, dtype=torch.bfloat16, pin_memory=True)
rows = {"save: ecx put from the GPU": [], "save: torch D2H, pinned": [],
        "load: ecx load + H2D": [], "load: torch H2D, pinned": []}
for r in range(20):
    t0 = time.perf_counter()
    p.put(f"bench-{r}", src)
    rows["save: ecx put from the GPU"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    pinned.copy_(src)
    rows["save: torch D2H, pinned"].append(time.perf_counter() - t0)
    found = c.lookup([f"bench-{r}"])
    t0 = time.perf_counter()
    (got,) = c.load(found)
    g = to_device(got)
    rows["load: ecx load + H2D"].append(time.perf_counter() - t0)
    del got, g
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        g = pinned.to(dev, non_blocking=True)
    side.synchronize()
    rows["load: torch H2D, pinned"].append(time.perf_counter() - t0)
    p.remove(f"bench-{r}")

print(f"# 7 MiB bfloat16, 20 rounds, medians (GB/s), same run:")
med = {k: gbps(size, statistics.median(v)) for k, v in rows.items()}
for k, v in med.items():
    print(f"#   {k:30s} {v:7.2f}")
print(f"# save {med['save: ecx put from the GPU'] / med['save: torch D2H, pinned']:.2f}x "
      f"torch's pinned D2H; load "
      f"{med['load: ecx load + H2D'] / med['load: torch H2D, pinned']:.2f}x "
      f"torch's pinned H2D (ecx's includes the transfer between processes)")
c.close()
p.close()
sys.exit(1 if bad else 0)
