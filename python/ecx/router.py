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
        "transfer_id": ...}}; once every encoder has answered (upstream's
        proxy's order), the prefill request gets ec_transfer_params with
        "ec_items": [{"mm_hash", "transfer_id"}] in the request's item
        order, each encoder entry under its mm_hash, and any keys the
        client's ec_transfer_params had. With --overlap, the prefill
        request goes out at once instead, beside the encoder requests
        (the prefill handles it and processes its media while the
        encoders encode and push), with "ec_items": [{"transfer_id"}] by
        position (no mm_hash: the consumer takes the i-th entry for its
        i-th item, upstream's lookup by index); its answer reaches the
        client once every encoder has answered. Not the default: with
        it, one CI run of tests/vllm/test_mooncake.py saw an ecx
        consumer's control port not answer an ecx encoder for 30 s.
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
        transfer_id) when there are several; if every item of the
        request still failed, the request goes to the prefill without
        ec_transfer_params, and if some items were pushed and others
        failed, the client gets the failure (the encoder's status and
        body, 502 or 504). With --overlap, each item goes to one encoder;
        where one fails, the prefill request in flight is dropped (its
        connection closed: vLLM aborts it, its consumer cancels the
        transfers) and the request is sent again without
        ec_transfer_params. A prefill request without
        ec_transfer_params is encoded by an ecx consumer itself (or
        pulled, beside a registry); upstream's ECMooncakeConnector
        consumer instead waits push_wait_timeout_s for pushes that never
        come and fails the request (a retryable 500). A 200 answer whose
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
import logging
import signal
import sys

from ._router import SHUTDOWN_GRACE_S, Router, aiohttp, web

logger = logging.getLogger("ecx.router")


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
        "item, and the prefill request, once they have answered, gets "
        "ec_items [{mm_hash, transfer_id}] and their entries (with "
        "--overlap it goes out at once beside them, naming each item's "
        "transfer_id by position). Errors: the prefill's "
        "4xx/5xx, and an encoder's 4xx, come back with their status and "
        "body; an instance that cannot be reached: 502; "
        "no answer within --timeout: 504; a body that is not JSON: 400. "
        "An encoder that fails with 5xx, cannot be reached or times out "
        "does not end the request: in pull mode the prefill encodes the "
        "item itself; in push mode the item is retried once on the next "
        "encoder; if no item could be pushed the prefill gets no "
        "ec_transfer_params, while a request with some items pushed and "
        "some not fails with the encoder's error (with --overlap: the "
        "prefill's request in flight is dropped and sent again without "
        "ec_transfer_params); an ecx consumer then encodes the items "
        "itself, upstream's ECMooncakeConnector waits its "
        "push_wait_timeout_s and fails the request. "
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
    p.add_argument("--overlap", action="store_true",
                   help="push mode: send the prefill its request at once, "
                   "beside the encoder requests, naming the items' "
                   "transfer_ids by position (default: once every encoder "
                   "has answered, upstream's proxy's order)")
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
