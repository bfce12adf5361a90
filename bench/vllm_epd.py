#!/usr/bin/env python3
"""Time to first token through an encoder/prefill split inside real vLLM,
every connector side by side, in one run:

    .venv/bin/python bench/vllm_epd.py [--models tiny,mib] [--runs 2]
        [--requests 10] [--concurrency 1,8] [--connectors LIST] [--json F]

Connectors (--connectors, default all):

- `aggregated`: one vLLM that encodes its images itself, on one core
  (the baseline every split is judged by), asked directly;
- `example`: vLLM's ECExampleConnector (a safetensors file per item);
- `vllm-mooncake`: vLLM's own ECMooncakeConnector (push over Mooncake's
  TCP wire); its consumer loads tests/vllm/runner_patch (vLLM 0.32's
  model runner lacks one branch it needs);
- `reference`: the registry-pull connector of
  ../shared/reference/ec_mooncake_connector.py.txt, loaded into vLLM by
  bench/vllm_ref/ref_ec_connector.py (its four shims are listed there);
- `ecx-pull`, `ecx-push`: ECXConnector, pulling from the encoder's
  registry, or pushed into by the encoder. A row of its own with other
  prefill settings: `ecx-pull+KEY=VALUE[+KEY=VALUE...]` (VALUE in JSON,
  else a string), e.g. `--connectors ecx-pull,ecx-pull+idle_wait_ms=0`
  to judge a setting against its default in the same run (a key the
  connector does not know stops the run; a VALUE holds no `,` or `+`).

Every split runs an encoder (`--mm-encoder-only`, core 0) and a prefill
(core 1), with ecx's router in front (python -m ecx.router, pull or push
mode: the encoder's request first, then the prefill's; --overlap passes
the router's --overlap for the push connectors). Each instance is
tests/vllm/harness.py's (float32, 127.0.0.1, free ports, its own process
group) with prefix caching off; a connector's instances start, serve,
and stop before the next connector's start.

Models (--models): `tiny` (tests/vllm's: text hidden 128, 64x64 to
448x336 images, 4 to 192 tokens of 512 bytes: 2 KiB to 96 KiB an
image) and `mib` (the same architecture, text hidden 1,024 and 1 layer,
images 448x336 to 1280x720: 0.8 to 4.9 MB an image, a 7B VLM's size
class).

A cell is a connector, a model, an image size and a concurrency: after
two warm-up requests, --requests requests of one new image each (drawn
from a seed that names the cell and the run, the same for every
connector), streamed, with --concurrency of them in flight. Each run
repeats every cell with new images. Printed per cell and run: TTFT p50
and p90 (ms, from the client's send to the first streamed token), the
end-to-end latency p50, requests per second, and whether every answer's
tokens equal the aggregated instance's; then where the time went, from
the prefill's own /metrics: vLLM's time to first token inside the prefill
(vllm:time_to_first_token_seconds, its mean over the cell), the rest
(router and encoder, before the prefill saw the request), and, for ecx,
how long requests waited for their remote items
(vllm:ecx_request_wait_seconds_total / vllm:ecx_requests_remote_total)
and how many items came from the encoder (pulled or pushed, against the
cell's items: fewer means the prefill encoded some itself).

Progress goes to stderr, the tables to stdout (markdown), --json F
writes every request's figures. Takes about 15 minutes with the defaults
on two cores. Needs `make venv` (vLLM's CPU build and this checkout's ecx
in .venv) and, for the two Mooncake rows, the Mooncake engine from
tests/requirements.txt.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))

import harness  # noqa: E402

CONNECTORS = ("aggregated", "example", "vllm-mooncake", "reference",
              "ecx-pull", "ecx-push")
MODELS = {
    "tiny": {"args": [], "sizes": [(224, 224), (448, 336), (640, 480)]},
    "mib": {"args": ["--hidden", "1024", "--layers", "1",
                     "--max-pixels", str(1280 * 784)],
            "sizes": [(448, 336), (896, 672), (1280, 720)]},
}
PATCH = os.path.join(ROOT, "tests", "vllm", "runner_patch")
REF_DIR = os.path.join(HERE, "vllm_ref")
REF_PAGE = os.path.join(ROOT, "..", "shared", "reference",
                        "ec_mooncake_connector.py.txt")
MC_ENV = {"MC_FORCE_TCP": "1"}
COMMON = ["--no-enable-prefix-caching"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def ecx_ec(role, extra):
    return {"ec_connector": "ECXConnector",
            "ec_connector_module_path": "ecx.vllm", "ec_role": role,
            "ec_buffer_device": "cpu",
            "ec_connector_extra_config": dict(extra, log_interval_s=5)}


def variant(conn):
    """(base connector, prefill keys) of a --connectors entry: ecx rows
    may carry +KEY=VALUE settings of their own. Raises ValueError."""
    base, *sets = conn.split("+")
    if base not in CONNECTORS:
        raise ValueError("unknown connector %r (have %s)" %
                         (base, ", ".join(CONNECTORS)))
    if sets and not base.startswith("ecx"):
        raise ValueError("%r: only ecx rows take +KEY=VALUE" % conn)
    keys = {}
    for kv in sets:
        k, eq, v = kv.partition("=")
        if not k or not eq:
            raise ValueError("%r: %r is not KEY=VALUE" % (conn, kv))
        try:
            keys[k] = json.loads(v)
        except ValueError:
            keys[k] = v
    return base, keys


def filename(conn):
    """conn as a log file's name (a +KEY=VALUE may hold a URL)."""
    return re.sub(r"[^\w.=+-]", "_", conn)


