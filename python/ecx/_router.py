"""The EPD router's server: the routes, the encoder requests, the
forwarding and what each failure becomes. python -m ecx.router (router.py)
says what it does and parses the command line."""
import asyncio
import collections
import json
import logging
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


def distinct(items):
    """(each item's key, {key: its first item}) of items: an item that
    appears twice is encoded once."""
    keys = [json.dumps(it, sort_keys=True) for it in items]
    first_of = {}
    for key, item in zip(keys, items):
        first_of.setdefault(key, item)
    return keys, first_of


async def _drop(task):
    """Ends a prefill request task: cancelled if still opening, its
    response closed (the connection with it) if it has one."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        task.result().close()


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
        self.overlap = getattr(args, "overlap", False)
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
                           headers, tid=None):
        """Encodes item (the k-th of request rid) on encoder first, or in
        push mode once more on the next one where it fails softly (not
        when tid, the transfer id the prefill already waits for, is
        given). Returns (mm_hash, entry, transfer_id) in push mode and
        None in pull mode, or the Failure."""
        given = tid
        tries = 2 if consumer is not None and len(self.encoders) > 1 and \
            given is None else 1
        failure = None
        for t in range(tries):
            url = self.encoders[(first + t) % len(self.encoders)]
            if t:
                self.counters["encoder_retries"] += 1
            tid = given or uuid.uuid4().hex
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
        keys, first_of = distinct(items)
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
        resp = await self._open(request, url, body, rid)
        return await self._relay(request, url, resp, rid)

    async def _open(self, request, url, body, rid):
        """POSTs body to url: the response, its headers read. Raises a
        soft Failure (502, 504)."""
        try:
            return await self.session.post(
                url, data=json.dumps(body).encode(),
                headers=self._headers(request, rid))
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise self._fail(url, e) from None

    async def _relay(self, request, url, resp, rid):
        """Answers the client with resp (of url): read whole, or passed on
        chunk by chunk when it is an event stream; resp is released or
        closed."""
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
        if consumer is not None and self.overlap and media_items(body):
            return await self._chat_overlapped(request, body, rid, i,
                                               consumer)
        body = await self._encode(request, body, rid, consumer)
        return await self._forward(request, i, "/v1/chat/completions", body,
                                   rid)

    async def _chat_overlapped(self, request, body, rid, i, consumer):
        """Push mode, overlapped (router.py says what and why): the prefill
        request goes out beside the encoders' with ec_items by position;
        its answer reaches the client once every encoder has answered. An
        encoder's soft failure drops it and sends the request again
        without ec_transfer_params; a 4xx drops it and ends the request."""
        keys, first_of = distinct(media_items(body))
        unique = list(first_of)
        tids = {key: uuid.uuid4().hex for key in unique}
        n = len(self.encoders)
        first, self._enc = self._enc, (self._enc + len(unique)) % n
        headers = self._headers(request, rid)
        params = dict(body.get("ec_transfer_params") or {})
        params.pop("consumer_zmq", None)
        params["ec_items"] = [{"transfer_id": tids[key]} for key in keys]
        url = self.prefills[i] + "/v1/chat/completions"
        prefill = asyncio.ensure_future(self._open(
            request, url, dict(body, ec_transfer_params=params), rid))
        try:
            got = await asyncio.gather(*(
                self._encode_item(body, first_of[key], k, (first + k) % n,
                                  rid, consumer, headers, tids[key])
                for k, key in enumerate(unique)))
        except BaseException:
            await _drop(prefill)
            raise
        failed = [g for g in got if isinstance(g, Failure)]
        if failed:
            await _drop(prefill)
            hard = [f for f in failed if not f.soft]
            if hard:
                raise hard[0]
            self.counters["items_not_encoded"] += len(failed)
            logger.warning("%s: %d of %d items not pushed; the prefill gets "
                           "the request again without ec_transfer_params",
                           rid, len(failed), len(unique))
            return await self._forward(request, i, "/v1/chat/completions",
                                       body, rid)
        resp = await prefill
        return await self._relay(request, url, resp, rid)

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
