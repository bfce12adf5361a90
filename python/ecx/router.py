"""The EPD router: an OpenAI front for encoder instances and prefill (or
prefill+decode) instances of vLLM.

    python -m ecx.router --encode http://enc0:8001 \\
        --encode http://enc1:8001 --prefill http://pd0:8002 --port 8000

POST /v1/chat/completions: every multimodal item of the messages
(image_url, input_audio, audio_url, video_url) is sent to an encoder
instance first, one request per item (the item alone in one user
message, the request's model, max_tokens 1, stream false, and the
request's mm_processor_kwargs and media_io_kwargs; an item that appears
twice in the request, once), the items spread over the encoders
round-robin and all of them in flight at once. Once
every encoder has answered, the original request goes to a prefill
instance (round-robin) and its answer comes back as it is; a streamed
answer (text/event-stream) is passed on chunk by chunk as it comes.
POST /v1/completions goes straight to a prefill instance. GET /v1/models
is a prefill instance's; GET /health is 200 only when every instance
answers its own /health with 200; GET /metrics has the router's
counters (Prometheus text).

The items stay raw media: nothing is rewritten into *_embeds and no uuid
is added, so the prefill computes the same mm_hash as the encoder did
(vLLM's mm_hash is a hash of the --model string, the item's media and
the request's mm_processor_kwargs and media_io_kwargs: give both
instances the same --model). An item the prefill finds nowhere it
encodes itself, so the router needs nothing from the encoders' answers
in pull mode.

Two modes:

  pull  (default) ecx's registry flow: the encoders publish what they
        encode to their registries and the prefill looks items up
        there; the requests carry nothing extra.
  push  upstream vLLM's ec_transfer_params protocol, as its
        disagg_epd_proxy.py and ECMooncakeConnector speak it. With
        --consumer-zmq tcp://HOST:PORT, one per --prefill in the same
        order (the consumer's rank-0 control address), each encoder
        request carries {"consumer_zmq": ..., "ec_items":
        [{"transfer_id": <new uuid4 hex>}]}; the encoder answers with a
        top-level ec_transfer_params {mm_hash: {"metadata": ...,
        "transfer_id": ...}}, and the prefill request gets
        ec_transfer_params with "ec_items": [{"mm_hash", "transfer_id"}]
        in the request's item order and each encoder entry under its
        mm_hash (beside any keys the client's ec_transfer_params had).

Errors: the prefill's 4xx or 5xx answer, and an encoder's 4xx (a bad
image), go back to the client with their status and body; an instance
that cannot be reached gives 502 and one that does not answer within
--timeout seconds (no connection, or no bytes of its answer) gives 504,
each with an OpenAI-style JSON error naming the URL; a body that is not
a JSON object gives 400. An encoder that fails otherwise (5xx,
unreachable, timed out) ends the request only where the prefill cannot
do without it; each item not encoded is counted (items_not_encoded) and
logged:

  pull  the request goes to the prefill all the same, and the prefill
        encodes the items it does not find.
  push  the item is tried once more on the next encoder (with a new
        transfer_id) when there are several. If every item of the
        request still failed, the request goes to the prefill without
        ec_transfer_params: an ecx consumer then encodes them itself
        (or pulls them, beside a registry); upstream's ECMooncakeConnector
        consumer instead waits push_wait_timeout_s for pushes that never
        come and fails the request (a retryable 500). If some items were
        pushed and others failed, the client gets the failure (the
        encoder's status and body, 502 or 504): no consumer encodes one
        item of a pushed request itself, both would wait
        push_wait_timeout_s and fail it. A 200 answer whose
        ec_transfer_params do not name the item's transfer_id counts as
        a failure too (is that encoder configured to push?).

The router keeps one aiohttp ClientSession; SIGINT or SIGTERM stops it,
letting requests in flight finish for up to SHUTDOWN_GRACE_S seconds.
It uses nothing of vLLM (it lives beside ecx.vllm, not in it, so that it
starts without importing vLLM and torch) and nothing of libecx, though
importing the package ecx loads the library. aiohttp is the extra
`ecx[router]`; vLLM's environment has it.
"""
import argparse
import asyncio
import collections
import json
import logging
import signal
import sys
import uuid

try:
    import aiohttp
    from aiohttp import web
except ImportError:  # main() says what to install
    aiohttp = web = None

logger = logging.getLogger("ecx.router")

