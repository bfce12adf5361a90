#!/usr/bin/python3
"""A producer that speaks only the reference connector's protocol.

Written from the reference (../../../shared/reference/
ec_mooncake_connector.py.txt, ECMooncakeConnector on the producer side, and
ECMooncakeRegistryServer) and Mooncake's source (mcwire.py), never from
ecx's code. It serves deterministic items (items.py: bytes from --seed and
the id) so that a consumer can check every byte:

  - an HTTP registry with the reference's one route, GET /ec/info/{mm_hash},
    answering the reference's entry {nbytes, shape, dtype, producer_zmq}
    and nothing else;
  - a ZeroMQ REP socket answering the reference's pull op exactly as the
    reference's producer loop does;
  - a Mooncake-wire writer (mcwire.fetch_segment, mcwire.write) that puts an
    item's bytes at dst_ptr in dst_session, and a handshake server of its
    own (the reference's engine has one; its metadata lists the items).

Usage: ref_producer.py [--bind HOST] [--seed S] [--ready-file F] ITEM...
  ITEM is ID:AxB...:DTYPE (e.g. img-0:64x3584:bfloat16).
Prints one JSON line when ready: {"registry", "producer_zmq", "session",
"items"}; --ready-file gets the same line (written whole, then renamed).
Each op answered goes to stderr as one line ('pull ID ok', 'answered
unknown op: hello'). Stops on SIGTERM or SIGINT (exit 0), or by itself
after --max-seconds.
"""
import argparse
import http.server
import json
import os
import signal
import socket
import sys
import threading
import urllib.parse

import numpy as np
import zmq

import items
import mcwire


class Registry(http.server.ThreadingHTTPServer):
    """ECMooncakeRegistryServer: FastAPI with one route. The answers keep
    FastAPI's shapes: the entry as compact JSON; 404 {"detail": "unknown
    mm_hash"} for an id it does not hold; 404 {"detail": "Not Found"} for
    any other path and 405 {"detail": "Method Not Allowed"} for another
    method on the route."""

    daemon_threads = True

    def __init__(self, addr, entries):
        self.entries = entries
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self):
        path = urllib.parse.urlsplit(self.path).path
        if not path.startswith("/ec/info/"):
            return None
        mm_hash = urllib.parse.unquote(path[len("/ec/info/"):])
        return mm_hash if mm_hash and "/" not in mm_hash else None

    def do_GET(self):
        mm_hash = self._route()
        if mm_hash is None:
            return self._send(404, {"detail": "Not Found"})
        entry = self.server.entries.get(mm_hash)
        if entry is None:
            return self._send(404, {"detail": "unknown mm_hash"})
        self._send(200, entry)

    def _other(self):
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        if self._route() is None:
            return self._send(404, {"detail": "Not Found"})
        self._send(405, {"detail": "Method Not Allowed"})

    do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _other


class Writer:
    """The producer's Mooncake engine, TCP transport: batch_transfer_sync_write
    with one entry opens dst_session once (src/transfer_metadata.cpp
    getSegmentID, getSegmentDesc: the P2P handshake), keeps its descriptor
    for the life of the process (getSegmentID's segment_name_to_id_map_;
    getSegmentDescByID fetches again only with metacache off) and writes
    to the data port at the host in the
    descriptor's name (src/transport/tcp_transport/tcp_transport.cpp
    startTransfer: getRpcMetaEntry(desc->name)). Like Mooncake's writer it
    does not check dst_ptr against the descriptor: the receiver does.
    Returns the reference's mooncake_ret: 0, or -1 (mooncake-integration/
    transfer_engine/transfer_engine_py.cpp batchTransferSync) and why."""

    def __init__(self, local_desc, timeout):
        self.local_desc = local_desc
        self.timeout = timeout
        self.segments = {}

    def write(self, session, src, dst_ptr):
        try:
            desc = self.segments.get(session)
            if desc is None:
                desc = mcwire.fetch_segment(session, self.local_desc(),
                                            self.timeout)
                self.segments[session] = desc
            host, _ = mcwire.parse_session(desc["name"])
        except (OSError, ValueError, mcwire.WireError) as e:
            return -1, f"cannot open segment {session}: {e}"
        why = mcwire.write(host, desc["tcp_data_port"],
                           desc["tcp_proto_version"], src, dst_ptr,
                           self.timeout)
        return (0, None) if why is None else (-1, why)


class MooncakeWriter:
    """--engine mooncake: Mooncake's own engine (its Python module,
    mooncake.engine: the mooncake-transfer-engine-non-cuda wheel in the
    project venv, or a module built from Mooncake's source) in the place
    of Writer, used as the reference uses it: initialize(host,
    "P2PHANDSHAKE", "tcp", ""), batch_register_memory of each tensor,
    batch_transfer_sync_write."""

    def __init__(self, host, tensors):
        from mooncake.engine import TransferEngine
        self.eng = TransferEngine()
        if self.eng.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine initialization failed")
        self.session = mcwire.session_name(host, self.eng.get_rpc_port())
        for t in tensors.values():
            if self.eng.batch_register_memory([t.ctypes.data],
                                              [t.nbytes]) != 0:
                raise RuntimeError("batch_register_memory failed")

    def write(self, session, src, dst_ptr):
        ret = self.eng.batch_transfer_sync_write(
            session, [src.ctypes.data], [dst_ptr], [src.nbytes])
        return ret, None if ret == 0 else "batch_transfer_sync_write failed"


