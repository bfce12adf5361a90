#!/usr/bin/python3
"""Latency of ECXConnector as vLLM drives it, for 64 KiB, 1 MiB and 7 MiB
items, the producer connector in another process, both flows in one run:

- today's flow (vLLM with ensure_cache_available): the time from a
  request's first ensure_cache_available to the step in which it is
  schedulable (lookup, background pulls, the workers' report back, all
  8 items of the request), has_cache_item per item (answered from memory),
  and what the step then waits in start_load_caches per item (the hand-over);
- the synchronous flow (older vLLM, or async_load false): has_cache_item
  per item (a registry lookup each) and start_load_caches per item (the
  load itself, inside the step).

    PYTHONPATH=python ECX_LIBRARY=build/libecx.so bench/connector_latency.py

Baselines printed beside, from the same run: the reference's lookup (a new
HTTP connection per has_cache_item, as httpx.get does) and a torch copy of
the same bytes (the least a load into a fresh tensor can cost).

Then the save path: save_caches of a CPU tensor on a producer worker (a
new id each time, so each is a real put: reserve, one copy into the
arena, publish to the embedded registry) beside two torch copies of the
same bytes, both into memory touched before, as the arena is: one into the
same destination each round (cache-hot: the least any copy costs), one
into the next of a ring of destinations larger than the last-level cache
(cold, as the arena's fresh or evicted places are); both with torch's
intra-op threads (all the cores: torch splits a large copy among them),
and the cold one again on one thread, as save_caches copies (cold1: the
like-for-like baseline)."""
import os
import pickle
import statistics
import subprocess
import sys
import time
import urllib.request

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
# vLLM's connector-facing classes as the tests' stand-in defines them
# (tests/python/vllm_stub, held to vLLM's by test_vllm_conformance.py),
# even where vLLM is installed: its VllmConfig wants a multimodal model for
# an encoder's role, and this bench drives the connector alone.
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python", "vllm_stub"))
from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

from ecx.vllm import ECXConnector  # noqa: E402

SIZES = {"64KiB": (32, 1024), "1MiB": (512, 1024), "7MiB": (1024, 3584)}
BATCH = 8
ROUNDS = int(os.environ.get("ROUNDS", "30"))
# The cold copy's ring: more than a last-level cache holds.
RING_BYTES = int(os.environ.get("RING_MIB", "96")) << 20

