#!/usr/bin/python3
"""Steps from a request's arrival to the step that schedules it, through a
step loop like vLLM's engine core: the scheduler connector in this process,
each worker connector (one per tensor-parallel rank) in a process of its
own, a step every STEP_MS (default 5 ms), one request per item arriving
back to back (each at the start of a step, the next once the one before
is scheduled), for 64 KiB, 1 MiB and 7 MiB items.

    PYTHONPATH=python ECX_LIBRARY=build/libecx.so bench/step_loop.py \
        [--tp N] [--rounds N] [--step-ms MS] [--wait-ms MS]

A step, in vLLM's order: ensure_cache_available for each waiting request,
has_cache_item and update_state_after_alloc for each item of a request it
schedules, build_connector_meta; on each worker (its metadata pickled to
it) bind_connector_metadata, start_load_caches, a check that every item
the step scheduled is in its encoder_cache, build_connector_worker_meta,
clear_connector_metadata; back here, the workers' metadata merged
(aggregate) into update_connector_output, then take_unavailable_requests.
A finished request frees its items (update_state_after_free,
request_finished) before the next arrives.

Printed per size (medians): steps from arrival to scheduled (1: the step
it arrived in), ms from arrival to its items being in every rank's
encoder_cache, for ecx (a producer connector in another process, its
embedded registry) and, in the same run, for a file per item in /dev/shm
that the scheduler finds with os.path.exists and the workers read in
start_load_caches into a fresh tensor (a shared-storage connector,
ready in the step it arrives). --wait-ms adds a row for ecx with pull_wait_ms (a bounded wait
in ensure_cache_available for what a request's first call started)."""
import argparse
import functools
import multiprocessing
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.path.join(HERE, "..", "tests", "python", "vllm_stub")
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, STUB)
from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

SIZES = {"64KiB": (32, 1024), "1MiB": (512, 1024), "7MiB": (1024, 3584)}

PRODUCER = """
import sys, torch
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from ecx.vllm import ECXConnector
cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
    ec_connector="ECXConnector", ec_role="ec_producer", ec_buffer_device="cpu",
    ec_connector_extra_config={"registry_http_port": 0, "bind_host": "127.0.0.1",
                               "capacity_bytes": %d}))
w = ECXConnector(cfg, ECConnectorRole.WORKER)
for h, shape in %r:
    w.save_caches({h: torch.randn(shape).to(torch.bfloat16)}, h)
print("ready", w._worker._producer.registry_port, flush=True)
sys.stdin.read()
"""


class Req:
    def __init__(self, rid, hashes, tokens):
        self.request_id = rid
        self.mm_features = [type("F", (), {"identifier": h})() for h in hashes]
        self.tokens = tokens

    def get_num_encoder_embeds(self, i):
        return self.tokens


# ---- the baseline: a file per item in /dev/shm ----------------------------

class FileMeta:
    def __init__(self, loads):
        self.loads = loads  # (id, shape)


class FileScheduler:
    """A shared-storage connector's scheduler side: an item exists when its
    file does; nothing to wait for."""

    def __init__(self, root):
        self.root = root
        self.loads = []
        self.shapes = {}

    def ensure_cache_available(self, request, n):
        return True

    def has_cache_item(self, h):
        return os.path.exists(os.path.join(self.root, h))

    def update_state_after_alloc(self, request, i):
        h = request.mm_features[i].identifier
        self.loads.append((h, self.shapes[h]))

    def build_connector_meta(self, out):
        meta, self.loads = FileMeta(self.loads), []
        return meta

    def update_connector_output(self, out):
        pass

    def take_unavailable_requests(self):
        return set()

    def update_state_after_free(self, request, i):
        pass

    def request_finished(self, request):
        return False, None