def serve_pulls(sock, tensors, writer, log, done):
    """The reference's producer loop (ECMooncakeConnector
    _start_producer_zmq_listener), field for field: unknown op, then the
    four fields (a missing one or a bad number is answered with str() of
    the exception, as the reference's except clause does), unknown mm_hash,
    size mismatch, then the write and {"ok": ret == 0, "mooncake_ret":
    ret}."""
    while not done.is_set():
        if not sock.poll(200):
            continue
        raw = sock.recv()
        try:
            req = json.loads(raw.decode("utf-8"))
            if req.get("op") != "pull":
                log(f"answered unknown op: {req.get('op')}")
                sock.send_json({"ok": False, "err": "unknown op"})
                continue
            mm_hash = req["mm_hash"]
            dst_session = req["dst_session"]
            dst_ptr = int(req["dst_ptr"])
            nbytes = int(req["nbytes"])
            tensor = tensors.get(mm_hash)
            if tensor is None:
                log(f"pull {mm_hash}: unknown mm_hash")
                sock.send_json({"ok": False, "err": "unknown mm_hash"})
                continue
            if tensor.nbytes != nbytes:
                log(f"pull {mm_hash}: size mismatch")
                sock.send_json({"ok": False, "err": "size mismatch"})
                continue
            ret, why = writer.write(dst_session, tensor, dst_ptr)
            log(f"pull {mm_hash} " + ("ok" if ret == 0 else f"failed: {why}"))
            sock.send_json({"ok": ret == 0, "mooncake_ret": int(ret)})
        except Exception as e:  # the reference answers every error so
            log(f"pull handler error: {e!r}")
            try:
                sock.send_json({"ok": False, "err": str(e)})
            except zmq.ZMQError:
                break
    sock.close(linger=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("items", nargs="+", metavar="ID:AxB:DTYPE")
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--registry-port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="bound on each handshake and write, seconds")
    ap.add_argument("--ready-file")
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--engine", choices=("mcwire", "mooncake"),
                    default="mcwire",
                    help="its own writer (default), or Mooncake's engine")
    args = ap.parse_args()

    def log(line):
        print(line, file=sys.stderr, flush=True)

    host = args.bind
    tensors, specs = {}, []
    for text in args.items:
        mm_hash, shape, dtype, nbytes = items.parse_spec(text)
        tensors[mm_hash] = np.frombuffer(
            bytearray(items.item_bytes(args.seed, mm_hash, nbytes)),
            dtype=np.uint8)
        specs.append((mm_hash, shape, dtype, nbytes))

    # The engine: a handshake server whose segment lists the registered
    # tensors (batch_register_memory), and no data port of its own that
    # anyone writes to (the producer only writes).
    state = {}

    def local_desc():
        return mcwire.encode_segment(
            state["session"], 0,
            [(t.ctypes.data, t.nbytes) for t in tensors.values()])

    if args.engine == "mooncake":
        hs = None
        writer = MooncakeWriter(host, tensors)
        state["session"] = writer.session
    else:
        hs = mcwire.HandshakeServer(host, local_desc)
        state["session"] = mcwire.session_name(host, hs.port)
        writer = Writer(local_desc, args.timeout)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    zhost = f"[{host}]" if ":" in host else host
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    zport = sock.bind_to_random_port(f"tcp://{zhost}")
    producer_zmq = f"tcp://{zhost}:{zport}"

    entries = {m: {"nbytes": n, "shape": list(s), "dtype": d,
                   "producer_zmq": producer_zmq}
               for m, s, d, n in specs}
    reg = Registry((host, args.registry_port), entries)
    threading.Thread(target=reg.serve_forever, daemon=True).start()
    reg_url = f"http://{zhost}:{reg.server_address[1]}"

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    puller = threading.Thread(target=serve_pulls,
                              args=(sock, tensors, writer, log, done))
    puller.start()

    ready = json.dumps({"registry": reg_url, "producer_zmq": producer_zmq,
                        "session": state["session"],
                        "items": [m for m, *_ in specs]})
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(ready + "\n")
        os.replace(args.ready_file + ".tmp", args.ready_file)
    print(ready, flush=True)

    if not done.wait(args.max_seconds):
        log("ref_producer: --max-seconds reached, stopping")
        done.set()
    puller.join()  # it closes the REP socket (sockets stay on one thread)
    reg.shutdown()
    if hs is not None:
        hs.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
