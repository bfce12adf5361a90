"""A consumer worker's background pulls (today's flow). A pull starts from
whichever reaches the worker first, the scheduler's start message (the
step channel) or the step's metadata; it runs in a pool thread, which
settles it the moment it ends and tells the scheduler (the step channel)
what this rank now holds or failed. What it holds is also reported in
every step's worker metadata."""
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("ecx.vllm")


class Pulls:
    """want: id -> the spec of its pull in flight; held: id -> (attempt,
    tensor). Every method may be called from any thread."""

    def __init__(self, cfg, stats, consumer, new_tensor):
        self._cfg = cfg
        self._stats = stats
        self._consumer = consumer      # () -> ecx.Consumer
        self._new_tensor = new_tensor  # (consumer, spec) -> tensor
        # Re-entrant: a pull that has ended by the time its callback is
        # added is settled in the thread that adds it.
        self._lock = threading.RLock()
        self.want: dict = {}
        self.held: dict = {}
        self._inflight: list = []  # [future, specs], one pull per producer
        self._failed_new: dict = {}
        # The highest attempt the metadata has started: a start message
        # of an attempt up to it was handled through the metadata already
        # (attempts only grow, and the metadata comes in order), and may
        # have been released since.
        self._meta_attempt = -1
        self._pool = None
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
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4,
                                            thread_name_prefix="ecx-pull")
        # One pull per producer, each waited for in a pool thread (a first
        # pull from a producer waits for its handshake, up to timeout_ms
        # where it is gone, and a load whose producer is gone tries the
        # item's other holders): never in a step, never one producer
        # holding up another.
        groups: dict = {}
        for s in specs:
            self.want[s.mm_hash] = s
            groups.setdefault(s.producer_zmq, []).append(s)
        for group in groups.values():
            pairs = [(s.item(), self._new_tensor(cons, s)) for s in group]
            self._stats.add("pulls_started")
            entry = [self._pool.submit(_pull, cons, pairs), group]
            self._inflight.append(entry)
            entry[0].add_done_callback(lambda _f, e=entry: self._ended(e))

    def _ended(self, entry) -> None:
        with self._lock:
            if entry not in self._inflight:
                return  # settled already
            self._inflight.remove(entry)
            held, failed = self._settle(entry[0], entry[1])
            # The future's callback holds the entry: emptied, the future
            # and its load's tensors go now, not at a garbage collection.
            entry.clear()
        if self.channel is not None:
            self.channel.send_news(held, failed)

    def _fail(self, s, why, failed) -> None:
        if self.want.get(s.mm_hash) is s:
            del self.want[s.mm_hash]
        failed[(s.mm_hash, s.attempt)] = str(why)
        self._failed_new[(s.mm_hash, s.attempt)] = str(why)
        self._stats.add("items_failed")

    def _settle(self, pull, specs):
        """(held, failed) of a pull that has ended: what it brought, for
        the specs still wanted."""
        held, failed = [], {}
        try:
            load = pull.result()
        except Exception as e:  # noqa: BLE001 - reported, never raised
            for s in specs:
                if self.want.get(s.mm_hash) is s:
                    self._fail(s, f"could not start the pull: {e}", failed)
            logger.warning("ECXConnector: pull of %d items from %s could "
                           "not start: %s", len(specs),
                           specs[0].producer_zmq, e)
            return held, failed
        for s, t, e in zip(specs, load.tensors, load.errors):
            if self.want.get(s.mm_hash) is not s:
                continue  # released, or pulled again, meanwhile
            if e is None:
                del self.want[s.mm_hash]
                self.held[s.mm_hash] = (s.attempt, t)
                held.append((s.mm_hash, s.attempt))
                self._stats.add("items_loaded")
                self._stats.add("bytes_loaded", s.nbytes)
            else:
                self._fail(s, e, failed)
                logger.warning("ECXConnector: pull of %s from %s failed: "
                               "%s", s.mm_hash, s.producer_zmq, e)
        return held, failed

    def poll(self) -> None:
        """Settles the pulls that have ended whose callbacks have not run
        yet (never waits)."""
        with self._lock:
            done = [e for e in self._inflight if e[0].done()]
        for e in done:
            self._ended(e)

    def wait_for(self, h) -> None:
        """Waits for the pull that brings h (bounded: a handshake and a
        load, each within timeout_ms)."""
        with self._lock:
            entry = next((e for e in self._inflight
                          if any(s.mm_hash == h for s in e[1])), None)
            if entry is None:
                return
            fut = entry[0]
        try:
            fut.result(timeout=2 * self._cfg.timeout_ms / 1000 + 1)
        except Exception:  # noqa: BLE001 - settled below
            pass
        if fut.done():
            self._ended(entry)

    def report(self):
        """(held pairs, failed since the last report), for the step's
        worker metadata."""
        self.poll()
        with self._lock:
            failed, self._failed_new = self._failed_new, {}
            return {(h, a) for h, (a, _) in self.held.items()}, failed

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # pulls end within timeouts
            self._pool = None
        with self._lock:
            self._inflight = []
            self.held.clear()
            self.want.clear()


def _pull(cons, pairs):
    """Starts a load and waits for its end (in a pool thread; ctypes lets
    the GIL go while libecx waits)."""
    load = cons.load_start(pairs)
    load.wait()
    return load
