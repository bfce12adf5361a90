#!/usr/bin/python3
"""Runs upstream vLLM's merged Mooncake EC connector (push mode), its own
files unchanged, on Mooncake's own Python engine (tcp), against ecx in both
cross roles: by hand, not a ctest test (ecx depends on neither).

--source DIR is a folder holding upstream's files at their paths under
vllm/distributed/ec_transfer/ec_connector/: mooncake/{__init__,config,
control,memory,metadata,producer,reservation,scheduler,state,transfer,
worker}.py, mooncake_ec_connector.py (the entry class) and utils.py
(PlaceholderMetadataResolver, collect_ec_item_metadata), imported
unmodified as vllm.distributed.ec_transfer.ec_connector.* (that folder is
appended to the stub package's __path__). README.md: which commits.

What stands in for vLLM (the minimum their imports and calls need):
  tests/python/vllm_stub: ECConnectorBase, ECConnectorMetadata,
    ECConnectorWorkerMetadata, ECConnectorRole, ECTransferConfig,
    ECConnectorOutput;
  vllm.logger.init_logger = logging.getLogger; vllm.utils.network_utils:
    get_ip() = 127.0.0.1, make_zmq_path (vLLM's rule: brackets for IPv6);
  vllm.utils.collection_utils.is_list_of;
  vllm.v1.outputs.ModelRunnerOutput (a name only: utils.py imports it);
  vllm.v1.core.sched.output.SchedulerOutput (free_encoder_mm_hashes);
  vllm.distributed.ec_transfer.ec_connector.cpu.common.
    _get_encoder_cache_hidden_dim = model_config.get_inputs_embeds_size()
    (vLLM's own for a model without deepstack);
  vllm.distributed.parallel_state: get_tp_group/get_pp_group raise
    AssertionError, as vLLM's do outside a distributed run (TP 1, PP 1);
  vllm.multimodal.MULTIMODAL_REGISTRY: fields {image_grid_thw} for images;
  the config object: ec_transfer_config, parallel_config (TP/PP/DP 1,
    data_parallel_index 0), model_config (dtype bfloat16, hidden 2048);
  torch 1.13 (Debian 12) lacks Tensor.nbytes and dtype.itemsize (2.1) and
    torch.OutOfMemoryError: added (the last only reached on a failed
    registration). ec_buffer_device is "cpu", so no CUDA path runs.
The driver reads two things of upstream's internals, to time and to wait,
never to change them: the producer worker's ProducerPushManager.complete
and .fail are wrapped to stamp when each push ends, and the reservation
future of a push is waited on before its encoder output is bound (as a
forward pass longer than a reserve round trip would).

The proxy's part is a stand-in of disagg_epd_proxy.py's flow (PUSH.md
section 6): a uuid4 hex transfer_id per item, {"consumer_zmq", "ec_items":
[{"transfer_id"}]} to the encoder, the encoder's {mm_hash: {metadata,
transfer_id}} back, {"ec_items": [{"mm_hash", "transfer_id"}], mm_hash:
entry} to the consumer.

Cases, each in a child process of its own, one request per item, N per
size (64 KiB, 1 MiB, 7 MiB of bfloat16 [tokens, 2048]), then the three in
one request (reserve_batch, complete_batch) N/10 times (at least 3), every
byte checked in the consumer's encoder_cache:
  upstream_to_ecx  upstream's encoder (ECMooncakeConnector, ec_producer:
    ensure_cache_available, update_state_after_alloc, build_connector_meta,
    start_save_caches, save_caches, build_connector_worker_meta,
    request_finished) into an ecx prefill (ECXConnector ec_consumer with
    ec_ip/ec_port, no registry);
  ecx_to_upstream  ecx's encoder (ecx.Producer and ecx.vllm.push.pusher's
    Pusher with specs_from_params/finished_map; the connector does not
    push yet) into upstream's consumer (ECMooncakeConnector ec_consumer,
    scheduler and worker, start_worker_services);
  ecx_to_ecx, upstream_to_upstream  the baselines (two Mooncake engines in
    one process for the latter).
push_ms: the encoder output bound (save_caches; Pusher.push) to the push
done (every write and complete acknowledged); sched_ms: from the same to
the consumer's ensure_cache_available true, a step every 0.5 ms. Medians,
printed as one JSON object. How to run, and --engine mcwire: README.md.
"""
import argparse
import ctypes
import gc
import hashlib
import json
import logging
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
import types
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.path.join(HERE, "..", "python", "vllm_stub")
EC = "vllm.distributed.ec_transfer.ec_connector"
SIZES = [64 << 10, 1 << 20, 7 << 20]
HIDDEN = 2048
CASES = ["upstream_to_ecx", "ecx_to_upstream", "ecx_to_ecx",
         "upstream_to_upstream"]


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, mod)
    return mod


