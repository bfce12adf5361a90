"""REQ clients of the push control shards (upstream's wire: one JSON
frame each way, the {"ok", "result" | "error"} envelope), as an encoder's
Pusher sends its ops: one socket per (thread, address), so that ops to
several shards go at once from a pool; every call bounded by
control_timeout_s; the socket thrown away after any error (a REQ socket
that missed its reply cannot send again)."""
import json
import threading

import zmq

from .wire import TOKEN_FIELD


class ControlError(RuntimeError):
    """An ok:false reply, or no reply within control_timeout_s."""


class ControlTimeout(ControlError):
    """No reply within control_timeout_s (the peer gone or stuck)."""


class Requests:
    """REQ clients: one per (thread, address), send and receive timeouts of
    control_timeout_s, linger 0, thrown away after any error."""

    def __init__(self, control_timeout_s, token):
        self.timeout_ms = max(1, int(-(-control_timeout_s * 1000 // 1)))
        self.token = token or None
        self.ctx = zmq.Context()
        self.local = threading.local()
        self.lock = threading.Lock()
        self.open = set()

    def _sock(self, addr):
        socks = self.local.__dict__.setdefault("socks", {})
        s = socks.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.REQ)
            s.setsockopt(zmq.IPV6, 1)
            s.linger = 0
            s.sndtimeo = s.rcvtimeo = self.timeout_ms
            s.connect(addr)
            socks[addr] = s
            with self.lock:
                self.open.add(s)
        return s

    def _drop(self, addr):
        s = self.local.__dict__.get("socks", {}).pop(addr, None)
        if s is not None:
            with self.lock:
                self.open.discard(s)
            s.close(0)

    def call(self, addr, req):
        if self.token:
            req = dict(req, **{TOKEN_FIELD: self.token})
        try:
            s = self._sock(addr)
        except zmq.ZMQError as e:  # not an endpoint: "tcp://host:port"
            raise ControlError(f"{req['op']} to {addr!r}: {e} (a consumer's "
                               f"control address is tcp://HOST:PORT)") \
                from None
        try:
            s.send(json.dumps(req, separators=(",", ":")).encode())
            reply = json.loads(s.recv())
        except zmq.Again:
            self._drop(addr)
            raise ControlTimeout(f"{req['op']} to {addr}: no reply within "
                                 f"{self.timeout_ms} ms (no EC consumer's "
                                 f"control port there, or it is stuck)") \
                from None
        except (zmq.ZMQError, ValueError) as e:
            self._drop(addr)
            raise ControlError(f"{req['op']} to {addr}: {e}") from None
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            err = reply
            if isinstance(reply, dict):  # upstream's envelope, or another
                err = reply.get("error", reply.get("err", reply))
            raise ControlError(f"{req['op']} on {addr}: {err}")
        return reply.get("result")

    def close(self):
        with self.lock:
            for s in self.open:
                s.close(0)
            self.open.clear()
        self.ctx.term()
