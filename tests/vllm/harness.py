"""Real vLLM instances, ecx's router and requests, for tests/vllm/.

Every instance is `python -m vllm.entrypoints.openai.api_server` of the
test environment (.venv, scripts/venv.sh), started in a folder outside
the checkout with no PYTHONPATH, so that the ecx it loads is the one
installed from its wheel. Each binds 127.0.0.1 on a free port and is
stopped by the test that started it (its whole process group).

vLLM keys encoder outputs by a hash of the --model string and the item,
so every instance is started as `--model tiny` from a folder holding
`tiny/` (the poisoned encoder from another folder, whose `tiny/` has the
vision merger negated: tests/vllm/make_model.py).
"""

import base64
import concurrent.futures
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.environ.get("ECX_PYTHON") or sys.executable
START_S = float(os.environ.get("ECX_VLLM_START_S", "600"))
MAX_TOKENS = 32


_GIVEN = set()  # ports this process has handed out


def _ephemeral_floor():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n):
    """n distinct ports free on 127.0.0.1, from below the kernel's
    ephemeral range, never handed out twice by this process. The kernel
    picks a port for a bind to port 0 or a connect from that range only,
    so no other socket (an instance's own, starting meanwhile) takes one of
    these between its choice and the bind of the server it is for: a port
    chosen by binding 0 was, once, and an encoder then failed to start
    with EADDRINUSE on its registry port."""
    # Below 49152 too (pyzmq's random ports), above Mooncake's 15000-17000.
    hi = min(_ephemeral_floor(), 49152) - 1
    lo = 20000
    if hi - lo < 1000:
        raise RuntimeError("free_ports: the kernel's ephemeral range starts "
                           "at %d, leaving no room for test ports in "
                           "%d..%d" % (hi + 1, lo, hi))
    socks, ports = [], []
    try:
        for _ in range(100 * n + 1000):
            if len(ports) == n:
                break
            p = random.randint(lo, hi)
            if p in _GIVEN:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(p)
            _GIVEN.add(p)
        if len(ports) < n:
            raise RuntimeError("free_ports: no %d free ports in %d..%d" %
                               (n, lo, hi))
        return ports
    finally:
        for s in socks:
            s.close()


def free_port():
    return free_ports(1)[0]


def clean_env(extra=None):
    """The environment of a process that must load the installed ecx."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ECX_LIBRARY", "LD_LIBRARY_PATH")}
    env.update({
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


class Process:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, name, argv, cwd, env, log_dir):
        self.name = name
        self.log_path = os.path.join(log_dir, name + ".log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env,
                                     stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def tail(self, n=40):
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout=30):
        """SIGTERM to the group, SIGKILL after timeout; True if it ended
        within the timeout."""
        pgid = self.proc.pid
        clean = True
        if self.alive():
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                clean = False
        # Children of the group (vLLM's engine core) go too.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            clean = False
        self.log.close()
        return clean


class Instance(Process):
    """One vLLM API server."""

    def __init__(self, name, cwd, log_dir, core, ec=None, extra_args=(),
                 env=None, port=None):
        self.port = port or free_port()  # port: a restarted one's
        self.url = "http://127.0.0.1:%d" % self.port
        argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server",
                "--model", "tiny", "--host", "127.0.0.1",
                "--port", str(self.port), "--max-model-len", "2048",
                "--max-num-seqs", "16", "--seed", "0",
                # float32 as the weights are: in bfloat16 (vLLM's default
                # on a CPU) an image encoded beside other requests' images
                # can round differently from the same image encoded in
                # another batch, and a near tie then flips a greedy token
                # (seen once in 7 requests with ECExampleConnector)
                "--dtype", "float32"]
        if ec is not None:
            argv += ["--ec-transfer-config", json.dumps(ec)]
        argv += list(extra_args)
        self.argv = argv
        super().__init__(name, argv, cwd,
                         clean_env(dict(env or {},
                                        VLLM_CPU_OMP_THREADS_BIND=str(core))),
                         log_dir)

    def healthy(self):
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False


def wait_healthy(instances, timeout=START_S):
    """Waits until every instance answers /health; raises with the log
    tail of one that died or did not come up."""
    deadline = time.monotonic() + timeout
    pending = list(instances)
    while pending:
        for inst in list(pending):
            if not inst.alive():
                raise RuntimeError("%s exited (%s) while starting:\n%s" %
                                   (inst.name, inst.proc.returncode, inst.tail()))
            if inst.healthy():
                pending.remove(inst)
        if pending and time.monotonic() > deadline:
            raise RuntimeError("%s not healthy after %.0f s:\n%s" %
                               (pending[0].name, timeout, pending[0].tail()))
        if pending:
            time.sleep(1)


class Router(Process):
    """ecx's EPD router (python -m ecx.router) of the test venv."""

    def __init__(self, name, log_dir, cwd, mode, encoders, prefills,
                 consumer_zmq=(), extra=()):
        argv = [PYTHON, "-m", "ecx.router", "--host", "127.0.0.1",
                "--port", "0", "--mode", mode, "--timeout", "120"]
        argv += list(extra)
        for e in encoders:
            argv += ["--encode", e]
        for p in prefills:
            argv += ["--prefill", p]
        for z in consumer_zmq:
            argv += ["--consumer-zmq", z]
        super().__init__(name, argv, cwd, clean_env(), log_dir)
        deadline = time.monotonic() + 60
        self.url = None
        while self.url is None:
            m = re.search(r"listening on (http://[0-9.:]+)", self.text())
            if m:
                self.url = m.group(1)
            elif not self.alive() or time.monotonic() > deadline:
                raise RuntimeError("router %s did not start:\n%s" %
                                   (name, self.tail()))
            else:
                time.sleep(0.1)


