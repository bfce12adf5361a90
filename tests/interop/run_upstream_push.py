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
first on the stub package's __path__, so upstream's utils.py is the one
both encoders' request_finished use). README.md: which commits.

What stands in for vLLM (the minimum their imports and calls need):
upstream_vllm.py, whose docstring names every stub. The driver reads two
things of each encoder's internals, to time and to wait, never to change
them: the end of each push is stamped (upstream's producer worker's
ProducerPushManager.complete and .fail wrapped; ecx's worker's
EncoderPushes._end wrapped), and the reservation of a push (upstream's
reservation future; ecx's reserve future) is waited on before its encoder
output is bound (as a forward pass longer than a reserve round trip
would).

The proxy's part is a stand-in of disagg_epd_proxy.py's flow (PUSH.md
section 6): a uuid4 hex transfer_id per item, {"consumer_zmq", "ec_items":
[{"transfer_id"}]} to the encoder, the encoder's {mm_hash: {metadata,
transfer_id}} back, {"ec_items": [{"mm_hash", "transfer_id"}], mm_hash:
entry} to the consumer.

Cases, each in a child process of its own, one request per item, N per
size (64 KiB, 1 MiB, 7 MiB of bfloat16 [tokens, 2048]), then the three in
one request (reserve_batch, complete_batch) N/10 times (at least 3), every
byte checked in the consumer's encoder_cache. Both encoders are
ec_producer connectors, scheduler and worker, stepped alike as vLLM's
engine and model runner step them (ensure_cache_available,
update_state_after_alloc, build_connector_meta, start_save_caches,
save_caches, get_finished, build_connector_worker_meta,
update_connector_output, then request_finished, whose map is the
encoder's reply to the proxy; after the consumer has its items, steps
with nothing scheduled while has_pending_push_work):
  upstream_to_ecx  upstream's encoder (ECMooncakeConnector) into an ecx
    prefill (ECXConnector ec_consumer with ec_ip/ec_port, no registry);
  ecx_to_upstream  ecx's encoder (ECXConnector, an ecx.Producer with its
    embedded registry behind the worker) into upstream's consumer
    (ECMooncakeConnector ec_consumer, scheduler and worker,
    start_worker_services);
  ecx_to_ecx, upstream_to_upstream  the baselines (two Mooncake engines in
    one process for the latter).
push_ms: the encoder output bound (save_caches) to the push
done (every write and complete acknowledged); sched_ms: from the same to
the consumer's ensure_cache_available true, a step every 0.5 ms. Medians,
printed as one JSON object. How to run, and --engine mcwire: README.md.
"""
import argparse
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
import uuid

from upstream_vllm import (HIDDEN, Request, SchedulerOutput, _module,
                           install_stubs, vllm_config)

SIZES = [64 << 10, 1 << 20, 7 << 20]
CASES = ["upstream_to_ecx", "ecx_to_upstream", "ecx_to_ecx",
         "upstream_to_upstream"]


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


class Encoder:
    """An encoder instance (scheduler and worker connectors of one
    class, ec_producer), its steps as vLLM's engine and model runner make
    them; a subclass stamps when each push ends (ended) and names the
    reservation of a push (reserved)."""

    def __init__(self, connector, make_config):
        from vllm.distributed.ec_transfer.ec_connector.base import (
            ECConnectorRole)
        self.sched = connector(make_config(), ECConnectorRole.SCHEDULER)
        self.worker = connector(make_config(), ECConnectorRole.WORKER)
        self.ended = {}  # transfer_id -> (perf_counter, error or None)
        self.cache = {}
        self.finished = set()

    def stamp(self, tid, error):
        self.ended[tid] = (time.perf_counter(), error)

    def step(self, req=None):
        """One engine step: req (a request of items, all to encode)
        scheduled, its metadata bound, the step's start of saves; returns
        the encoder cache for the model runner to fill."""
        if req is not None:
            assert not any(self.sched.has_cache_item(f.identifier)
                           for f in req.mm_features)
            assert self.sched.ensure_cache_available(req, 0)
            for i in range(len(req.mm_features)):
                self.sched.update_state_after_alloc(req, i)
        meta = self.sched.build_connector_meta(SchedulerOutput())
        self.worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        self.worker.start_save_caches(encoder_cache=self.cache)
        return self.cache

    def end_step(self):
        from vllm.v1.outputs import ECConnectorOutput
        self.worker.get_finished(self.finished)
        self.finished = set()
        wm = pickle.loads(pickle.dumps(
            self.worker.build_connector_worker_meta()))
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(
            ECConnectorOutput(ec_connector_worker_meta=wm))
        assert not self.sched.take_unavailable_requests()

    def encode(self, params, items, rid):
        """One engine step encoding a request of items, then its
        request_finished; returns (bound at, pushes ended at, the map)."""
        req = Request(rid, items, params)
        tids = [e["transfer_id"] for e in params["ec_items"]]
        cache = self.step(req)
        for tid in tids:
            self.reserved(tid).result(timeout=10)
        cache.update(items)  # the encoder's output
        t0 = time.perf_counter()
        for h, _ in items:
            self.worker.save_caches(encoder_cache=cache, mm_hash=h)
        self.end_step()
        for h, _ in items:  # vLLM frees an encoder-only request's cache
            cache.pop(h)
        _, reply = self.sched.request_finished(req)
        self.finished.add(rid)
        return t0, max(self.ended_at(t) for t in tids), reply

    def drain(self, timeout_s=20.0):
        """Steps with nothing scheduled while has_pending_push_work, as
        vLLM's engine keeps stepping for it."""
        deadline = time.monotonic() + timeout_s
        while self.sched.has_pending_push_work():
            if time.monotonic() > deadline:
                raise RuntimeError("has_pending_push_work stays true")
            self.step()
            self.end_step()
            time.sleep(0.001)

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


class UpstreamEncoder(Encoder):
    """Upstream's ECMooncakeConnector: its ProducerPushManager's complete
    and fail stamp; a push's reservation_future."""

    def __init__(self, make_config):
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector \
            import ECMooncakeConnector
        super().__init__(ECMooncakeConnector, make_config)
        self.mgr = mgr = self.worker._worker._producer_pushes

        def stamped(call):  # complete(records), fail(records, error)
            def stamp(records, *error):
                call(records, *error)
                for r in records:
                    self.stamp(r.spec.transfer_id,
                               str(error[0]) if error else None)
            return stamp
        mgr.complete, mgr.fail = stamped(mgr.complete), stamped(mgr.fail)

    def reserved(self, tid):
        return self.mgr._records[tid].reservation_future


class EcxEncoder(Encoder):
    """ECXConnector (an ecx.Producer with its embedded registry behind
    the worker): its EncoderPushes' _end stamps; a push's reserve."""

    def __init__(self, make_config):
        from ecx.vllm import ECXConnector
        super().__init__(ECXConnector, make_config)
        self.pushes = p = self.worker._worker._pushes
        end = p._end

        def stamped(push, error):
            end(push, error)
            self.stamp(push.plan.transfer_id, error)
        p._end = stamped

    def reserved(self, tid):
        return self.pushes._live[tid].reserved


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
    enc.drain()
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
        enc = EcxEncoder(lambda: vllm_config(
            "ECXConnector", "ec_producer", port + 1, 64 << 20, {
                "registry_http_port": 0, "bind_host": "127.0.0.1",
                "capacity_bytes": 64 << 20, "control_timeout_s": 5}))
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