MEDIA_TYPES = ("image_url", "input_audio", "audio_url", "video_url")
ENCODER_KEYS = ("mm_processor_kwargs", "media_io_kwargs")
SHUTDOWN_GRACE_S = 10.0
HEALTH_TIMEOUT_S = 5.0
# A request's media may be inline (base64 data URLs).
MAX_REQUEST_BYTES = 1 << 30
# vLLM's server closes an idle keep-alive connection after 5 s
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); aiohttp would keep it 15 s, and a POST
# on a connection the server has closed fails. Drop idle ones first.
KEEPALIVE_S = 2.0
# /metrics, each ecx_router_<name>_total: requests (chat and completions
# alike), encoder_requests, encoder_failures (5xx, unreachable, timed out,
# no push reported), encoder_retries (push mode), items_not_encoded (the
# request went on without them, or failed), bad_requests (400),
# unreachable and timeouts (calls to any instance), upstream_errors (an
# instance's 4xx/5xx passed on), streams_cut (a stream that broke off).
COUNTERS = ("requests", "encoder_requests", "encoder_failures",
            "encoder_retries", "items_not_encoded", "bad_requests",
            "unreachable", "timeouts", "upstream_errors", "streams_cut")


def error_body(status, kind, message):
    """vLLM's (OpenAI's) error JSON, as bytes."""
    return json.dumps({"error": {"message": message, "type": kind,
                                 "code": status}}).encode()


class Failure(Exception):
    """An answer that goes to the client instead of the prefill's: status,
    body (bytes) and content type. soft: an encoder's failure that the
    request may do without (5xx, unreachable, timed out)."""

    def __init__(self, status, body, content_type="application/json",
                 soft=False):
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.soft = soft

    def response(self):
        return web.Response(status=self.status, body=self.body,
                            content_type=self.content_type)


async def answer_failures(request, handler):
    """The middleware that answers a Failure a handler raised."""
    try:
        return await handler(request)
    except Failure as f:
        return f.response()


def media_items(body):
    """The multimodal items of a chat request's messages, in order."""
    items = []
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            items.extend(c for c in content if isinstance(c, dict) and
                         c.get("type") in MEDIA_TYPES)
    return items


def reported_entry(data, transfer_id):
    """(mm_hash, entry) of an encoder's answer (bytes) whose top-level
    ec_transfer_params name transfer_id, or its only entry where that
    names no transfer_id; None where neither."""
    try:
        params = json.loads(data).get("ec_transfer_params")
    except (ValueError, AttributeError):
        return None
    if not isinstance(params, dict):
        return None
    entries = [(h, e) for h, e in params.items() if isinstance(e, dict)]
    for h, e in entries:
        if e.get("transfer_id") == transfer_id:
            return h, e
    if len(entries) == 1 and entries[0][1].get("transfer_id") is None:
        return entries[0]
    return None


