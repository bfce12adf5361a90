"""PushScheduler: the consumer scheduler in push mode (upstream's, PUSH.md
section 7). One PULL socket is connected to every shard's event endpoint
(found through peers and event_port); events are drained without blocking
whenever the engine asks; a transfer is ready once every shard has
reported it. A request's items are found by transfer_id in its
ec_transfer_params["ec_items"]; an item not ready waits in a record whose
deadline is fixed at push_wait_timeout_s after it was first asked for,
after which its request is unavailable (take_unavailable_requests; the
engine lives). A ready item is handed over in the step that schedules it
(the workers take it from their shards before the model runs), for
whichever request vLLM allocates it first: has_cache_item answers per
item, so a request that does not name the push (one sent straight
here, say) is handed it, and the one it was pushed for finds it handed. Items the
engine frees stay resident on the shards (a later push of the same
mm_hash is served from them); requests that finish with items not handed
over have them cancelled on every shard; ended records stay as tombstones
for the TTL so that late events do nothing. A failure event (ecx: a
shard's "ecx_failed", sent when the writer abandons a transfer or its
bytes fail the writer's hash) makes the requests waiting for that
transfer unavailable at once, or, beside pulls, pulls the item instead
where a producer holds it.

A request without ec_transfer_params goes to the pull flow where a
registry is configured (pull: the pull scheduler), else is encoded here.
Beside pulls, an item whose push has not come push_fallback_ms after its
request first asked is looked up in the registry (again every
push_fallback_ms while it waits) and, where a producer holds it, pulled
instead: the request then waits for that pull (_fallback, which a failed
push's event calls too).
"""
import collections
import json
import logging
import queue
import time

import zmq

from ..metadata import ECXConnectorMetadata, ECXWorkerMetadata
from ..push.wire import FAILED_FIELD
from .control import Control, event_socket

logger = logging.getLogger("ecx.vllm")

WAITING, AVAILABLE, TAKING, TAKEN = "waiting", "available", "taking", "taken"


class _Named:
    """A request known by its id alone (what _fallback reads of it)."""

    def __init__(self, request_id):
        self.request_id = request_id
UNAVAILABLE, CANCELLED, EXPIRED = "unavailable", "cancelled", "expired"
ENDED = (UNAVAILABLE, CANCELLED, EXPIRED)
TOMBSTONES_MAX = 65536
# A ready record unclaimed this long is dropped (and cancelled) before the
# shards' TTL ends it there; so is one that events made (some shards'
# only) and no request has asked for.
AVAILABLE_MAX_S = 270.0


class _Rec:
    __slots__ = ("mm_hash", "state", "shards", "deadline", "since")

    def __init__(self, mm_hash, state, now):
        self.mm_hash = mm_hash
        self.state = state
        self.shards = set()
        self.deadline = None
        self.since = now


def transfer_id_of(params, i, h):
    """upstream's lookup: ec_items[i] when its mm_hash is missing or h and
    it has a transfer_id; else the first entry whose mm_hash is h."""
    items = (params or {}).get("ec_items") or ()
    if i < len(items) and isinstance(items[i], dict):
        e = items[i]
        if e.get("transfer_id") and e.get("mm_hash") in (None, h):
            return str(e["transfer_id"])
    for e in items:
        if isinstance(e, dict) and e.get("mm_hash") == h and \
                e.get("transfer_id"):
            return str(e["transfer_id"])
    return None


