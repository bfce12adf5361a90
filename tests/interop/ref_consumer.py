#!/usr/bin/python3
"""A consumer that speaks only the reference connector's protocol.

Written from the reference (../../../shared/reference/
ec_mooncake_connector.py.txt: ECMooncakeConnector.has_cache_item and
start_load_caches) and Mooncake's source (mcwire.py), never from ecx's
code. For each id, in order, one at a time as the reference does:

  1. GET {registry}/ec/info/{id} (5 s): a non-200, or no producer_zmq, is a
     miss; else nbytes, shape, dtype, producer_zmq;
  2. a receive buffer of nbytes (a numpy array), registered with its own
     Mooncake-wire receiver: a handshake server whose metadata lists the
     buffers (mcwire.HandshakeServer) and a data port that takes the 24-byte
     header and the bytes and answers the v2 status (mcwire.DataServer);
  3. a ZeroMQ REQ to producer_zmq: {"op": "pull", "mm_hash", "dst_session":
     its own host:rpc_port, "dst_ptr": the buffer's address, "nbytes"},
     waiting --timeout seconds (the reference: 120) for {"ok": true};
  4. the bytes checked: --seed S (ref_producer.py's items), --file ID=PATH
     (the file's bytes), --sha256 ID=HEX; an id with no check given only
     has to load.

Prints one JSON object: {"ok", "session", "items": [{"id", "found",
"nbytes", "shape", "dtype", "reply", "checked", "bytes_ok", "error"}],
"receiver": {"writes", "bytes", "rejected", "handshakes"}}. Exit 0 when
every id was found, pulled and (where checked) matched; 1 otherwise; 2
usage.
"""
import argparse
import hashlib
import json
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import zmq

import items
import mcwire


class Receiver:
    """The consumer's Mooncake engine, TCP transport: batch_register_memory
    adds a range to its segment (src/transport/tcp_transport/
    tcp_transport.cpp registerLocalMemory); a WRITE is accepted into any
    registered range (validateTcpAddress), as Mooncake does."""

    def __init__(self, host):
        self._lock = threading.Lock()
        self._buffers = []  # (addr, numpy uint8 array)
        self.data = mcwire.DataServer(host, self._resolve)
        self.hs = mcwire.HandshakeServer(host, self._describe)
        self.session = mcwire.session_name(host, self.hs.port)

    def register(self, arr):
        with self._lock:
            self._buffers.append((arr.ctypes.data, arr))

    def _describe(self):
        with self._lock:
            bufs = [(a, arr.nbytes) for a, arr in self._buffers]
        return mcwire.encode_segment(self.session, self.data.port, bufs)

    def _resolve(self, addr, size):
        # validateTcpAddress: size > 0, no overflow, inside one buffer.
        if size == 0 or addr + size >= 1 << 64:
            return None
        with self._lock:
            for base, arr in self._buffers:
                if base <= addr and addr + size <= base + arr.nbytes:
                    off = addr - base
                    return memoryview(arr)[off:off + size]
        return None

    def stats(self):
        return {"writes": self.data.writes, "bytes": self.data.bytes,
                "rejected": self.data.rejected, "reads": self.data.reads,
                "handshakes": self.hs.served}

    def close(self):
        self.hs.close()
        self.data.close()


class MooncakeReceiver:
    """--engine mooncake: Mooncake's own engine (its Python module,
    mooncake.engine: the mooncake-transfer-engine-non-cuda wheel in the
    project venv, or a module built from Mooncake's source) in the place
    of Receiver, set up as the reference's _ensure_engine does
    (P2PHANDSHAKE, protocol "tcp"). It counts nothing: stats are None."""

    def __init__(self, host):
        from mooncake.engine import TransferEngine
        self.eng = TransferEngine()
        if self.eng.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine initialization failed")
        self.session = mcwire.session_name(host, self.eng.get_rpc_port())
        self._keep = []

    def register(self, arr):
        if self.eng.batch_register_memory([arr.ctypes.data],
                                          [arr.nbytes]) != 0:
            raise RuntimeError("batch_register_memory failed")
        self._keep.append(arr)

    def stats(self):
        return {"writes": None, "bytes": None, "rejected": None,
                "reads": None, "handshakes": None}

    def close(self):
        pass