def image(w, h, seed):
    """A PNG data URL of w x h pixels, its content from seed."""
    from PIL import Image

    rnd = random.Random(seed)
    im = Image.new("RGB", (w, h))
    px = im.load()
    a, b, c = rnd.randrange(1, 255), rnd.randrange(1, 255), rnd.randrange(256)
    for y in range(h):
        for x in range(w):
            px[x, y] = ((x * a + y) % 256, (y * b + x * 3) % 256,
                        (c + rnd.randrange(64)) % 256)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# Image sizes (pixels): 4, 12, 48 and 192 tokens after the 2 x 2 merge.
SIZES = [(64, 64), (112, 84), (224, 160), (448, 336)]


def chat(images, text="Describe this image."):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    content.append({"type": "text", "text": text})
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0,
            "ignore_eos": True, "return_token_ids": True}


def post(url, body, timeout=180, path="/v1/chat/completions"):
    """(status, parsed JSON or text) of a POST."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        data = e.read().decode("utf-8", "replace")
        try:
            return e.code, json.loads(data)
        except ValueError:
            return e.code, data


def tokens(url, body, timeout=180):
    status, out = post(url, body, timeout)
    assert status == 200, "%s answered %s: %s" % (url, status, out)
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == MAX_TOKENS, out
    return ids


def tokens_many(url, bodies, parallel=4):
    """Token ids of each body, sent with `parallel` requests in flight."""
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda b: tokens(url, b), bodies))


def counters(inst, who="scheduler"):
    """The last line of ECXConnector counters that inst logged for `who`,
    as a dict (the connector logs them every log_interval_s while it
    steps)."""
    last = None
    for line in inst.text().splitlines():
        m = re.search(r"ECXConnector %s: (.*)$" % who, line)
        if m:
            last = m.group(1)
    out = {}
    for part in (last or "").split(", "):
        k, _, v = part.rpartition(" ")
        if k:
            out[k] = float(v)
    return out


def fresh_counters(inst, who="scheduler", body=None):
    """inst's counters as of now: waits past log_interval_s (1 s in these
    tests), then has inst step once more (a request: text alone unless
    body is given), so that it logs a line, and reads it."""
    time.sleep(1.2)
    status, out = post(inst.url, body or dict(chat([]), max_tokens=4))
    assert status == 200, (inst.name, status, out)
    return counters(inst, who)


def prometheus(inst):
    """inst's /metrics as {name: value}, each name's samples summed over
    their labels."""
    with urllib.request.urlopen(inst.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def requests_set(seed, sizes=SIZES, pairs=True):
    """Chat bodies: one image of each size, and (pairs) two images of two
    sizes in one request; the images drawn from seed, so a set is new to
    every instance that has not seen that seed."""
    bodies = []
    for i, (w, h) in enumerate(sizes):
        bodies.append(chat([image(w, h, seed * 100 + i)]))
    if pairs:
        for i in range(len(sizes) - 1):
            (w1, h1), (w2, h2) = sizes[i], sizes[i + 1]
            bodies.append(chat([image(w1, h1, seed * 100 + 50 + i),
                                image(w2, h2, seed * 100 + 70 + i)],
                               "Compare the two images."))
    return bodies


def describe(body):
    """'64x64+112x84' for a body's images, for tables and messages."""
    from PIL import Image

    sizes = []
    for part in body["messages"][0]["content"]:
        if part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            sizes.append("%dx%d" % Image.open(io.BytesIO(data)).size)
    return "+".join(sizes)
