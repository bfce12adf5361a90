"""What travels between the scheduler and its workers (load specs, the
step's metadata both ways), and the connector's counters."""
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata)

import ecx

try:  # today's vLLM
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorWorkerMetadata)
except ImportError:  # an older vLLM: the connector never builds one
    ECConnectorWorkerMetadata = object
try:
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorStats)
except ImportError:
    ECConnectorStats = None


logger = logging.getLogger("ecx.vllm")


@dataclass
class ECXLoadSpec:
    """One item for a worker to load (pickled from scheduler to worker).
    attempt tells a fresh pull of an id from an older one. leases: in the
    synchronous flow, the item's leases, one per tensor-parallel rank: a
    rank's pull names its own, which ends it."""
    mm_hash: str
    num_token: int
    nbytes: int
    shape: tuple
    dtype: str
    producer_zmq: str
    epoch: int = 0
    attempt: int = 0
    leases: tuple = ()

    def item(self, rank=None) -> ecx.Item:
        """The item to load; with rank, naming that rank's lease."""
        lease = self.leases[rank % len(self.leases)] \
            if rank is not None and self.leases else 0
        return ecx.Item(self.mm_hash, self.dtype, self.shape, self.nbytes,
                        self.producer_zmq, self.epoch, lease)

    @classmethod
    def of(cls, found: ecx.Item, attempt=0, num_token=0) -> "ECXLoadSpec":
        return cls(mm_hash=found.id, num_token=num_token,
                   nbytes=found.nbytes, shape=tuple(found.shape),
                   dtype=found.dtype, producer_zmq=found.producer,
                   epoch=found.epoch, attempt=attempt)


@dataclass
class ECXPushSpec:
    """One item an encoder pushes (push mode, scheduler -> worker): where
    (consumer_zmq, the proxy's), under which transfer_id, for which
    request. shape [tokens, width] and dtype name where the scheduler
    knows the model's (then the worker reserves before the encoder runs),
    else None (the worker reserves with the output's)."""
    mm_hash: str
    transfer_id: str
    consumer_zmq: str
    request_id: str
    shape: Optional[tuple] = None
    dtype: Optional[str] = None


@dataclass
class ECXConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> workers, one step.

    loads: items to load now, synchronously (older vLLM, or async_load
    false). starts: items whose pulls workers start now, in the background.
    ready: ids every rank holds that this step needs in encoder_cache.
    releases: (id, attempt) pairs workers drop, that attempt and older
    ones (their receive-arena space comes back once vLLM's encoder cache
    lets go of the tensor too). Push mode: takes, (id, transfer_id) pairs
    every rank's shard holds READY, for the workers to hand over now;
    freed, pushed ids the engine let go of (kept resident, evictable);
    pushes, ECXPushSpecs an encoder's workers push; push_seq, the
    encoder scheduler's count of the metadata it built (1, 2, ...), which
    its workers' reports name."""
    loads: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    releases: list = field(default_factory=list)
    takes: list = field(default_factory=list)
    freed: list = field(default_factory=list)
    pushes: list = field(default_factory=list)
    push_seq: int = 0

    def add_load(self, spec: ECXLoadSpec) -> None:
        self.loads.append(spec)


@dataclass
class ECXWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, each step. held: (id, attempt) pairs the rank
    holds now; failed: (id, attempt) -> why, for pulls that ended badly
    since the last report. Merged over ranks, an item is held when every
    rank holds it and failed when any rank failed it. push_failed: id ->
    why, for pushed items a rank could not take from its shard. An
    encoder's: pushes_pending, its pushes planned and not ended (summed);
    pushes_seq, the push_seq of the newest metadata it had taken when it
    counted them (merged: the oldest of the ranks that push; -1 where no
    rank pushes); saves_failed, request ids whose push was refused (a
    transfer_id it already pushes elsewhere). stats: the rank's counters
    of the interval not yet taken by get_ec_connector_stats (summed):
    vLLM 0.32's model runner never asks a worker for them, so they reach
    the scheduler, and vLLM's metrics, this way."""
    held: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)
    push_failed: dict = field(default_factory=dict)
    pushes_pending: int = 0
    pushes_seq: int = -1
    saves_failed: set = field(default_factory=set)
    stats: dict = field(default_factory=dict)

    def aggregate(self, other):
        if not isinstance(other, ECXWorkerMetadata):
            return self
        return ECXWorkerMetadata(
            held=self.held & other.held,
            failed={**self.failed, **other.failed},
            push_failed={**self.push_failed, **other.push_failed},
            pushes_pending=self.pushes_pending + other.pushes_pending,
            pushes_seq=min((s for s in (self.pushes_seq, other.pushes_seq)
                            if s >= 0), default=-1),
            saves_failed=self.saves_failed | other.saves_failed,
            stats={k: self.stats.get(k, 0) + other.stats.get(k, 0)
                   for k in self.stats.keys() | other.stats.keys()})


_STATS_BASE = ECConnectorStats if ECConnectorStats is not None else object


@dataclass
class ECXConnectorStats(_STATS_BASE):
    """Counters of an interval (sums over workers when aggregated)."""
    data: dict = field(default_factory=dict)

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        for k, v in (getattr(other, "data", None) or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        return dict(self.data)

    def is_empty(self):
        return not any(self.data.values())


class Counters:
    """Totals since start and since the last get_ec_connector_stats."""

    def __init__(self):
        self.total: dict = {}
        self.interval: dict = {}
        self._logged = time.monotonic()

    def add(self, name, n=1):
        self.total[name] = self.total.get(name, 0) + n
        self.interval[name] = self.interval.get(name, 0) + n

    def add_interval(self, name, n):
        """Counts n in the interval only: a worker's, reported to the
        scheduler, whose totals stay its own."""
        self.interval[name] = self.interval.get(name, 0) + n

    def take_interval(self):
        out, self.interval = self.interval, {}
        return out

    def maybe_log(self, interval_s, who):
        now = time.monotonic()
        if interval_s > 0 and now - self._logged >= interval_s:
            self._logged = now
            logger.info("ECXConnector %s: %s", who, self.line())

    def line(self):
        return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else
                         f"{k} {v}" for k, v in sorted(self.total.items()))