def install_stubs(source):
    """vLLM's names that upstream's files import, and torch 1.13's gaps."""
    import torch
    sys.path.insert(0, STUB)
    import vllm.distributed.ec_transfer.ec_connector as ecpkg
    import vllm.v1.outputs as outputs
    ecpkg.__path__.append(os.path.join(
        source, "vllm", "distributed", "ec_transfer", "ec_connector"))
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.utils", __path__=[])

    def make_zmq_path(scheme, host, port=None):
        path = f"{scheme}://[{host}]" if ":" in host else f"{scheme}://{host}"
        return path if port is None else f"{path}:{port}"
    _module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
            make_zmq_path=make_zmq_path)
    _module("vllm.utils.collection_utils", is_list_of=lambda v, t: (
        isinstance(v, list) and all(isinstance(x, t) for x in v)))
    outputs.ModelRunnerOutput = type("ModelRunnerOutput", (), {})
    for name in ("vllm.v1.core", "vllm.v1.core.sched"):
        _module(name, __path__=[])
    _module("vllm.v1.core.sched.output", SchedulerOutput=SchedulerOutput)
    _module(EC + ".cpu", __path__=[])
    _module(EC + ".cpu.common", _get_encoder_cache_hidden_dim=lambda c: (
        c.model_config.get_inputs_embeds_size()))

    def no_group():
        raise AssertionError("group is not initialized")
    _module("vllm.distributed.parallel_state", get_tp_group=no_group,
            get_pp_group=no_group)
    info = types.SimpleNamespace(data_parser=types.SimpleNamespace(
        placeholder_metadata_fields=lambda m: (
            {"image_grid_thw"} if m == "image" else set())))
    _module("vllm.multimodal", MULTIMODAL_REGISTRY=types.SimpleNamespace(
        create_processor=lambda mc: types.SimpleNamespace(info=info)))
    if not hasattr(torch.Tensor, "nbytes"):
        torch.Tensor.nbytes = property(
            lambda t: t.numel() * t.element_size())
    if not hasattr(torch.bfloat16, "itemsize"):  # an immutable C type
        gc.get_referents(torch.dtype.__dict__)[0]["itemsize"] = property(
            lambda d: torch.empty((), dtype=d).element_size())
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(torch.dtype))
    if not hasattr(torch, "OutOfMemoryError"):
        torch.OutOfMemoryError = getattr(torch.cuda, "OutOfMemoryError",
                                         MemoryError)


class SchedulerOutput:
    def __init__(self, freed=()):
        self.free_encoder_mm_hashes = list(freed)


class ModelConfig:
    def __init__(self, dtype):
        self.dtype = dtype
        self.hf_config = None

    def get_inputs_embeds_size(self):
        return HIDDEN


def vllm_config(connector, role, port, size, extra):
    import torch
    from vllm.config import ECTransferConfig
    ec = ECTransferConfig(
        ec_connector=connector, ec_role=role, ec_ip="127.0.0.1",
        ec_port=port, ec_buffer_size=size, ec_buffer_device="cpu",
        ec_connector_module_path="ecx.vllm" if connector == "ECXConnector"
        else None, ec_connector_extra_config=dict(extra))
    par = types.SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1,
        data_parallel_size=1, data_parallel_index=0, data_parallel_rank=0,
        rank=0)
    return types.SimpleNamespace(ec_transfer_config=ec, parallel_config=par,
                                 model_config=ModelConfig(torch.bfloat16))


