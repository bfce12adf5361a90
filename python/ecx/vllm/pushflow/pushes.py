"""EncoderPushes: push mode on an encoder's worker (the first rank, whose
Producer holds the outputs), as upstream's encoder does it (PUSH.md
section 5), never blocking a step: every control call and write runs on
threads of its own.

plan(specs) takes the step's ECXPushSpecs: those with a shape are
reserved at once on every shard of their consumer (one reserve_batch per
shard for the step's items of one consumer); those without wait for
their output. bind(mm_hash, tensor), once save_caches has put the output
in the Producer, starts each push of that mm_hash: it waits for its
reservation (bounded), for a device save's commit (bounded), and runs
Pusher.push (a stale reservation refreshed, the writes over Mooncake's
wire, complete_batch (with the item's XXH3 where integrity is on), or
cancel with abandon on any failure, which an ecx consumer hears as a
failure event). finished(ids)
abandons the pushes of finished requests whose output was never bound.
pending() counts the pushes planned and not ended: what
has_pending_push_work reports.
"""
import collections
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor

from ...dtypes import torch_name
from ..push.pusher import PushSpec, Pusher
from ..push.wire import DTYPE_SIZES

logger = logging.getLogger("ecx.vllm")

JOB_THREADS = 4
SAVED_MAX = 4096  # outputs remembered as bound, for plans that come later


class _Push:
    __slots__ = ("plan", "spec", "reserved", "bound", "job")

    def __init__(self, plan, spec):
        self.plan = plan        # the ECXPushSpec
        self.spec = spec        # its PushSpec, once its shape is known
        self.reserved = None    # the future of its reserve, if started
        self.bound = False
        self.job = None


