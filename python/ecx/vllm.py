"""ECXConnector: vLLM's EC connector on ecx.

Start vLLM with

    --ec-transfer-config '{"ec_connector": "ECXConnector",
      "ec_connector_module_path": "ecx.vllm", "ec_role": "ec_producer",
      "ec_connector_extra_config": {"registry_http_port": 9018}}'

on an encoder instance, and with "ec_role": "ec_consumer" and
{"remote_registry_url": "http://ENCODER:9018"} on a prefill instance.
../../docs/vllm.md has the full guide, every key, and the mapping of the
reference connector's keys.

The producer keeps encoder outputs in an arena registered once (LRU
eviction, pins while a pull reads) and publishes them to an HTTP registry
whose GET /ec/info/{mm_hash} is the reference's.

On today's vLLM (a base class with ensure_cache_available) a consumer never
blocks a step and never ends the engine: the scheduler looks a request's
items up once (one batched call, ecx.Client), defers the request while its
workers pull them in the background into their receive arenas, reports
what every rank holds back through the worker metadata, and reports a
request it cannot serve through take_unavailable_requests. start_load_caches
then only hands the tensors over (zero copy on the CPU).

On an older vLLM (no such hooks) it works as before: has_cache_item asks
the registry, start_load_caches loads the step's items in one batched call
and raises RuntimeError naming each item that failed.
"""
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase, ECConnectorMetadata, ECConnectorRole)

import ecx
import ecx.cuda

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

logger = logging.getLogger(__name__)

_ROLES = ("ec_producer", "ec_consumer", "ec_both")

# True where vLLM's scheduler calls ensure_cache_available and friends.
VLLM_HAS_ASYNC_HOOKS = all(
    hasattr(ECConnectorBase, n) for n in
    ("ensure_cache_available", "take_unavailable_requests",
     "build_connector_worker_meta"))


# ---- configuration ---------------------------------------------------------

_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_size(value, key="size"):
    """Bytes from an int, a float, or a string with a unit: B, KiB, MiB,
    GiB, TiB (and K, M, G, T: binary, as the ecx command line reads them)
    or KB, MB, GB, TB (decimal). "8GiB", "1.5 GB", 1 << 30. Raises
    ValueError naming key otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{key}: a size cannot be negative ({value!r})")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*"
                         r"([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"{key}: {value!r} is not a size: write bytes (an integer) or a "
        f"number with a unit, B, KiB, MiB, GiB, TiB or KB, MB, GB, TB "
        f"(\"8GiB\")")


def _check_urls(urls, key):
    for u in urls.split(","):
        u = u.strip()
        if not (u.startswith("http://") or u.startswith("redis://")):
            raise ValueError(
                f"ECXConnector: ec_connector_extra_config[{key!r}] has "
                f"{u!r}, which is not a registry URL: write "
                f"http://HOST:PORT or redis://HOST:PORT[/DB]")


_KEYS = {"remote_registry_url", "registry", "registry_http_port",
         "capacity_bytes", "recv_capacity_bytes", "token", "timeout_ms",
         "bind_host", "advertise_host", "transport", "mooncake_protocol",
         "load_timeout_s", "async_load", "log_interval_s", "lease_ms",
         "lease_max_ms", "lease_share_pct"}


class _Config:
    """ec_connector_extra_config, with the reference's keys kept; sizes
    default from vLLM's ec_buffer_size."""

    def __init__(self, extra: dict, buffer_size=None):
        extra = dict(extra or {})
        key = "remote_registry_url" if extra.get("remote_registry_url") \
            else "registry"
        urls = extra.get(key)
        if isinstance(urls, (list, tuple)):
            urls = ",".join(urls)
        if urls:
            _check_urls(urls, key)
        # http://HOST:PORT or redis://HOST:PORT[/DB], one or several.
        self.registry: Optional[str] = urls or None
        self.registry_http_port = int(extra.get("registry_http_port", 9018))
        default = parse_size(buffer_size if buffer_size is not None
                             else 1e9, "ec_buffer_size")
        self.capacity_bytes = parse_size(
            extra.get("capacity_bytes", default), "capacity_bytes")
        # The worker's receive arena: loads land in it (registered once,
        # shared-memory mapped) while it has room, in fresh tensors after.
        self.recv_capacity_bytes = parse_size(
            extra.get("recv_capacity_bytes", default), "recv_capacity_bytes")
        self.token = extra.get("token")  # None: ECX_TOKEN
        self.timeout_ms = int(extra.get("timeout_ms", 5000))
        self.bind_host = extra.get("bind_host", "0.0.0.0")
        self.advertise_host = extra.get("advertise_host")
        self.transport = extra.get("transport")
        self.load_timeout_s = float(extra.get("load_timeout_s", 30))
        # The scheduler's lookups lease what they find (ecx's "a hit will
        # load": the producer pins it until every rank has it, the request
        # is freed, or this many ms pass); 0 turns leases off.
        self.lease_ms = int(extra.get("lease_ms", 30000))
        if self.lease_ms < 0:
            raise ValueError("ECXConnector: lease_ms is 0 (no leases) or "
                             f"more, not {self.lease_ms}")
        # A producer's bounds on leases: the longest it grants, and the
        # share of its arena leased items may take (None: ecx's defaults,
        # 30 s and 50 %).
        self.lease_max_ms = extra.get("lease_max_ms")
        self.lease_share_pct = extra.get("lease_share_pct")
        self.log_interval_s = float(extra.get("log_interval_s", 60))
        mode = extra.get("async_load", "auto")
        if mode not in ("auto", True, False):
            raise ValueError("ECXConnector: async_load is \"auto\", true or "
                             f"false, not {mode!r}")
        self.async_load = VLLM_HAS_ASYNC_HOOKS if mode == "auto" else mode
        if self.async_load and not VLLM_HAS_ASYNC_HOOKS:
            raise ValueError("ECXConnector: async_load needs a vLLM whose "
                             "EC connector base has ensure_cache_available")
        proto = extra.get("mooncake_protocol")
        if proto is not None and self.transport is None:
            # The reference's transport choice: TCP maps over; RDMA is
            # UCX's to pick ("auto") where UCX has it.
            if proto == "tcp":
                self.transport = "tcp"
            else:
                logger.warning("ECXConnector: mooncake_protocol=%r is "
                               "mapped to transport 'auto' (UCX picks "
                               "shared memory, RDMA or TCP)", proto)
        unknown = set(extra) - _KEYS
        if unknown:
            logger.warning("ECXConnector: ignoring unknown "
                           "ec_connector_extra_config keys %s",
                           sorted(unknown))