def split(conn, cwd, logs, tmp, ecx_extra=None):
    """(encoder, prefill, router mode, consumer zmq) of connector conn,
    started. ecx_extra: keys added to an ecx prefill's extra config (the
    row's own +KEY=VALUE keys over them)."""
    name, own = variant(conn)
    reg, ec_port = harness.free_ports(2)
    enc_env = pre_env = None
    zmq = []
    mode = "pull"
    if name == "example":
        shared = os.path.join(tmp, "ec_cache")
        os.makedirs(shared, exist_ok=True)
        enc = pre = {"ec_connector": "ECExampleConnector",
                     "ec_connector_extra_config": {
                         "shared_storage_path": shared}}
        enc = dict(enc, ec_role="ec_producer")
        pre = dict(pre, ec_role="ec_consumer")
    elif name == "vllm-mooncake":
        mc = {"ec_connector": "ECMooncakeConnector", "ec_buffer_device": "cpu",
              "ec_buffer_size": 2 ** 29}
        enc = dict(mc, ec_role="ec_producer", ec_connector_extra_config={
            "mooncake_protocol": "tcp"})
        pre = dict(mc, ec_role="ec_consumer", ec_ip="127.0.0.1",
                   ec_port=ec_port, ec_connector_extra_config={
                       "mooncake_protocol": "tcp",
                       "push_wait_timeout_s": 60})
        enc_env = MC_ENV
        pre_env = dict(MC_ENV, PYTHONPATH=PATCH)
        mode, zmq = "push", ["tcp://127.0.0.1:%d" % ec_port]
    elif name == "reference":
        ref = {"ec_connector": "ReferenceECMooncakeConnector",
               "ec_connector_module_path": "ref_ec_connector",
               "ec_buffer_device": "cpu"}
        enc = dict(ref, ec_role="ec_producer", ec_connector_extra_config={
            "mooncake_protocol": "tcp", "registry_http_port": reg})
        pre = dict(ref, ec_role="ec_consumer", ec_connector_extra_config={
            "mooncake_protocol": "tcp",
            "remote_registry_url": "http://127.0.0.1:%d" % reg})
        enc_env = pre_env = dict(MC_ENV, PYTHONPATH=REF_DIR,
                                 ECX_REFERENCE_PAGE=REF_PAGE)
    elif name == "ecx-pull":
        enc = ecx_ec("ec_producer", {"registry_http_port": reg,
                                     "bind_host": "127.0.0.1",
                                     "capacity_bytes": "1GiB"})
        pre = ecx_ec("ec_consumer", {
            "remote_registry_url": "http://127.0.0.1:%d" % reg,
            "recv_capacity_bytes": "1GiB"})
    elif name == "ecx-push":
        enc = ecx_ec("ec_producer", {"registry_http_port": reg,
                                     "bind_host": "127.0.0.1",
                                     "capacity_bytes": "1GiB"})
        pre = ecx_ec("ec_consumer", {"push": True,
                                     "recv_capacity_bytes": "1GiB"})
        pre.update(ec_ip="127.0.0.1", ec_port=ec_port)
        mode, zmq = "push", ["tcp://127.0.0.1:%d" % ec_port]
    else:
        raise ValueError(name)
    if name.startswith("ecx"):
        pre["ec_connector_extra_config"].update(ecx_extra or {})
        pre["ec_connector_extra_config"].update(own)
    e = harness.Instance(filename(conn) + "-encoder", cwd, logs, core=0,
                         ec=enc, extra_args=["--mm-encoder-only"] + COMMON,
                         env=enc_env)
    p = harness.Instance(filename(conn) + "-prefill", cwd, logs, core=1,
                         ec=pre,
                         extra_args=COMMON, env=pre_env)
    return [e, p], mode, zmq