class EncoderPushes:
    """producer: the rank's ecx.Producer; control_timeout_s, token: the
    control wire's (PushConfig); stats: Counters; wait_saved(mm_hash,
    timeout_s): where saves commit later (a device copy), waits for that
    one, True once it has; integrity: the connector's key, whether pushes
    carry the hash the producer made at put (as pulls do only with it)."""

    def __init__(self, producer, control_timeout_s, token, stats,
                 wait_saved=None, integrity=False):
        self.pusher = Pusher(producer, control_timeout_s=control_timeout_s,
                             token=token, send_hash=integrity)
        self._bound_s = float(control_timeout_s)
        self._stats = stats
        self._wait_saved = wait_saved
        self._lock = threading.Lock()
        self._live = {}  # transfer_id -> _Push, planned and not ended
        # mm_hash -> [_Push] of _live not bound yet: a save finds its
        # pushes without a walk through every push in flight.
        self._unbound = {}
        self._saved = collections.OrderedDict()  # mm_hash -> bound output
        self._jobs = ThreadPoolExecutor(JOB_THREADS,
                                        thread_name_prefix="ecx-push-job")
        # Reserves on threads of their own: a job waits for its reserve.
        self._reserves = ThreadPoolExecutor(
            2, thread_name_prefix="ecx-push-reserve")
        self._seen = None
        self._seq = 0  # push_seq of the newest metadata taken
        self._refused = set()  # request ids, since the last report
        self.done = []  # (transfer_id, error or None), newest last
        self._closed = False

    # ---- the step's hooks ----

    def from_metadata(self, meta):
        """The plans of a step's metadata, once per metadata object."""
        if meta is None or meta is self._seen:
            return
        self._seen = meta
        plans = getattr(meta, "pushes", None)
        if plans:
            self.plan(plans)
        # After its pushes are planned: a report made meanwhile names
        # push_seq only once it counts them.
        with self._lock:
            self._seq = max(self._seq, int(getattr(meta, "push_seq", 0) or 0))

    def plan(self, plans):
        fresh = {}  # consumer_zmq -> [PushSpec] to reserve now
        bind = []
        with self._lock:
            for p in plans:
                old = self._live.get(p.transfer_id)
                if old is not None:
                    if (old.plan.mm_hash, old.plan.consumer_zmq) != (
                            p.mm_hash, p.consumer_zmq):
                        logger.warning(
                            "ECXConnector: transfer %s is already pushed "
                            "for %s to %s: refused", p.transfer_id,
                            old.plan.mm_hash, old.plan.consumer_zmq)
                        self._refused.add(p.request_id)
                    continue
                push = _Push(p, self._spec(p, p.shape, p.dtype))
                self._live[p.transfer_id] = push
                self._unbound.setdefault(p.mm_hash, []).append(push)
                if push.spec is not None:
                    fresh.setdefault(p.consumer_zmq, []).append(push)
                saved = self._saved.get(p.mm_hash)
                if saved is not None:
                    # Taken now: a bind below (or another thread's) may
                    # evict it from _saved before its turn comes.
                    bind.append((p.mm_hash, saved))
            for consumer, pushes in fresh.items():
                fut = self._reserves.submit(self.pusher.reserve, consumer,
                                            [x.spec for x in pushes])
                for x in pushes:
                    x.reserved = fut
        for h, saved in bind:
            self.bind(h, saved)

    def bind(self, mm_hash, tensor):
        """The output of mm_hash is in the Producer (or being committed):
        starts its pushes. tensor: the output, or (shape, dtype name)."""
        shape, dtype = (tuple(tensor[0]), tensor[1]) \
            if isinstance(tensor, tuple) else \
            (tuple(tensor.shape), torch_name(tensor.dtype))
        with self._lock:
            self._saved[mm_hash] = (shape, dtype)
            self._saved.move_to_end(mm_hash)
            while len(self._saved) > SAVED_MAX:
                self._saved.popitem(last=False)
            for x in self._unbound.pop(mm_hash, ()):
                x.bound = True
                if x.spec is None:
                    x.spec = self._spec(x.plan, shape, dtype)
                x.job = self._jobs.submit(self._run, x, shape, dtype)

    def finished(self, request_ids):
        """Requests that finished: their pushes whose output was never
        bound are abandoned on every shard (in the background)."""
        if not request_ids:
            return
        with self._lock:
            gone = [x for x in self._live.values()
                    if x.plan.request_id in request_ids and not x.bound]
            for x in gone:
                x.bound = True
                waiting = self._unbound.get(x.plan.mm_hash)
                if waiting is not None:
                    waiting.remove(x)
                    if not waiting:
                        del self._unbound[x.plan.mm_hash]
                x.job = self._jobs.submit(self._drop, x)

    def pending(self):
        with self._lock:
            return len(self._live)

    def report(self):
        """(pushes pending, request ids refused since the last report,
        the push_seq of the newest metadata they count)."""
        with self._lock:
            refused, self._refused = self._refused, set()
            return len(self._live), refused, self._seq

    # ---- the jobs ----

    @staticmethod
    def _spec(plan, shape, dtype):
        if shape is None or dtype not in DTYPE_SIZES:
            return None
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        return PushSpec(plan.transfer_id, plan.mm_hash, nbytes, list(shape),
                        dtype)

    def _run(self, push, shape, dtype):
        spec, consumer = push.spec, push.plan.consumer_zmq
        try:
            if spec is None:
                raise ValueError(f"output dtype {dtype} is not carried")
            if push.reserved is not None:
                push.reserved.result(timeout=2 * self._bound_s + 1)
            if spec.error is None and (list(shape) != spec.shape or
                                       dtype != spec.dtype):
                raise ValueError(f"the output is {dtype}{list(shape)}, the "
                                 f"push planned {spec.dtype}{spec.shape}")
            if spec.error is None and self._wait_saved is not None and \
                    not self._wait_saved(spec.mm_hash, self._bound_s):
                raise TimeoutError(f"the save of {spec.mm_hash} did not "
                                   f"commit within {self._bound_s:g} s")
            if spec.error is None:
                self.pusher.push(consumer, [spec])
        except Exception as e:  # noqa: BLE001 - reported, never raised
            if spec is not None and spec.error is None:
                spec.error = f"{type(e).__name__}: {e}"
                if spec.shards:
                    self.pusher.abandon(consumer, [spec])
            elif spec is None:
                logger.warning("ECXConnector: push of %s: %s",
                               push.plan.mm_hash, e)
        self._end(push, spec.error if spec is not None else "no spec")

    def _drop(self, push):
        spec = push.spec
        if spec is not None:
            try:
                if push.reserved is not None:
                    push.reserved.result(timeout=2 * self._bound_s + 1)
                self.pusher.abandon(push.plan.consumer_zmq, [spec])
            except Exception as e:  # noqa: BLE001 - logged
                logger.warning("ECXConnector: abandoning transfer %s: %s",
                               spec.transfer_id, e)
        self._end(push, "its request finished before its output was bound")

    def _end(self, push, error):
        tid = push.plan.transfer_id
        with self._lock:
            if self._live.get(tid) is push:
                del self._live[tid]
            self.done.append((tid, error))
            del self.done[:-SAVED_MAX]
        if error is None:
            self._stats.add("pushes_done")
            self._stats.add("bytes_pushed", push.spec.nbytes)
        else:
            self._stats.add("pushes_failed")
            logger.warning("ECXConnector: push of %s (transfer %s) to %s "
                           "failed: %s", push.plan.mm_hash, tid,
                           push.plan.consumer_zmq, error)

    def close(self):
        """Waits for the pushes under way (each bounded), abandons those
        never bound, and closes the control sockets."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            ids = {x.plan.request_id for x in self._live.values()}
        self.finished(ids)
        self._jobs.shutdown(wait=True)
        self._reserves.shutdown(wait=True)
        self.pusher.close()
