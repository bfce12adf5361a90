"""ControlShard: one consumer rank's control server in push mode, on
upstream vLLM's wire (../../../../docs/protocol.md, "Push mode").

A ZeroMQ REP socket at tcp://<ec_ip>:<ec_port + dp_rank*tp_size +
tp_rank> and a PUSH socket for ready events on an ephemeral port, both
bound to ec_ip only (IPv6 enabled, written in brackets). One thread per
shard runs the loop: flush queued events without blocking, run the reaper
once a second has passed, wait up to 100 ms for a request and serve it.

With a token, every request must carry it as "ecx_token" (else upstream's
error envelope, and nothing is done), and the event socket takes only
subscribers that hold it (events.py: the event socket, the queue its
events wait in, the ZAP handler).

ecx's fetch (fetch.py): over a pool with a consumer (ArenaPool), a reserve
that asks with "ecx_fetch": true is told "ecx_fetch": true, and the op
ecx_fetch has the shard pull the named writers' bytes from an ecx producer
into their ranges, settling each reservation as complete would (or failing
it, with a failure event) when its load ends.
"""
import errno
import hmac
import logging
import threading
import time

import zmq

from . import wire
from ...dtypes import DTYPES
from .events import (EVENT_BACKLOG, EventQueue, bind_events, bind_zap,
                     serve_zap)
from .fetch import Fetches
from .table import TTL_S, Refused, ReservationTable
from .wire import BadRequest, error, ok

logger = logging.getLogger("ecx.vllm.push")

POLL_MS = 100
REAP_EVERY_S = 1.0
START_WAIT_S = 5.0


def shard_port(ec_port, dp_rank, tp_size, tp_rank):
    """upstream's formula: ec_port + dp_rank*tp_size + tp_rank."""
    return ec_port + dp_rank * tp_size + tp_rank