class Feature:
    def __init__(self, mm_hash, tokens, offset):
        import torch
        self.identifier = mm_hash
        self.modality = "image"
        self.mm_position = types.SimpleNamespace(offset=offset, length=tokens)
        grid = torch.tensor([[1, tokens // 4 or 1, 4]])
        self.data = types.SimpleNamespace(
            get_data=lambda: {"image_grid_thw": grid})


class Request:
    """A request of items [(mm_hash, tensor)]: the encoder's (ec_items
    with transfer_id, consumer_zmq) or the consumer's (ec_items with
    mm_hash)."""

    def __init__(self, rid, items, params):
        self.request_id = rid
        self.mm_features, off = [], 1
        for mm_hash, t in items:
            self.mm_features.append(Feature(mm_hash, t.shape[0], off))
            off += t.shape[0] + 1
        self.ec_transfer_params = params

    def get_num_encoder_embeds(self, index):
        return self.mm_features[index].mm_position.length


def proxy_encoder_params(consumer_zmq, k):
    return {"consumer_zmq": consumer_zmq, "ec_items": [
        {"transfer_id": uuid.uuid4().hex} for _ in range(k)]}


def proxy_consumer_params(encoder_reply, mm_hashes):
    """The decode request's ec_transfer_params: ec_items in item order
    (each item's entry found by its uuid, here its mm_hash), every
    encoder entry merged in under its key."""
    return {"ec_items": [{"mm_hash": h, "transfer_id": encoder_reply[h][
        "transfer_id"]} for h in mm_hashes], **encoder_reply}


def item(case, size, rep):
    import torch
    mm_hash = hashlib.sha256(f"{case}:{size}:{rep}".encode()).hexdigest()
    data = random.Random(mm_hash).randbytes(size)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return mm_hash, data, t.view(torch.bfloat16).view(size // 2 // HIDDEN,
                                                      HIDDEN)


class Prefill:
    """A consumer instance (scheduler and one worker rank) stepped as
    vLLM's engine does; load() steps until a request is scheduled and
    returns when, with its tensors from the worker's encoder_cache."""

    def __init__(self, connector, make_config):
        from vllm.distributed.ec_transfer.ec_connector.base import (
            ECConnectorRole)
        self.worker = connector(make_config(), ECConnectorRole.WORKER)
        try:
            self.worker.start_worker_services()
        except RuntimeError:  # its port is taken
            self.worker.shutdown()
            raise
        self.sched = connector(make_config(), ECConnectorRole.SCHEDULER)
        self.cache = {}
        self.freed = []

    def step(self, req):
        from vllm.v1.outputs import ECConnectorOutput
        ready = self.sched.ensure_cache_available(req, 0)
        if ready:
            for i in range(len(req.mm_features)):
                self.sched.update_state_after_alloc(req, i)
        meta = self.sched.build_connector_meta(SchedulerOutput(self.freed))
        self.freed = []
        self.worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        self.worker.start_load_caches(self.cache)
        self.worker.get_finished(set())
        wm = pickle.loads(pickle.dumps(
            self.worker.build_connector_worker_meta()))
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(
            ECConnectorOutput(ec_connector_worker_meta=wm))
        if self.sched.take_unavailable_requests():
            raise RuntimeError(f"request {req.request_id} unavailable")
        return ready

    def load(self, req, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        while not self.step(req):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{req.request_id}: not schedulable")
            time.sleep(0.0005)
        t = time.perf_counter()
        return t, [self.cache[f.identifier] for f in req.mm_features]

    def finish(self, req):
        for i, f in enumerate(req.mm_features):
            self.sched.update_state_after_free(req, i)
            self.cache.pop(f.identifier, None)
            self.freed.append(f.identifier)
        self.sched.request_finished(req)

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


class UpstreamEncoder:
    """Upstream's encoder instance (scheduler and worker connectors), its
    steps as vLLM's engine and model runner make them."""

    def __init__(self, make_config):
        from vllm.distributed.ec_transfer.ec_connector.base import (
            ECConnectorRole)
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector \
            import ECMooncakeConnector
        self.sched = ECMooncakeConnector(make_config(),
                                         ECConnectorRole.SCHEDULER)
        self.worker = ECMooncakeConnector(make_config(),
                                          ECConnectorRole.WORKER)
        self.ended = {}
        self.mgr = mgr = self.worker._worker._producer_pushes

        def stamped(call):  # complete(records), fail(records, error)
            def stamp(records, *error):
                call(records, *error)
                t = time.perf_counter()
                for r in records:
                    self.ended[r.spec.transfer_id] = (
                        t, str(error[0]) if error else None)
            return stamp
        mgr.complete, mgr.fail = stamped(mgr.complete), stamped(mgr.fail)

    def encode(self, params, items, rid):
        """One engine step encoding a request of items; returns (bound
        at, pushes ended at, request_finished's map)."""
        from vllm.v1.outputs import ECConnectorOutput
        req = Request(rid, items, params)
        tids = [e["transfer_id"] for e in params["ec_items"]]
        assert not any(self.sched.has_cache_item(h) for h, _ in items)
        assert self.sched.ensure_cache_available(req, 0)
        for i in range(len(items)):
            self.sched.update_state_after_alloc(req, i)
        meta = self.sched.build_connector_meta(SchedulerOutput())
        self.worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        cache = {}
        self.worker.start_save_caches(encoder_cache=cache)
        for tid in tids:
            self.mgr._records[tid].reservation_future.result(timeout=10)
        cache.update(items)  # the encoder's output
        t0 = time.perf_counter()
        for h, _ in items:
            self.worker.save_caches(encoder_cache=cache, mm_hash=h)
        self.worker.get_finished(set())
        wm = pickle.loads(pickle.dumps(
            self.worker.build_connector_worker_meta()))
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(
            ECConnectorOutput(ec_connector_worker_meta=wm))
        assert not self.sched.take_unavailable_requests()
        _, reply = self.sched.request_finished(req)
        return t0, max(self.ended_at(t) for t in tids), reply

    def ended_at(self, tid, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        while tid not in self.ended:
            if time.monotonic() > deadline:
                raise RuntimeError(f"push {tid} never ended")
            time.sleep(0.0002)
        t, err = self.ended[tid]
        if err:
            raise RuntimeError(f"push {tid} failed: {err}")
        return t

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


class EcxEncoder:
    """ecx's encoder side: an ecx.Producer holding the items and
    ecx.vllm.push.pusher's Pusher."""

    def __init__(self):
        import ecx
        from ecx.vllm.push.pusher import Pusher
        self.prod = ecx.Producer(capacity_bytes=64 << 20,
                                 bind_host="127.0.0.1", registry_port=0,
                                 mooncake=True)
        self.pusher = Pusher(self.prod, control_timeout_s=5.0)

    def encode(self, params, items, rid):
        from ecx.vllm.push.pusher import finished_map, specs_from_params
        feats = []
        for h, t in items:
            self.prod.put(h, t)
            feats.append((h, t.numel() * 2, list(t.shape), "bfloat16",
                          {"image_grid_thw": [[1, t.shape[0] // 4 or 1, 4]]}))
        consumer, specs = specs_from_params(params, feats)
        assert self.pusher.reserve(consumer, specs) == specs, specs[0].error
        t0 = time.perf_counter()
        failed, t1 = self.pusher.push(consumer, specs), time.perf_counter()
        if failed:
            raise RuntimeError(failed[0].error)
        for h, _ in items:
            self.prod.remove(h)
        return t0, t1, finished_map(specs)

    def close(self):
        self.pusher.close()
        self.prod.close()


def one(case, enc, prefill, base, made, rid):
    """One request of items made [(mm_hash, bytes, tensor)] through the
    encoder, the proxy and the prefill: (push s, sched s, reply)."""
    import torch
    items = [(h, t) for h, _, t in made]
    t0, t1, reply = enc.encode(proxy_encoder_params(base, len(items)),
                               items, "enc-" + rid)
    req = Request("dec-" + rid, items,
                  proxy_consumer_params(reply, [h for h, _ in items]))
    t2, got = prefill.load(req)
    for (h, data, t), g in zip(made, got):
        raw = g.contiguous().view(torch.uint8).numpy().tobytes()
        if raw != data or g.shape != t.shape:
            raise RuntimeError(f"{case} {rid} {h[:8]}: bytes differ")
    prefill.finish(req)
    return t1 - t0, t2 - t0, reply


def run_case(case, n):
    from ecx.vllm import ECXConnector
    from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector \
        import ECMooncakeConnector
    ups = {"mooncake_protocol": "tcp", "control_timeout_s": 5,
           "push_wait_timeout_s": 30}
    for port in random.sample(range(20000, 60000), 20):  # a free one
        try:
            if case.endswith("_to_upstream"):
                prefill = Prefill(ECMooncakeConnector, lambda: vllm_config(
                    "ECMooncakeConnector", "ec_consumer", port, 64 << 20,
                    ups))
            else:
                prefill = Prefill(ECXConnector, lambda: vllm_config(
                    "ECXConnector", "ec_consumer", port, 64 << 20,
                    {"control_timeout_s": 5, "push_wait_timeout_s": 30}))
            break
        except RuntimeError:
            continue
    base = f"tcp://127.0.0.1:{port}"
    if case.startswith("upstream_to_"):
        enc = UpstreamEncoder(lambda: vllm_config(
            "ECMooncakeConnector", "ec_producer", port + 1, 64 << 20, ups))
    else:
        enc = EcxEncoder()
    rows = {}
    # One item a request, then the three sizes in one request
    # (reserve_batch, complete_batch), a tenth as often.
    plan = [(str(z), n, [z]) for z in SIZES] + [
        ("batch_of_3", max(3, n // 10), SIZES)]
    try:
        for name, reps, sizes in plan:
            got = [one(case, enc, prefill, base, [item(
                case, z, f"{name}-{rep}") for z in sizes], f"{name}-{rep}")
                for rep in range(reps)]
            rows[name] = {"n": reps, "bytes_checked": reps * len(sizes)}
            for k, key in enumerate(("push_ms", "sched_ms")):
                rows[name][key] = round(statistics.median(
                    g[k] for g in got) * 1e3, 3)
            reply = got[0][2]
    finally:
        enc.close()
        prefill.close()
    return {"sizes": rows, "encoder_reply": json.dumps(
        {k[:12] + "...": v for k, v in reply.items()})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True,
                    help="folder with upstream's vllm/... files")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--case", choices=CASES)
    ap.add_argument("--engine", choices=["mooncake", "mcwire"],
                    default="mooncake")
    args = ap.parse_args()
    os.environ.setdefault("MC_FORCE_TCP", "1")
    if args.case:  # a child: one case, one JSON line
        logging.basicConfig(level=logging.WARNING)
        install_stubs(os.path.abspath(args.source))
        if args.engine == "mcwire":
            _module("mooncake", __path__=[])  # mcwire_engine: beside this
            from mcwire_engine import TransferEngine
            _module("mooncake.engine", TransferEngine=TransferEngine)
        try:
            out = {"ok": True, **run_case(args.case, args.n)}
        except Exception as e:  # said, with the case, in the summary
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
        os._exit(0 if out["ok"] else 1)
    results = {"engine": args.engine, "load_average": os.getloadavg(),
               "n": args.n, "hidden": HIDDEN, "dtype": "bfloat16",
               "cases": {}}
    for case in CASES:
        p = subprocess.run([sys.executable, __file__, "--source",
                            args.source, "--n", str(args.n), "--case", case,
                            "--engine", args.engine],
                           capture_output=True, text=True, timeout=900)
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        results["cases"][case] = json.loads(lines[-1]) if lines else {
            "ok": False, "rc": p.returncode, "stderr": p.stderr[-2000:]}
    results["load_average_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    return 0 if all(c["ok"] for c in results["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
