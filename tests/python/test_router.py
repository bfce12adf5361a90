"""The EPD router (python -m ecx.router) as a real process, in front
of stand-ins of vLLM's API (small aiohttp servers of this process on
127.0.0.1, each recording what it was asked): the shape of the encoder
requests, push mode's ec_transfer_params both ways, round-robin over
encoders and prefills, streams passed on as they come, the statuses and
bodies a client sees when an instance fails, is gone or is slow, and
SIGTERM."""
import asyncio
import hashlib
import http.client
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

aiohttp = pytest.importorskip(
    "aiohttp", reason="the router and its stand-ins need aiohttp "
    "(pip install 'ecx[router]')")
from aiohttp import web  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# The router process imports the packages ecx and ecx.vllm on the way;
# vLLM's names come from the stand-in, as for the connector's tests.
PYTHONPATH = [os.path.join(HERE, "vllm_stub"),
              os.path.abspath(os.path.join(HERE, "..", "..", "python"))]
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


def mm_hash(item):
    """The stand-in encoder's mm_hash of an item."""
    return hashlib.sha256(json.dumps(item, sort_keys=True).encode()) \
        .hexdigest()


def image(name):
    return {"type": "image_url",
            "image_url": {"url": f"http://media.example/{name}.jpg"}}


AUDIO = {"type": "input_audio",
         "input_audio": {"data": "UklGRg==", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "file:///v/clip.mp4"}}


def chat(*items, **extra):
    """A chat request with text around items."""
    content = [{"type": "text", "text": "What is in these?"}, *items]
    return {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": content}], "max_tokens": 8, **extra}


# ---- the stand-ins' loop and servers ----

class Loop:
    """An asyncio loop in a thread of its own: the stand-ins serve there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever,
                                       daemon=True)
        self.thread.start()

    def call(self, coro, timeout=10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop) \
            .result(timeout)

    def soon(self, fn, *args):
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


class Standin:
    """One vLLM instance's API on 127.0.0.1 (a free port): records every
    request as (path, headers, JSON body or None) and answers with
    answer(self, request, path, body), a coroutine."""

    def __init__(self, loop, name, answer):
        self.loop = loop
        self.name = name
        self.answer = answer
        self.requests = []
        self.inflight = 0
        self.max_inflight = 0
        self.gate = 1  # encoder answers wait for this many at once
        self.release = None  # an asyncio.Event, made in the loop
        loop.call(self._start())

    async def _start(self):
        self.release = asyncio.Event()
        app = web.Application(client_max_size=1 << 26)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _handle(self, request):
        body = await request.json() if request.method == "POST" else None
        self.requests.append((request.path, request.headers.copy(), body))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self.answer(self, request, request.path, body)
        finally:
            self.inflight -= 1

    def posts(self, path="/v1/chat/completions"):
        return [b for p, _, b in self.requests if p == path]

    def stop(self):
        self.loop.call(self.runner.cleanup())


async def encoder_ok(s, request, path, body):
    """vLLM's encoder instance: waits until s.gate requests are in flight
    at once (5 s at most), then answers; in push mode with the connector's
    map {mm_hash: {metadata, transfer_id}} of the request's items."""
    if path == "/health":
        return web.Response(text="")
    deadline = time.monotonic() + 5
    while s.inflight < s.gate and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    out = {"id": "chatcmpl-enc", "object": "chat.completion",
           "choices": [{"index": 0, "finish_reason": "length",
                        "message": {"role": "assistant", "content": "x"}}]}
    params = body.get("ec_transfer_params")
    if params:
        items = body["messages"][0]["content"]
        out["ec_transfer_params"] = {
            mm_hash(it): {"metadata": {"image_grid_thw": [[1, 4, 4]]},
                          "transfer_id": e["transfer_id"]}
            for it, e in zip(items, params["ec_items"])}
    return web.json_response(out)


async def prefill_ok(s, request, path, body):
    if path == "/health":
        return web.Response(text="")
    if path == "/v1/models":
        return web.json_response({"object": "list",
                                  "data": [{"id": MODEL, "object": "model"}]})
    return web.json_response({
        "id": "chatcmpl-1", "object": "chat.completion", "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": f"answer of {s.name}"}}]})