class FileWorker:
    """Its worker side: start_load_caches reads each scheduled file."""

    def __init__(self, root):
        self.root = root
        self.meta = None

    def bind_connector_metadata(self, meta):
        self.meta = meta

    def clear_connector_metadata(self):
        self.meta = None

    def start_load_caches(self, cache):
        for h, shape in self.meta.loads:
            n = shape[0] * shape[1] * 2
            t = torch.empty(n, dtype=torch.uint8)
            with open(os.path.join(self.root, h), "rb") as f:
                if f.readinto(t.numpy()) != n:
                    raise RuntimeError(f"{h}: a short file")
            cache[h] = t.view(torch.bfloat16).reshape(shape)

    def build_connector_worker_meta(self):
        return None


# ---- a worker process -------------------------------------------------------

def worker_main(conn, cfg_blob, rank, root):
    from ecx.vllm import ECXConnector
    hooks = {}
    for kind, blob in pickle.loads(cfg_blob).items():
        cfg = pickle.loads(blob)
        cfg.parallel_config.rank = rank
        hooks[kind] = ECXConnector(cfg, ECConnectorRole.WORKER)
    hooks["file"] = FileWorker(root)
    caches = {k: {} for k in hooks}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "step":
            _, kind, blob, need = msg
            c, cache = hooks[kind], caches[kind]
            c.bind_connector_metadata(pickle.loads(blob))
            c.start_load_caches(cache)
            t = time.monotonic()
            missing = [h for h in need if h not in cache]
            wm = c.build_connector_worker_meta()
            c.clear_connector_metadata()
            conn.send((pickle.dumps(wm), t, missing))
        elif msg[0] == "free":
            for h in msg[2]:
                caches[msg[1]].pop(h, None)
        else:
            for k, c in hooks.items():
                if k != "file":
                    c.shutdown()
            conn.send("bye")
            return


class Workers:
    def __init__(self, cfgs, tp, root):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        blob = pickle.dumps({k: pickle.dumps(c) for k, c in cfgs.items()})
        for r in range(tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(b, blob, r, root))
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            assert c.recv() == "ready"

    def step(self, kind, meta, need):
        blob = pickle.dumps(meta)
        for c in self.conns:
            c.send(("step", kind, blob, need))
        out = [c.recv() for c in self.conns]
        for _, _, missing in out:
            if missing:
                raise RuntimeError(f"encoder cache miss: {missing}")
        metas = [pickle.loads(o[0]) for o in out]
        agg = None
        if metas[0] is not None:
            agg = functools.reduce(lambda a, b: a.aggregate(b), metas)
        return agg, max(o[1] for o in out)

    def free(self, kind, ids):
        for c in self.conns:
            c.send(("free", kind, ids))

    def stop(self):
        for c in self.conns:
            c.send(("stop",))
        for c, p in zip(self.conns, self.procs):
            c.recv()
            p.join(10)


# ---- the step loop ----------------------------------------------------------

def run(kind, sched, workers, ids, shape, step_s):
    """Requests of one item each, back to back: (steps, ms) per request."""
    out = []
    steps = 0
    next_step = time.monotonic()
    for k, h in enumerate(ids):
        req = Req(f"{kind}-{h}-{k}", [h], shape[0])
        arrived_step, t_arrive, done = steps + 1, None, None
        while done is None:
            now = time.monotonic()
            if now < next_step:
                time.sleep(next_step - now)
            next_step = time.monotonic() + step_s
            steps += 1
            if t_arrive is None:
                t_arrive = time.monotonic()
            scheduled = []
            if sched.ensure_cache_available(req, 0):
                hits = [sched.has_cache_item(f.identifier)
                        for f in req.mm_features]
                if not all(hits):
                    raise RuntimeError(f"{kind}: {h} is not a hit")
                for i in range(len(req.mm_features)):
                    sched.update_state_after_alloc(req, i)
                scheduled = [h]
            meta = sched.build_connector_meta(None)
            agg, t_loaded = workers.step(kind, meta, scheduled)
            if agg is not None:
                sched.update_connector_output(
                    ECConnectorOutput(ec_connector_worker_meta=agg))
            bad = sched.take_unavailable_requests()
            if bad:
                raise RuntimeError(f"{kind}: unavailable {bad}")
            if scheduled:
                done = (steps - arrived_step + 1, (t_loaded - t_arrive) * 1e3)
        out.append(done)
        sched.update_state_after_free(req, 0)
        sched.request_finished(req)
        workers.free(kind, [h])
    return out


