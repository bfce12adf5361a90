#!/usr/bin/env python3
"""A soak inside real vLLM: many requests, each with an image of its own,
through ecx pull and ecx push, a few in flight at all times.

    .venv/bin/python bench/vllm_soak.py [--requests 1000] [--inflight 4]
        [--modes pull,push]

One ecx encoder (`--mm-encoder-only`, core 0) and one ecx prefill (core
1; it pulls from the encoder's registry and takes pushes), ecx's router
in front (pull mode, then push mode), and one aggregated instance whose
tokens every answer must equal; tests/vllm's tiny model and harness.
Every instance runs with vLLM's multimodal processor cache bounded to
--processor-cache-gb (default 0.05): it keeps up to 4 GiB of processed
inputs by default, one entry per new image, which would grow every
instance's RSS through a soak of new images whatever the connector does;
it is not turned off (0), as with it off vLLM names an item by its
request ("renderer0-mm-N-image-0"), not by a hash of its content, and an
encoder's output is then found under no name a prefill asks for.
"""
import argparse
import concurrent.futures
import io
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))

import harness  # noqa: E402


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def image(seed, w=112, h=84):
    """A PNG data URL of random pixels (numpy: fast enough for thousands)."""
    import base64

    import numpy as np
    from PIL import Image

    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def rss_mib(proc):
    """RSS of proc's process group (MiB), from /proc."""
    pgid = proc.proc.pid
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open("/proc/%s/statm" % pid) as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            continue
    return total / 2 ** 20


def shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000,
                    help="requests per mode (default 1000)")
    ap.add_argument("--inflight", type=int, default=4,
                    help="requests in flight at all times (default 4)")
    ap.add_argument("--modes", default="pull,push",
                    help="comma-separated: pull, push")
    ap.add_argument("--processor-cache-gb", type=float, default=0.05,
                    help="vLLM's --mm-processor-cache-gb on every instance "
                    "(default 0.05; vLLM's own default is 4)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if any(m not in ("pull", "push") for m in modes) or args.requests < 10 \
            or args.inflight < 1:
        ap.error("--modes is pull and/or push, --requests at least 10, "
                 "--inflight at least 1")
    shm0 = shm()
    tmp = tempfile.mkdtemp(prefix="vllm_soak.")
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    cwd = os.path.join(tmp, "good")
    subprocess.run([harness.PYTHON, os.path.join(ROOT, "tests", "vllm",
                                                 "make_model.py"),
                    os.path.join(cwd, "tiny")], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=harness.clean_env())
    reg, ec_port = harness.free_ports(2)
    if args.processor_cache_gb <= 0:
        ap.error("--processor-cache-gb must be above 0 (at 0 vLLM names "
                 "items by request, and no encoder output is found)")
    extra = ["--mm-processor-cache-gb", str(args.processor_cache_gb)]
    ecx = {"ec_connector": "ECXConnector",
           "ec_connector_module_path": "ecx.vllm"}
    enc = harness.Instance("soak-encoder", cwd, logs, core=0, ec=dict(
        ecx, ec_role="ec_producer", ec_connector_extra_config={
            "registry_http_port": reg, "bind_host": "127.0.0.1",
            "capacity_bytes": "256MiB", "log_interval_s": 5}),
        extra_args=["--mm-encoder-only"] + extra)
    pre = harness.Instance("soak-prefill", cwd, logs, core=1, ec=dict(
        ecx, ec_role="ec_consumer", ec_buffer_device="cpu",
        ec_ip="127.0.0.1", ec_port=ec_port, ec_connector_extra_config={
            "remote_registry_url": "http://127.0.0.1:%d" % reg,
            "push": True, "recv_capacity_bytes": "256MiB",
            "log_interval_s": 5}), extra_args=extra)
    agg = harness.Instance("soak-aggregated", cwd, logs, core=1,
                           extra_args=extra)
    procs = [enc, pre, agg]
    results = []
    try:
        harness.wait_healthy(procs)
        for mode in modes:
            router = harness.Router(
                "soak-router-" + mode, logs, cwd, mode, [enc.url], [pre.url],
                ["tcp://127.0.0.1:%d" % ec_port] if mode == "push" else [])
            procs.append(router)
            results.append(soak(args, mode, router, enc, pre, agg))
    finally:
        for p in procs:
            p.stop()
    time.sleep(1)
    left = sorted(shm() - shm0)
    vllm_left = [f for f in left if f.startswith(("psm_", "sem.mp-"))]
    ecx_left = [f for f in left if f not in vllm_left]
    for r in results:
        print("%(mode)s: %(ok)d answered, %(failed)d failed, %(differ)d "
              "tokens differ, %(remote)d of %(items)d items from the encoder, "
              "%(rps).1f req/s" % r)
        print("  RSS MiB encoder %s; prefill %s" % (
            " ".join("%.0f" % x for x in r["rss_enc"]),
            " ".join("%.0f" % x for x in r["rss_pre"])))
        print("  growth from the third tenth to the end: encoder %+.1f MiB, "
              "prefill %+.1f MiB" % (r["rss_enc"][-1] - r["rss_enc"][2],
                                     r["rss_pre"][-1] - r["rss_pre"][2]))
    print("/dev/shm after shutdown: %d ecx file(s) left %s; vLLM's own: %d "
          "%s" % (len(ecx_left), ecx_left, len(vllm_left), vllm_left))
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


def soak(args, mode, router, enc, pre, agg):
    n = args.requests
    base = 7_000_000 if mode == "pull" else 8_000_000
    key = "items_remote" if mode == "pull" else "push_items_taken"
    before = harness.fresh_counters(pre)

    def one(i):
        body = harness.chat([image(base + i)])
        st, out = harness.post(router.url, body, timeout=300)
        if st != 200:
            return "failed", None
        got = out["choices"][0]["token_ids"]
        return "ok", got == harness.tokens(agg.url, body)

    rss_enc, rss_pre = [], []
    ok = failed = differ = 0
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.inflight) as pool:
        futs = [pool.submit(one, i) for i in range(n)]
        for i, f in enumerate(futs):
            what, equal = f.result()
            ok += what == "ok"
            failed += what == "failed"
            differ += equal is False
            if (i + 1) % max(1, n // 10) == 0:
                rss_enc.append(rss_mib(enc))
                rss_pre.append(rss_mib(pre))
                log("vllm_soak %s: %d/%d, %d failed, %d differ, RSS encoder "
                    "%.0f MiB, prefill %.0f MiB" % (
                        mode, i + 1, n, failed, differ, rss_enc[-1],
                        rss_pre[-1]))
    wall = time.monotonic() - t0
    after = harness.fresh_counters(pre)
    return {"mode": mode, "ok": ok, "failed": failed, "differ": differ,
            "remote": after.get(key, 0) - before.get(key, 0), "items": n,
            "rps": n / wall, "rss_enc": rss_enc, "rss_pre": rss_pre}


if __name__ == "__main__":
    main()
