"""Push mode through ECXConnector, the consumer side: a prefill request
that arrives after its encoder finished pushing (upstream's encoder
stand-in, tests/interop/upstream_encoder.py, over Mooncake's TCP wire into
the worker's receive arena). Per size: the time from the request's
arrival to schedulable (ensure_cache_available true, in the step it
arrives) and to its tensor in the worker's encoder_cache (that step's
build_connector_meta and start_load_caches), and ensure_cache_available
per item; beside a file per item in /dev/shm read into a tensor, in the
same run. Medians over --rounds.

  ECX_LIBRARY=build/libecx.so PYTHONPATH=python \\
      /usr/bin/python3 bench/push_latency.py --rounds 200
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from test_push_connector import (Prefill, Request, mc_writer,  # noqa: E402
                                 push_item)
from upstream_encoder import UpstreamEncoder  # noqa: E402

SIZES = {"64KiB": 64, "1MiB": 1024, "7.3MiB": 7475}  # tokens x 512 bf16


def med_us(xs):
    return statistics.median(xs) * 1e6


def push_round(p, enc, k, tokens):
    it = push_item(f"b{k}-{tokens}", tokens)
    assert enc.push(p.base, [it]) == []
    sched, (worker, cache) = p.sched, p.engine.workers[0]
    while not sched.has_cache_item(it.mm_hash):  # steps till its events
        worker.bind_connector_metadata(sched.build_connector_meta(object()))
        worker.start_load_caches(cache)  # (and the last round's frees)
        worker.clear_connector_metadata()
    req = Request(f"r{k}", [it])
    t0 = time.perf_counter()
    ok = sched.ensure_cache_available(req, 0)
    t1 = time.perf_counter()
    assert ok, "not schedulable in the step it arrived"
    sched.update_state_after_alloc(req, 0)
    worker.bind_connector_metadata(sched.build_connector_meta(object()))
    worker.start_load_caches(cache)
    t2 = time.perf_counter()
    assert cache[it.mm_hash].numel() == tokens * 512
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    t3 = time.perf_counter()
    for _ in range(10):
        sched.ensure_cache_available(req, 0)
    per_item = (time.perf_counter() - t3) / 10
    p.engine.finish(req)
    worker.bind_connector_metadata(sched.build_connector_meta(object()))
    worker.start_load_caches(cache)  # the free reaches the worker
    worker.clear_connector_metadata()
    return t1 - t0, t2 - t0, per_item


def shm_round(k, tokens):
    path = f"/dev/shm/ecx-bench-push-{os.getpid()}-{k}"
    data = os.urandom(tokens * 512 * 2)
    with open(path, "wb") as f:
        f.write(data)
    t0 = time.perf_counter()
    ok = os.path.exists(path)
    t1 = time.perf_counter()
    t = torch.from_file(path, size=len(data), dtype=torch.uint8).clone()
    t = t.view(torch.bfloat16).reshape(tokens, 512)
    t2 = time.perf_counter()
    os.unlink(path)
    assert ok and t.numel() == tokens * 512
    return t1 - t0, t2 - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    os.environ.setdefault("ECX_MOONCAKE", "auto")
    p = Prefill(tp=1)
    enc = UpstreamEncoder(control_timeout_s=5, writer=mc_writer())
    try:
        print(f"{'size':>8} {'what':>32} {'median':>10}")
        for name, tokens in SIZES.items():
            rows = [push_round(p, enc, k, tokens)
                    for k in range(args.rounds)]
            shm = [shm_round(k, tokens) for k in range(args.rounds)]
            print(f"{name:>8} {'push: arrival->schedulable':>32} "
                  f"{med_us([r[0] for r in rows]):9.1f}us")
            print(f"{name:>8} {'push: arrival->in encoder_cache':>32} "
                  f"{med_us([r[1] for r in rows]):9.1f}us")
            print(f"{name:>8} {'push: ensure_cache_available/it':>32} "
                  f"{med_us([r[2] for r in rows]):9.1f}us")
            print(f"{name:>8} {'shm file: arrival->schedulable':>32} "
                  f"{med_us([s[0] for s in shm]):9.1f}us")
            print(f"{name:>8} {'shm file: arrival->tensor':>32} "
                  f"{med_us([s[1] for s in shm]):9.1f}us")
    finally:
        enc.close()
        p.close()


if __name__ == "__main__":
    main()