# ---- what travels between scheduler and workers ---------------------------


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
class ECXConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> workers, one step.

    loads: items to load now, synchronously (older vLLM, or async_load
    false). starts: items whose pulls workers start now, in the background.
    ready: ids every rank holds that this step needs in encoder_cache.
    releases: ids workers drop (their receive-arena space comes back once
    vLLM's encoder cache lets go of the tensor too)."""
    loads: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    releases: list = field(default_factory=list)

    def add_load(self, spec: ECXLoadSpec) -> None:
        self.loads.append(spec)


@dataclass
class ECXWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, each step. held: (id, attempt) pairs the rank
    holds now; failed: (id, attempt) -> why, for pulls that ended badly
    since the last report. Merged over ranks, an item is held when every
    rank holds it and failed when any rank failed it."""
    held: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)

    def aggregate(self, other):
        if not isinstance(other, ECXWorkerMetadata):
            return self
        return ECXWorkerMetadata(held=self.held & other.held,
                                 failed={**self.failed, **other.failed})


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


class _Counters:
    """Totals since start and since the last get_ec_connector_stats."""

    def __init__(self):
        self.total: dict = {}
        self.interval: dict = {}
        self._logged = time.monotonic()

    def add(self, name, n=1):
        self.total[name] = self.total.get(name, 0) + n
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


# ---- the scheduler's state (today's vLLM) ----------------------------------

_STARTING, _READY, _FAILED = "starting", "ready", "failed"


class _ItemState:
    __slots__ = ("spec", "state", "requests", "t0", "leased")

    def __init__(self, spec, leased=None):
        self.spec = spec
        self.state = _STARTING
        self.requests: set = set()
        self.t0 = time.monotonic()
        # The ecx.Item whose lease pins it at its producer until every
        # rank holds it (then released), or None.
        self.leased = leased


class _RequestState:
    __slots__ = ("items", "deadline", "t0", "ready")

    def __init__(self, items, timeout_s):
        self.items = items  # its remote ids
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout_s
        self.ready = not items


# ---- the connector ---------------------------------------------------------


class ECXConnector(ECConnectorBase):
    """vLLM EC connector on ecx (see the module's docstring)."""

    def __init__(self, vllm_config, role: ECConnectorRole):
        cfg = vllm_config.ec_transfer_config
        if cfg is None:
            raise ValueError("ECXConnector needs ec_transfer_config")
        if cfg.ec_role not in _ROLES:
            raise ValueError(f"ECXConnector: unknown ec_role "
                             f"{cfg.ec_role!r}; expected one of {_ROLES}")
        super().__init__(vllm_config=vllm_config, role=role)
        self._role = role
        self._ec_cfg = cfg
        self._cfg = _Config(cfg.ec_connector_extra_config,
                            getattr(cfg, "ec_buffer_size", None))
        if self.is_consumer and not self._cfg.registry:
            raise ValueError(
                "an ec_consumer with ECXConnector needs "
                "ec_connector_extra_config['remote_registry_url'] (one URL, "
                "a list, or a comma-separated string)")
        self._async = bool(self._cfg.async_load)
        self._lock = threading.Lock()
        self._stats = _Counters()
        self._rank = _rank(vllm_config)
        # Scheduler (consumer).
        self._client: Optional[ecx.Client] = None
        self._pending_specs: dict[str, ECXLoadSpec] = {}  # synchronous flow
        self._loads: dict[str, int] = {}
        self._items: dict[str, _ItemState] = {}
        self._reqs: dict[str, _RequestState] = {}
        self._to_start: list = []
        self._to_release: list = []
        self._step_ready: list = []
        self._unavailable: set = set()
        self._attempts = 0
        self._unlease: list = []  # leased ecx.Items to release
        # Synchronous flow: the step's leased hits (id -> an ecx.Item per
        # rank), and the leases handed to workers by request (request ->
        # [time handed, Items]), released if the request is freed first.
        self._sync_leases: dict = {}
        self._req_leases: dict = {}
        self._tp = _tp_size(vllm_config)
        # Worker.
        self._producer: Optional[ecx.Producer] = None
        self._consumer: Optional[ecx.Consumer] = None
        self._want: dict[str, ECXLoadSpec] = {}   # pulls started
        self._held: dict[str, tuple] = {}         # id -> (attempt, tensor)
        self._inflight: list = []   # (Load or Future of a Load, specs)
        self._connected: set = set()  # producers pulled from, no handshake
        self._pool: Optional[ThreadPoolExecutor] = None
        self._failed_new: dict = {}
        self._seen_meta = None
        # Device copies (ecx.cuda): the device interface, where vLLM's
        # tensors live, copies to it (consumer) and saves from it
        # (producer); set at the worker's start.
        self._api = None
        self._buffer_device = None
        self._copies: Optional[ecx.cuda.ToDevice] = None
        self._saves: Optional[ecx.cuda.Saves] = None
        if role == ECConnectorRole.SCHEDULER and self.is_consumer:
            # No data plane: a persistent connection per registry.
            c = self._cfg
            self._client = ecx.Client(c.registry, token=c.token,
                                      timeout_ms=c.timeout_ms)
        if role == ECConnectorRole.WORKER:
            # Now, not at the first request: mapping and touching an
            # arena of GiBs takes seconds.
            if self.is_consumer:
                self._ensure_consumer()
            if self.is_producer and self._rank == 0:
                self._ensure_producer()
            self._start_device(vllm_config)

    # ---- worker side ----

    def _ensure_producer(self) -> ecx.Producer:
        with self._lock:
            if self._producer is None:
                c = self._cfg
                self._producer = ecx.Producer(
                    capacity_bytes=c.capacity_bytes, bind_host=c.bind_host,
                    advertise_host=c.advertise_host,
                    registry_port=None if c.registry else
                    c.registry_http_port,
                    registry=c.registry, token=c.token,
                    transport=c.transport, timeout_ms=c.timeout_ms,
                    lease_max_ms=c.lease_max_ms,
                    lease_share_pct=c.lease_share_pct)
                logger.info("ECXConnector producer at %s, registry %s, "
                            "arena %d bytes", self._producer.address,
                            c.registry or
                            f"embedded on port {c.registry_http_port}",
                            c.capacity_bytes)
            return self._producer

    def _ensure_consumer(self) -> ecx.Consumer:
        with self._lock:
            if self._consumer is None:
                c = self._cfg
                self._consumer = ecx.Consumer(
                    c.registry, token=c.token, timeout_ms=c.timeout_ms,
                    transport=c.transport,
                    recv_capacity=c.recv_capacity_bytes)
            return self._consumer

    def save_caches(self, encoder_cache: dict, mm_hash: str,
                    **kwargs: Any) -> None:
        # Every instance calls this for what it encoded; only a producer's
        # workers keep it.
        if not self.is_producer or self._role != ECConnectorRole.WORKER:
            return
        if not _first_rank():
            return  # tensor-parallel ranks hold the same output
        # A CUDA tensor is copied once, from the device straight into its
        # place in the producer's (page-locked) arena.
        tensor = encoder_cache[mm_hash]
        try:
            self._save(mm_hash, tensor)
        except Exception as e:  # noqa: BLE001 - logged, never raised
            # An item that cannot be kept (arena full, a dtype ecx does not
            # carry, a CUDA error) is one consumers encode again; it must
            # not fail the encoder's request.
            logger.warning("ECXConnector: not saving %s: %s: %s", mm_hash,
                           type(e).__name__, e)

    def _start_device(self, vllm_config) -> None:
        """Where this worker's tensors live, and its arenas page-locked for
        them, decided now: a bad setting or a failed pin ends the start,
        not a step (page-locking GiBs takes seconds, logged)."""
        model = _model_device_type(vllm_config)
        if self.is_consumer:
            self._buffer_device = self._choose_device(model)
            if self._buffer_device.type == "cuda":
                self._copies = ecx.cuda.ToDevice(self._api,
                                                 self._buffer_device)
                cons = self._ensure_consumer()
                if cons.arena()[1] > 0:  # recv_capacity_bytes 0: none
                    self._pin(cons, "receive arena")
        if self._producer is not None and model in (None, "cuda"):
            api = self._api or _device_api()
            if api.available():
                self._api = api
                self._pin(self._producer, "arena")
                self._saves = ecx.cuda.Saves(self._producer, api,
                                             api.current_device())

    def _choose_device(self, model):
        """The device of the tensors handed to vLLM: the CPU, or this
        rank's current GPU whatever index ec_buffer_device names (each
        tensor-parallel rank reads its own GPU's encoder cache)."""
        want = torch.device(self._ec_cfg.ec_buffer_device or "cuda")
        if want.type == "cpu":
            if model == "cuda":
                raise ValueError(
                    "ECXConnector: ec_buffer_device is \"cpu\" but the model "
                    "runs on CUDA: vLLM would merge CPU tensors from the "
                    "encoder cache into CUDA ones; set ec_buffer_device to "
                    "\"cuda\" (each rank then uses its own GPU)")
            return want
        if want.type != "cuda":
            raise ValueError(f"ECXConnector: ec_buffer_device {str(want)!r} "
                             f"is not supported: \"cuda\" or \"cpu\"")
        self._api = self._api or _device_api()
        if not self._api.available():
            raise RuntimeError("ECXConnector: ec_buffer_device is cuda but "
                               "CUDA is not available")
        dev = self._api.current_device()
        if want.index is not None and want.index != dev.index:
            logger.warning("ECXConnector: ec_buffer_device is %s but worker "
                           "rank %d runs on %s: its tensors go to %s",
                           want, self._rank, dev, dev)
        return dev

    def _pin(self, handle, what) -> None:
        t0 = time.perf_counter()
        try:
            ok = handle.pin_for_cuda(required=True)
        except Exception as e:
            raise RuntimeError(f"ECXConnector: cannot page-lock the {what} "
                               f"for CUDA copies: {e}") from e
        if not ok:
            raise RuntimeError(f"ECXConnector: cannot page-lock the {what} "
                               f"for CUDA copies: the CUDA driver is not "
                               f"available")
        logger.info("ECXConnector worker rank %d: the %s is page-locked for "
                    "CUDA (%.2f s)", self._rank, what,
                    time.perf_counter() - t0)

    def _device(self):
        if self._buffer_device is None:
            self._buffer_device = self._choose_device(None)
        return self._buffer_device

    def _to_device(self, t, device):
        """A loaded host tensor as vLLM reads it: itself on the CPU; on a
        GPU, a copy made on a side stream from the page-locked receive
        arena, which the current stream waits for (on the device) before
        reading it. The arena range stays held until the copy has
        completed (ecx.cuda.ToDevice, polled each step)."""
        if device.type == "cpu":
            return t
        if self._copies is None:
            self._copies = ecx.cuda.ToDevice(self._api, device)
        return self._copies.copy([t])[0]

    def _poll_copies(self) -> None:
        if self._copies is not None:
            self._copies.poll()

    def _save(self, mm_hash, tensor) -> None:
        """A device tensor is reserved now and committed once its copy has
        completed (ecx.cuda.Saves, off the step); anything else is put."""
        producer = self._ensure_producer()
        if self._saves is not None and self._api.owns(tensor):
            self._saves.save(mm_hash, tensor)
        else:
            producer.put(mm_hash, tensor)

    def _new_tensor(self, cons, spec):
        t = cons.arena_tensor(spec.item())
        # Past the arena, a GPU's copies still come from page-locked
        # memory (torch's own, which it keeps until they are read): one
        # from pageable memory would wait for the copy stream in the step.
        return t if t is not None else torch.empty(
            tuple(spec.shape), dtype=getattr(torch, spec.dtype),
            pin_memory=self._copies is not None and self._api.pinned_host())

    def _process_metadata(self, meta) -> None:
        """Releases and starts of a step, once per metadata object."""
        if meta is self._seen_meta or not isinstance(
                meta, ECXConnectorMetadata):
            return
        self._seen_meta = meta
        # A copy still reading a released tensor keeps it (ToDevice).
        for h in meta.releases:
            self._held.pop(h, None)
            self._want.pop(h, None)
        if not meta.starts:
            return
        cons = self._ensure_consumer()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4,
                                            thread_name_prefix="ecx-pull")
        # One pull per producer. The first pull from a producer waits for
        # its handshake (up to timeout_ms where it is gone), which must not
        # hold up the step or the other producers: it starts from a thread
        # of the pool. Pulls from producers already connected start here
        # and return at once; they are polled, never waited for.
        groups: dict = {}
        for s in meta.starts:
            self._want[s.mm_hash] = s
            groups.setdefault(s.producer_zmq, []).append(s)
        for producer, specs in groups.items():
            pairs = [(s.item(), self._new_tensor(cons, s)) for s in specs]
            self._stats.add("pulls_started")
            if producer in self._connected:
                try:
                    self._inflight.append((cons.load_start(pairs), specs))
                except (ecx.EcxError, ValueError) as e:
                    self._inflight.append((_failed_future(e), specs))
            else:
                self._inflight.append(
                    (self._pool.submit(_pull, cons, pairs), specs))

    def _fail(self, spec, why):
        if self._want.get(spec.mm_hash) is spec:
            del self._want[spec.mm_hash]
        self._failed_new[(spec.mm_hash, spec.attempt)] = str(why)
        self._stats.add("items_failed")

    def _settle(self, pull, specs) -> None:
        try:
            load = pull if isinstance(pull, ecx.Load) else pull.result()
        except Exception as e:  # noqa: BLE001 - reported, never raised
            self._connected.discard(specs[0].producer_zmq)
            for s in specs:
                if self._want.get(s.mm_hash) is s:
                    self._fail(s, f"could not start the pull: {e}")
            logger.warning("ECXConnector: pull of %d items from %s could "
                           "not start: %s", len(specs),
                           specs[0].producer_zmq, e)
            return
        for s, t, e in zip(specs, load.tensors, load.errors):
            if self._want.get(s.mm_hash) is not s:
                continue  # released, or pulled again, meanwhile
            if e is None:
                self._connected.add(s.producer_zmq)
                del self._want[s.mm_hash]
                self._held[s.mm_hash] = (s.attempt, t)
                self._stats.add("items_loaded")
                self._stats.add("bytes_loaded", s.nbytes)
            else:
                if e.name not in ("ENOTFOUND", "ESIZE"):
                    # Its connection is suspect: the next pull from it
                    # starts from the pool again.
                    self._connected.discard(s.producer_zmq)
                self._fail(s, e)
                logger.warning("ECXConnector: pull of %s from %s failed: "
                               "%s", s.mm_hash, s.producer_zmq, e)

    def _poll(self) -> None:
        """Settles the pulls that have ended. It waits for no pull, but a
        load whose producer is gone tries the item's other holders as it
        is settled (bounded by the load's deadline): that happens here,
        in the step. Moving it off the step is left to do."""
        still = []
        for pull, specs in self._inflight:
            if pull.test() if isinstance(pull, ecx.Load) else pull.done():
                self._settle(pull, specs)
            else:
                still.append((pull, specs))
        self._inflight = still

    def _wait_for(self, h) -> None:
        """Waits for the pull that brings h (bounded: a handshake and a
        load, each within timeout_ms)."""
        for k, (pull, specs) in enumerate(self._inflight):
            if any(s.mm_hash == h for s in specs):
                if isinstance(pull, ecx.Load):
                    pull.wait()
                else:
                    try:
                        pull.result(
                            timeout=2 * self._cfg.timeout_ms / 1000 + 1)
                    except Exception:  # noqa: BLE001 - settled below
                        pass
                    if not pull.done():
                        return
                self._settle(pull, specs)
                del self._inflight[k]
                return

    def start_load_caches(self, encoder_cache: dict, **kwargs: Any) -> None:
        if not self.is_consumer:
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECXConnectorMetadata)
        self._poll_copies()  # arena ranges whose copies have completed
        if metadata.ready and metadata is not self._seen_meta:
            # The hand-over comes before the step's releases: an item one
            # request lets go of may be the one another starts using.
            self._hand_over(encoder_cache, metadata.ready)
        self._process_metadata(metadata)
        if metadata.loads:
            self._load_now(encoder_cache, metadata.loads)
        self._poll()

    def _hand_over(self, encoder_cache: dict, ready: list) -> None:
        t0 = time.perf_counter()
        device = self._device()
        self._poll()
        for h in ready:
            if h in encoder_cache:
                continue
            held = self._held.get(h)
            if held is None and h in self._want:
                self._wait_for(h)  # the scheduler says every rank holds it
                held = self._held.get(h)
            if held is None:
                # Cannot happen while ranks report truthfully; vLLM then
                # reports the cache miss itself.
                logger.error("ECXConnector: %s was scheduled as loaded but "
                             "rank %d does not hold it", h, self._rank)
                continue
            encoder_cache[h] = self._to_device(held[1], device)
        self._stats.add("items_handed_over", len(ready))
        self._stats.add("step_wait_s", time.perf_counter() - t0)

    def _load_now(self, encoder_cache: dict, loads: list) -> None:
        """The synchronous flow: loads the step's items, raises
        RuntimeError naming each that failed."""
        specs = [s for s in loads if s.mm_hash not in encoder_cache]
        if not specs:
            return
        device = self._device()
        # Loads land in host memory, in the receive arena while it has
        # room; a GPU buffer device gets a copy.
        cons = self._ensure_consumer()
        outs = [self._new_tensor(cons, s) for s in specs]
        # Each pull names this rank's lease, and so ends it.
        items = [s.item(self._rank % self._tp) for s in specs]
        errors = cons.load_into(list(zip(items, outs)))
        self._release_failed(cons, items, errors)
        failed = [(s.mm_hash, e) for s, e in zip(specs, errors)
                  if e is not None]
        for s, t, e in zip(specs, outs, errors):
            if e is None:
                encoder_cache[s.mm_hash] = self._to_device(t, device)
                self._stats.add("items_loaded")
                self._stats.add("bytes_loaded", s.nbytes)
        if failed:
            self._stats.add("items_failed", len(failed))
            raise RuntimeError(
                f"ECXConnector: {len(failed)} of {len(specs)} encoder "
                f"outputs could not be loaded: " +
                "; ".join(f"{h}: {e}" for h, e in failed[:4]))

    @staticmethod
    def _release_failed(cons, items, errors) -> None:
        """Ends the leases of the loads that failed (the pulls of the
        others ended theirs)."""
        left = [it for it, e in zip(items, errors)
                if e is not None and it.lease]
        if left:
            try:
                cons.release(left)
            except ecx.EcxError as e:
                logger.warning("ECXConnector: releasing %d leases failed "
                               "(they expire): %s", len(left), e)

    def build_connector_worker_meta(self):
        if not self.is_consumer or not self._async or \
                self._role != ECConnectorRole.WORKER:
            return None
        if self._connector_metadata is not None:
            self._process_metadata(self._connector_metadata)
        self._poll()
        self._poll_copies()
        failed, self._failed_new = self._failed_new, {}
        self._stats.maybe_log(self._cfg.log_interval_s,
                              f"worker rank {self._rank}")
        # Always an object, so a rank holding nothing is not skipped
        # when ranks are merged.
        return ECXWorkerMetadata(
            held={(h, a) for h, (a, _) in self._held.items()},
            failed=failed)

    # ---- scheduler side ----

    def has_cache_item(self, identifier: str) -> bool:
        if not self.is_consumer or self._role != ECConnectorRole.SCHEDULER:
            return False
        self._stats.add("has_cache_item_calls")
        if self._async:
            # Local state only: True for what every rank holds.
            it = self._items.get(identifier)
            return it is not None and it.state == _READY
        if identifier in self._pending_specs:
            return True  # found in this step already: its leases hold
        # With leases, one per rank (the same id asked once per rank, in
        # one round trip): each rank's pull ends its own, so a lease ends
        # when its load is done, whichever hooks this vLLM calls.
        n = self._tp if self._cfg.lease_ms > 0 else 1
        found = self._lookup([identifier] * n, count=1)
        if any(f is None for f in found):
            self._unlease.extend(f for f in found
                                 if f is not None and f.lease)
            return False
        spec = ECXLoadSpec.of(found[0])
        if found[0].lease:
            spec.leases = tuple(f.lease for f in found)
            self._sync_leases[identifier] = list(found)
        self._pending_specs[identifier] = spec
        return True

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
        if not self._async or not self.is_consumer:
            return True
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._admit(request, num_computed_tokens)
        elif not st.ready and any(h not in self._items for h in st.items):
            self._readmit(rid, st)
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
        ids = self._remote_ids(request, num_computed_tokens)
        remote = []
        ask = [h for h in ids if h not in self._items or
               self._items[h].state == _FAILED]
        found = dict(zip(ask, self._lookup(ask))) if ask else {}
        for h in ids:
            it = self._items.get(h)
            if h in found:
                if found[h] is None:
                    continue  # nobody saved it: encoded here
                if it is not None:  # failed before: a fresh pull
                    self._release(h)
                it = self._start(found[h])
            remote.append(h)
            it.requests.add(rid)
        st = _RequestState(remote, self._cfg.load_timeout_s)
        self._reqs[rid] = st
        self._stats.add("requests")
        if remote:
            self._stats.add("requests_remote")
        return st

    def _readmit(self, rid, st) -> None:
        """Looks up again the items of a waiting request that were released
        meanwhile (it was preempted and freed them)."""
        gone = [h for h in st.items if h not in self._items]
        for h, f in zip(gone, self._lookup(gone)):
            if f is None:
                st.items.remove(h)  # encoded here after all
            else:
                self._start(f).requests.add(rid)

    def _start(self, found) -> _ItemState:
        self._attempts += 1
        # The workers' pulls do not name the lease: with several ranks the
        # first pull would end it before the others. The scheduler
        # releases it once every rank holds the item (or gives up).
        it = _ItemState(ECXLoadSpec.of(found, self._attempts),
                        found if found.lease else None)
        self._items[found.id] = it
        self._to_start.append(it.spec)
        self._stats.add("items_remote")
        self._stats.add("bytes_remote", found.nbytes)
        return it

    def _unlease_item(self, it) -> None:
        if it is not None and it.leased is not None:
            self._unlease.append(it.leased)
            it.leased = None

    def _flush_unlease(self) -> None:
        """Ends the leases no longer needed: one call per step, one round
        trip per producer."""
        items, self._unlease = self._unlease, []
        if not items or self._client is None:
            return
        self._stats.add("leases_released", len(items))
        try:
            self._client.release(items)
        except ecx.EcxError as e:
            # They end at their expiry instead.
            logger.warning("ECXConnector: releasing %d leases failed: %s",
                           len(items), e)

    def _release(self, h) -> None:
        it = self._items.pop(h, None)
        if it is not None:
            self._unlease_item(it)
            self._to_release.append(h)

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
        if self._async:
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
        elif mm_hash in self._pending_specs:  # only its own hits
            self._loads[mm_hash] = request.get_num_encoder_embeds(index)
            leased = self._sync_leases.pop(mm_hash, None)
            if leased is not None:
                self._req_leases.setdefault(
                    getattr(request, "request_id", None),
                    [time.monotonic(), []])[1].extend(leased)

    def _free_sync_leases(self, request) -> None:
        """Releases the leases of request's loads (a no-op at the producer
        for those its pulls ended already)."""
        held = self._req_leases.pop(getattr(request, "request_id", None),
                                    None)
        if held is not None:
            self._unlease.extend(held[1])

    def update_state_after_free(self, request, index: int):
        if not self._async:
            self._free_sync_leases(request)
            return
        h = request.mm_features[index].identifier
        st = self._reqs.get(request.request_id)
        if st is not None and h in st.items:
            st.items.remove(h)
            self._drop(request.request_id, [h])

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        meta = ECXConnectorMetadata()
        if self._async:
            meta.starts, self._to_start = self._to_start, []
            meta.ready, self._step_ready = self._step_ready, []
            meta.releases, self._to_release = self._to_release, []
            self._flush_unlease()
            self._stats.maybe_log(self._cfg.log_interval_s, "scheduler")
            return meta
        for mm_hash, num_token in self._loads.items():
            spec = self._pending_specs[mm_hash]
            spec.num_token = num_token
            meta.add_load(spec)
        # has_cache_item asks again in a later step, so nothing stale
        # (an item evicted since) is scheduled from an old answer; the
        # leases of hits no request took end now.
        self._pending_specs.clear()
        self._loads.clear()
        for found in self._sync_leases.values():
            self._unlease.extend(found)
        self._sync_leases.clear()
        # Leases handed to workers end at their pulls, or expire: those
        # older than lease_ms are forgotten (an older vLLM frees no
        # request through the connector).
        old = time.monotonic() - self._cfg.lease_ms / 1000
        while self._req_leases:
            rid = next(iter(self._req_leases))
            if self._req_leases[rid][0] > old:
                break
            del self._req_leases[rid]
        self._flush_unlease()
        return meta

    def update_connector_output(self, connector_output):
        wm = getattr(connector_output, "ec_connector_worker_meta", None)
        if not self._async or not isinstance(wm, ECXWorkerMetadata):
            return
        now = time.monotonic()
        for h, attempt in wm.held:
            it = self._items.get(h)
            if it is not None and it.spec.attempt == attempt and \
                    it.state == _STARTING:
                it.state = _READY
                self._unlease_item(it)  # every rank holds it now
                self._stats.add("items_ready")
                self._stats.add("item_load_s", now - it.t0)
        for (h, attempt), why in wm.failed.items():
            it = self._items.get(h)
            if it is None or it.spec.attempt != attempt or \
                    it.state == _READY:
                continue
            it.state = _FAILED
            self._unlease_item(it)
            self._stats.add("items_failed")
            for rid in list(it.requests):
                self._give_up(rid, f"{h}: {why}")
            self._release(h)

    def request_finished(self, request):
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._drop(request.request_id, st.items)
        if not self._async:
            self._free_sync_leases(request)
        return False, None

    def get_ec_connector_stats(self):
        data = self._stats.take_interval()
        return ECXConnectorStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data=None):
        return ECXConnectorStats(data=dict(data or {}))

    def stats(self) -> dict:
        """Counters since start (lookups, pulls, bytes, failures, seconds
        waited), of this instance."""
        return dict(self._stats.total)

    def shutdown(self):
        if self._stats.total:
            logger.info("ECXConnector %s: %s",
                        "scheduler" if self._role == ECConnectorRole.SCHEDULER
                        else f"worker rank {self._rank}", self._stats.line())
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # pulls end within timeouts
            self._pool = None
        for pull, _ in self._inflight:
            if isinstance(pull, ecx.Load):
                pull.wait()
        self._inflight = []
        # Device copies end before the arenas are unpinned and unmapped:
        # the receive arena's copies to the GPU, the producer's saves
        # (committed, or left reserved after their bound).
        if self._copies is not None:
            self._copies.drain()
        if self._saves is not None:
            left = self._saves.close()
            if left:
                logger.warning("ECXConnector: %d saves still copying at "
                               "shutdown were dropped", left)
            self._saves = None
        self._held.clear()
        if self._client is not None:
            for it in self._items.values():
                self._unlease_item(it)
            for items in self._sync_leases.values():
                self._unlease.extend(items)
            for _, items in self._req_leases.values():
                self._unlease.extend(items)
            self._sync_leases.clear()
            self._req_leases.clear()
            self._flush_unlease()
        with self._lock:
            for h in (self._producer, self._consumer, self._client):
                if h is not None:
                    h.close()
            self._producer = self._consumer = self._client = None


def _failed_future(e):
    f = Future()
    f.set_exception(e)
    return f


def _pull(cons, pairs):
    """Starts a load and waits for its end (in a pool thread; ctypes lets
    the GIL go while libecx waits)."""
    load = cons.load_start(pairs)
    load.wait()
    return load


def _tp_size(vllm_config) -> int:
    pc = getattr(vllm_config, "parallel_config", None)
    return max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1))


def _device_api():
    """The device interface of the worker's copies (ecx.cuda.TorchCuda;
    tests put a stand-in here)."""
    return ecx.cuda.TorchCuda()


def _model_device_type(vllm_config):
    """The device type the model runs on, from vLLM's device_config
    ("cuda", "cpu", ...), or None where the config does not say."""
    dc = getattr(vllm_config, "device_config", None)
    kind = getattr(dc, "device_type", None)
    if not kind:
        kind = getattr(getattr(dc, "device", None), "type", None)
    return str(kind) if kind else None


def _rank(vllm_config) -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    pc = getattr(vllm_config, "parallel_config", None)
    return int(getattr(pc, "rank", 0) or 0)


def _first_rank() -> bool:
    """True on the first tensor-parallel rank (or outside torch.distributed):
    the ranks of an encoder instance compute the same outputs."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True