def fails_with(status, text):
    """An answer of status with vLLM's JSON error body text (bytes)."""
    async def answer(s, request, path, body):
        if path == "/health":
            return web.Response(status=status)
        return web.Response(status=status, body=text,
                            content_type="application/json")
    return answer


def vllm_error(status, message):
    return json.dumps({"error": {"message": message, "type":
                                 "BadRequestError" if status < 500 else
                                 "InternalServerError", "param": None,
                                 "code": status}}).encode()


# ---- the router process and a client ----

class Router:
    """python -m ecx.router --port 0 ARGS, its port read from its
    first line; its stderr in a file."""

    def __init__(self, tmp_path, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            PYTHONPATH + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.log = tmp_path / f"router-{time.monotonic_ns()}.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ecx.router", "--port", "0",
                 *args], stdout=subprocess.PIPE, stderr=err, text=True,
                env=env)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(60)
        sel.close()
        line = self.proc.stdout.readline() if ready else ""
        m = re.fullmatch(r"router: listening on http://127\.0\.0\.1:(\d+)\n",
                         line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"no listening line ({line!r}): "
                                 f"{self.log.read_text()}")
        self.port = int(m.group(1))

    def call(self, method, path, body=None, headers=None, timeout=30):
        """(status, Content-Type, body bytes) of one request."""
        c = http.client.HTTPConnection("127.0.0.1", self.port,
                                       timeout=timeout)
        data = body if body is None or isinstance(body, bytes) else \
            json.dumps(body).encode()
        c.request(method, path, body=data, headers={
            "Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        out = r.status, r.getheader("Content-Type"), r.read()
        c.close()
        return out

    def post(self, body, path="/v1/chat/completions", **kw):
        return self.call("POST", path, body, **kw)

    def metrics(self):
        status, _, text = self.call("GET", "/metrics")
        assert status == 200
        return {m.group(1): int(m.group(2)) for m in re.finditer(
            r"^ecx_router_(\w+)_total (\d+)$", text.decode(), re.M)}

    def stop(self):
        """SIGTERM; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self.proc.stdout.close()


@pytest.fixture
def start(tmp_path, loop):
    """start(*args) -> a Router; every one is stopped (SIGTERM) at the
    end and must have exited 0, and every stand-in stopped."""
    made = []

    def router(*args):
        r = Router(tmp_path, *args)
        made.append(r)
        return r
    yield router
    for r in made:
        assert r.stop() == 0, r.log.read_text()


@pytest.fixture
def standin(loop):
    made = []

    def make(name, answer):
        s = Standin(loop, name, answer)
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_of(body):
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"}
    return err


# ---- pull mode ----

def test_pull_encoder_requests_and_forward(start, standin):
    enc = standin("enc", encoder_ok)
    pre = standin("pre", prefill_ok)
    enc.gate = 3  # the three items' requests must be in flight at once
    r = start("--encode", enc.url, "--prefill", pre.url)
    req = chat(image("a"), AUDIO, VIDEO, temperature=0.5,
               mm_processor_kwargs={"max_pixels": 65536},
               media_io_kwargs={"video": {"num_frames": 4}})
    status, ctype, body = r.post(req, headers={"X-Request-Id": "req-7"})
    assert status == 200, body
    assert ctype.startswith("application/json")
    assert json.loads(body)["choices"][0]["message"]["content"] == \
        "answer of pre"
    assert enc.max_inflight == 3
    sent = enc.posts()
    assert len(sent) == 3
    got = sorted(json.dumps(b, sort_keys=True) for b in sent)
    want = sorted(json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": [it]}],
        "max_tokens": 1, "stream": False,
        "mm_processor_kwargs": {"max_pixels": 65536},
        "media_io_kwargs": {"video": {"num_frames": 4}}}, sort_keys=True)
        for it in (image("a"), AUDIO, VIDEO))
    assert got == want
    ids = [h["X-Request-Id"] for p, h, _ in enc.requests]
    assert all(i.startswith("req-7:") for i in ids) and len(set(ids)) == 3
    # The prefill gets the request exactly as the client sent it.
    assert pre.posts() == [req]
    assert pre.requests[0][1]["X-Request-Id"] == "req-7"
    # Text alone: no encoder request.
    status, _, _ = r.post(chat())
    assert status == 200 and len(enc.posts()) == 3
    assert r.metrics()["encoder_requests"] == 3


def test_items_round_robin_over_two_encoders_and_prefills(start, standin):
    e0 = standin("e0", encoder_ok)
    e1 = standin("e1", encoder_ok)
    p0 = standin("p0", prefill_ok)
    p1 = standin("p1", prefill_ok)
    r = start("--encode", e0.url, "--encode", e1.url,
              "--prefill", f"{p0.url},{p1.url}")
    items = [image(n) for n in "abcd"]
    assert r.post(chat(*items))[0] == 200
    assert [b["messages"][0]["content"][0] for b in e0.posts()] in \
        ([items[0], items[2]], [items[2], items[0]])
    assert sorted(json.dumps(b["messages"][0]["content"][0])
                  for b in e1.posts()) == \
        sorted(json.dumps(items[i]) for i in (1, 3))
    # The cursor goes on from where the last request left it.
    assert r.post(chat(image("e")))[0] == 200
    assert len(e0.posts()) == 3 and len(e1.posts()) == 2
    answers = [len(p0.posts()), len(p1.posts())]
    assert answers == [1, 1]


def test_completions_models_health(start, standin):
    enc = standin("enc", encoder_ok)
    pre = standin("pre", prefill_ok)
    r = start("--encode", enc.url, "--prefill", pre.url)
    req = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    status, _, body = r.post(req, path="/v1/completions")
    assert status == 200, body
    assert pre.posts("/v1/completions") == [req] and not enc.posts()
    status, _, body = r.call("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    status, _, body = r.call("GET", "/health")
    assert status == 200, body
    enc.stop()
    status, _, body = r.call("GET", "/health")
    assert status == 503
    assert json.loads(body)["encoders"][enc.url].startswith("unreachable")
    assert json.loads(body)["prefills"][pre.url] == "ok"


# ---- push mode ----

def test_push_ec_transfer_params_both_ways(start, standin):
    """Upstream's proxy's order and params (the default)."""
    e0 = standin("e0", encoder_ok)
    e1 = standin("e1", encoder_ok)
    p0 = standin("p0", prefill_ok)
    p1 = standin("p1", prefill_ok)
    zmq = ["tcp://10.0.0.5:14579", "tcp://10.0.0.6:14579"]
    r = start("--mode", "push", "--encode", e0.url,
              "--encode", e1.url, "--prefill", p0.url, "--prefill", p1.url,
              "--consumer-zmq", zmq[0], "--consumer-zmq", zmq[1])
    # The same image twice: encoded and pushed once, named twice.
    items = [image("a"), AUDIO, image("b"), image("a")]
    for n, prefill in enumerate((p0, p1)):
        req = chat(*items, ec_transfer_params={"client_key": 1})
        status, _, body = r.post(req)
        assert status == 200, body
        (got,) = prefill.posts()
        # Which transfer_id each item's encoder request carried.
        tid_of = {}
        for b in e0.posts() + e1.posts():
            ec = b["ec_transfer_params"]
            if ec["consumer_zmq"] != zmq[n]:
                continue
            assert set(ec) == {"consumer_zmq", "ec_items"}
            (entry,) = ec["ec_items"]
            assert set(entry) == {"transfer_id"}
            assert re.fullmatch(r"[0-9a-f]{32}", entry["transfer_id"])
            (item,) = b["messages"][0]["content"]
            tid_of[json.dumps(item)] = entry["transfer_id"]
        assert len(tid_of) == 3
        params = got["ec_transfer_params"]
        assert params["ec_items"] == [
            {"mm_hash": mm_hash(it), "transfer_id": tid_of[json.dumps(it)]}
            for it in items]
        for it in items:
            assert params[mm_hash(it)] == {
                "metadata": {"image_grid_thw": [[1, 4, 4]]},
                "transfer_id": tid_of[json.dumps(it)]}
        assert params["client_key"] == 1 and "consumer_zmq" not in params
        assert len(params) == 2 + 3
        # The media stay as they were: no *_embeds, no uuid.
        assert {k: v for k, v in got.items() if k != "ec_transfer_params"} \
            == {k: v for k, v in req.items() if k != "ec_transfer_params"}
    tids = [b["ec_transfer_params"]["ec_items"][0]["transfer_id"]
            for b in e0.posts() + e1.posts()]
    assert len(tids) == 6 and len(set(tids)) == 6


def test_push_retries_on_the_other_encoder(start, standin):
    """A failed item is tried on the next encoder."""
    bad = standin("bad", fails_with(500, vllm_error(500, "engine dead")))
    good = standin("good", encoder_ok)
    pre = standin("pre", prefill_ok)
    r = start("--mode", "push", "--encode", bad.url,
              "--encode", good.url, "--prefill", pre.url,
              "--consumer-zmq", "tcp://127.0.0.1:9")
    items = [image("a"), image("b")]
    status, _, body = r.post(chat(*items))
    assert status == 200, body
    assert len(bad.posts()) == 1 and len(good.posts()) == 2
    ec = pre.posts()[0]["ec_transfer_params"]["ec_items"]
    assert [e["mm_hash"] for e in ec] == [mm_hash(it) for it in items]
    sent = {b["ec_transfer_params"]["ec_items"][0]["transfer_id"]
            for b in good.posts()}
    assert {e["transfer_id"] for e in ec} == sent
    m = r.metrics()
    assert m["encoder_retries"] == 1 and m["items_not_encoded"] == 0


def test_push_without_a_push_forwards_bare_or_fails(start, standin):
    """One encoder: an item it fails (503 for image b) is not pushed. All
    of a request's items failed: the prefill gets it without
    ec_transfer_params; some pushed and some not: the client gets the
    encoder's error and the prefill nothing."""
    err = vllm_error(503, "overloaded")

    async def picky(s, request, path, body):
        if path != "/health" and \
                "b.jpg" in json.dumps(body["messages"]):
            return web.Response(status=503, body=err,
                                content_type="application/json")
        return await encoder_ok(s, request, path, body)
    enc = standin("enc", picky)
    pre = standin("pre", prefill_ok)
    r = start("--mode", "push", "--encode", enc.url,
              "--prefill", pre.url, "--consumer-zmq", "tcp://127.0.0.1:9")
    req = chat(image("b"))
    assert r.post(req)[0] == 200
    assert pre.posts() == [req]
    status, _, body = r.post(chat(image("a"), image("b")))
    assert (status, body) == (503, err)
    assert len(pre.posts()) == 1
    assert r.metrics()["items_not_encoded"] == 2


def test_push_overlapped_prefill_request_goes_out_at_once(start, standin):
    """Push mode with --overlap: the prefill has its request
    while the encoders are still encoding (they answer only once it has),
    with each item's transfer_id by position and no mm_hash, the client's
    keys kept; the client gets the prefill's answer."""
    p0 = standin("p0", prefill_ok)

    async def waits_for_prefill(s, request, path, body):
        deadline = time.monotonic() + 5
        while not p0.posts() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        s.saw_prefill = bool(p0.posts())
        return await encoder_ok(s, request, path, body)
    e0 = standin("e0", waits_for_prefill)
    e1 = standin("e1", waits_for_prefill)
    zmq = "tcp://10.0.0.5:14579"
    r = start("--mode", "push", "--overlap", "--encode", e0.url,
              "--encode", e1.url, "--prefill", p0.url, "--consumer-zmq", zmq)
    items = [image("a"), AUDIO, image("b"), image("a")]
    req = chat(*items, ec_transfer_params={"client_key": 1})
    t0 = time.monotonic()
    status, _, body = r.post(req)
    assert status == 200 and json.loads(body)["choices"][0]["message"][
        "content"] == "answer of p0", body
    assert time.monotonic() - t0 < 4, "the encoders waited for the prefill"
    assert e0.saw_prefill and e1.saw_prefill
    tid_of = {}
    for b in e0.posts() + e1.posts():
        ec = b["ec_transfer_params"]
        assert ec["consumer_zmq"] == zmq
        (item,) = b["messages"][0]["content"]
        tid_of[json.dumps(item)] = ec["ec_items"][0]["transfer_id"]
    assert len(tid_of) == 3  # the same image twice: encoded once
    (got,) = p0.posts()
    params = got["ec_transfer_params"]
    assert params == {"client_key": 1, "ec_items": [
        {"transfer_id": tid_of[json.dumps(it)]} for it in items]}
    assert {k: v for k, v in got.items() if k != "ec_transfer_params"} \
        == {k: v for k, v in req.items() if k != "ec_transfer_params"}


def test_push_overlapped_failed_encoder_sends_the_request_again(
        start, standin):
    """--overlap: an encoder that fails softly (503 for image b) drops the
    prefill request in flight, which the router sends again without
    ec_transfer_params (the prefill encodes); an encoder's 400 ends the
    request with that answer. The prefill answers a request with
    ec_transfer_params with its headers at once (as vLLM's stream does)
    and nothing more until its connection closes: the router must close
    it."""
    err = vllm_error(503, "overloaded")
    bad = vllm_error(400, "not an image")

    async def picky(s, request, path, body):
        text = json.dumps(body["messages"]) if body else ""
        if "b.jpg" in text:
            return web.Response(status=503, body=err,
                                content_type="application/json")
        if "c.jpg" in text:
            return web.Response(status=400, body=bad,
                                content_type="application/json")
        return await encoder_ok(s, request, path, body)

    async def holds_pushed(s, request, path, body):
        if body and body.get("ec_transfer_params"):
            # Headers first, as vLLM's streamed answer has them at once.
            resp = web.StreamResponse()
            resp.headers["Content-Type"] = "text/event-stream"
            await resp.prepare(request)
            deadline = time.monotonic() + 20  # until the router drops it
            while time.monotonic() < deadline:
                t = request.transport
                if t is None or t.is_closing():
                    s.dropped += 1
                    break
                await asyncio.sleep(0.01)
            return resp
        return await prefill_ok(s, request, path, body)
    enc = standin("enc", picky)
    pre = standin("pre", holds_pushed)
    pre.dropped = 0
    r = start("--mode", "push", "--overlap", "--encode", enc.url,
              "--prefill", pre.url, "--consumer-zmq", "tcp://127.0.0.1:9")
    req = chat(image("a"), image("b"))
    t0 = time.monotonic()
    status, _, body = r.post(req)
    assert status == 200, body
    assert time.monotonic() - t0 < 10
    first, again = pre.posts()
    deadline = time.monotonic() + 5
    while not pre.dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pre.dropped == 1
    assert len(first["ec_transfer_params"]["ec_items"]) == 2
    assert again == req
    assert r.metrics()["items_not_encoded"] == 1
    status, _, body = r.post(chat(image("c")))
    assert (status, body) == (400, bad)
    assert len(pre.posts()) == 3  # the dropped one only
    deadline = time.monotonic() + 5
    while pre.dropped < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pre.dropped == 2
    assert r.metrics()["items_not_encoded"] == 1


# ---- streams ----

def test_stream_chunks_pass_as_they_come(start, standin, loop):
    async def streams(s, request, path, body):
        resp = web.StreamResponse()
        resp.headers["Content-Type"] = "text/event-stream; charset=utf-8"
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        # The second chunk waits until the client has the first.
        try:
            await asyncio.wait_for(s.release.wait(), 10)
        except asyncio.TimeoutError:
            await resp.write(b"data: the first chunk never came\n\n")
        await resp.write(b'data: {"n": 2}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    enc = standin("enc", encoder_ok)
    pre = standin("pre", streams)
    r = start("--encode", enc.url, "--prefill", pre.url)
    req = chat(image("a"), stream=True)
    c = http.client.HTTPConnection("127.0.0.1", r.port, timeout=5)
    c.request("POST", "/v1/chat/completions", body=json.dumps(req),
              headers={"Content-Type": "application/json"})
    resp = c.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type") == \
        "text/event-stream; charset=utf-8"
    assert resp.readline() == b'data: {"n": 1}\n'  # before the rest exists
    loop.soon(pre.release.set)
    assert resp.read() == b'\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    c.close()
    assert pre.posts() == [req] and len(enc.posts()) == 1


# ---- errors ----

def test_errors_come_back_with_status_and_body(start, standin):
    bad_image = vllm_error(400, "cannot identify image file")

    async def rejects(s, request, path, body):
        if path != "/health" and "bad.jpg" in json.dumps(body):
            return web.Response(status=400, body=bad_image,
                                content_type="application/json")
        return await encoder_ok(s, request, path, body)
    enc = standin("enc", rejects)
    broken = vllm_error(500, "EngineCore died")
    pre = standin("pre", fails_with(500, broken))
    r = start("--encode", enc.url, "--prefill", pre.url)
    # An encoder's 4xx: the client's, and the prefill is not asked.
    status, ctype, body = r.post(chat(image("a"), image("bad")))
    assert (status, body) == (400, bad_image)
    assert ctype.startswith("application/json") and not pre.posts()
    # The prefill's 5xx.
    status, _, body = r.post(chat(image("a")))
    assert (status, body) == (500, broken)
    # Not JSON, or not an object: 400.
    for raw in (b"{not json", b"[1, 2]"):
        status, _, body = r.post(raw)
        assert status == 400
        assert error_of(body)["code"] == 400
    status, _, body = r.post(b"{", path="/v1/completions")
    assert status == 400


def test_pull_forwards_past_a_failed_encoder(start, standin):
    dead = f"http://127.0.0.1:{free_port()}"
    sick = standin("sick", fails_with(500, vllm_error(500, "oom")))
    pre = standin("pre", prefill_ok)
    r = start("--encode", dead, "--encode", sick.url, "--prefill", pre.url)
    req = chat(image("a"), image("b"))
    status, _, body = r.post(req)
    assert status == 200, body
    assert pre.posts() == [req] and len(sick.posts()) == 1
    m = r.metrics()
    assert m["items_not_encoded"] == 2 and m["encoder_failures"] == 2


def test_unreachable_prefill_is_502(start, standin):
    enc = standin("enc", encoder_ok)
    dead = f"http://127.0.0.1:{free_port()}"
    r = start("--encode", enc.url, "--prefill", dead)
    for path, body in (("/v1/chat/completions", chat(image("a"))),
                       ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        status, ctype, out = r.post(body, path=path)
        assert status == 502 and ctype.startswith("application/json")
        err = error_of(out)
        assert err["type"] == "BadGateway" and err["code"] == 502
        assert dead + path in err["message"]
    assert r.call("GET", "/v1/models")[0] == 502


def test_slow_prefill_is_504(start, standin):
    async def slow(s, request, path, body):
        await asyncio.sleep(4)
        return await prefill_ok(s, request, path, body)
    enc = standin("enc", encoder_ok)
    pre = standin("pre", slow)
    r = start("--encode", enc.url, "--prefill", pre.url, "--timeout", "1")
    t0 = time.monotonic()
    status, _, body = r.post(chat(image("a")))
    assert status == 504, body
    assert time.monotonic() - t0 < 3.5
    err = error_of(body)
    assert err["type"] == "GatewayTimeout" and pre.url in err["message"]


# ---- the process ----

def test_sigterm_stops_it(tmp_path, standin):
    enc = standin("enc", encoder_ok)
    pre = standin("pre", prefill_ok)
    r = Router(tmp_path, "--encode", enc.url, "--prefill", pre.url)
    assert r.post(chat(image("a")))[0] == 200
    t0 = time.monotonic()
    assert r.stop() == 0, r.log.read_text()
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", r.port), timeout=2)


def test_arguments_are_checked(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(PYTHONPATH))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "ecx.router",
                               *args], capture_output=True, text=True,
                              env=env, timeout=60)
    out = run("--help")
    assert out.returncode == 0
    assert "pull" in out.stdout and "push" in out.stdout
    for args, why in (
            (["--prefill", "http://p:1"], "--encode"),
            (["--encode", "http://e:1"], "--prefill"),
            (["--encode", "http://e:1", "--prefill", "http://p:1",
              "--mode", "push"], "one --consumer-zmq per --prefill"),
            (["--encode", "http://e:1", "--prefill", "http://p:1",
              "--consumer-zmq", "tcp://c:1"], "--mode push"),
            (["--encode", "e:1", "--prefill", "http://p:1"], "http://")):
        out = run(*args)
        assert out.returncode == 2 and why in out.stderr, out.stderr