PRODUCER = """
import sys, torch
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from ecx.vllm import ECXConnector
cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
    ec_connector="ECXConnector", ec_role="ec_producer", ec_buffer_device="cpu",
    ec_connector_extra_config={"registry_http_port": 0, "bind_host": "127.0.0.1",
                               "capacity_bytes": 256 << 20}))
w = ECXConnector(cfg, ECConnectorRole.WORKER)
for name, shape in %r.items():
    for i in range(%d):
        h = f"{name}-{i}"
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


def config(url, async_load):
    return VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_consumer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={"remote_registry_url": url,
                                   "recv_capacity_bytes": "256MiB",
                                   "async_load": async_load}))


def worker_step(sched, worker, cache):
    """The rest of a step after scheduling: metadata to the worker, its
    hand-over, its report back. Returns the seconds start_load_caches
    took."""
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(None)))
    worker.bind_connector_metadata(meta)
    t0 = time.perf_counter()
    worker.start_load_caches(cache)
    t1 = time.perf_counter()
    wm = pickle.loads(pickle.dumps(worker.build_connector_worker_meta()))
    worker.clear_connector_metadata()
    if wm is not None:
        sched.update_connector_output(
            ECConnectorOutput(ec_connector_worker_meta=wm))
    return t1 - t0


def new_flow_round(sched, worker, rid, hashes, tokens):
    """(seconds to schedulable, has_cache_item seconds per item, seconds
    start_load_caches took per item) for one request of len(hashes)."""
    req = Req(rid, hashes, tokens)
    cache = {}
    t0 = time.perf_counter()
    while not sched.ensure_cache_available(req, 0):
        worker_step(sched, worker, cache)  # a step that schedules nothing
        if time.perf_counter() - t0 > 30:
            raise RuntimeError("not schedulable within 30 s")
    t1 = time.perf_counter()
    hits = [sched.has_cache_item(h) for h in hashes]
    t2 = time.perf_counter()
    assert all(hits)
    for i in range(len(hashes)):
        sched.update_state_after_alloc(req, i)
    wait = worker_step(sched, worker, cache)
    assert len(cache) == len(hashes)
    # The request ends: its items go back.
    for i in range(len(hashes)):
        sched.update_state_after_free(req, i)
    sched.request_finished(req)
    cache.clear()
    worker_step(sched, worker, cache)
    return t1 - t0, (t2 - t1) / len(hashes), wait / len(hashes)


def old_flow_round(sched, worker, hashes, tokens):
    t0 = time.perf_counter()
    hits = [sched.has_cache_item(h) for h in hashes]
    t1 = time.perf_counter()
    assert all(hits)
    for i in range(len(hashes)):
        sched.update_state_after_alloc(Req("old", hashes, tokens), i)
    cache = {}
    wait = worker_step(sched, worker, cache)
    assert len(cache) == len(hashes)
    return (t1 - t0) / len(hashes), wait / len(hashes)


def main():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    prod = subprocess.Popen([sys.executable, "-c",
                             PRODUCER % (SIZES, BATCH)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    line = prod.stdout.readline()
    while line.startswith("["):
        line = prod.stdout.readline()
    url = "http://127.0.0.1:%d" % int(line.split()[1])
    sched = ECXConnector(config(url, True), ECConnectorRole.SCHEDULER)
    worker = ECXConnector(config(url, True), ECConnectorRole.WORKER)
    old_sched = ECXConnector(config(url, False), ECConnectorRole.SCHEDULER)
    old_worker = ECXConnector(config(url, False), ECConnectorRole.WORKER)
    print(f"ECXConnector, producer in another process, {ROUNDS} rounds, "
          f"requests of {BATCH} items (bfloat16), medians")
    print(f"{'':>6} | {'today: ensure->':>15} {'has_cache':>10} "
          f"{'start_load':>11} | {'sync: has_cache':>15} {'start_load':>11} "
          f"{'GB/s':>6} | {'reference':>10} {'torch':>8}")
    print(f"{'item':>6} | {'schedulable ms':>15} {'us/item':>10} "
          f"{'us/item':>11} | {'us/item':>15} {'us/item':>11} "
          f"{'':>6} | {'lookup us':>10} {'copy us':>8}")
    for name, shape in SIZES.items():
        hashes = [f"{name}-{i}" for i in range(BATCH)]
        ready, look, hand, olook, oload, ref, copy = ([] for _ in range(7))
        src = torch.randn(shape).to(torch.bfloat16)
        for r in range(ROUNDS + 2):
            a, b, c = new_flow_round(sched, worker, f"{name}-{r}", hashes,
                                     shape[0])
            d, e = old_flow_round(old_sched, old_worker, hashes, shape[0])
            # The reference's has_cache_item: a new connection per call.
            t4 = time.perf_counter()
            for h in hashes:
                with urllib.request.urlopen(f"{url}/ec/info/{h}") as resp:
                    resp.read()
            t5 = time.perf_counter()
            dst = [torch.empty(shape, dtype=torch.bfloat16)
                   for _ in range(BATCH)]
            t6 = time.perf_counter()
            for x in dst:
                x.copy_(src)
            t7 = time.perf_counter()
            if r >= 2:
                ready.append(a)
                look.append(b)
                hand.append(c)
                olook.append(d)
                oload.append(e)
                ref.append((t5 - t4) / BATCH)
                copy.append((t7 - t6) / BATCH)
        med = statistics.median
        nbytes = shape[0] * shape[1] * 2
        print(f"{name:>6} | {med(ready) * 1e3:>15.2f} "
              f"{med(look) * 1e6:>10.2f} "
              f"{med(hand) * 1e6:>11.1f} | {med(olook) * 1e6:>15.1f} "
              f"{med(oload) * 1e6:>11.1f} {nbytes / med(oload) / 1e9:>6.2f} "
              f"| {med(ref) * 1e6:>10.1f} {med(copy) * 1e6:>8.1f}")
    for c in (worker, sched, old_worker, old_sched):
        c.shutdown()
    prod.stdin.close()
    prod.wait(10)
    save_rows()


def save_rows():
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_producer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={"registry_http_port": 0,
                                   "bind_host": "127.0.0.1",
                                   "capacity_bytes": 512 << 20}))
    w = ECXConnector(cfg, ECConnectorRole.WORKER)
    threads = torch.get_num_threads()
    print(f"\nsave_caches of a CPU tensor (new id each round), beside a "
          f"torch copy of it into memory touched before: the same "
          f"destination each round (hot) and a ring of destinations of "
          f"{RING_BYTES >> 20} MiB (cold), each with torch's {threads} "
          f"threads, and the cold one again on 1 thread, as save_caches "
          f"copies (cold1); alternating, medians of {ROUNDS} rounds "
          f"(up to 400 for smaller items, 64 MiB of saves)")
    print(f"{'item':>6} | {'save_caches us':>14} {'GB/s':>6} | "
          f"{'hot copy us':>11} {'save/hot':>8} | {'cold copy us':>12} "
          f"{'save/cold':>9} | {'cold1 us':>8} {'save/cold1':>10}")
    for name, shape in SIZES.items():
        src = torch.randn(shape).to(torch.bfloat16)
        dst = torch.empty_like(src)
        dst.fill_(0)  # touched, like the arena
        nbytes = src.numel() * 2
        ring = [torch.empty_like(src)
                for _ in range(max(2, RING_BYTES // nbytes))]
        for x in ring:
            x.fill_(0)
        # Small items get more rounds (a 64 KiB save is ~10 us, where a
        # few scheduler hiccups move a median of 30).
        rounds = max(ROUNDS, min(400, (64 << 20) // nbytes))
        save, copy, cold, cold1 = [], [], [], []
        for r in range(rounds + 2):
            h = f"save-{name}-{r}"
            t0 = time.perf_counter()
            w.save_caches({h: src}, h)
            t1 = time.perf_counter()
            dst.copy_(src)
            t2 = time.perf_counter()
            ring[(2 * r) % len(ring)].copy_(src)
            t3 = time.perf_counter()
            torch.set_num_threads(1)
            t4 = time.perf_counter()
            ring[(2 * r + 1) % len(ring)].copy_(src)
            t5 = time.perf_counter()
            torch.set_num_threads(threads)
            if r >= 2:
                save.append(t1 - t0)
                copy.append(t2 - t1)
                cold.append(t3 - t2)
                cold1.append(t5 - t4)
        med = statistics.median
        print(f"{name:>6} | {med(save) * 1e6:>14.1f} "
              f"{nbytes / med(save) / 1e9:>6.2f} | "
              f"{med(copy) * 1e6:>11.1f} {med(save) / med(copy):>8.2f} | "
              f"{med(cold) * 1e6:>12.1f} {med(save) / med(cold):>9.2f} | "
              f"{med(cold1) * 1e6:>8.1f} {med(save) / med(cold1):>10.2f}")
        del ring
    w.shutdown()


if __name__ == "__main__":
    main()
