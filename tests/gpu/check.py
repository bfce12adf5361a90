"""ecx's CUDA path on a real GPU, in one go (tests/gpu/check.sh runs it).

The producer runs in a process of its own (producer.py); this process is
the consumer. Each row of the table printed at the end is one check:

- torch: >= 2.1 (dtype.itemsize, float8) with CUDA usable; otherwise a
  failure (check.sh runs this only where a GPU is).
- pin (issue 27 item 1): memory registered already (cudaHostRegister, as
  a UCX built with CUDA does) is taken as pinned-not-ours by ecx.cuda.pin,
  and a kernel launched after that runs; never unregistered by ecx. The
  old way (cudaHostRegister twice through torch's cudart, then a kernel)
  is shown beside it, not asserted.
- arenas: both are page-locked (cuMemHostGetFlags at both ends, torch's
  is_pinned on a tensor over them).
- dtypes: every dtype ecx carries round-trips byte for byte, GPU to GPU.
- save: ecx's put from the GPU >= 0.7x torch's D2H into pinned memory;
  load: the H2D copy from the receive arena >= 0.8x torch's H2D from its
  own pinned memory (medians, same run, alternating).
- connector: ECXConnector with ec_buffer_device="cuda", both flows, each
  step taken while the compute stream is busy (torch.cuda._sleep): no step
  waits for it (the stream is still busy when the step returns), and every
  tensor handed over has its item's bytes.
- reuse (item 2): the same with the connector's copy stream held back, so
  arena ranges would be reused before their DMAs read them if they were
  not kept.
- producer (item 6): save_caches returns at once while the compute stream
  is busy, and the items are published once their copies have completed.
- second GPU (item 4), where there is one: a rank on cuda:1 gets its
  tensors on cuda:1 whatever ec_buffer_device says.
"""
import os
import pickle
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.path.join(HERE, "..", "python", "vllm_stub")
MiB = 1 << 20
STEP_SLEEP_MS = 60
ROWS = []


def row(name, value, want, ok):
    ROWS.append((name, value, want, ok))
    return ok


def table():
    print(f"{'check':58s} {'value':>14s} {'want':>14s}  result")
    for name, value, want, ok in ROWS:
        res = "ok" if ok is True else ("FAIL" if ok is False else "info")
        print(f"{name:58s} {value:>14s} {want:>14s}  {res}")
    bad = sum(1 for r in ROWS if r[3] is False)
    print(f"# {len(ROWS)} rows, {bad} failed")
    return bad


def torch_problem(torch):
    """Why this torch cannot run the check, or None."""
    nums = [int(x) for x in re.findall(r"\d+", torch.__version__)[:2]]
    if tuple(nums) < (2, 1) or not hasattr(torch.bfloat16, "itemsize") \
            or not hasattr(torch, "float8_e4m3fn"):
        return (f"torch {torch.__version__} is older than 2.1, which this "
                f"check needs (dtype.itemsize, torch.float8_e4m3fn): point "
                f"ECX_PYTHON at vLLM's environment")
    if not torch.cuda.is_available():
        return (f"a GPU is here but torch {torch.__version__} (CUDA "
                f"{torch.version.cuda}) cannot use it: "
                f"torch.cuda.is_available() is False (a CPU build of torch? "
                f"CUDA_VISIBLE_DEVICES? the driver?)")
    return None


def preflight():
    try:
        import torch
    except ImportError as e:
        return None, (f"{sys.executable} cannot import torch ({e}): point "
                      f"ECX_PYTHON at vLLM's environment")
    return torch, torch_problem(torch)


# ---- pinning (item 1) ------------------------------------------------------

OLD_WAY = r"""
import ctypes, mmap, torch
torch.ones(1, device="cuda")
m = mmap.mmap(-1, 1 << 24)
b = ctypes.addressof(ctypes.c_char.from_buffer(m))
cr = torch.cuda.cudart()
cr.cudaHostRegister(b, 1 << 24, 0)
r = cr.cudaHostRegister(b, 1 << 24, 0)
try:
    torch.ones(4, device="cuda").mul_(2).sum().item()
    print("kernel ran, second register", int(r))
except Exception as e:
    print("kernel raised", type(e).__name__, "second register", int(r))
"""