def has_cache_item(registry, mm_hash):
    """ECMooncakeConnector.has_cache_item with urllib for httpx: the entry,
    or None (a non-200, an HTTP error, no producer_zmq)."""
    url = registry.rstrip("/") + f"/ec/info/{mm_hash}"
    try:
        with urllib.request.urlopen(url, timeout=5.0) as r:
            if r.status != 200:
                return None
            data = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if not data.get("producer_zmq"):
        return None
    return {"nbytes": int(data["nbytes"]),
            "shape": [int(x) for x in data["shape"]],
            "dtype": str(data["dtype"]),
            "producer_zmq": str(data["producer_zmq"])}


def pull(producer_zmq, req, timeout):
    """start_load_caches: a fresh context and REQ socket per pull, RCVTIMEO,
    send_json, recv_json, close with linger 0. None when no reply came."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.IPV6, 1)
    sock.connect(producer_zmq)
    try:
        sock.send_json(req)
        return sock.recv_json()
    except zmq.Again:
        return None
    finally:
        sock.close(linger=0)
        ctx.term()


def expected(args, mm_hash, nbytes):
    """The bytes an id must hold, or None when no check was given."""
    if mm_hash in args.files:
        with open(args.files[mm_hash], "rb") as f:
            return ("file", f.read())
    if mm_hash in args.hashes:
        return ("sha256", args.hashes[mm_hash])
    if args.seed is not None:
        return ("seed", items.item_bytes(args.seed, mm_hash, nbytes))
    return None


def load_one(args, recv, mm_hash):
    res = {"id": mm_hash, "found": False, "checked": None,
           "bytes_ok": None, "error": None}
    spec = has_cache_item(args.registry, mm_hash)
    if spec is None:
        res["error"] = "not in the registry"
        return res
    res.update(found=True, nbytes=spec["nbytes"], shape=spec["shape"],
               dtype=spec["dtype"])
    size = items.ITEMSIZE.get(spec["dtype"])
    if size is not None and size * int(np.prod(spec["shape"])) != \
            spec["nbytes"]:
        res["error"] = "the entry's nbytes is not its shape times its dtype"
        return res
    buf = np.zeros(spec["nbytes"], dtype=np.uint8)
    recv.register(buf)
    req = {"op": "pull", "mm_hash": mm_hash, "dst_session": recv.session,
           "dst_ptr": int(buf.ctypes.data), "nbytes": int(buf.nbytes)}
    reply = pull(spec["producer_zmq"], req, args.timeout)
    res["reply"] = reply
    if reply is None:
        res["error"] = f"no reply within {args.timeout} s"
        return res
    if not reply.get("ok"):
        res["error"] = f"EC Mooncake pull failed: {reply}"
        return res
    want = expected(args, mm_hash, spec["nbytes"])
    if want is None:
        return res
    kind, value = want
    res["checked"] = kind
    got = buf.tobytes()
    if kind == "sha256":
        res["bytes_ok"] = hashlib.sha256(got).hexdigest() == value.lower()
    else:
        res["bytes_ok"] = got == value
        if not res["bytes_ok"]:
            n = min(len(got), len(value))
            diff = next((i for i in range(n) if got[i] != value[i]), n)
            res["error"] = f"bytes differ from offset {diff}"
    if res["bytes_ok"] is False and res["error"] is None:
        res["error"] = "bytes differ"
    return res


def pairs(values, what):
    out = {}
    for v in values or []:
        k, sep, x = v.partition("=")
        if not sep or not k or not x:
            raise SystemExit(f"ref_consumer: {what} {v!r}: want ID=VALUE")
        out[k] = x
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--registry", required=True)
    ap.add_argument("ids", nargs="+")
    ap.add_argument("--bind", default="127.0.0.1",
                    help="host of its own session and data port")
    ap.add_argument("--seed")
    ap.add_argument("--file", action="append", dest="file_args")
    ap.add_argument("--sha256", action="append", dest="hash_args")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--engine", choices=("mcwire", "mooncake"),
                    default="mcwire",
                    help="its own receiver (default), or Mooncake's engine")
    args = ap.parse_args()
    args.files = pairs(args.file_args, "--file")
    args.hashes = pairs(args.hash_args, "--sha256")

    recv = (Receiver if args.engine == "mcwire" else MooncakeReceiver)(
        args.bind)
    try:
        results = [load_one(args, recv, m) for m in args.ids]
    finally:
        recv.close()
    ok = all(r["found"] and r["error"] is None and r["bytes_ok"] is not False
             for r in results)
    print(json.dumps({"ok": ok, "session": recv.session, "items": results,
                      "receiver": recv.stats()}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
