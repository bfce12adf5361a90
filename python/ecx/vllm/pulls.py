"""A consumer worker's background pulls (today's flow). A pull starts from
whichever reaches the worker first, the scheduler's start message (the
step channel) or the step's metadata. libecx runs it in a thread of its
own (ecx_consumer_load_notify: handshakes, the wait, failover, the
integrity check) and, the moment it ends, sends the scheduler its news on
the step channel's socket, so no thread of Python's has to run, or win the
GIL, for the scheduler to learn an item landed. The worker settles a pull
(what this rank now holds, or failed) when its step hooks poll it (never
waiting), and reports it in every step's worker metadata too."""
import logging
import threading

from ecx.errors import CODES, EcxError

logger = logging.getLogger("ecx.vllm")


class Pulls:
    """want: id -> the spec of its pull in flight; held: id -> (attempt,
    tensor). Every method may be called from any thread."""

    def __init__(self, cfg, stats, consumer, new_tensor):
        self._cfg = cfg
        self._stats = stats
        self._consumer = consumer      # () -> ecx.Consumer
        self._new_tensor = new_tensor  # (consumer, spec) -> tensor
        self._lock = threading.RLock()
        self.want: dict = {}
        self.held: dict = {}
        self._inflight: list = []  # (ecx.Load, specs), one per producer
        self._failed_new: dict = {}
        # The highest attempt the metadata has started: a start message
        # of an attempt up to it was handled through the metadata already
        # (attempts only grow, and the metadata comes in order), and may
        # have been released since.
        self._meta_attempt = -1
        self.channel = None  # the worker's end of the step channel, or None

    def from_channel(self, specs) -> None:
        with self._lock:
            self._begin([s for s in specs if s.attempt > self._meta_attempt])

    def from_metadata(self, meta) -> None:
        """A step's releases, then its starts (once per metadata object)."""
        with self._lock:
            # A release names the attempt it ends: a newer pull of the id,
            # started from its message meanwhile, stays. A device copy
            # still reading a released tensor keeps it (ToDevice).
            for h, attempt in meta.releases:
                held = self.held.get(h)
                if held is not None and held[0] <= attempt:
                    del self.held[h]
                w = self.want.get(h)
                if w is not None and w.attempt <= attempt:
                    del self.want[h]
            if meta.starts:
                self._meta_attempt = max(self._meta_attempt, max(
                    s.attempt for s in meta.starts))
                self._begin(meta.starts)

    def _known(self, s) -> bool:
        w = self.want.get(s.mm_hash)
        held = self.held.get(s.mm_hash)
        return (w is not None and w.attempt >= s.attempt) or \
            (held is not None and held[0] >= s.attempt)

    def _begin(self, specs) -> None:
        specs = [s for s in specs if not self._known(s)]
        if not specs:
            return
        cons = self._consumer()
        # One pull per producer, each in a thread of libecx's (a first
        # pull from a producer waits for its handshake, up to timeout_ms
        # where it is gone, and a load whose producer is gone tries the
        # item's other holders): never in a step, never one producer
        # holding up another.
        groups: dict = {}
        for s in specs:
            self.want[s.mm_hash] = s
            groups.setdefault(s.producer_zmq, []).append(s)
        # A group whose news would not fit one message (libecx's tag
        # limit: ~850 ids of 64 characters) is pulled in pieces, each
        # saying its own end.
        pieces = []
        for group in groups.values():
            if self.channel is None:
                pieces.append(group)
                continue
            by = {(s.mm_hash, s.attempt): s for s in group}
            pieces += [[by[p] for p in piece] for piece in
                       self.channel.pieces(list(by))]
        for group in pieces:
            pairs = [(s.mm_hash, s.attempt) for s in group]
            sock, tag = self.channel.notify(pairs) if self.channel \
                else (None, b"")
            try:
                load = cons.load_notify(
                    [(s.item(), self._new_tensor(cons, s)) for s in group],
                    sock, tag)
            except Exception as e:  # noqa: BLE001 - reported, never raised
                failed = {}
                for s in group:
                    self._fail(s, f"could not start the pull: {e}", failed)
                logger.warning("ECXConnector: pull of %d items from %s "
                               "could not start: %s", len(group),
                               group[0].producer_zmq, e)
                if self.channel is not None:
                    code = e.code if isinstance(e, EcxError) else \
                        CODES["EINTERNAL"]
                    self.channel.send_failed({k: code for k in failed})
                continue
            self._stats.add("pulls_started")
            self._inflight.append((load, group))

    def _fail(self, s, why, failed) -> None:
        if self.want.get(s.mm_hash) is s:
            del self.want[s.mm_hash]
        failed[(s.mm_hash, s.attempt)] = str(why)
        self._failed_new[(s.mm_hash, s.attempt)] = str(why)
        self._stats.add("items_failed")

    def _settle(self, load, specs) -> None:
        """What a pull that has ended brought, for the specs still
        wanted."""
        errors = load.wait()  # at once: it has ended
        failed: dict = {}
        for s, t, e in zip(specs, load.tensors, errors):
            if self.want.get(s.mm_hash) is not s:
                continue  # released, or pulled again, meanwhile
            if e is None:
                del self.want[s.mm_hash]
                self.held[s.mm_hash] = (s.attempt, t)
                self._stats.add("items_loaded")
                self._stats.add("bytes_loaded", s.nbytes)
            else:
                self._fail(s, e, failed)
                logger.warning("ECXConnector: pull of %s from %s failed: "
                               "%s", s.mm_hash, s.producer_zmq, e)

    def poll(self) -> None:
        """Settles the pulls that have ended (never waits)."""
        with self._lock:
            for entry in [e for e in self._inflight if e[0].test()]:
                self._inflight.remove(entry)
                self._settle(*entry)

    def wait_for(self, h) -> None:
        """Waits for the pull that brings h (bounded: a handshake and a
        load, each within timeout_ms)."""
        with self._lock:
            entry = next((e for e in self._inflight
                          if any(s.mm_hash == h for s in e[1])), None)
            if entry is None:
                return
            self._inflight.remove(entry)
        entry[0].wait()  # without the lock: starts go on meanwhile
        with self._lock:
            self._settle(*entry)

    def report(self):
        """(held pairs, failed since the last report), for the step's
        worker metadata."""
        self.poll()
        with self._lock:
            failed, self._failed_new = self._failed_new, {}
            return {(h, a) for h, (a, _) in self.held.items()}, failed

    def shutdown(self) -> None:
        with self._lock:
            for load, _ in self._inflight:
                load.wait()  # each ends within its timeouts
            self._inflight = []
            self.held.clear()
            self.want.clear()
