"""The consumer scheduler's control side in push mode, as upstream's
scheduler does it: discovery (peers at the replica's base address, each
shard's address by replacing the port, event_port of each) and cancels
(every shard, {"op":"cancel","transfer_id":...,"reservation_id":""}, up
to 2 tries each), on a thread of its own so that no scheduler step waits
on a socket. REQ sockets time out after control_timeout_s and are thrown
away after any error. close() returns within about POLL_S: the call in
flight gives up and the cancels still queued are dropped (their
reservations end at the shards' TTL), so a scheduler that stops after its
shards (as vLLM's does) waits for no dead peer."""
import json
import logging
import queue
import threading
import time

import zmq

from ..push.events import PLAIN_USER
from ..push.wire import TOKEN_FIELD

logger = logging.getLogger("ecx.vllm")

RETRY_S = 0.1
POLL_S = 0.05  # how often a call waiting for its reply looks at close()


def replace_port(addr, port):
    return f"{addr.rsplit(':', 1)[0]}:{port}"


class Control:
    """base: tcp://ec_ip:port of the replica's rank 0. on_shards(list of
    (shard port, event endpoint), number of shards) is called from this
    thread for the shards whose event ports it has learnt: once peers has
    answered, a shard that does not answer event_port (stopped, slow) is
    asked again between cancels, so the live shards' events are heard
    meanwhile; cancel(transfer_ids) queues cancels."""

    def __init__(self, base, timeout_s, token, on_shards):
        self.base = base
        self._timeout_ms = max(1, int(-(-timeout_s * 1000 // 1)))
        self._token = token
        self._on_shards = on_shards
        self._ctx = zmq.Context()
        self._socks = {}
        self._q = queue.Queue()
        self._stop = threading.Event()
        self.shards = None  # [shard address], once peers has answered
        self._unknown = {}  # shard address -> port: event port not known
        self.pending = 0  # cancels queued or being sent
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ecx-push-control")
        self._thread.start()

    def cancel(self, transfer_ids):
        if transfer_ids:
            with self._lock:
                self.pending += len(transfer_ids)
            self._q.put(list(transfer_ids))

    def _call(self, addr, req):
        s = self._socks.get(addr)
        if s is None:
            s = self._socks[addr] = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.IPV6, 1)
            s.linger = 0
            s.sndtimeo = s.rcvtimeo = self._timeout_ms
            s.connect(addr)
        if self._token:
            req = dict(req, **{TOKEN_FIELD: self._token})
        try:
            s.send(json.dumps(req).encode())
            # the reply awaited in slices, so that close() need not wait
            # out control_timeout_s for a peer that is gone
            until = time.monotonic() + self._timeout_ms / 1000
            while not s.poll(int(POLL_S * 1000)):
                if self._stop.is_set():
                    raise zmq.ZMQError(msg="stopped")
                if time.monotonic() >= until:
                    raise zmq.ZMQError(msg=f"no reply within "
                                       f"{self._timeout_ms} ms")
            reply = json.loads(s.recv())
        except (zmq.ZMQError, ValueError) as e:
            self._socks.pop(addr).close(0)
            raise RuntimeError(f"{req['op']} to {addr}: {e}") from None
        if not isinstance(reply, dict) or not reply.get("ok"):
            why = reply.get("error") if isinstance(reply, dict) else reply
            raise RuntimeError(f"{req['op']} to {addr}: {why}")
        return reply.get("result")

    def _discover(self):
        if self.shards is None:
            ports = self._call(self.base, {"op": "peers"})["ports"]
            addrs = [replace_port(self.base, p) for p in ports]
            self._unknown = dict(zip(addrs, ports))
            self.shards = addrs
        found = []
        for a, p in list(self._unknown.items()):
            try:
                ev = int(self._call(a, {"op": "event_port"}))
            except Exception as e:  # noqa: BLE001 - asked again later
                logger.debug("ECXConnector: event_port of %s: %s", a, e)
                continue
            del self._unknown[a]
            found.append((int(p), replace_port(a, ev)))
        if found:
            self._on_shards(found, len(self.shards))

    def _run(self):
        while not self._stop.is_set() and self.shards is None:
            try:
                self._discover()
            except Exception as e:  # noqa: BLE001 - the shards start later
                logger.debug("ECXConnector: push discovery at %s: %s",
                             self.base, e)
                self._stop.wait(RETRY_S)
        while not self._stop.is_set():
            if self._unknown:
                self._discover()
            try:
                ids = self._q.get(timeout=RETRY_S if self._unknown else 0.1)
            except queue.Empty:
                continue
            for tid in ids:
                for a in self.shards:
                    for _ in range(2):
                        if self._stop.is_set():
                            break  # the rest dropped (close())
                        try:
                            self._call(a, {"op": "cancel",
                                           "transfer_id": tid,
                                           "reservation_id": ""})
                            break
                        except Exception as e:  # noqa: BLE001 - logged
                            logger.warning("ECXConnector: cancel of %s: "
                                           "%s", tid, e)
            with self._lock:
                self.pending -= len(ids)

    def close(self):
        self._stop.set()
        self._thread.join()
        with self._lock:
            self.pending = 0  # what was queued is dropped
        for s in self._socks.values():
            s.close(0)
        self._socks = {}
        self._ctx.term()


def event_socket(ctx, token):
    """The scheduler's PULL socket (a PLAIN client where a token is set)."""
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.IPV6, 1)
    s.linger = 0
    if token:
        s.plain_username = PLAIN_USER.encode()
        s.plain_password = token.encode()
    return s
