"""The scheduler's side on an older vLLM (no ensure_cache_available), or
with async_load false: has_cache_item asks the registry, and the step's
metadata tells workers to load its hits synchronously."""

from .metadata import ECXConnectorMetadata, ECXLoadSpec
from .scheduler import Scheduler


class SyncScheduler(Scheduler):
    """The synchronous flow, on a consumer's scheduler."""

    def __init__(self, cfg, stats, tp=1):
        super().__init__(cfg, stats, tp)
        self._pending_specs: dict = {}  # id -> ECXLoadSpec, this step's hits
        self._loads: dict = {}          # id -> tokens, of those allocated
        self._connect()

    def has_cache_item(self, identifier: str) -> bool:
        self._stats.add("has_cache_item_calls")
        if identifier in self._pending_specs:
            return True  # found in this step already: its leases hold
        # With leases, one per rank (the same id asked once per rank, in
        # one round trip): each rank's pull ends its own, so a lease ends
        # when its load is done, whichever hooks this vLLM calls.
        n = self._tp if self._cfg.lease_ms > 0 else 1
        found = self._lookup([identifier] * n, count=1)
        if any(f is None for f in found):
            self._leases.end(f for f in found if f is not None and f.lease)
            return False
        spec = ECXLoadSpec.of(found[0])
        if found[0].lease:
            spec.leases = tuple(f.lease for f in found)
            self._leases.hits[identifier] = list(found)
        self._pending_specs[identifier] = spec
        return True

    def update_state_after_alloc(self, request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if mm_hash in self._pending_specs:  # only its own hits
            self._loads[mm_hash] = request.get_num_encoder_embeds(index)
            self._leases.hand_to_request(
                getattr(request, "request_id", None), mm_hash)

    def update_state_after_free(self, request, index: int):
        self._leases.free_request(getattr(request, "request_id", None))

    def build_connector_meta(self, scheduler_output):
        meta = ECXConnectorMetadata()
        for mm_hash, num_token in self._loads.items():
            spec = self._pending_specs[mm_hash]
            spec.num_token = num_token
            meta.add_load(spec)
        # has_cache_item asks again in a later step, so nothing stale
        # (an item evicted since) is scheduled from an old answer.
        self._pending_specs.clear()
        self._loads.clear()
        self._leases.end_step()
        self._leases.flush()
        return meta

    def request_finished(self, request):
        self._leases.free_request(getattr(request, "request_id", None))
        return False, None

    def shutdown(self):
        self._leases.close()
        super().shutdown()
