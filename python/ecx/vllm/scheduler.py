"""The scheduler's side: Scheduler (what a scheduler that looks nothing up
answers: a producer's, or any hook called on a worker), and
AsyncScheduler, today's flow (a base class with ensure_cache_available):
it looks a request's items up once, defers the request while its workers
pull them in the background, and reports what it cannot serve through
take_unavailable_requests. Workers tell it the moment an item has landed
(the step channel, channel.py) as well as in each step's report."""
import logging
import time

import ecx

from .channel import SchedulerChannel
from .leases import Leases
from .metadata import ECXConnectorMetadata, ECXLoadSpec, ECXWorkerMetadata

logger = logging.getLogger("ecx.vllm")

_STARTING, _READY, _FAILED = "starting", "ready", "failed"


class _ItemState:
    __slots__ = ("spec", "state", "requests", "t0", "leased", "ranks")

    def __init__(self, spec, leased=None):
        self.spec = spec
        self.state = _STARTING
        self.requests: set = set()
        self.t0 = time.monotonic()
        # The ecx.Item whose lease pins it at its producer until every
        # rank holds it (then released), or None.
        self.leased = leased
        self.ranks: set = set()  # the ranks whose news say they hold it


class _RequestState:
    __slots__ = ("items", "deadline", "t0", "ready")

    def __init__(self, items, timeout_s):
        self.items = items  # its remote ids
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout_s
        self.ready = not items


class Scheduler:
    """The hooks of a scheduler with nothing to look up; the base of both
    flows (their lookups)."""

    def __init__(self, cfg, stats, tp=1, channel_key=None):
        self._cfg = cfg
        self._stats = stats
        self._tp = tp
        self._client = None
        self._leases = Leases(None, stats, cfg.lease_ms)

    def _connect(self):
        """The registry client (no data plane): a persistent connection
        per registry."""
        c = self._cfg
        self._client = ecx.Client(c.registry, token=c.token,
                                  timeout_ms=c.timeout_ms)
        self._leases = Leases(self._client, self._stats, c.lease_ms)

    def has_cache_item(self, identifier):
        return False

    def ensure_cache_available(self, request, num_computed_tokens):
        return True

    def take_unavailable_requests(self):
        return set()

    def wait_news(self, timeout_s) -> bool:
        """Waits up to timeout_s for news of an item (nothing to wait for
        here); True if some came."""
        return False

    def given_up(self, request_id) -> bool:
        """Whether request_id is unavailable (told in the next
        take_unavailable_requests)."""
        return request_id in getattr(self, "_unavailable", ())

    def update_state_after_alloc(self, request, index):
        pass

    def update_state_after_free(self, request, index):
        pass

    def build_connector_meta(self, scheduler_output):
        return ECXConnectorMetadata()

    def update_connector_output(self, connector_output):
        pass

    def request_finished(self, request):
        return False, None

    def shutdown(self):
        if self._client is not None:
            self._client.close()
            self._client = None

    def _lookup(self, ids, count=None):
        """One batched lookup; what could not be asked counts as missing
        (the request then encodes it locally). With lease_ms, what it finds
        is leased, and what could not be leased is missing too. count: the
        lookups it counts as (default len(ids))."""
        self._stats.add("lookups", len(ids) if count is None else count)
        try:
            if self._cfg.lease_ms > 0:
                found = self._client.lookup(ids,
                                            lease_ms=self._cfg.lease_ms)
                self._stats.add("leases", sum(
                    1 for f in found if f is not None and f.lease))
                return found
            return self._client.lookup(ids)
        except ecx.EcxError as e:
            self._stats.add("lookup_errors")
            logger.warning("ECXConnector: registry lookup of %d ids failed: "
                           "%s", len(ids), e)
            found = getattr(e, "found", None)
            return found if found is not None else [None] * len(ids)