def stream(url, body, timeout=300):
    """One streamed chat request: (ttft s, latency s, token ids or text,
    error or None)."""
    body = dict(body, stream=True)
    req = urllib.request.Request(url + "/v1/chat/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    ids, text = [], []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if not line.startswith(b"data: ") or line == b"data: [DONE]\n":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices", ()):
                    got = ch.get("token_ids") or []
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if (got or piece) and ttft is None:
                        ttft = time.monotonic() - t0
                    ids.extend(got)
                    text.append(piece)
    except Exception as e:  # noqa: BLE001 - reported per request
        return None, time.monotonic() - t0, None, "%s: %s" % (
            type(e).__name__, e)
    lat = time.monotonic() - t0
    if ttft is None:
        return None, lat, None, "no token streamed"
    return ttft, lat, ids or "".join(text), None


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def metrics(inst):
    try:
        return harness.prometheus(inst)
    except Exception:  # noqa: BLE001 - an instance without /metrics
        return {}


def delta(after, before, key):
    return after.get(key, 0.0) - before.get(key, 0.0)


def run_cell(url, bodies, conc):
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(conc) as pool:
        out = list(pool.map(lambda b: stream(url, b), bodies))
    return out, time.monotonic() - t0


def bodies_for(model, size, conc, run, n, warm=False):
    w, h = size
    base = zlib.crc32(repr((model, w, h, conc, run, warm)).encode()) \
        % 10 ** 6 * 100
    return [harness.chat([harness.image(w, h, base + i)])
            for i in range(n)]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,mib",
                    help="comma-separated, of %s" % ", ".join(MODELS))
    ap.add_argument("--connectors", default=",".join(CONNECTORS),
                    help="comma-separated, of %s; an ecx row may add "
                    "+KEY=VALUE prefill settings (ecx-pull+idle_wait_ms=0)"
                    % ", ".join(CONNECTORS))
    ap.add_argument("--concurrency", default="1,8",
                    help="requests in flight per cell, comma-separated")
    ap.add_argument("--requests", type=int, default=10,
                    help="requests per cell and run (default 10)")
    ap.add_argument("--runs", type=int, default=2,
                    help="runs of every cell, each with new images")
    ap.add_argument("--json", help="write every request's figures here")
    ap.add_argument("--overlap", action="store_true",
                    help="the router's --overlap for the push connectors "
                    "(default: its default order)")
    ap.add_argument("--ecx-extra", type=json.loads, default={},
                    metavar="JSON", help="keys added to the ecx prefills' "
                    "ec_connector_extra_config, e.g. '{\"idle_wait_ms\": 0}'")
    ap.add_argument("--keep", action="store_true",
                    help="keep the working folder (models, logs)")
    args = ap.parse_args()
    models = args.models.split(",")
    conns = args.connectors.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    for m in models:
        if m not in MODELS:
            ap.error("unknown model %r (have %s)" % (m, ", ".join(MODELS)))
    for c in conns:
        try:
            variant(c)
        except ValueError as e:
            ap.error(str(e))
    if any(c < 1 for c in concs) or args.requests < 1 or args.runs < 1:
        ap.error("--concurrency, --requests and --runs are at least 1")
    if "aggregated" not in conns:
        conns.insert(0, "aggregated")  # the baseline and the tokens
    if "reference" in conns and not os.path.exists(REF_PAGE):
        ap.error("the reference connector's page is not at %s" % REF_PAGE)

    tmp = tempfile.mkdtemp(prefix="vllm_epd.")
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    log("vllm_epd: working in %s; %s" % (tmp, time.strftime("%H:%M:%S")))
    rows = []
    try:
        for model in models:
            cwd = os.path.join(tmp, model)
            subprocess.run([harness.PYTHON,
                            os.path.join(ROOT, "tests", "vllm", "make_model.py"),
                            os.path.join(cwd, "tiny")] + MODELS[model]["args"],
                           check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=harness.clean_env())
            want = {}
            for conn in conns:
                rows += bench_connector(args, model, conn, cwd, logs, tmp,
                                        concs, want)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.keep:
            log("vllm_epd: kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(rows, models, conns, concs, args.runs)


def bench_connector(args, model, conn, cwd, logs, tmp, concs, want):
    log("vllm_epd: %s, %s: starting" % (model, conn))
    router = None
    if conn == "aggregated":
        procs = [harness.Instance("%s-aggregated" % model, cwd, logs, core=0,
                                  extra_args=COMMON)]
        mode, zmq = None, []
    else:
        procs, mode, zmq = split(conn, cwd, logs, tmp, args.ecx_extra)
    rows = []
    try:
        harness.wait_healthy(procs)
        ignored = [ln for ln in procs[-1].text().splitlines()
                   if "ignoring unknown ec_connector_extra_config" in ln]
        if ignored:  # a misspelt +KEY=VALUE: the row would be the default
            raise RuntimeError("%s: %s" % (conn, ignored[0].strip()))
        url = procs[0].url
        if conn != "aggregated":
            router = harness.Router(
                "%s-%s-router" % (model, filename(conn)), logs, cwd, mode,
                [procs[0].url], [procs[1].url], zmq,
                ["--overlap"] if mode == "push" and args.overlap else [])
            url = router.url
        pre = procs[-1]
        for size in MODELS[model]["sizes"]:
            for b in bodies_for(model, size, 0, 0, 2, warm=True):
                stream(url, b)
            for run in range(args.runs):
                for conc in concs:
                    bodies = bodies_for(model, size, conc, run, args.requests)
                    m0 = metrics(pre)
                    out, wall = run_cell(url, bodies, conc)
                    time.sleep(5.5 if conn.startswith("ecx") else 0.2)
                    stream(url, harness.chat([], "tick"))  # logs, counters
                    m1 = metrics(pre)
                    rows.append(cell_row(model, conn, size, conc, run, bodies,
                                         out, wall, m0, m1, want))
                    r = rows[-1]
                    if not r["ok"]:
                        raise RuntimeError("no request of %dx%d served: %s" %
                                           (size[0], size[1], r["errors"]))
                    log("vllm_epd: %s %s %dx%d c%d run %d: TTFT p50 %.0f ms, "
                        "%d/%d ok, tokens %s" % (
                            model, conn, size[0], size[1], conc, run,
                            r["ttft_p50_ms"], r["ok"], len(bodies),
                            r["tokens"]))
    except Exception as e:  # noqa: BLE001 - the next connector still runs
        log("vllm_epd: %s, %s: FAILED: %s" % (model, conn, e))
        for p in procs:
            if not p.alive():
                log(p.tail(15))
        rows.append({"model": model, "connector": conn, "failed": str(e)})
    finally:
        if router is not None:
            router.stop()
        for p in procs:
            p.stop()
    return rows


def cell_row(model, conn, size, conc, run, bodies, out, wall, m0, m1, want):
    ttfts = [o[0] * 1e3 for o in out if o[0] is not None]
    lats = [o[1] * 1e3 for o in out if o[3] is None]
    errors = [o[3] for o in out if o[3] is not None]
    key = (model, size, conc, run)
    toks = [o[2] for o in out]
    if conn == "aggregated":
        want[key] = toks
        equal = "ref"
    elif key in want:
        same = sum(1 for a, b in zip(toks, want[key]) if a is not None and
                   a == b)
        equal = "%d/%d" % (same, len(toks))
    else:
        equal = "?"
    n = delta(m1, m0, "vllm:time_to_first_token_seconds_count")
    pre_ttft = delta(m1, m0, "vllm:time_to_first_token_seconds_sum") / n \
        * 1e3 if n else float("nan")
    remote = delta(m1, m0, "vllm:ecx_items_remote_total") + \
        delta(m1, m0, "vllm:ecx_push_items_taken_total")
    rr = delta(m1, m0, "vllm:ecx_requests_remote_total")
    wait = delta(m1, m0, "vllm:ecx_request_wait_seconds_total") / rr * 1e3 \
        if rr else float("nan")
    return {"model": model, "connector": conn, "size": "%dx%d" % size,
            "concurrency": conc, "run": run, "requests": len(bodies),
            "ok": len(lats), "errors": errors[:3],
            "ttft_ms": ttfts, "latency_ms": lats,
            "ttft_p50_ms": statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p90_ms": pct(ttfts, 0.9),
            "latency_p50_ms": statistics.median(lats) if lats else float("nan"),
            "rps": len(lats) / wall if wall else 0.0,
            "tokens": equal,
            "prefill_ttft_ms": pre_ttft,
            "ecx_remote_items": remote if conn.startswith("ecx") else None,
            "ecx_wait_ms": wait}


def report(rows, models, conns, concs, runs):
    ok = [r for r in rows if "failed" not in r]
    for r in rows:
        if "failed" in r:
            print("**%s, %s failed**: %s\n" % (r["model"], r["connector"],
                                               r["failed"]))
    for model in models:
        sizes = ["%dx%d" % s for s in MODELS[model]["sizes"]]
        for conc in concs:
            print("### %s model, concurrency %d: TTFT p50/p90 ms, "
                  "each run (latency p50 ms; req/s)\n" % (model, conc))
            print("| connector | " + " | ".join(sizes) + " | tokens |")
            print("|---" * (len(sizes) + 2) + "|")
            for conn in conns:
                cells, toks = [], []
                for s in sizes:
                    rs = [r for r in ok if r["model"] == model and
                          r["connector"] == conn and r["size"] == s and
                          r["concurrency"] == conc]
                    cells.append(", ".join(
                        "%.0f/%.0f (%.0f; %.1f)" % (
                            r["ttft_p50_ms"], r["ttft_p90_ms"],
                            r["latency_p50_ms"], r["rps"])
                        + ("" if r["ok"] == r["requests"] else
                           " %d/%d served" % (r["ok"], r["requests"]))
                        for r in rs) or "-")
                    toks += [r["tokens"] for r in rs]
                print("| %s | %s | %s |" % (conn, " | ".join(cells),
                                            tokens_summary(toks)))
            print()
        print("### %s model, where the time went (mean ms over the cell, "
              "first run): the prefill's own TTFT (vLLM's), the rest "
              "(router and encoder), ecx's wait for remote items\n" % model)
        print("| connector | concurrency | " + " | ".join(sizes) + " |")
        print("|---" * (len(sizes) + 2) + "|")
        for conn in conns:
            for conc in concs:
                cells = []
                for s in sizes:
                    rs = [r for r in ok if r["model"] == model and
                          r["connector"] == conn and r["size"] == s and
                          r["concurrency"] == conc and r["run"] == 0]
                    if not rs:
                        cells.append("-")
                        continue
                    r = rs[0]
                    mean = statistics.mean(r["ttft_ms"]) if r["ttft_ms"] \
                        else float("nan")
                    c = "prefill %.0f, before it %.0f" % (
                        r["prefill_ttft_ms"], mean - r["prefill_ttft_ms"])
                    if r["ecx_wait_ms"] == r["ecx_wait_ms"]:
                        c += ", ecx wait %.1f" % r["ecx_wait_ms"]
                    if r.get("ecx_remote_items") is not None:
                        c += ", %d/%d items from the encoder" % (
                            r["ecx_remote_items"], r["requests"])
                    cells.append(c)
                print("| %s | %d | %s |" % (conn, conc, " | ".join(cells)))
        print()


def tokens_summary(toks):
    if not toks or all(t == "ref" for t in toks):
        return "(reference)"
    same = total = 0
    for t in toks:
        if "/" in t:
            a, b = t.split("/")
            same, total = same + int(a), total + int(b)
    return "%d/%d equal" % (same, total)


if __name__ == "__main__":
    main()
