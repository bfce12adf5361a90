"""ecx's counters in vLLM's own /metrics.

vLLM asks the connector class for its Prometheus metrics once
(`build_prom_metrics`) and then hands every interval's stats to their
`observe`: the dict that `get_ec_connector_stats` returned, summed over the
scheduler and the workers of one engine. Each key becomes a counter named
`vllm:ecx_<key>_total` (a key in seconds, `*_s`, becomes
`vllm:ecx_<key without _s>_seconds_total`), labelled as vLLM labels its own
metrics (model_name, engine). The counters below exist from the start, at
zero; a key not listed here gets its counter the first time it is seen.
docs/vllm.md ("Metrics") lists them.
"""

try:  # vLLM's base class; without vLLM this module is not used
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorPromMetrics as _Base)
except ImportError:  # pragma: no cover
    _Base = object

# key -> what one unit of it counts. The scheduler's and the workers'
# reports of one engine are summed: items_failed and items_loaded are
# counted where each happens.
COUNTERS = {
    "requests": "requests the scheduler took on",
    "requests_remote": "requests with an item found in the registry",
    "requests_ready": "requests whose remote items all landed",
    "requests_unavailable":
        "requests given up on (their items not fetched in time)",
    "lookups": "items looked up in the registry",
    "lookup_errors": "registry lookups that failed",
    "leases": "producer leases taken for pulls",
    "leases_released": "producer leases released",
    "items_remote": "items found in the registry",
    "bytes_remote": "bytes of the items found in the registry",
    "pulls_started": "pulls started by a worker",
    "items_ready": "items pulled and ready to schedule",
    "items_adopted": "items taken on for a request after its arrival",
    "items_loaded": "items copied into vLLM's encoder cache",
    "bytes_loaded": "bytes copied into vLLM's encoder cache",
    "items_failed": "items whose pull or load failed",
    "items_handed_over": "items handed over on the step channel",
    "items_pushed_taken": "pushed items taken by a worker",
    "has_cache_item_calls": "has_cache_item calls answered",
    "request_wait_s": "time requests waited for their remote items",
    "pull_wait_s": "time items waited for their pull to land",
    "item_load_s": "time from an item's lookup to ready",
    "step_wait_s": "time workers waited for handovers in a step",
    "idle_wait_s": "time an idle engine's scheduler waited for items",
    "pushes_planned": "pushes an encoder planned",
    "pushes_done": "pushes an encoder completed",
    "pushes_failed": "pushes an encoder failed",
    "bytes_pushed": "bytes an encoder pushed",
    "push_items_ready": "pushed items that landed in a prefill",
    "push_items_taken": "pushed items handed to requests",
    "push_items_failed": "pushed items that failed",
    "push_items_failed_events": "failure events from encoders",
    "push_events_late": "push events for items no longer awaited",
    "push_fallbacks": "items pulled where their push did not come",
}


def metric_name(key: str) -> str:
    """The Prometheus name of a stats key, before the client's `_total`."""
    if key.endswith("_s"):
        return f"vllm:ecx_{key[:-2]}_seconds"
    return f"vllm:ecx_{key}"


class ECXPromMetrics(_Base):
    """One counter per stats key, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames,
                 per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames,
                         per_engine_labelvalues)
        self._per_engine: dict = {}
        for key, doc in COUNTERS.items():
            self._counter(key, doc)

    def _counter(self, key, doc):
        c = self._counter_cls(name=metric_name(key),
                              documentation=f"ecx: {doc}",
                              labelnames=self._labelnames)
        self._per_engine[key] = {
            idx: c.labels(*values)
            for idx, values in self.per_engine_labelvalues.items()}
        return self._per_engine[key]

    def observe(self, transfer_stats_data, engine_idx=0):
        for key, value in (transfer_stats_data or {}).items():
            if not isinstance(value, (int, float)) or value <= 0:
                continue
            per = self._per_engine.get(key)
            if per is None:
                if not key.replace("_", "").isalnum():
                    continue
                per = self._counter(key, f"counter {key}")
            child = per.get(engine_idx)
            if child is not None:
                child.inc(value)