def consumer_config(url, tp, engine_id, **extra):
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_consumer",
        ec_buffer_device="cpu", engine_id=engine_id,
        ec_connector_extra_config={"remote_registry_url": url,
                                   "recv_capacity_bytes": "256MiB",
                                   **extra}))
    cfg.parallel_config.tensor_parallel_size = tp
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int,
                    default=int(os.environ.get("ROUNDS", "20")))
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--wait-ms", type=float, default=0.0)
    ap.add_argument("--verbose", action="store_true",
                    help="each kind's steps per request, and the time "
                    "from an item's start to every rank holding it")
    a = ap.parse_args()
    n = a.rounds + 2
    items = [(f"{name}-{i}", shape) for name, shape in SIZES.items()
             for i in range(n)]
    cap = sum(s[0] * s[1] * 2 for _, s in items) + (64 << 20)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    prod = subprocess.Popen([sys.executable, "-c", PRODUCER % (cap, items)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    line = prod.stdout.readline()
    while line.startswith("["):
        line = prod.stdout.readline()
    url = "http://127.0.0.1:%d" % int(line.split()[1])
    root = tempfile.mkdtemp(prefix="ecx-step-loop-", dir="/dev/shm")
    try:
        measure(a, url, root, items, n)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        prod.stdin.close()
        prod.wait(10)


def measure(a, url, root, items, n):
    from ecx.vllm import ECXConnector
    for h, shape in items:
        x = torch.randn(shape).to(torch.bfloat16).view(torch.uint8)
        with open(os.path.join(root, h), "wb") as f:
            f.write(x.numpy().tobytes())
    kinds = {"ecx": consumer_config(url, a.tp, str(uuid.uuid4()))}
    if a.wait_ms:
        kinds[f"ecx wait {a.wait_ms:g}"] = consumer_config(
            url, a.tp, str(uuid.uuid4()), pull_wait_ms=a.wait_ms)
    workers = Workers(kinds, a.tp, root)
    scheds = {k: ECXConnector(c, ECConnectorRole.SCHEDULER)
              for k, c in kinds.items()}
    # vLLM loads its model between making its connectors and the first
    # request: the workers' sockets have found the scheduler's by then.
    time.sleep(0.3)
    files = FileScheduler(root)
    files.shapes = dict(items)
    scheds["file"] = files
    try:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "?"
    print(f"step loop: a step every {a.step_ms:g} ms, tp {a.tp} (a worker "
          f"process per rank), {a.rounds} requests of one item per size "
          f"arriving back to back, medians; load average {load}")
    cols = list(scheds)
    print(f"{'item':>6} | " + " | ".join(f"{k + ' steps':>16} {'ms':>7}"
                                         for k in cols))
    for name, shape in SIZES.items():
        ids = [f"{name}-{i}" for i in range(n)]
        row = []
        for k in cols:
            before = dict(scheds[k].stats()) if k != "file" else {}
            res = run(k, scheds[k], workers, ids, shape, a.step_ms / 1e3)[2:]
            row.append((statistics.median(s for s, _ in res),
                        statistics.median(m for _, m in res)))
            if a.verbose:
                line = f"  {name} {k}: steps {[s for s, _ in res]}"
                if k != "file":
                    st = scheds[k].stats()
                    ready = st.get("items_ready", 0) - before.get(
                        "items_ready", 0)
                    t = st.get("item_load_s", 0) - before.get(
                        "item_load_s", 0)
                    line += (f", start to held "
                             f"{t / max(ready, 1) * 1e3:.2f} ms")
                print(line, file=sys.stderr)
        print(f"{name:>6} | " + " | ".join(f"{s:>16g} {m:>7.2f}"
                                           for s, m in row))
    workers.stop()
    for k, s in scheds.items():
        if k != "file":
            s.shutdown()


if __name__ == "__main__":
    main()
