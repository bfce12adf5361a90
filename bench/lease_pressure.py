#!/usr/bin/python3
"""Leases under eviction pressure through ECXConnector's synchronous flow,
as an older vLLM drives it (tests/python/vllm_stub_old: no
update_state_after_free, no request_finished); FLOW=today runs today's
flow instead (tests/python/vllm_stub: ensure_cache_available, background
pulls, the workers' reports LAG_MS late), for comparison.

A producer connector in another process saves a new 1 MiB item every
2 ms into a 32 MiB arena (so an item lives about 60 ms, less what leases
hold). The consumer's scheduler runs a step every 2 ms: a new request
arrives each step for an item saved AGE_MS ago, waits WAIT steps (asked
again each step, as vLLM asks a waiting request's items every step) and
is then scheduled; its load runs LAG_MS after its lookup (the worker
loads the step's metadata then). It prints lookups, hits, loads and
failed loads, and the cost of a lookup: the leased scheduler's
has_cache_item beside an unleased one (lease_ms 0) asked for the same id
right after, in the same steps.

    PYTHONPATH=python ECX_LIBRARY=build/libecx.so bench/lease_pressure.py
    SECONDS=15 AGE_MS=10 LAG_MS=20 WAIT=3 LEASE_MS=30000 FLOW=sync

With LEASE_MS=0 the loads are unprotected: failed loads show the window
the leases close."""
import mmap
import os
import pickle
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FLOW = os.environ.get("FLOW", "sync")
STUB = os.path.join(HERE, "..", "tests", "python",
                    "vllm_stub" if FLOW == "today" else "vllm_stub_old")
sys.path.insert(0, STUB)
from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)

from ecx.vllm import ECXConnector  # noqa: E402

SECONDS = float(os.environ.get("SECONDS", "15"))
AGE_MS = float(os.environ.get("AGE_MS", "10"))
LAG_MS = float(os.environ.get("LAG_MS", "20"))
WAIT = int(os.environ.get("WAIT", "3"))
LEASE_MS = int(os.environ.get("LEASE_MS", "30000"))
STEP_S = 0.002
SAVE_S = 0.002

PRODUCER = """
import mmap, struct, sys, time, torch
sys.path.insert(0, %(stub)r)
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from ecx.vllm import ECXConnector
cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
    ec_connector="ECXConnector", ec_role="ec_producer", ec_buffer_device="cpu",
    ec_connector_extra_config={"registry_http_port": 0,
                               "bind_host": "127.0.0.1",
                               "capacity_bytes": 32 << 20}))
w = ECXConnector(cfg, ECConnectorRole.WORKER)
f = open(%(progress)r, "r+b")
last = mmap.mmap(f.fileno(), 8)
src = torch.randn(512, 1024).to(torch.bfloat16)  # 1 MiB
print("ready", w._worker._producer.registry_port, flush=True)
t0 = time.monotonic()
k = 0
while time.monotonic() - t0 < %(seconds)f:
    h = "lp-%%d" %% k
    w.save_caches({h: src}, h)
    last[:8] = struct.pack("q", k)
    k += 1
    pause = t0 + k * %(save_s)f - time.monotonic()
    if pause > 0:
        time.sleep(pause)
print("saved", k, "evictions", w._worker._producer.stats()["evictions"],
      flush=True)
sys.stdin.read()
w.shutdown()
"""


class Feature:
    def __init__(self, h):
        self.identifier = h


class Request:
    def __init__(self, rid, h):
        self.request_id = rid
        self.mm_features = [Feature(h)]

    def get_num_encoder_embeds(self, i):
        return 512


def config(url, lease_ms, async_load=False):
    return VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_consumer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={"remote_registry_url": url,
                                   "recv_capacity_bytes": "64MiB",
                                   "timeout_ms": 2000,
                                   "lease_ms": lease_ms,
                                   "async_load": async_load}))