class ControlShard:
    """The control server of one (dp_rank, tp_rank). pool: a ReceivePool.
    token: None or "" for none (upstream's behaviour), else the secret
    every op and the event subscription need. clock: seconds (TTLs,
    tombstones, the reaper), time.monotonic unless given. on_reclaimed:
    called with each mm_hash evicted from the pool. fetch: whether ecx's
    fetch is served (None: where the pool has a consumer). start() binds
    and starts the thread; stop() ends it."""

    def __init__(self, pool, ec_ip="127.0.0.1", ec_port=14579, dp_rank=0,
                 tp_size=1, tp_rank=0, token=None, clock=time.monotonic,
                 ttl=TTL_S, control_timeout_s=30.0, on_reclaimed=None,
                 event_backlog=EVENT_BACKLOG, poll_ms=POLL_MS, fetch=None):
        if not 0 <= tp_rank < tp_size or dp_rank < 0:
            raise ValueError(f"tp_rank {tp_rank} of tp_size {tp_size}, "
                             f"dp_rank {dp_rank}")
        self.base_port = ec_port + dp_rank * tp_size
        if self.base_port < 1 or self.base_port + tp_size - 1 > 65535:
            raise ValueError(
                f"ec_port {ec_port}: the shard ports {self.base_port}.."
                f"{self.base_port + tp_size - 1} are not all in 1..65535")
        self.pool = pool
        self.ec_ip = ec_ip
        self.host = wire.host_for_url(ec_ip)
        self.tp_size = tp_size
        self.port = self.base_port + tp_rank
        self.endpoint = f"tcp://{self.host}:{self.port}"
        self.event_port = None
        self.event_endpoint = None
        self.clock = clock
        self.control_timeout_s = float(control_timeout_s)
        self._token = token.encode() if token else None
        self.table = ReservationTable(
            pool, clock, self._queue_event, on_reclaimed, ttl=ttl,
            on_failed=lambda r, why: self._queue_failed([r.transfer_id],
                                                        why))
        # An event queued by another thread (a data plane calling the
        # table) or a stop wakes the loop through the queue's pipe.
        self._events = EventQueue(self.endpoint, event_backlog)
        self._poll_ms = int(poll_ms)
        self.requests = 0
        self._thread = None
        self._started = threading.Event()
        self._start_error = None
        self._stop = threading.Event()
        self._wait_s = self.control_timeout_s
        self._last_reap = clock()
        consumer = getattr(pool, "consumer", None)
        self._fetches = (Fetches(consumer)
                         if consumer is not None
                         and fetch is not False else None)
        self._ops = {"peers": self._op_peers,
                     "event_port": self._op_event_port,
                     "reserve": self._op_reserve,
                     "reserve_batch": self._op_reserve_batch,
                     "complete": self._op_complete,
                     "complete_batch": self._op_complete_batch,
                     "cancel": self._op_cancel,
                     "status": self._op_status,
                     "ecx_fetch": self._op_fetch}

    # ---- life ----

    def start(self):
        """Binds both sockets and starts the server thread; returns once
        bound (at most 5 s). Raises RuntimeError naming the endpoint where
        a bind fails."""
        self._events.open()
        self._thread = threading.Thread(
            target=self._run, name=f"ecx-push-{self.port}", daemon=True)
        self._thread.start()
        if not self._started.wait(START_WAIT_S):
            self.stop(0)
            raise RuntimeError(f"push control shard {self.endpoint}: not "
                               f"bound within {START_WAIT_S} s")
        if self._start_error is not None:
            self.stop(0)
            raise RuntimeError(f"push control shard: cannot bind "
                               f"{self._start_error}")
        return self

    def stop(self, wait_s=None):
        """Refuses new reserves, cancels READY records and followers,
        makes writers CANCEL_PENDING, serves completes and cancels until no
        writer holds memory or wait_s (control_timeout_s unless given)
        passes, then closes the sockets."""
        if self._thread is None:
            return
        if wait_s is not None:
            self._wait_s = float(wait_s)
        self._stop.set()
        self._events.wake()
        self._thread.join()
        self._thread = None
        self._events.close()

    @property
    def events_dropped(self):
        """Events dropped from a full backlog with no subscriber."""
        return self._events.dropped

    # ---- what the data plane and the loader call ----

    def take(self, transfer_id, mm_hash):
        """(addr, nbytes, shape, dtype) of a READY transfer, now the pinned
        resident copy of mm_hash (ReservationTable.take)."""
        return self.table.take(transfer_id, mm_hash)

    def release(self, mm_hash):
        self.table.release(mm_hash)

    def run_reaper(self):
        """Runs the reaper now (what the loop does every second)."""
        self._last_reap = self.clock()
        return self.table.reap()

    # ---- the loop ----

    def _bind(self, ctx):
        socks = []
        where = "the ZAP handler"
        try:
            zap = None
            if self._token:
                zap = bind_zap(ctx)
                socks.append(zap)
            rep = ctx.socket(zmq.REP)
            socks.append(rep)
            rep.setsockopt(zmq.IPV6, 1)
            rep.linger = 0
            rep.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME)
            where = self.endpoint
            rep.bind(where)
            where = f"tcp://{self.host}:0"
            ev, self.event_port = bind_events(ctx, self.host, self._token)
            self.event_endpoint = f"tcp://{self.host}:{self.event_port}"
        except zmq.ZMQError as e:
            for s in socks:
                s.close(0)
            hint = ""
            if e.errno == errno.ENODEV:  # ZeroMQ took the host for a NIC
                hint = (f" (ec_ip {self.host!r}: an IP address of this "
                        f"host or an interface's name; ZeroMQ does not "
                        f"look up host names)")
            raise RuntimeError(f"{where}: {e}{hint}") from None
        return zap, rep, ev

    def _run(self):
        ctx = zmq.Context()
        try:
            zap, rep, ev = self._bind(ctx)
        except RuntimeError as e:
            self._start_error = e
            ctx.term()
            self._started.set()
            return
        self._started.set()
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        if zap is not None:
            poller.register(zap, zmq.POLLIN)
        poller.register(self._events.fileno(), zmq.POLLIN)
        if self._fetches is not None:
            poller.register(self._fetches.fileno(), zmq.POLLIN)
        deadline = None
        try:
            while True:
                if self._stop.is_set():
                    if deadline is None:
                        self.table.shutdown()
                        deadline = time.monotonic() + self._wait_s
                    if (not self.table.writers_left()
                            or time.monotonic() >= deadline):
                        self._events.flush(ev)
                        break
                self._events.flush(ev)
                if self.clock() - self._last_reap >= REAP_EVERY_S:
                    self.run_reaper()
                wait = self._poll_ms
                if deadline is not None:
                    wait = min(wait, max(0, int(
                        (deadline - time.monotonic()) * 1000) + 1))
                ready = dict(poller.poll(wait))
                if self._events.fileno() in ready:
                    self._events.drain_wake()
                if self._fetches is not None:
                    self._settle(self._fetches.landed())
                if zap is not None and zap in ready:
                    serve_zap(zap, self._token)
                if rep in ready:
                    frames = rep.recv_multipart()
                    rep.send(wire.encode(self._handle(frames)))
        except Exception:  # the thread must not die silently
            logger.exception("push control shard %s stopped", self.endpoint)
        finally:
            if self._fetches is not None:
                self._settle(self._fetches.close())
                self._fetches = None
            for s in (ev, rep, zap):
                if s is not None:
                    s.close(0)
            ctx.term()

    def _queue_event(self, event):
        event["shard"] = self.port
        self._events.put(wire.encode(event))
        if threading.current_thread() is not self._thread:
            self._events.wake()

    # ---- requests ----

    def _handle(self, frames):
        self.requests += 1
        try:
            req = wire.decode(frames)
        except BadRequest as e:
            return error(e)
        if self._token:
            t = req.get(wire.TOKEN_FIELD)
            if not isinstance(t, str) or not hmac.compare_digest(
                    t.encode(), self._token):
                return error(f"unauthorized: this EC consumer needs its "
                             f"token in {wire.TOKEN_FIELD!r}")
        op = self._ops.get(req["op"])
        if op is None:
            return error(f"unknown control op {req['op'][:64]!r}")
        try:
            return ok(op(req))
        except (BadRequest, Refused) as e:
            return error(e)
        except Exception as e:
            logger.exception("push control shard %s: %s", self.endpoint,
                             req["op"])
            return error(f"{type(e).__name__}: {e}")

    def _op_peers(self, req):
        return {"ports": [self.base_port + i for i in range(self.tp_size)]}

    def _op_event_port(self, req):
        return self.event_port

    def _advert(self, req, spec, result):
        """A reservation told "ecx_fetch": true where its peer asked, this
        shard fetches and ecx carries its dtype (ecx)."""
        if (self._fetches is not None and req.get(wire.FETCH_FIELD) is True
                and spec.dtype in DTYPES):
            result[wire.FETCH_FIELD] = True
        return result

    def _hashed(self, req):
        """Whether a reserve's window is hashed as its bytes land: where
        its writer says it will send the hash, and always with a token
        (whose completes must carry one, _need_hashes)."""
        return wire.hashed(req) or bool(self._token)

    def _need_hashes(self, hashes, op):
        """With a token, every complete and ecx_fetch entry must carry
        its writer's hash: Mooncake's wire carries no token, so a peer
        without it that reaches the data port could write into an open
        window, and only the check against the hash (made by a writer
        that has the token) keeps those bytes from becoming ready."""
        if self._token and any(h is None for h in hashes):
            raise Refused(f"this EC consumer has a token: every {op} "
                          f"entry must carry {wire.HASH_FIELD} (its "
                          f"writer's hash of the bytes)")

    def _op_reserve(self, req):
        spec = wire.reserve_spec(req, self.pool.limit, self._hashed(req))
        self.table.reap()
        return self._advert(req, spec, self.table.reserve(spec))

    def _op_reserve_batch(self, req):
        items = wire.batch_items(req)
        hashed = self._hashed(req)
        self.table.reap()
        out = []
        for item in items:
            try:
                spec = wire.reserve_spec(item, self.pool.limit, hashed)
                out.append(ok(self._advert(req, spec,
                                           self.table.reserve(spec))))
            except (BadRequest, Refused) as e:
                out.append(error(e))
        return {"items": out}

    def _op_complete(self, req):
        args, want = wire.complete_args(req), wire.complete_hash(req)
        self._need_hashes([want], "complete")
        return self._complete(args, want)

    def _op_complete_batch(self, req):
        args = [(wire.complete_args(i), wire.complete_hash(i))
                for i in wire.batch_items(req)]
        self._need_hashes([h for _, h in args], "complete_batch")
        return {"items": [self._complete(a, h) for a, h in args]}

    def _complete(self, args, want, fetched=None):
        """complete (or the end of fetched's fetch that landed), with the
        landed bytes checked against an ecx writer's hash (want) where it
        sent one: a mismatch ends the reservation CANCELLED and queues a
        failure event."""
        got = []

        def verify(addr, nbytes, landed_xxh3):
            # the receiver's hash, made as the bytes came in order, else
            # one made now (a fetch's, or a write in pieces out of order)
            got.append(landed_xxh3 if landed_xxh3 is not None
                       else self.pool.xxh3(addr, nbytes))
            return got[0] == want

        with self.table.lock:
            followers = self._followers(args[0])
            check = None if want is None else verify
            done, ready = (self.table.complete(*args, verify=check)
                           if fetched is None else
                           self.table.fetch_done(fetched, True, check))
        if got and got[0] != want:
            logger.warning("push control shard %s: transfer %s landed "
                           "with xxh3 %016x, its writer sent %016x: "
                           "cancelled", self.endpoint, args[0][:64],
                           got[0], want)
            self._queue_failed([args[0]] + followers,
                               f"the bytes landed do not match the "
                               f"writer's {wire.HASH_FIELD}")
        return {"completed": done, "became_ready": ready}

    def _op_cancel(self, req):
        tid, rid, abandon, refresh = wire.cancel_args(req)
        with self.table.lock:
            followers = self._followers(tid)
            done = self.table.cancel(tid, rid, abandon, refresh)
        if done and abandon and not refresh:
            self._queue_failed([tid] + followers,
                               "cancelled with abandon by its writer")
        return {"cancelled": done}

    def _followers(self, transfer_id):
        r = self.table.get(transfer_id)
        return [f.transfer_id for f in r.followers] if r is not None else []

    def _queue_failed(self, transfer_ids, why):
        """Failure events (ecx), one per transfer (a writer's followers
        end with it): ready false, so upstream's scheduler skips them;
        ecx's fails the requests that wait for the transfer. A record is
        told once: one that expired while its fetch ran, or was abandoned
        and is abandoned again, is not told a second time."""
        for tid in transfer_ids:
            r = self.table.get(tid)
            if r is not None:
                if r.told:
                    continue
                r.told = True
            self._queue_event({"transfer_id": tid,
                               "mm_hash": r.mm_hash if r is not None else "",
                               "ready": False, wire.FAILED_FIELD: why})

    def _op_fetch(self, req):
        """ecx_fetch (ecx): every entry checked first; each names a writer
        in WRITING that no fetch runs for ("fetching": true, its load
        started) or not ("fetching": false, nothing done), on its own: an
        entry that repeats another's transfer_id finds that record already
        fetching (or with another reservation_id), so it is false."""
        if self._fetches is None:
            raise BadRequest("this EC consumer does not fetch")
        producer, epoch = wire.fetch_source(req)
        args = [(wire.complete_args(i), wire.complete_hash(i),
                 wire.fetch_lease(i)) for i in wire.batch_items(req)]
        self._need_hashes([h for _, h, _ in args], "ecx_fetch")
        picked = []  # per entry: the record it started, or None
        with self.table.lock:
            for (tid, rid), _, _ in args:
                picked.append(self.table.fetchable(tid, rid))
        go = [(r, want) for r, (_, want, _) in zip(picked, args)
              if r is not None]
        leases = [lease for r, (_, _, lease) in zip(picked, args)
                  if r is not None]
        try:
            if go:
                self._fetches.start(producer, epoch, go, leases)
        except Exception as e:
            with self.table.lock:
                for r, _ in go:
                    r.fetching = False
            raise BadRequest(f"ecx_fetch from {producer[:256]}: {e}")
        return {"items": [{"fetching": r is not None} for r in picked]}

    def _settle(self, ended):
        """The reservations of ended fetch loads: each completed where its
        bytes landed (and match the writer's hash), else ended CANCELLED
        with a failure event (where none was sent for it yet: one that
        expired while its load ran was told then)."""
        for entries, errors, producer in ended:
            for (r, want), err in zip(entries, errors):
                try:
                    self._settle_one(r, want, err, producer)
                except Exception:  # the batch's others are settled still
                    logger.exception("push control shard %s: settling the "
                                     "fetch of %s", self.endpoint,
                                     r.transfer_id[:64])
                    with self.table.lock:
                        if r.fetching:  # its range is freed
                            self.table.fetch_done(r, False)

    def _settle_one(self, r, want, err, producer):
        if err is None:
            self._complete((r.transfer_id, r.reservation_id), want,
                           fetched=r)
            return
        with self.table.lock:
            followers = self._followers(r.transfer_id)
            _, live = self.table.fetch_done(r, False)
        if live:
            logger.warning("push control shard %s: fetch of %s failed: %s",
                           self.endpoint, r.transfer_id[:64], err)
            self._queue_failed([r.transfer_id] + followers,
                               f"ecx_fetch from {producer}: {err}")

    def _op_status(self, req):
        return self.table.status(wire.field(req, "transfer_id", "str"))