class Router:
    """The handlers and their state: args (main's), one ClientSession
    (made in start, closed in close), round-robin cursors, counters."""

    def __init__(self, args):
        self.encoders = args.encode
        self.prefills = args.prefill
        self.consumers = args.consumer_zmq
        self.push = args.mode == "push"
        self.timeout_s = args.timeout
        self.counters = collections.Counter({k: 0 for k in COUNTERS})
        self._enc = 0
        self._pre = 0
        self.session = None

    async def start(self, app):
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None,
                                          sock_connect=self.timeout_s,
                                          sock_read=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0,
                                           keepalive_timeout=KEEPALIVE_S))

    async def close(self, app):
        await self.session.close()

    def app(self):
        app = web.Application(
            client_max_size=MAX_REQUEST_BYTES,
            middlewares=[web.middleware(answer_failures)])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app

    # ---- calls to the instances ----

    def _fail(self, url, e):
        """The Failure for an exception of a call to url."""
        if isinstance(e, asyncio.TimeoutError):
            self.counters["timeouts"] += 1
            return Failure(504, error_body(
                504, "GatewayTimeout",
                f"{url} did not answer within {self.timeout_s:g} s"),
                soft=True)
        self.counters["unreachable"] += 1
        return Failure(502, error_body(
            502, "BadGateway",
            f"{url} cannot be reached: {type(e).__name__}: {e}"),
            soft=True)

    async def _post(self, url, body, headers):
        """Posts body (JSON) to url and reads the whole answer: (status,
        bytes, content type). Raises a soft Failure (502, 504)."""
        try:
            async with self.session.post(url, data=json.dumps(body).encode(),
                                         headers=headers) as resp:
                return resp.status, await resp.read(), resp.content_type
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise self._fail(url, e) from None

    @staticmethod
    def _headers(request, rid):
        h = {"Content-Type": "application/json", "X-Request-Id": rid}
        if "Authorization" in request.headers:
            h["Authorization"] = request.headers["Authorization"]
        return h

    # ---- encoding ----

    async def _encode_item(self, body, item, k, first, rid, consumer,
                           headers):
        """Encodes item (the k-th of request rid) on encoder first, or in
        push mode once more on the next one where it fails softly.
        Returns (mm_hash, entry, transfer_id) in push mode and None in
        pull mode, or the Failure."""
        tries = 2 if consumer is not None and len(self.encoders) > 1 else 1
        failure = None
        for t in range(tries):
            url = self.encoders[(first + t) % len(self.encoders)]
            if t:
                self.counters["encoder_retries"] += 1
            tid = uuid.uuid4().hex
            req = {"model": body.get("model"),
                   "messages": [{"role": "user", "content": [item]}],
                   "max_tokens": 1, "stream": False}
            for key in ENCODER_KEYS:
                if key in body:
                    req[key] = body[key]
            if consumer is not None:
                req["ec_transfer_params"] = {
                    "consumer_zmq": consumer,
                    "ec_items": [{"transfer_id": tid}]}
            hdr = dict(headers, **{
                "X-Request-Id": f"{rid}:{k}:{uuid.uuid4().hex[:6]}"})
            self.counters["encoder_requests"] += 1
            try:
                status, data, ctype = await self._post(
                    url + "/v1/chat/completions", req, hdr)
            except Failure as f:
                failure = f
                logger.warning("item %d of %s: %s", k, rid,
                               json.loads(f.body)["error"]["message"])
                self.counters["encoder_failures"] += 1
                continue
            if 400 <= status < 500:
                self.counters["upstream_errors"] += 1
                return Failure(status, data, ctype)
            if not 200 <= status < 300:
                failure = Failure(status, data, ctype, soft=True)
                logger.warning("item %d of %s: encoder %s answered %d: %s",
                               k, rid, url, status,
                               data[:300].decode(errors="replace"))
                self.counters["encoder_failures"] += 1
                continue
            if consumer is None:
                return None
            found = reported_entry(data, tid)
            if found is not None:
                return found[0], found[1], tid
            logger.warning("item %d of %s: encoder %s answered without "
                           "ec_transfer_params for transfer %s (is it "
                           "configured to push?)", k, rid, url, tid)
            self.counters["encoder_failures"] += 1
            failure = Failure(502, error_body(
                502, "BadGateway",
                f"{url} did not report the push of transfer {tid}"),
                soft=True)
        return failure

    async def _encode(self, request, body, rid, consumer):
        """Has the encoders encode body's items (an item that appears
        twice, once); returns the body for the prefill (body itself, or
        with ec_transfer_params in push mode). Raises the Failure the
        client gets."""
        items = media_items(body)
        if not items:
            return body
        keys = [json.dumps(it, sort_keys=True) for it in items]
        first_of = {}
        for key, item in zip(keys, items):
            first_of.setdefault(key, item)
        unique = list(first_of)
        n = len(self.encoders)
        first, self._enc = self._enc, (self._enc + len(unique)) % n
        headers = self._headers(request, rid)
        got = await asyncio.gather(*(
            self._encode_item(body, first_of[key], k, (first + k) % n,
                              rid, consumer, headers)
            for k, key in enumerate(unique)))
        failed = [g for g in got if isinstance(g, Failure)]
        hard = [f for f in failed if not f.soft]
        if hard:
            raise hard[0]
        if failed:
            self.counters["items_not_encoded"] += len(failed)
        if consumer is None:
            if failed:
                logger.warning("%s: %d of %d items not encoded; the prefill "
                               "encodes them", rid, len(failed), len(unique))
            return body
        if len(failed) == len(unique):
            logger.warning("%s: no item was pushed; the prefill gets no "
                           "ec_transfer_params", rid)
            return body
        if failed:
            logger.warning("%s: %d of %d items not pushed; the request "
                           "fails", rid, len(failed), len(unique))
            raise failed[0]
        pushed = dict(zip(unique, got))
        params = dict(body.get("ec_transfer_params") or {})
        params.pop("consumer_zmq", None)
        params["ec_items"] = [{"mm_hash": pushed[key][0],
                               "transfer_id": pushed[key][2]}
                              for key in keys]
        for h, entry, _ in got:
            params[h] = entry
        return dict(body, ec_transfer_params=params)

    # ---- the prefill ----

    def _pick_prefill(self):
        i = self._pre
        self._pre = (i + 1) % len(self.prefills)
        return i

    async def _forward(self, request, i, path, body, rid):
        """Sends body to prefill i's path and answers the client with its
        answer: read whole, or passed on chunk by chunk when it is an
        event stream."""
        url = self.prefills[i] + path
        try:
            resp = await self.session.post(
                url, data=json.dumps(body).encode(),
                headers=self._headers(request, rid))
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise self._fail(url, e) from None
        done = False
        try:
            if resp.status >= 400 or \
                    resp.content_type != "text/event-stream":
                try:
                    data = await resp.read()
                except (asyncio.TimeoutError, aiohttp.ClientError,
                        OSError) as e:
                    raise self._fail(url, e) from None
                if resp.status >= 400:
                    self.counters["upstream_errors"] += 1
                done = True
                return web.Response(
                    status=resp.status, body=data,
                    headers={"Content-Type": resp.headers.get(
                        "Content-Type", "application/json")})
            out = web.StreamResponse(status=resp.status)
            out.headers["Content-Type"] = resp.headers["Content-Type"]
            out.headers["Cache-Control"] = "no-cache"
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    try:
                        await out.write(chunk)
                    except ConnectionResetError:
                        logger.info("%s: the client left the stream", rid)
                        return out
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                # The status has gone; the client sees the stream end.
                self.counters["streams_cut"] += 1
                logger.warning("%s: the stream from %s broke off: %s: %s",
                               rid, url, type(e).__name__, e)
                return out
            await out.write_eof()
            done = True
            return out
        finally:
            # A stream the client left (or that broke) closes the
            # connection, so the prefill sees it go and aborts.
            if done:
                resp.release()
            else:
                resp.close()

    # ---- the handlers ----

    async def _json(self, request):
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            body = e
        if not isinstance(body, dict):
            self.counters["bad_requests"] += 1
            why = body if isinstance(body, ValueError) else \
                f"a {type(body).__name__}, not an object"
            raise Failure(400, error_body(
                400, "BadRequestError",
                f"the request body is not a JSON object: {why}"))
        return body

    @staticmethod
    def _rid(request):
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    async def chat(self, request):
        self.counters["requests"] += 1
        body = await self._json(request)
        rid = self._rid(request)
        i = self._pick_prefill()
        consumer = self.consumers[i] if self.push else None
        body = await self._encode(request, body, rid, consumer)
        return await self._forward(request, i, "/v1/chat/completions", body,
                                   rid)

    async def completions(self, request):
        self.counters["requests"] += 1
        body = await self._json(request)
        return await self._forward(request, self._pick_prefill(),
                                   "/v1/completions", body,
                                   self._rid(request))

    async def models(self, request):
        url = self.prefills[self._pick_prefill()] + "/v1/models"
        try:
            async with self.session.get(url) as resp:
                return web.Response(status=resp.status,
                                    body=await resp.read(),
                                    content_type=resp.content_type)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise self._fail(url, e) from None

    async def _health_of(self, url):
        try:
            async with self.session.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(
                        total=min(self.timeout_s, HEALTH_TIMEOUT_S))) as r:
                return "ok" if r.status == 200 else f"HTTP {r.status}"
        except asyncio.TimeoutError:
            return "timed out"
        except (aiohttp.ClientError, OSError) as e:
            return f"unreachable: {type(e).__name__}: {e}"

    async def health(self, request):
        urls = self.encoders + self.prefills
        states = await asyncio.gather(*(self._health_of(u) for u in urls))
        n = len(self.encoders)
        ok = all(s == "ok" for s in states)
        return web.json_response(
            {"status": "ok" if ok else "unhealthy",
             "encoders": dict(zip(urls[:n], states[:n])),
             "prefills": dict(zip(urls[n:], states[n:]))},
            status=200 if ok else 503)

    async def metrics(self, request):
        text = "".join(f"# TYPE ecx_router_{k}_total counter\n"
                       f"ecx_router_{k}_total {v}\n"
                       for k, v in sorted(self.counters.items()))
        return web.Response(text=text, content_type="text/plain")