def main():
    tmp = tempfile.NamedTemporaryFile(prefix="ecx-lease-", delete=False)
    tmp.write(struct.pack("q", -1))
    tmp.close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    code = PRODUCER % {"stub": STUB, "progress": tmp.name,
                       "seconds": SECONDS + 2, "save_s": SAVE_S}
    prod = subprocess.Popen([sys.executable, "-c", code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        (run_today if FLOW == "today" else run)(prod, tmp.name)
    finally:
        if prod.poll() is None:
            prod.stdin.close()
            prod.wait(30)
        os.unlink(tmp.name)


def run(prod, progress):
    line = prod.stdout.readline()
    while line and not line.startswith("ready"):
        line = prod.stdout.readline()
    url = "http://127.0.0.1:%d" % int(line.split()[1])
    f = open(progress, "rb")
    last = mmap.mmap(f.fileno(), 8, access=mmap.ACCESS_READ)
    sched = ECXConnector(config(url, LEASE_MS), ECConnectorRole.SCHEDULER)
    plain = ECXConnector(config(url, 0), ECConnectorRole.SCHEDULER)
    worker = ECXConnector(config(url, LEASE_MS), ECConnectorRole.WORKER)
    age = int(AGE_MS / 1000 / SAVE_S)
    while struct.unpack("q", last[:8])[0] < age + 5:
        time.sleep(0.01)
    waiting = []  # [request, steps waited]
    due = []      # (time, metadata)
    n = lookups = hits = scheduled = 0
    t_leased, t_plain = [], []
    t_start = time.monotonic()
    next_step = t_start
    while time.monotonic() - t_start < SECONDS:
        k = struct.unpack("q", last[:8])[0] - age
        waiting.append([Request("r%d" % n, "lp-%d" % k), 0])
        n += 1
        still = []
        for entry in waiting:
            req, steps = entry
            h = req.mm_features[0].identifier
            t0 = time.perf_counter()
            hit = sched.has_cache_item(h)
            t1 = time.perf_counter()
            plain.has_cache_item(h)
            t2 = time.perf_counter()
            lookups += 1
            hits += hit
            if steps == 0:  # the first ask of an id in a step
                t_leased.append(t1 - t0)
                t_plain.append(t2 - t1)
            if steps < WAIT:
                entry[1] += 1
                still.append(entry)
            elif hit:
                sched.update_state_after_alloc(req, 0)
                scheduled += 1
        waiting = still
        meta = sched.build_connector_meta(None)
        plain.build_connector_meta(None)
        if meta.loads:
            due.append((time.monotonic() + LAG_MS / 1000,
                        pickle.loads(pickle.dumps(meta))))
        while due and due[0][0] <= time.monotonic():
            worker.bind_connector_metadata(due.pop(0)[1])
            try:
                worker.start_load_caches({})
            except RuntimeError:
                pass  # counted as items_failed
            worker.clear_connector_metadata()
        next_step += STEP_S
        pause = next_step - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_step = time.monotonic()
    for _, meta in due:
        worker.bind_connector_metadata(meta)
        try:
            worker.start_load_caches({})
        except RuntimeError:
            pass
    ws = worker.stats()
    for c in (worker, sched, plain):
        c.shutdown()
    prod.stdin.close()
    saved = prod.stdout.readline().split()
    loaded = ws.get("items_loaded", 0)
    failed = ws.get("items_failed", 0)
    med = statistics.median
    lc, pc = med(t_leased), med(t_plain)
    print(f"sync flow (older vLLM), {SECONDS:g} s, a 1 MiB item saved "
          f"every {SAVE_S * 1e3:g} ms into a 32 MiB arena "
          f"({saved[1] if len(saved) > 1 else '?'} saved, "
          f"{saved[3] if len(saved) > 3 else '?'} evicted); requests for "
          f"items {AGE_MS:g} ms old, asked {WAIT + 1} steps, loads "
          f"{LAG_MS:g} ms after the lookup; lease_ms {LEASE_MS}")
    print(f"lookups {lookups}  hits {hits} ({100 * hits / max(lookups, 1):.1f}"
          f" %)  scheduled {scheduled}  loaded {loaded}  failed loads "
          f"{failed}")
    print(f"lookup (has_cache_item, first of its step), medians of "
          f"{len(t_leased)}: leased {lc * 1e3:.3f} ms, unleased "
          f"{pc * 1e3:.3f} ms, leased/unleased {lc / pc:.2f}x")


def run_today(prod, progress):
    """Today's flow: a request is looked up once (leased) when first
    offered, deferred until every rank holds its item, then scheduled and
    handed over; the worker runs each step's metadata LAG_MS late, so its
    pulls start and its reports arrive that late. A request the connector
    cannot serve comes out of take_unavailable_requests (a failed load)."""
    from vllm.v1.outputs import ECConnectorOutput
    line = prod.stdout.readline()
    while line and not line.startswith("ready"):
        line = prod.stdout.readline()
    url = "http://127.0.0.1:%d" % int(line.split()[1])
    f = open(progress, "rb")
    last = mmap.mmap(f.fileno(), 8, access=mmap.ACCESS_READ)
    sched = ECXConnector(config(url, LEASE_MS, True),
                         ECConnectorRole.SCHEDULER)
    worker = ECXConnector(config(url, LEASE_MS, True),
                          ECConnectorRole.WORKER)
    age = int(AGE_MS / 1000 / SAVE_S)
    while struct.unpack("q", last[:8])[0] < age + 5:
        time.sleep(0.01)
    waiting, due, done = [], [], []
    n = scheduled = unavailable = local = 0
    cache = {}
    t_start = time.monotonic()
    next_step = t_start
    while time.monotonic() - t_start < SECONDS:
        k = struct.unpack("q", last[:8])[0] - age
        waiting.append(Request("t%d" % n, "lp-%d" % k))
        n += 1
        gone = sched.take_unavailable_requests()
        unavailable += len(gone)
        still = []
        for req in waiting:
            if req.request_id in gone:
                continue
            if not sched.ensure_cache_available(req, 0):
                still.append(req)
                continue
            if sched.has_cache_item(req.mm_features[0].identifier):
                sched.update_state_after_alloc(req, 0)
                scheduled += 1
                done.append(req)
            else:
                local += 1  # not found: encoded here
        waiting = [r for r in still if r.request_id not in gone]
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(None)))
        due.append((time.monotonic() + LAG_MS / 1000, meta, done))
        done = []
        while due and due[0][0] <= time.monotonic():
            _, meta, finished = due.pop(0)
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(cache)
            wm = pickle.loads(pickle.dumps(
                worker.build_connector_worker_meta()))
            worker.clear_connector_metadata()
            sched.update_connector_output(
                ECConnectorOutput(ec_connector_worker_meta=wm))
            for req in finished:  # handed over: the request ends
                cache.pop(req.mm_features[0].identifier, None)
                sched.update_state_after_free(req, 0)
                sched.request_finished(req)
        next_step += STEP_S
        pause = next_step - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_step = time.monotonic()
    st = sched.stats()
    for c in (worker, sched):
        c.shutdown()
    prod.stdin.close()
    saved = prod.stdout.readline().split()
    print(f"today's flow, {SECONDS:g} s, a 1 MiB item saved every "
          f"{SAVE_S * 1e3:g} ms into a 32 MiB arena "
          f"({saved[1] if len(saved) > 1 else '?'} saved); a request a step "
          f"for an item {AGE_MS:g} ms old, worker reports {LAG_MS:g} ms "
          f"late; lease_ms {LEASE_MS}")
    print(f"requests {n}  lookups {st.get('lookups', 0)}  scheduled as "
          f"loads {scheduled}  encoded locally (misses) {local}  failed "
          f"(unavailable) {unavailable}  still waiting {len(waiting)}")


if __name__ == "__main__":
    main()