class AsyncScheduler(Scheduler):
    """Today's flow, on a consumer's scheduler. channel_key: (engine_id,
    data-parallel rank) naming the step channel; ranks: how many workers
    must say they hold an item (tensor x pipeline parallel)."""

    def __init__(self, cfg, stats, tp=1, channel_key=None, ranks=None):
        super().__init__(cfg, stats, tp)
        self._items: dict = {}   # id -> _ItemState
        self._reqs: dict = {}    # request id -> _RequestState
        self._ranks = ranks or tp
        self._channel = None
        if channel_key and channel_key[0]:
            try:
                self._channel = SchedulerChannel(*channel_key)
            except Exception as e:  # noqa: BLE001 - the reports remain
                logger.warning("ECXConnector: no step channel (%s): items "
                               "are known to have landed from the step's "
                               "worker reports only", e)
        self._to_send: list = []  # starts not told to the workers yet
        self._drained = False     # the news read in this step
        self._wait_left = cfg.pull_wait_ms / 1e3
        self._to_start: list = []
        self._to_release: list = []
        self._step_ready: list = []
        self._unavailable: set = set()
        self._attempts = 0
        self._connect()

    def has_cache_item(self, identifier: str) -> bool:
        self._stats.add("has_cache_item_calls")
        # Local state only: True for what every rank holds.
        it = self._items.get(identifier)
        return it is not None and it.state == _READY

    def _remote_ids(self, request, num_computed_tokens):
        """The ids of request's items still to be computed, once each."""
        out = []
        for f in getattr(request, "mm_features", None) or ():
            pos = getattr(f, "mm_position", None)
            if pos is not None and num_computed_tokens and \
                    pos.offset + pos.length <= num_computed_tokens:
                continue  # its tokens are prefix-cached already
            if f.identifier not in out:
                out.append(f.identifier)
        return out

    def ensure_cache_available(self, request, num_computed_tokens: int
                               ) -> bool:
        if not self._drained:
            self._drained = True
            self._read_news()
        rid = request.request_id
        if rid in self._unavailable:
            # Given up (news of a failed pull, just now): not taken on
            # again before vLLM takes it out of the step.
            return False
        st = self._reqs.get(rid)
        if st is None:
            st = self._admit(request, num_computed_tokens)
            self._send_starts()
            self._wait(st)
        elif not st.ready and any(h not in self._items for h in st.items):
            self._readmit(rid, st)
            self._send_starts()
        if st.ready:
            return True
        for h in st.items:
            it = self._items.get(h)
            if it is None or it.state == _FAILED:
                self._give_up(rid, f"{h} could not be loaded")
                return False
            if it.state != _READY:
                break
        else:
            st.ready = True
            self._stats.add("requests_ready")
            self._stats.add("request_wait_s", time.monotonic() - st.t0)
            return True
        if time.monotonic() >= st.deadline:
            self._give_up(rid, f"its items did not arrive within "
                          f"load_timeout_s={self._cfg.load_timeout_s:g}")
        return False

    def _admit(self, request, num_computed_tokens) -> _RequestState:
        rid = request.request_id
        st = _RequestState([], self._cfg.load_timeout_s)
        self._take_on(rid, st,
                      self._remote_ids(request, num_computed_tokens))
        st.ready = not st.items
        self._reqs[rid] = st
        self._stats.add("requests")
        if st.items:
            self._stats.add("requests_remote")
        return st

    def _take_on(self, rid, st, ids) -> list:
        """Looks up (once, batched) those of ids not pulled already (or
        failed before), starts a pull of each found, and adds every id
        pulled to request rid's state st; returns them. An id nobody holds
        is left out (the request encodes it here)."""
        ask = [h for h in ids if h not in self._items or
               self._items[h].state == _FAILED]
        found = dict(zip(ask, self._lookup(ask))) if ask else {}
        out = []
        for h in ids:
            it = self._items.get(h)
            if h in found:
                if found[h] is None:
                    continue  # nobody saved it: encoded here
                if it is not None:  # failed before: a fresh pull
                    self._release(h)
                it = self._start(found[h])
            it.requests.add(rid)
            if h not in st.items:
                st.items.append(h)
            out.append(h)
        return out

    def adopt(self, request_id, ids) -> list:
        """Pulls ids for request request_id, whose other items are no
        business of this flow (push mode's fallback: items whose pushes
        did not come): looks up those not pulled already, starts a pull of
        each found (told to the workers at once) and makes the request
        wait for them in ensure_cache_available, within load_timeout_s
        from the first call. Returns the ids it pulls (not those nobody
        holds)."""
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _RequestState(
                [], self._cfg.load_timeout_s)
        out = self._take_on(request_id, st, ids)
        if out:
            st.ready = False
            self._send_starts()
            self._stats.add("items_adopted", len(out))
        return out

    def _readmit(self, rid, st) -> None:
        """Looks up again the items of a waiting request that were released
        meanwhile (it was preempted and freed them)."""
        gone = [h for h in st.items if h not in self._items]
        for h, f in zip(gone, self._lookup(gone)):
            if f is None:
                st.items.remove(h)  # encoded here after all
            else:
                self._start(f).requests.add(rid)

    def _send_starts(self) -> None:
        """Tells the workers to start the pulls just looked up now, not
        when the step's metadata reaches them (which carries them too)."""
        if self._to_send and self._channel is not None:
            self._channel.send_starts(self._to_send)
        self._to_send = []

    def wait_news(self, timeout_s) -> bool:
        """Waits up to timeout_s for the workers' news (none without the
        step channel) and applies it; True if some came."""
        return self._read_news(timeout_s)

    def _read_news(self, timeout_s=0.0) -> bool:
        """Applies what workers said since (waiting up to timeout_s for the
        first news where none has come): an item is ready once every rank
        holds it, failed once one rank failed it. True if any came."""
        if self._channel is None:
            return False
        news = self._channel.news(timeout_s)
        for rank, held, failed in news:
            for h, attempt in held:
                it = self._items.get(h)
                if it is not None and it.spec.attempt == attempt and \
                        it.state == _STARTING:
                    it.ranks.add(rank)
                    if len(it.ranks) >= self._ranks:
                        self._ready(it)
            for h, attempt, why in failed:
                self._failed(h, attempt, why)
        return bool(news)

    def _wait(self, st) -> None:
        """With pull_wait_ms, waits in this step for the items of a request
        just admitted (at most pull_wait_ms in all in a step)."""
        if self._channel is None or self._wait_left <= 0:
            return
        deadline = time.monotonic() + self._wait_left
        while True:
            pending = [h for h in st.items
                       if self._items.get(h) is not None and
                       self._items[h].state == _STARTING]
            now = time.monotonic()
            if not pending or now >= deadline:
                break
            self._read_news(deadline - now)
        waited = self._wait_left - max(0.0, deadline - time.monotonic())
        self._wait_left = max(0.0, self._wait_left - waited)
        self._stats.add("pull_wait_s", waited)

    def _ready(self, it) -> None:
        it.state = _READY
        self._leases.end_item(it)  # every rank holds it now
        self._stats.add("items_ready")
        self._stats.add("item_load_s", time.monotonic() - it.t0)

    def _failed(self, h, attempt, why) -> None:
        it = self._items.get(h)
        if it is None or it.spec.attempt != attempt or it.state == _READY:
            return
        it.state = _FAILED
        self._leases.end_item(it)
        self._stats.add("items_failed")
        for rid in list(it.requests):
            self._give_up(rid, f"{h}: {why}")
        self._release(h)

    def _start(self, found) -> _ItemState:
        self._attempts += 1
        # The workers' pulls do not name the lease: with several ranks the
        # first pull would end it before the others. The scheduler
        # releases it once every rank holds the item (or gives up).
        it = _ItemState(ECXLoadSpec.of(found, self._attempts),
                        found if found.lease else None)
        self._items[found.id] = it
        self._to_start.append(it.spec)
        self._to_send.append(it.spec)
        self._stats.add("items_remote")
        self._stats.add("bytes_remote", found.nbytes)
        return it


    def _release(self, h) -> None:
        it = self._items.pop(h, None)
        if it is not None:
            self._leases.end_item(it)
            self._to_release.append((h, it.spec.attempt))

    def _drop(self, rid, ids) -> None:
        for h in ids:
            it = self._items.get(h)
            if it is not None:
                it.requests.discard(rid)
                if not it.requests:
                    self._release(h)

    def _give_up(self, rid, why) -> None:
        st = self._reqs.pop(rid, None)
        if rid not in self._unavailable:
            self._unavailable.add(rid)
            self._stats.add("requests_unavailable")
            logger.warning("ECXConnector: request %s is unavailable: %s",
                           rid, why)
        if st is not None:
            self._drop(rid, st.items)

    def take_unavailable_requests(self) -> set:
        out, self._unavailable = self._unavailable, set()
        return out


    def update_state_after_alloc(self, request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        it = self._items.get(mm_hash)
        if it is not None and it.state == _READY:
            self._step_ready.append(mm_hash)
            # It is this request's now too, whichever request brought
            # it: it stays on the workers until both let go.
            rid = request.request_id
            st = self._reqs.get(rid)
            if st is None:
                st = self._reqs[rid] = _RequestState(
                    [], self._cfg.load_timeout_s)
            if mm_hash not in st.items:
                st.items.append(mm_hash)
            it.requests.add(rid)

    def update_state_after_free(self, request, index: int):
        h = request.mm_features[index].identifier
        st = self._reqs.get(request.request_id)
        if st is not None and h in st.items:
            st.items.remove(h)
            self._drop(request.request_id, [h])

    def build_connector_meta(self, scheduler_output):
        meta = ECXConnectorMetadata()
        meta.starts, self._to_start = self._to_start, []
        meta.ready, self._step_ready = self._step_ready, []
        meta.releases, self._to_release = self._to_release, []
        self._drained = False
        self._wait_left = self._cfg.pull_wait_ms / 1e3
        self._leases.flush()
        return meta

    def update_connector_output(self, connector_output):
        wm = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(wm, ECXWorkerMetadata):
            return
        for h, attempt in wm.held:  # merged: what every rank holds
            it = self._items.get(h)
            if it is not None and it.spec.attempt == attempt and \
                    it.state == _STARTING:
                self._ready(it)
        for (h, attempt), why in wm.failed.items():
            self._failed(h, attempt, why)


    def request_finished(self, request):
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._drop(request.request_id, st.items)
        return False, None

    def shutdown(self):
        self._leases.close(self._items.values())
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        super().shutdown()