def _urls(values, flag, parser):
    """Each value may hold several comma-separated URLs."""
    out = [u.strip().rstrip("/") for v in values or () for u in v.split(",")
           if u.strip()]
    for u in out:
        if not u.startswith(("http://", "https://")):
            parser.error(f"{flag} {u}: not an http:// or https:// URL")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m ecx.router",
        description="The EPD router: an OpenAI server in front of vLLM "
        "encoder instances and prefill (or prefill+decode) instances. For "
        "POST /v1/chat/completions it has an encoder encode each "
        "multimodal item (image_url, input_audio, audio_url, video_url; "
        "one request per item, round-robin over the encoders, all at "
        "once), then sends the original request to a prefill instance "
        "(round-robin) and returns its answer, streamed chunk by chunk "
        "when it streams. POST /v1/completions goes straight to a "
        "prefill; GET /v1/models, /health (200 only if every instance's "
        "/health is), /metrics. Items stay raw media (no *_embeds, no "
        "uuid), so give every instance the same --model.",
        epilog="Modes: pull (default) is ecx's registry flow: encoders "
        "publish, the prefill looks items up, nothing is added to the "
        "requests. push is upstream vLLM's ec_transfer_params protocol "
        "(ECMooncakeConnector, or ECXConnector in push mode): each encoder "
        "request names the prefill's --consumer-zmq and a transfer_id per "
        "item, and the prefill request gets ec_items [{mm_hash, "
        "transfer_id}] and the encoders' entries. Errors: the prefill's "
        "4xx/5xx, and an encoder's 4xx, come back with their status and "
        "body; an instance that cannot be reached: 502; "
        "no answer within --timeout: 504; a body that is not JSON: 400. "
        "An encoder that fails with 5xx, cannot be reached or times out "
        "does not end the request: in pull mode the prefill encodes the "
        "item itself; in push mode the item is retried once on the next "
        "encoder, and if no item of the request could be pushed the "
        "prefill gets no ec_transfer_params (an ecx consumer encodes "
        "them; upstream's ECMooncakeConnector waits its "
        "push_wait_timeout_s and fails the request), while a request with "
        "some items pushed and some not fails with the encoder's error. "
        "An encoder's 4xx ends the request. SIGINT/SIGTERM stop the "
        f"router after at most {SHUTDOWN_GRACE_S:g} s of requests in "
        "flight.")
    p.add_argument("--encode", action="append", metavar="URL",
                   help="an encoder instance (http://host:port); "
                   "repeatable, or comma-separated")
    p.add_argument("--prefill", action="append", metavar="URL",
                   help="a prefill (or prefill+decode) instance; "
                   "repeatable, or comma-separated")
    p.add_argument("--mode", choices=("pull", "push"), default="pull",
                   help="pull (default): ecx's registry flow; push: "
                   "upstream's ec_transfer_params (needs --consumer-zmq)")
    p.add_argument("--consumer-zmq", action="append", metavar="tcp://H:P",
                   help="push mode: the control address (rank 0) of each "
                   "--prefill instance's EC consumer, one per --prefill in "
                   "the same order; repeatable, or comma-separated")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="the port (default 8000; 0: a free one); once "
                   "bound, stdout says 'router: listening on "
                   "http://HOST:PORT'")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for a connection to an instance, "
                   "or for the next bytes of its answer (default 300); "
                   "past it: 504")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"),
                   help="default info (to stderr; debug adds an access "
                   "log)")
    args = p.parse_args(argv)
    args.encode = _urls(args.encode, "--encode", p)
    args.prefill = _urls(args.prefill, "--prefill", p)
    args.consumer_zmq = [a.strip() for v in args.consumer_zmq or ()
                         for a in v.split(",") if a.strip()]
    if not args.encode:
        p.error("at least one --encode URL is needed")
    if not args.prefill:
        p.error("at least one --prefill URL is needed")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    if args.mode == "push":
        if len(args.consumer_zmq) != len(args.prefill):
            p.error(f"push mode needs one --consumer-zmq per --prefill "
                    f"({len(args.prefill)}), got {len(args.consumer_zmq)}")
        for a in args.consumer_zmq:
            if not a.startswith("tcp://"):
                p.error(f"--consumer-zmq {a}: not a tcp://host:port address")
    elif args.consumer_zmq:
        p.error("--consumer-zmq is for --mode push")
    return args


async def serve(args):
    """Serves until SIGINT or SIGTERM."""
    router = Router(args)
    runner = web.AppRunner(
        router.app(), shutdown_timeout=SHUTDOWN_GRACE_S,
        access_log=logging.getLogger("aiohttp.access")
        if args.log_level == "debug" else None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        logger.info("%s mode; encoders %s; prefills %s%s", args.mode,
                    args.encode, args.prefill,
                    f"; consumers {args.consumer_zmq}"
                    if args.consumer_zmq else "")
        print(f"router: listening on http://{args.host}:{port}", flush=True)
        await stop.wait()
        logger.info("stopping")
    finally:
        await runner.cleanup()


def main(argv=None):
    args = parse_args(argv)
    if aiohttp is None:
        sys.exit("the router needs aiohttp: pip install 'ecx[router]' "
                 "(or aiohttp>=3.9)")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    try:
        asyncio.run(serve(args))
    except OSError as e:  # the port is taken, the host is not ours
        sys.exit(f"router: {e}")


if __name__ == "__main__":
    main()
