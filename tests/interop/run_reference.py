#!/usr/bin/python3
"""Runs the reference connector's own code, unchanged, on Mooncake's own
engine: by hand, not a ctest test (ecx does not depend on Mooncake or
FastAPI). The connector's page (ECMooncakeConnector, given with --source)
is executed as it is, after a header that supplies what it imports from
vLLM: tests/python/vllm_stub's ECConnectorBase, get_ip() = 127.0.0.1,
Tensor.nbytes where torch lacks it (before 2.1),
is_local_first_rank() = True, envs.VLLM_MOONCAKE_SYNC_AFTER_TRANSFER =
False, mooncake.engine.TransferEngine, FastAPI, uvicorn, httpx, torch.

  run_reference.py --source F consumer --registry URL --seed S ID...
      the scheduler side (has_cache_item, update_state_after_alloc,
      build_connector_meta) then the worker side (start_load_caches into
      CPU tensors), one step per ID, --repeat times; checks every byte
      against the seed (items.py) and prints JSON with the load times.
  run_reference.py --source F producer --seed S ID:AxB:DTYPE...
      the worker side of a producer: save_caches of each item; its registry
      is the reference's, on 0.0.0.0:9018 (registry_http_port), so run it
      in a network namespace of its own (unshare -n); prints one JSON
      line when ready and serves until SIGTERM.
"""
import __future__
import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python", "vllm_stub"))

import items  # noqa: E402


def load_reference(path):
    """The connector's classes: the page's text, minus its title line,
    executed in a namespace holding the names it imports."""
    import httpx
    import torch
    import uvicorn
    import zmq
    from fastapi import FastAPI, HTTPException
    from mooncake.engine import TransferEngine
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase, ECConnectorMetadata, ECConnectorRole)
    if not hasattr(torch.Tensor, "nbytes"):  # torch < 2.1 (Debian 12's)
        torch.Tensor.nbytes = property(
            lambda t: t.numel() * t.element_size())
    text = open(path).read()
    body = text[text.index("\nclass ") + 1:]
    ns = dict(
        __name__="ec_mooncake_connector", json=json, threading=threading,
        time=time, dataclass=dataclass, field=field, Any=Any, httpx=httpx,
        torch=torch, uvicorn=uvicorn, zmq=zmq, FastAPI=FastAPI,
        HTTPException=HTTPException, TransferEngine=TransferEngine,
        _MOONCAKE_IMPORT_ERROR=None, ECConnectorBase=ECConnectorBase,
        ECConnectorMetadata=ECConnectorMetadata,
        ECConnectorRole=ECConnectorRole, VllmConfig=Any, SchedulerOutput=Any,
        logger=logging.getLogger("ec_mooncake_connector"),
        envs=types.SimpleNamespace(VLLM_MOONCAKE_SYNC_AFTER_TRANSFER=False),
        get_ip=lambda: "127.0.0.1", is_local_first_rank=lambda: True)
    # Annotations stay unevaluated, as under the module's own
    # "from __future__ import annotations" (the page names
    # ECMooncakeLoadSpec in an annotation before defining it).
    mod = types.ModuleType(ns["__name__"])
    mod.__dict__.update(ns)
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(body, path, "exec",
                 flags=__future__.annotations.compiler_flag), mod.__dict__)
    return mod.__dict__


def config(role, extra):
    ec = types.SimpleNamespace(
        is_ec_producer=role == "producer", is_ec_consumer=role == "consumer",
        ec_connector_extra_config=dict(extra, mooncake_protocol="tcp"),
        ec_buffer_device="cpu")
    par = types.SimpleNamespace(tensor_parallel_size=1,
                                pipeline_parallel_size=1)
    return types.SimpleNamespace(ec_transfer_config=ec, parallel_config=par)


class Request:
    """What update_state_after_alloc reads of a request."""

    def __init__(self, mm_hash):
        self.mm_features = [types.SimpleNamespace(identifier=mm_hash)]

    def get_num_encoder_embeds(self, index):
        return 1


