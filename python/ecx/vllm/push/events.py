"""The event side of a ControlShard (shard.py): the PUSH socket its ready
and failure events go out on, the queue they wait in for a subscriber,
and the ZAP handler that keeps the socket to the holders of the token.

With a token the event socket is a ZeroMQ PLAIN server whose password is
the token, checked by the shard's own ZAP handler (zap_reply): a peer
without it never completes the handshake, so it is never one of the PUSH
socket's peers and can neither receive nor take away an event.
"""
import collections
import hmac
import logging
import os
import threading

import zmq


logger = logging.getLogger("ecx.vllm.push")

EVENT_BACKLOG = 4096
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "ecx.push.events"
PLAIN_USER = "ecx"


class EventQueue:
    """Encoded events waiting for the PUSH socket, at most backlog of
    them: past that the oldest is dropped (counted in dropped, logged),
    and the pipe that wakes the shard's loop (open() makes it, close()
    ends it, the loop polls fileno()), so that an event put from another
    thread, or a stop, does not wait for the poll to time out. put() and
    wake() may be called from any thread; flush() and drain_wake() from
    the loop. endpoint names the shard in the log."""

    def __init__(self, endpoint, backlog=EVENT_BACKLOG):
        self.endpoint = endpoint
        self.backlog = int(backlog)
        self.dropped = 0
        self._frames = collections.deque()
        self._lock = threading.Lock()
        self._wake_r = self._wake_w = None
        self._wake_lock = threading.Lock()

    def open(self):
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def close(self):
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = None

    def fileno(self):
        return self._wake_r

    def wake(self):
        with self._wake_lock:
            if self._wake_w is None:
                return  # stopped
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # already woken

    def drain_wake(self):
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def put(self, frame):
        with self._lock:
            if len(self._frames) >= self.backlog:
                self._frames.popleft()
                self.dropped += 1
                logger.warning("push control shard %s: %d ready events "
                               "queued with no subscriber; the oldest is "
                               "dropped", self.endpoint, self.backlog)
            self._frames.append(frame)

    def flush(self, ev):
        """Sends what ev takes without blocking; the rest waits."""
        with self._lock:
            while self._frames:
                try:
                    ev.send(self._frames[0], zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._frames.popleft()


def bind_zap(ctx):
    """The ZAP handler's REP socket (ZeroMQ asks it about every handshake
    in ctx). The caller closes it."""
    zap = ctx.socket(zmq.REP)
    zap.linger = 0
    try:
        zap.bind(ZAP_ENDPOINT)
    except zmq.ZMQError:
        zap.close(0)
        raise
    return zap


def bind_events(ctx, host, token):
    """The PUSH socket, bound to an ephemeral port of host (IPv6 enabled),
    a PLAIN server on ZAP_DOMAIN where token is set. Returns (socket,
    port); raises zmq.ZMQError where the bind fails."""
    ev = ctx.socket(zmq.PUSH)
    try:
        ev.setsockopt(zmq.IPV6, 1)
        ev.linger = 0
        if token:
            ev.plain_server = True
            ev.zap_domain = ZAP_DOMAIN.encode()
        ev.bind(f"tcp://{host}:0")
        last = ev.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError:
        ev.close(0)
        raise
    return ev, int(last.rsplit(":", 1)[1])


def zap_reply(frames, token):
    """The reply to one ZAP request (RFC 27): PLAIN with the token on the
    event socket's domain is accepted, all else there refused; other
    domains (the REP socket, NULL) are accepted as ZeroMQ would without
    us."""
    version, rid = frames[0], frames[1] if len(frames) > 1 else b""
    domain = frames[2] if len(frames) > 2 else b""
    mech = frames[5] if len(frames) > 5 else b""
    good = True
    if domain == ZAP_DOMAIN.encode():
        good = (mech == b"PLAIN" and len(frames) == 8
                and frames[6] == PLAIN_USER.encode()
                and hmac.compare_digest(frames[7], token))
    code, text = (b"200", b"OK") if good else (b"400", b"bad token")
    return [version, rid, code, text, b"", b""]


def serve_zap(zap, token):
    """Answers one ZAP request waiting on zap."""
    zap.send_multipart(zap_reply(zap.recv_multipart(), token))