def check_pin(torch, ecx):
    import ctypes
    import mmap
    size = 64 * MiB
    m = mmap.mmap(-1, size)
    holder = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(holder)
    cr = torch.cuda.cudart()
    rc = int(cr.cudaHostRegister(base, size, 0))  # someone else's pin
    ok = True
    try:
        pin = ecx.cuda.pin(base, size, "check's range")
        ok = pin is not None and not pin.ours
        x = torch.ones(1 << 20, device="cuda")
        y = (x * 2).sum().item()  # a kernel launch after the 712
        ok = ok and y == 2 * (1 << 20)
        ecx.cuda.unpin(pin)
        still = ecx.cuda.driver().host_flags(base) is not None
        row("pin: already registered (712) is pinned-not-ours, "
            "kernel runs", f"rc {rc}", "no raise", ok)
        row("pin: ecx never unregisters what is not its own",
            str(still), "True", still)
    except Exception as e:  # noqa: BLE001 - a row, not a crash
        row("pin: already registered (712), then a kernel",
            type(e).__name__, "no raise", False)
        print(f"# pin: {e}")
    finally:
        cr.cudaHostUnregister(base)
        del holder
        m.close()
    r = subprocess.run([sys.executable, "-c", OLD_WAY], capture_output=True,
                       text=True, timeout=60)
    said = "raised" if "raised" in r.stdout else (
        "ran" if "ran" in r.stdout else f"rc {r.returncode}")
    row("pin: old way (cudaHostRegister twice, then a kernel)", said, "",
        None)
    print(f"# old way: {r.stdout.strip()} {r.stderr.strip()[-200:]}")


# ---- the producer process --------------------------------------------------


def start_producer():
    import json
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE,
                                                          "producer.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer process ended (rc "
                               f"{proc.wait()}) before it was ready")
        if line.startswith("{"):
            return proc, json.loads(line)


# ---- the consumer ----------------------------------------------------------


def h2d(torch, t, side):
    with torch.cuda.stream(side):
        g = t.to("cuda", non_blocking=True)
    side.synchronize()
    return g


def check_arenas_and_dtypes(torch, ecx, prod, c):
    import ctypes
    import producer as P
    flags = prod["arena_flags"]
    row("producer arena page-locked (cuMemHostGetFlags, both ends)",
        str(flags), "not None", None not in flags)
    row("producer arena: torch is_pinned on a tensor over it",
        str(prod["arena_is_pinned"]), "True", prod["arena_is_pinned"])
    row("producer arena pin time (1 GiB), s", f"{prod['pin_s']:.2f}", "",
        None)
    base, size = c.arena()
    drv = ecx.cuda.driver()
    ends = [drv.host_flags(base), drv.host_flags(base + size - 1)]
    row("receive arena page-locked (cuMemHostGetFlags, both ends)",
        str(ends), "not None", None not in ends)
    t = torch.frombuffer((ctypes.c_char * size).from_address(base),
                         dtype=torch.uint8)
    pinned = bool(t.is_pinned())
    del t
    row("receive arena: torch is_pinned on a tensor over it", str(pinned),
        "True", pinned)
    side = torch.cuda.Stream()
    bad = []
    for i, name in enumerate(ecx.DTYPES):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        (got,) = c.load(c.lookup([f"dtype-{name}"]))
        back = h2d(torch, got, side)
        want = P.rand(torch, dt, MiB // dt.itemsize + 3, i)
        if not torch.equal(back.view(torch.uint8), want.view(torch.uint8)):
            bad.append(name)
    row("every dtype round-trips GPU -> GPU, byte for byte",
        f"{len(prod['dtypes']) - len(bad)}/{len(prod['dtypes'])}",
        "all", not bad and len(prod["dtypes"]) == len(ecx.DTYPES))


def check_speed(torch, prod, c):
    import producer as P
    ratio = prod["save_ecx_gbps"] / prod["save_torch_gbps"]
    row("save: ecx put from the GPU, GB/s", f"{prod['save_ecx_gbps']:.2f}",
        "", None)
    row("save: torch D2H into pinned memory, GB/s",
        f"{prod['save_torch_gbps']:.2f}", "", None)
    row("save: ecx / torch (medians, same run)", f"{ratio:.2f}x", ">= 0.70x",
        ratio >= 0.7)
    side = torch.cuda.Stream()
    n = P.BENCH_BYTES // 2
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    arena_s, torch_s, load_s = [], [], []
    for r in range(P.BENCH_ROUNDS + 1):
        found = c.lookup([f"bench-load-{r}"])
        t0 = time.perf_counter()
        (got,) = c.load(found)
        t1 = time.perf_counter()
        h2d(torch, got, side)
        t2 = time.perf_counter()
        h2d(torch, pinned, side)
        t3 = time.perf_counter()
        del got
        if r:
            load_s.append(t1 - t0)
            arena_s.append(t2 - t1)
            torch_s.append(t3 - t2)
    gb = P.BENCH_BYTES / 1e9
    a, t = gb / statistics.median(arena_s), gb / statistics.median(torch_s)
    row("load: ecx load between processes, GB/s",
        f"{gb / statistics.median(load_s):.2f}", "", None)
    row("load: H2D from the receive arena, GB/s", f"{a:.2f}", "", None)
    row("load: torch H2D from its pinned memory, GB/s", f"{t:.2f}", "", None)
    row("load: arena H2D / torch's (medians, same run)", f"{a / t:.2f}x",
        ">= 0.80x", a / t >= 0.8)


def connector(url, async_load, recv="256MiB", device="cuda"):
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorRole)
    from ecx.vllm import ECXConnector
    import producer as P
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm",
        ec_role="ec_consumer", ec_buffer_device=device,
        ec_connector_extra_config={"remote_registry_url": url,
                                   "token": P.TOKEN, "timeout_ms": 5000,
                                   "load_timeout_s": 20,
                                   "recv_capacity_bytes": recv,
                                   "async_load": async_load}))
    return (ECXConnector(cfg, ECConnectorRole.SCHEDULER),
            ECXConnector(cfg, ECConnectorRole.WORKER))