class PushScheduler:
    """pcfg: a PushConfig; stats: Counters; dp_rank, tp: the replica's;
    pull: the pull flow's scheduler (or None)."""

    def __init__(self, pcfg, stats, dp_rank, tp, pull=None, clock=None):
        self._p = pcfg
        self._stats = stats
        self._pull = pull
        self._clock = clock or time.monotonic
        self._recs = {}  # transfer_id -> _Rec
        self._tombs = collections.OrderedDict()  # transfer_id -> ended at
        self._reqs = {}  # request id -> {mm_hash: transfer_id}
        self._local = {}  # mm_hash -> request ids using the handed copy
        # request id -> mm_hashes it uses of pushes it does not name
        self._borrowed = {}
        self._ready_hash = {}  # mm_hash -> transfer_id AVAILABLE
        self._takes = []
        self._freed = []
        self._unavailable = set()
        self._fb = {}  # request id -> the ids it pulls instead (fallback)
        self._fb_at = {}  # request id -> when it may look up again
        self._nshards = tp
        self._ctx = zmq.Context()
        self._sock = event_socket(self._ctx, pcfg.token)
        self._found = queue.SimpleQueue()  # (endpoints, shards) found
        self.control = Control(pcfg.base_addr(dp_rank, tp),
                               pcfg.control_timeout_s, pcfg.token,
                               self._shards_found)

    # ---- events ----

    def _shards_found(self, found, nshards):
        self._found.put((found, nshards))  # connected by the scheduler

    def _drain(self):
        while not self._found.empty():
            found, self._nshards = self._found.get()
            for _, endpoint in found:
                self._sock.connect(endpoint)
        sock = self._sock
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = json.loads(raw)
            except ValueError:
                logger.warning("ECXConnector: dropped a malformed push "
                               "event")
                continue
            if isinstance(ev, dict) and ev.get("ready") is True:
                self._event(ev)
            elif isinstance(ev, dict) and ev.get(FAILED_FIELD):
                self._failed(ev)

    def _event(self, ev):
        tid, h = ev.get("transfer_id"), ev.get("mm_hash")
        if not isinstance(tid, str) or not isinstance(h, str):
            return
        if tid in self._tombs:
            self._stats.add("push_events_late")
            return
        rec = self._recs.get(tid)
        now = self._clock()
        if rec is None:  # before its request: the event makes the record
            rec = self._recs[tid] = _Rec(h, WAITING, now)
        if rec.mm_hash != h:
            logger.warning("ECXConnector: event for transfer %s names %s, "
                           "not %s: dropped", tid, h, rec.mm_hash)
            return
        rec.shards.add(ev.get("shard"))
        if rec.state == WAITING and len(rec.shards) >= self._nshards:
            rec.state, rec.since = AVAILABLE, now
            self._ready_hash[h] = tid
            self._stats.add("push_items_ready")

    def _failed(self, ev):
        """A failure event (ecx): the transfer's writer gave up on it on
        some shard, or its bytes did not match the writer's hash. It ends
        here (no cancel: the shard has ended it) and every request waiting
        for it is unavailable now, not at push_wait_timeout_s."""
        tid = ev.get("transfer_id")
        if not isinstance(tid, str) or tid in self._tombs:
            return
        rec = self._recs.get(tid)
        if rec is not None and rec.state == TAKING:
            return  # being handed over: a rank that cannot says so
        self._end(tid, UNAVAILABLE)
        self._stats.add("push_items_failed_events")
        why = str(ev.get(FAILED_FIELD))[:200]
        for rid, mine in list(self._reqs.items()):
            lost = [h for h, t in mine.items() if t == tid]
            if lost and self._pull_instead(rid, lost):
                continue
            if lost:
                self._give_up(rid, f"transfer {tid} failed on shard "
                              f"{ev.get('shard')}: {why}")

    def _pull_instead(self, rid, mm_hashes):
        """Whether every one of mm_hashes (of request rid, whose pushes
        failed or ended) is now pulled instead (no pull flow: never)."""
        if self._pull is None or self._p.fallback_s <= 0:
            return False
        return not self._fallback(_Named(rid), mm_hashes)

    def wait_news(self, timeout_s) -> bool:
        """Waits up to timeout_s for a push event (or, beside pulls, the
        workers' news of a pull) and takes it in; True if one came."""
        deadline = self._clock() + timeout_s
        while True:
            left = deadline - self._clock()
            slice_ms = max(0, int(left * 1e3 + 0.999))
            if self._pull is not None:
                slice_ms = min(slice_ms, 1)
            if self._sock.poll(slice_ms):
                self._drain()
                return True
            if self._pull is not None and self._pull.wait_news(0):
                return True
            if self._clock() >= deadline:
                return False

    # ---- records ----

    def _end(self, tid, state, cancel=False):
        rec = self._recs.pop(tid, None)
        if rec is not None and self._ready_hash.get(rec.mm_hash) == tid:
            del self._ready_hash[rec.mm_hash]
        self._tombs[tid] = self._clock()
        self._tombs.move_to_end(tid)
        while len(self._tombs) > TOMBSTONES_MAX:
            self._tombs.popitem(last=False)
        if cancel:
            self.control.cancel([tid])
        return rec

    def _reap(self, now):
        while self._tombs:
            tid, t = next(iter(self._tombs.items()))
            if now - t < self._p.ttl_s:
                break
            del self._tombs[tid]
        old = [t for t, r in self._recs.items()
               if (r.state == AVAILABLE or (r.state == WAITING and
                                            r.deadline is None)) and
               now - r.since > AVAILABLE_MAX_S]
        for t in old:
            self._end(t, EXPIRED, cancel=True)

    # ---- the hooks ----

    def _push_request(self, request):
        return bool((getattr(request, "ec_transfer_params", None) or {})
                    .get("ec_items"))

    def ensure_cache_available(self, request, num_computed_tokens):
        self._drain()
        if not self._push_request(request):
            if self._pull is not None:
                return self._pull.ensure_cache_available(request,
                                                         num_computed_tokens)
            return True
        rid = request.request_id
        params = request.ec_transfer_params
        mine = self._reqs.setdefault(rid, {})
        pulled = self._fb.get(rid, ())
        now = self._clock()
        late = []
        for i, f in enumerate(getattr(request, "mm_features", None) or ()):
            h = f.identifier
            pos = getattr(f, "mm_position", None)
            if pos is not None and num_computed_tokens and \
                    pos.offset + pos.length <= num_computed_tokens:
                continue
            if h in self._local or h in pulled:
                continue
            tid = mine.get(h) or transfer_id_of(params, i, h) or \
                f"{rid}:{i}"
            mine[h] = tid
            if tid in self._tombs:
                if self._pull_instead(rid, [h]):
                    pulled = self._fb.get(rid, ())
                    continue
                self._give_up(rid, f"transfer {tid} of {h} has ended")
                return False
            rec = self._recs.get(tid)
            if rec is None:
                rec = self._recs[tid] = _Rec(h, WAITING, now)
            elif rec.mm_hash != h:
                self._give_up(rid, f"transfer {tid} is {rec.mm_hash}'s, "
                              f"not {h}'s")
                return False
            if rec.deadline is None:
                rec.deadline = now + self._p.push_wait_timeout_s
            if rec.state in (AVAILABLE, TAKING):
                continue
            if now >= rec.deadline:
                self._end(tid, UNAVAILABLE, cancel=True)
                self._give_up(rid, f"{h} was not pushed within "
                              f"push_wait_timeout_s="
                              f"{self._p.push_wait_timeout_s:g}")
                return False
            late.append((h, rec.deadline - self._p.push_wait_timeout_s))
        return self._wait_or_pull(request, num_computed_tokens, late, now)

    def _wait_or_pull(self, request, num_computed_tokens, late, now):
        """Whether request is ready, its items not pushed yet being late
        ((id, first asked at) pairs): those waited for push_fallback_ms
        are pulled instead where the registry finds them (looked up at
        most once per push_fallback_ms per request), and the request is
        ready once its pushes and its pulls are."""
        rid = request.request_id
        fb_s = self._p.fallback_s
        due = [h for h, t0 in late if now - t0 >= fb_s]
        if due and self._pull is not None and fb_s > 0 and \
                now >= self._fb_at.get(rid, 0.0):
            self._fb_at[rid] = now + fb_s
            self._fallback(request, due)
        pulled = self._fb.get(rid, ())
        ready = not any(h not in pulled for h, _ in late)
        if pulled:
            ready = self._pull.ensure_cache_available(
                request, num_computed_tokens) and ready
        return ready

    def _fallback(self, request, mm_hashes):
        """Pulls mm_hashes of push request request instead of waiting for
        their pushes (one that has not come within push_fallback_ms, or
        that failed): one registry lookup, a pull of each id a producer
        holds; the request then waits for those pulls (and their
        load_timeout_s) instead, and their transfers are cancelled when it
        finishes. Returns the ids nobody holds, which are still waited for
        as pushes (all of them without a pull flow)."""
        if self._pull is None:
            return list(mm_hashes)
        rid = request.request_id
        fb = self._fb.setdefault(rid, set())
        want = [h for h in mm_hashes if h not in fb]
        got = self._pull.adopt(rid, want) if want else []
        fb.update(got)
        if not fb:
            del self._fb[rid]
        if got:
            self._stats.add("push_fallbacks", len(got))
            logger.info("ECXConnector: request %s pulls %d items whose "
                        "pushes did not come", rid, len(got))
        return [h for h in mm_hashes if h not in fb]

    def has_cache_item(self, identifier):
        if identifier in self._local or identifier in self._ready_hash:
            return True
        return self._pull is not None and \
            self._pull.has_cache_item(identifier)

    def _ours(self, h):
        """Whether has_cache_item(h) holds for a push, not a pull: the
        item is handed or ready, and the pull flow has no copy of it."""
        return (h in self._local or h in self._ready_hash) and not (
            self._pull is not None and self._pull.has_cache_item(h))

    def update_state_after_alloc(self, request, index):
        h = request.mm_features[index].identifier
        rid = request.request_id
        tid = self._reqs.get(rid, {}).get(h)
        if h in self._fb.get(rid, ()) or (tid is None and
                                          not self._ours(h)):
            if self._pull is not None:
                self._pull.update_state_after_alloc(request, index)
            return
        if tid is None:
            # has_cache_item said yes for a push this request does not
            # name (sent straight here, or its item was handed already
            # when it asked): vLLM will not encode it, so it is this
            # request's too, and a ready one is handed now, whichever
            # request it was pushed for (which then finds it handed).
            self._borrowed.setdefault(rid, set()).add(h)
            tid = self._ready_hash.get(h)
        if h in self._local:
            self._local[h].add(rid)
            return
        rec = self._recs.get(tid)
        if rec is None or rec.state != AVAILABLE:
            return
        rec.state = TAKING
        if self._ready_hash.get(h) == tid:
            del self._ready_hash[h]
        self._takes.append((h, tid))
        self._local[h] = {rid}

    def _let_go(self, rid, h):
        users = self._local.get(h)
        if users is not None and rid in users:
            users.discard(rid)
            if not users and not self._engine_frees:
                del self._local[h]
                self._freed.append(h)

    _engine_frees = False  # the engine says what it frees (free list)

    def _done_with(self, rid, h):
        """Request rid has finished with handed item h."""
        if self._engine_frees:  # the engine's free list lets it go
            users = self._local.get(h)
            if users is not None:
                users.discard(rid)
        else:
            self._let_go(rid, h)

    def update_state_after_free(self, request, index):
        h = request.mm_features[index].identifier
        rid = request.request_id
        borrowed = self._borrowed.get(rid)
        if h in self._fb.get(rid, ()):
            self._pull.update_state_after_free(request, index)
        elif h in self._reqs.get(rid, {}):
            self._let_go(rid, h)
        elif borrowed is not None and h in borrowed:
            borrowed.discard(h)
            if not borrowed:
                del self._borrowed[rid]
            self._let_go(rid, h)
        elif self._pull is not None:
            self._pull.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output):
        self._drain()  # so that a step with nobody waiting hears them too
        meta = self._pull.build_connector_meta(scheduler_output) \
            if self._pull is not None else ECXConnectorMetadata()
        freed = getattr(scheduler_output, "free_encoder_mm_hashes", None)
        if freed is not None:
            self._engine_frees = True
            for h in freed:
                if self._local.pop(h, None) is not None:
                    self._freed.append(h)
        for h, tid in self._takes:
            rec = self._recs.pop(tid, None)
            if rec is not None:
                self._tombs[tid] = self._clock()
            self._stats.add("push_items_taken")
        meta.takes, self._takes = self._takes, []
        meta.freed, self._freed = self._freed, []
        self._reap(self._clock())
        return meta

    def update_connector_output(self, connector_output):
        wm = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(wm, ECXWorkerMetadata):
            for h, why in (getattr(wm, "push_failed", None) or {}).items():
                self._local.pop(h, None)
                self._stats.add("push_items_failed")
                logger.error("ECXConnector: a rank could not take pushed "
                             "item %s: %s", h, why)
        if self._pull is not None:
            self._pull.update_connector_output(connector_output)

    def request_finished(self, request):
        rid = request.request_id
        mine = self._reqs.pop(rid, None)
        for h in self._borrowed.pop(rid, ()):
            self._done_with(rid, h)
        self._fb_at.pop(rid, None)
        if self._fb.pop(rid, None):
            self._pull.request_finished(request)
        if mine is None:
            if self._pull is not None:
                return self._pull.request_finished(request)
            return False, None
        for h, tid in mine.items():
            self._done_with(rid, h)
            rec = self._recs.get(tid)
            if tid in self._tombs or (rec is not None and
                                      rec.state == TAKING):
                continue
            if rec is not None and any(
                    t == tid for r in self._reqs.values()
                    for t in r.values()):
                continue  # another request waits for it too
            self._end(tid, CANCELLED, cancel=True)
        self._unavailable.discard(rid)
        return False, None

    def _give_up(self, rid, why):
        if rid not in self._unavailable:
            self._unavailable.add(rid)
            self._stats.add("requests_unavailable")
            logger.warning("ECXConnector: request %s is unavailable: %s",
                           rid, why)

    def given_up(self, request_id):
        return request_id in self._unavailable or (
            self._pull is not None and self._pull.given_up(request_id))

    def take_unavailable_requests(self):
        out, self._unavailable = self._unavailable, set()
        if self._pull is not None:
            out |= self._pull.take_unavailable_requests()
        return out

    def has_pending_push_work(self):
        return self.control.pending > 0

    def shutdown(self):
        self.control.close()
        self._sock.close(0)
        self._ctx.term()
        if self._pull is not None:
            self._pull.shutdown()
