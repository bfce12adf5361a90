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
workers pull them in the background into their receive arenas, and
reports a request it cannot serve through take_unavailable_requests.
Workers start a pull the moment the scheduler has looked it up and tell
the scheduler the moment it has landed (the step channel: ZeroMQ between
the processes), so an item is schedulable in the step after its request
arrived; the step's metadata carries the same starts and reports, so a
lost message costs steps, never items. start_load_caches
then only hands the tensors over (zero copy on the CPU).

On an older vLLM (no such hooks) it runs the synchronous flow: has_cache_item asks
the registry, start_load_caches loads the step's items in one batched call
and raises RuntimeError naming each item that failed.

The package: config (ec_connector_extra_config), metadata (what travels
between scheduler and workers in the step), channel (the step channel),
scheduler (today's flow), scheduler_sync (the synchronous flow), leases
(the scheduler's leases), worker (saves, device copies, the synchronous
flow's loads), pulls (the worker's background pulls), pushflow (push mode
on upstream vLLM's wire: the consumer's config, worker control shard and
scheduler events; the encoder's scheduler plans and worker pushes).
ECXConnector picks its parts at construction and hands each hook to one
of them.

A consumer configured as upstream's Mooncake EC consumer (ec_ip, ec_port,
no registry URL) serves push mode: upstream's encoder and proxy push into
it. An encoder pushes the items of every request whose ec_transfer_params
name consumer_zmq (upstream's proxy adds it) into that consumer, and
returns upstream's proxy map from request_finished
(../../../docs/vllm.md, "Push mode in the connector").
"""
import logging
import time

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase, ECConnectorMetadata, ECConnectorRole)

from .channel import engine_key
from .config import (VLLM_HAS_ASYNC_HOOKS, Config, parse_size,  # noqa: F401
                     pp_size, rank, tp_size)
from .metadata import (Counters, ECXConnectorMetadata,  # noqa: F401
                       ECXConnectorStats, ECXLoadSpec, ECXWorkerMetadata)
from .pushflow import EncoderScheduler, PushConfig, PushScheduler
from .scheduler import AsyncScheduler, Scheduler
from .scheduler_sync import SyncScheduler
from .worker import NoWorker, Worker

logger = logging.getLogger("ecx.vllm")


def _log_where_vllm_logs():
    """Inside vLLM, ecx's lines go where vLLM's go: its handler, its format
    and VLLM_LOGGING_LEVEL. vLLM sets up its own logger alone, so without
    this ecx's INFO lines (the counters every log_interval_s) were dropped
    and its warnings came out bare, through Python's last-resort handler.
    A handler already on "ecx.vllm" (the user's) is left as it is."""
    vl = logging.getLogger("vllm")
    if logger.handlers or not vl.handlers:
        return
    for h in vl.handlers:
        logger.addHandler(h)
    if logger.level == logging.NOTSET:
        logger.setLevel(vl.level)
    logger.propagate = vl.propagate


_log_where_vllm_logs()

__all__ = ["ECXConnector", "ECXConnectorMetadata", "ECXWorkerMetadata",
           "ECXLoadSpec", "ECXConnectorStats", "VLLM_HAS_ASYNC_HOOKS",
           "parse_size"]

_ROLES = ("ec_producer", "ec_consumer", "ec_both")


class ECXConnector(ECConnectorBase):
    """vLLM EC connector on ecx (see the package's docstring): the
    scheduler's part (today's flow, the synchronous one, or none) and the
    worker's (or none), chosen here; every hook is one of theirs."""

    def __init__(self, vllm_config, role: ECConnectorRole):
        cfg = vllm_config.ec_transfer_config
        if cfg is None:
            raise ValueError("ECXConnector needs ec_transfer_config")
        if cfg.ec_role not in _ROLES:
            raise ValueError(f"ECXConnector: unknown ec_role "
                             f"{cfg.ec_role!r}; expected one of {_ROLES}")
        super().__init__(vllm_config=vllm_config, role=role)
        self._role = role
        self._cfg = Config(cfg.ec_connector_extra_config,
                           getattr(cfg, "ec_buffer_size", None))
        # Push mode (upstream's wire): on for a consumer configured as
        # upstream's (no registry URL), beside pulls with push: true.
        self._push = PushConfig(cfg, cfg.ec_connector_extra_config,
                                bool(self._cfg.registry))
        if self.is_consumer and not self._cfg.registry and \
                not self._push.enabled:
            raise ValueError(
                "an ec_consumer with ECXConnector needs "
                "ec_connector_extra_config['remote_registry_url'] (one URL, "
                "a list, or a comma-separated string) or push mode")
        if self.is_consumer and self._push.enabled and \
                not self._cfg.async_load:
            raise ValueError(
                "ECXConnector: push mode needs a vLLM whose EC connector "
                "base has ensure_cache_available (and async_load not "
                "false)")
        self._stats = Counters()
        self._idle = False  # the last step scheduled no token
        self._rank = rank(vllm_config)
        tp = tp_size(vllm_config)
        # The step channel between this engine's scheduler and workers
        # (today's flow): named by vLLM's engine_id and data-parallel rank.
        key = engine_key(vllm_config)
        dp = key[1]
        if role == ECConnectorRole.SCHEDULER and self.is_consumer and \
                self._push.enabled:
            pull = AsyncScheduler(self._cfg, self._stats, tp, key,
                                  tp * pp_size(vllm_config)) \
                if self._cfg.registry else None
            self._scheduler = PushScheduler(self._push, self._stats, dp, tp,
                                            pull)
        elif role == ECConnectorRole.SCHEDULER and self.is_consumer:
            if self._cfg.async_load:
                self._scheduler = AsyncScheduler(
                    self._cfg, self._stats, tp, key,
                    tp * pp_size(vllm_config))
            else:
                self._scheduler = SyncScheduler(self._cfg, self._stats, tp)
        else:
            self._scheduler = Scheduler(self._cfg, self._stats, tp)
        if role == ECConnectorRole.SCHEDULER and self.is_producer:
            # Push mode on an encoder: requests with consumer_zmq.
            self._scheduler = EncoderScheduler(self._scheduler, vllm_config,
                                               self._stats)
        self._worker = NoWorker()
        if role == ECConnectorRole.WORKER:
            self._worker = Worker(vllm_config, cfg, self._cfg, self._stats,
                                  self._rank, tp, self.is_producer,
                                  self.is_consumer,
                                  bool(self._cfg.async_load), key,
                                  push=self._push, dp_rank=dp)

    # ---- worker side ----

    def save_caches(self, encoder_cache: dict, mm_hash: str,
                    **kwargs) -> None:
        self._worker.save_caches(encoder_cache, mm_hash,
                                 metadata=self._connector_metadata, **kwargs)

    def start_save_caches(self, **kwargs) -> None:
        # An encoder's pushes are reserved now, before the encoder runs.
        self._worker.start_save_caches(self._connector_metadata,
                                       kwargs.get("encoder_cache"))

    def start_load_caches(self, encoder_cache: dict, **kwargs) -> None:
        self._worker.start_load_caches(self._get_connector_metadata,
                                       encoder_cache, **kwargs)

    def build_connector_worker_meta(self):
        return self._worker.build_connector_worker_meta(
            self._connector_metadata)

    def get_finished(self, finished_req_ids):
        # Loads end in the step that schedules them (the take), and saves
        # and pushes are never waited for (an encoder's pushes of finished
        # requests whose output was never bound are abandoned here).
        self._worker.get_finished(finished_req_ids)
        return None, None

    def start_worker_services(self) -> None:
        # The push control shard serves from the worker's construction,
        # so where vLLM calls this the shard is up already (a no-op; a
        # shard is started once and never restarted after shutdown).
        self._worker.start_worker_services()

    # ---- scheduler side ----

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request, num_computed_tokens: int
                               ) -> bool:
        ready = self._scheduler.ensure_cache_available(request,
                                                       num_computed_tokens)
        rid = request.request_id
        if ready or not self._idle or self._cfg.idle_wait_ms <= 0 or \
                self._scheduler.given_up(rid):
            return ready
        # The last step ran nothing: rather than let the engine spin
        # through empty steps, wait (once a step, idle_wait_ms at most)
        # for news of an item landing, and ask again, unless the news
        # made the request unavailable (asked again, it would be new).
        self._idle = False
        t0 = time.monotonic()
        news = self._scheduler.wait_news(self._cfg.idle_wait_ms / 1e3)
        self._stats.add("idle_wait_s", time.monotonic() - t0)
        if not news or self._scheduler.given_up(rid):
            return False
        return self._scheduler.ensure_cache_available(request,
                                                      num_computed_tokens)

    def take_unavailable_requests(self) -> set:
        return self._scheduler.take_unavailable_requests()

    def update_state_after_alloc(self, request, index: int) -> None:
        self._scheduler.update_state_after_alloc(request, index)

    def update_state_after_free(self, request, index: int):
        self._scheduler.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        self._idle = not getattr(scheduler_output,
                                 "total_num_scheduled_tokens", 1)
        meta = self._scheduler.build_connector_meta(scheduler_output)
        # Every flow's scheduler (pull, push alone, an encoder's) logs its
        # counters every log_interval_s while the engine steps.
        self._stats.maybe_log(self._cfg.log_interval_s, "scheduler")
        return meta

    def update_connector_output(self, connector_output):
        # The workers' counters of the step (ECXWorkerMetadata.stats) join
        # the interval vLLM takes next, and so its /metrics.
        wm = getattr(connector_output, "ec_connector_worker_meta", None)
        for k, v in (getattr(wm, "stats", None) or {}).items():
            self._stats.add_interval(k, v)
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request):
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        # An encoder: while pushes are planned or in flight; a push-mode
        # consumer: while cancels are still to be sent.
        f = getattr(self._scheduler, "has_pending_push_work", None)
        return bool(f()) if f is not None else False

    # ---- both ----

    def get_ec_connector_stats(self):
        data = self._stats.take_interval()
        return ECXConnectorStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data=None):
        return ECXConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        """The interval's counters in vLLM's /metrics (ecx/vllm/prom.py)."""
        from .prom import ECXPromMetrics
        return ECXPromMetrics(vllm_config, metric_types, labelnames,
                              per_engine_labelvalues)

    def stats(self) -> dict:
        """Counters since start (lookups, pulls, bytes, failures, seconds
        waited), of this instance."""
        return dict(self._stats.total)

    def shutdown(self):
        if self._stats.total:
            logger.info("ECXConnector %s: %s",
                        "scheduler" if self._role == ECConnectorRole.SCHEDULER
                        else f"worker rank {self._rank}", self._stats.line())
        self._worker.shutdown()
        self._scheduler.shutdown()