class Req:
    def __init__(self, rid, h):
        feat = type("F", (), {})()
        feat.identifier = h
        self.request_id, self.mm_features = rid, [feat]
        self.remote = {}

    def get_num_encoder_embeds(self, index):
        return 1


def step(sched, w, cache, waiting):
    from vllm.v1.outputs import ECConnectorOutput
    for req in list(waiting):
        if not sched.ensure_cache_available(req, 0):
            continue
        for f in req.mm_features:
            req.remote[f.identifier] = sched.has_cache_item(f.identifier)
        sched.update_state_after_alloc(req, 0)
        waiting.remove(req)
    w.bind_connector_metadata(pickle.loads(pickle.dumps(
        sched.build_connector_meta(object()))))
    w.start_load_caches(cache)
    wm = pickle.loads(pickle.dumps(w.build_connector_worker_meta()))
    w.clear_connector_metadata()
    sched.update_connector_output(ECConnectorOutput(
        ec_connector_worker_meta=wm))
    return sched.take_unavailable_requests()


def run_requests(torch, sched, w, ids, cycles, hold_side=0):
    """One request per id, in turn, each step after STEP_SLEEP_MS of
    compute queued (and hold_side cycles on the copy stream); returns
    (handed tensors, slowest step s, steps that returned with the compute
    stream idle, requests given up)."""
    handed, slowest, idle, lost = {}, 0.0, 0, set()
    cur = torch.cuda.current_stream()
    for k, h in enumerate(ids):
        req, cache = Req(f"r{k}", h), {}
        waiting = [req]
        deadline = time.monotonic() + 20
        while (waiting or h not in cache) and time.monotonic() < deadline \
                and not lost:
            torch.cuda._sleep(cycles)
            copies = w._worker._copies
            if hold_side and copies is not None and copies._side:
                with torch.cuda.stream(copies._side):
                    torch.cuda._sleep(hold_side)
            t0 = time.perf_counter()
            lost |= step(sched, w, cache, waiting)
            slowest = max(slowest, time.perf_counter() - t0)
            idle += bool(cur.query())
            if waiting or h not in cache:
                time.sleep(0.002)
        if h in cache:
            handed[h] = cache.pop(h)
        sched.update_state_after_free(req, 0)
        sched.request_finished(req)
    step(sched, w, {}, [])
    return handed, slowest, idle, lost


