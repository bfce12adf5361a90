#!/usr/bin/python3
"""Per-item latency of ECXConnector.has_cache_item and start_load_caches for
64 KiB, 1 MiB and 7 MiB items, measured through the connector as vLLM
drives it, with the producer connector in another process.

    PYTHONPATH=python ECX_LIBRARY=build/libecx.so bench/connector_latency.py

Baselines printed beside, from the same run: the reference's lookup (a new
HTTP connection per has_cache_item, as httpx.get does) and a torch copy of
the same bytes (the least a load into a fresh tensor can cost)."""
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
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python",
                                    "vllm_stub"))
from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorRole)

from ecx.vllm import ECXConnector  # noqa: E402

SIZES = {"64KiB": (32, 1024), "1MiB": (512, 1024), "7MiB": (1024, 3584)}
BATCH = 8
ROUNDS = int(os.environ.get("ROUNDS", "30"))

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
print("ready", w._producer.registry_port, flush=True)
sys.stdin.read()
"""


class Req:
    def __init__(self, hashes, tokens):
        self.mm_features = [type("F", (), {"identifier": h})() for h in hashes]
        self.tokens = tokens

    def get_num_encoder_embeds(self, i):
        return self.tokens


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
    cfg = VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="ECXConnector", ec_role="ec_consumer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={"remote_registry_url": url}))
    sched = ECXConnector(cfg, ECConnectorRole.SCHEDULER)
    worker = ECXConnector(cfg, ECConnectorRole.WORKER)
    print(f"ECXConnector, producer in another process, {ROUNDS} rounds, "
          f"batches of {BATCH} items (bfloat16), medians (us per item)")
    print(f"{'item':>6} {'has_cache_item':>15} {'reference lookup':>17} "
          f"{'start_load_caches':>18} {'torch copy':>11} {'GB/s':>6}")
    for name, shape in SIZES.items():
        hashes = [f"{name}-{i}" for i in range(BATCH)]
        look, ref, load, copy = [], [], [], []
        src = torch.randn(shape).to(torch.bfloat16)
        for r in range(ROUNDS + 2):
            t0 = time.perf_counter()
            hits = [sched.has_cache_item(h) for h in hashes]
            t1 = time.perf_counter()
            assert all(hits)
            for i in range(len(hashes)):
                sched.update_state_after_alloc(Req(hashes, shape[0]), i)
            meta = pickle.loads(pickle.dumps(
                sched.build_connector_meta(None)))
            worker.bind_connector_metadata(meta)
            cache = {}
            t2 = time.perf_counter()
            worker.start_load_caches(cache)
            t3 = time.perf_counter()
            worker.clear_connector_metadata()
            assert len(cache) == BATCH
            # The reference's has_cache_item: a new connection per call.
            t4 = time.perf_counter()
            for h in hashes:
                with urllib.request.urlopen(f"{url}/ec/info/{h}") as resp:
                    resp.read()
            t5 = time.perf_counter()
            dst = [torch.empty(shape, dtype=torch.bfloat16)
                   for _ in range(BATCH)]
            t6 = time.perf_counter()
            for d in dst:
                d.copy_(src)
            t7 = time.perf_counter()
            if r >= 2:
                look.append((t1 - t0) / BATCH)
                load.append((t3 - t2) / BATCH)
                ref.append((t5 - t4) / BATCH)
                copy.append((t7 - t6) / BATCH)
        us = lambda v: statistics.median(v) * 1e6  # noqa: E731
        nbytes = shape[0] * shape[1] * 2
        print(f"{name:>6} {us(look):>15.1f} {us(ref):>17.1f} "
              f"{us(load):>18.1f} {us(copy):>11.1f} "
              f"{nbytes / statistics.median(load) / 1e9:>6.2f}")
    worker.shutdown()
    sched.shutdown()
    prod.stdin.close()
    prod.wait(10)


if __name__ == "__main__":
    main()