def consumer(ns, args):
    import torch
    Role = ns["ECConnectorRole"]
    cfg = config("consumer", {"remote_registry_url": args.registry})
    sched = ns["ECMooncakeConnector"](cfg, Role.SCHEDULER)
    worker = ns["ECMooncakeConnector"](cfg, Role.WORKER)
    results, times = [], {}
    # Every loaded tensor stays alive: the reference registers each with
    # its engine and never unregisters it, and Mooncake refuses a new
    # registration overlapping an old one ("does not support overlapped
    # memory region"), which a freed tensor's reused memory would be.
    kept = []
    for rep in range(args.repeat):
        for mm_hash in args.ids:
            t0 = time.perf_counter()
            found = sched.has_cache_item(mm_hash)
            t1 = time.perf_counter()
            if not found:
                results.append({"id": mm_hash, "found": False})
                continue
            sched.update_state_after_alloc(Request(mm_hash), 0)
            meta = sched.build_connector_meta(None)
            worker.bind_connector_metadata(meta)
            cache = {}
            kept.append(cache)
            t2 = time.perf_counter()
            try:
                worker.start_load_caches(cache)
                err = None
            except Exception as e:  # the reference raises RuntimeError
                err = str(e)
            t3 = time.perf_counter()
            worker.clear_connector_metadata()
            res = {"id": mm_hash, "found": True, "error": err}
            if err is None:
                t = cache[mm_hash]
                raw = t.contiguous().view(torch.uint8).numpy().tobytes()
                res["bytes_ok"] = raw == items.item_bytes(
                    args.seed, mm_hash, len(raw))
                times.setdefault(mm_hash, []).append(
                    {"lookup": t1 - t0, "load": t3 - t2})
            if rep == 0 or err or not res.get("bytes_ok"):
                results.append(res)
    ok = all(r.get("found") and not r.get("error") and r.get("bytes_ok")
             for r in results)
    summary = {
        m: {"n": len(v),
            "load_p50_ms": round(statistics.median(
                x["load"] for x in v) * 1e3, 3),
            "lookup_p50_ms": round(statistics.median(
                x["lookup"] for x in v) * 1e3, 3)}
        for m, v in times.items()}
    print(json.dumps({"ok": ok, "items": results, "times": summary}))
    return 0 if ok else 1


def producer(ns, args):
    import numpy as np
    import torch
    Role = ns["ECConnectorRole"]
    worker = ns["ECMooncakeConnector"](config("producer", {}), Role.WORKER)
    cache = {}
    for spec in args.items:
        mm_hash, shape, dtype, nbytes = items.parse_spec(spec)
        raw = np.frombuffer(bytearray(items.item_bytes(args.seed, mm_hash,
                                                       nbytes)), np.uint8)
        cache[mm_hash] = torch.from_numpy(raw).view(
            getattr(torch, dtype)).reshape(shape)
        worker.save_caches(cache, mm_hash)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(json.dumps({"registry": "http://127.0.0.1:9018",
                      "items": list(cache)}), flush=True)
    done.wait(args.max_seconds)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True,
                    help="the connector's page (ec_mooncake_connector.py)")
    sub = ap.add_subparsers(dest="role", required=True)
    c = sub.add_parser("consumer")
    c.add_argument("--registry", required=True)
    c.add_argument("--seed", required=True)
    c.add_argument("--repeat", type=int, default=1)
    c.add_argument("ids", nargs="+")
    p = sub.add_parser("producer")
    p.add_argument("--seed", required=True)
    p.add_argument("--max-seconds", type=float, default=300)
    p.add_argument("items", nargs="+")
    args = ap.parse_args()
    ns = load_reference(args.source)
    return (consumer if args.role == "consumer" else producer)(ns, args)


if __name__ == "__main__":
    sys.exit(main())