def check_connector(torch, prod):
    import producer as P
    url = prod["conn_registry"]
    cycles = P.sleep_cycles(torch, STEP_SLEEP_MS)
    ids = [(P.conn_id(s), s, rows) for s, rows in P.CONNECTOR_ITEMS]
    row("producer: save_caches while compute is busy, slowest ms",
        f"{prod['save_caches_max_ms']:.2f}", "< 20",
        prod["save_caches_max_ms"] < 20 and prod["save_caches_busy_after"])
    row("producer: nothing published before its copy completed",
        f"{prod['saves_pending_while_busy']} pending",
        f"{len(ids)} pending",
        prod["saves_pending_while_busy"] == len(ids))
    row("producer: every save published after", str(prod["saves_committed"]),
        str(len(ids)), prod["saves_committed"] == len(ids))
    for async_load in (True, False):
        flow = "async" if async_load else "sync"
        for hold, recv in ((0, "256MiB"), (4 * cycles, "64MiB")):
            sched, w = connector(url, async_load, recv)
            try:
                # Warm-up: the first pull's handshake, the side stream.
                run_requests(torch, sched, w, [ids[0][0]], 0)
                torch.cuda.synchronize()
                handed, slowest, idle, lost = run_requests(
                    torch, sched, w, [i for i, _, _ in ids[1:]], cycles,
                    hold)
                torch.cuda.synchronize()
                bad = [h for h, s, rows in ids[1:]
                       if h not in handed or not torch.equal(
                           handed[h].view(torch.uint8),
                           P.connector_tensor(torch, s, rows)
                           .view(torch.uint8))]
                what = "reuse, copies held back" if hold else "busy compute"
                row(f"connector {flow} ({what}): slowest step, ms",
                    f"{slowest * 1e3:.1f}", f"< {STEP_SLEEP_MS}",
                    slowest * 1e3 < STEP_SLEEP_MS)
                row(f"connector {flow} ({what}): steps that waited",
                    str(idle), "0", idle == 0)
                row(f"connector {flow} ({what}): bytes equal",
                    f"{len(ids) - 1 - len(bad)}/{len(ids) - 1}", "all",
                    not bad and not lost)
                on = {str(t.device) for t in handed.values()}
                row(f"connector {flow} ({what}): on", ",".join(sorted(on)),
                    "cuda:0", on == {"cuda:0"})
            finally:
                w.shutdown()
                sched.shutdown()


def check_second_gpu(torch, prod):
    import producer as P
    if torch.cuda.device_count() < 2:
        row("second GPU: a rank on cuda:1 gets cuda:1 tensors", "1 GPU",
            "", None)
        return
    s, rows = P.CONNECTOR_ITEMS[0]
    h = P.conn_id(s)
    want = P.connector_tensor(torch, s, rows).cpu()
    torch.cuda.set_device(1)
    try:
        sched, w = connector(prod["conn_registry"], True, "64MiB",
                             device="cuda:0")
        handed, _, _, _ = run_requests(torch, sched, w, [h], 0)
        torch.cuda.synchronize()
        t = handed.get(h)
        ok = t is not None and t.device == torch.device("cuda", 1) and \
            torch.equal(t.cpu().view(torch.uint8), want.view(torch.uint8))
        row("second GPU: ec_buffer_device cuda:0, rank on cuda:1",
            str(t.device) if t is not None else "missing", "cuda:1", ok)
        w.shutdown()
        sched.shutdown()
    finally:
        torch.cuda.set_device(0)


def guarded(name, fn, *args):
    """Runs one check; an exception is a failed row, and the rest run."""
    import traceback
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        row(f"{name}: raised", type(e).__name__, "no raise", False)
        return None


def main():
    t_start = time.monotonic()
    torch, problem = preflight()
    if problem:
        print(f"FAIL: {problem}")
        return 1
    sys.path.insert(0, STUB)
    import ecx
    import ecx.cuda
    print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; "
          f"{sys.executable}")
    guarded("pin", check_pin, torch, ecx)
    started = guarded("producer process", start_producer)
    if started is not None:
        proc, prod = started
        try:
            c = ecx.Consumer(prod["registry"], token="gpu-check",
                             recv_capacity=512 * MiB)
            c.pin_for_cuda(required=True)
            guarded("arenas, dtypes", check_arenas_and_dtypes, torch, ecx,
                    prod, c)
            guarded("speed", check_speed, torch, prod, c)
            c.close()
            guarded("connector", check_connector, torch, prod)
            guarded("second GPU", check_second_gpu, torch, prod)
        finally:
            proc.stdin.close()
            proc.wait(30)
    row("the check's own time, s", f"{time.monotonic() - t_start:.0f}",
        "< 300", time.monotonic() - t_start < 300)
    return 1 if table() else 0


if __name__ == "__main__":
    sys.exit(main())
