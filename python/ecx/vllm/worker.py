"""The worker's side: the producer's saves (save_caches) and the
consumer's pulls, in the background (today's flow, pulls.Pulls: started
from the scheduler's start message or the step's metadata, whichever comes
first, reported the moment they land, handed to vLLM's encoder cache once
every rank holds them) or in the step (the synchronous flow); device
copies through ecx.cuda."""
import logging
import threading
import time
from typing import Any, Optional

import torch

import ecx
import ecx.cuda
from ecx.errors import mask_urls

from .channel import WorkerChannel
from .config import first_rank, model_device_type
from .metadata import ECXConnectorMetadata, ECXLoadSpec, ECXWorkerMetadata
from .pulls import Pulls
from .pushflow import PushWorker
from .pushflow.pushes import EncoderPushes

logger = logging.getLogger("ecx.vllm")


class NoWorker:
    """The worker hooks of a connector that is no worker (a scheduler's)."""

    def save_caches(self, encoder_cache, mm_hash, **kwargs):
        pass

    def start_save_caches(self, metadata, encoder_cache=None):
        pass

    def get_finished(self, finished_req_ids):
        pass

    def start_load_caches(self, get_metadata, encoder_cache, **kwargs):
        pass

    def build_connector_worker_meta(self, metadata):
        return None

    def start_worker_services(self) -> None:
        pass

    def shutdown(self):
        pass


class Worker(NoWorker):
    """A worker's pulls, saves and device copies."""

    def __init__(self, vllm_config, ec_cfg, cfg, stats, rank, tp,
                 is_producer, is_consumer, async_load, channel_key=None,
                 push=None, dp_rank=0):
        self._ec_cfg = ec_cfg
        self._cfg = cfg
        self._stats = stats
        self._rank = rank
        self._tp = tp
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._async = async_load
        self._lock = threading.Lock()
        self._producer: Optional[ecx.Producer] = None
        self._consumer: Optional[ecx.Consumer] = None
        self._pulls = Pulls(cfg, stats, self._ensure_consumer,
                            self._new_tensor)
        self._channel = None
        self._seen_meta = None
        self._push: Optional[PushWorker] = None
        self._push_failed: dict = {}
        self._pushes: Optional[EncoderPushes] = None
        # Device copies (ecx.cuda): the device interface, where vLLM's
        # tensors live, copies to it (consumer) and saves from it
        # (producer); set at the start.
        self._api = None
        self._buffer_device = None
        self._copies: Optional[ecx.cuda.ToDevice] = None
        self._saves: Optional[ecx.cuda.Saves] = None
        # Now, not at the first request: mapping and touching an arena of
        # GiBs takes seconds.
        if is_consumer:
            self._ensure_consumer()
        if is_producer and rank == 0:
            self._ensure_producer()
        self._start_device(vllm_config)
        # Push mode on an encoder: the rank whose Producer holds the
        # outputs pushes them where its requests' ec_transfer_params say.
        if self._producer is not None and push is not None:
            self._pushes = EncoderPushes(
                self._producer, push.control_timeout_s, push.token, stats,
                wait_saved=lambda h, t: self._saves is None or
                self._saves.wait_for(h, t), integrity=cfg.integrity)
        # Push mode: this rank's control shard, serving from now (ranks of
        # the first pipeline stage only, as upstream's).
        if is_consumer and push is not None and push.enabled and rank < tp:
            self._push = PushWorker(push, self._ensure_consumer(), dp_rank,
                                    tp, rank % tp).start()
        if is_consumer and async_load and channel_key and channel_key[0]:
            try:
                self._channel = WorkerChannel(
                    channel_key[0], channel_key[1], rank,
                    self._pulls.from_channel, ECXLoadSpec)
                self._pulls.channel = self._channel
            except Exception as e:  # noqa: BLE001 - the metadata remains
                logger.warning("ECXConnector worker rank %d: no step "
                               "channel (%s): pulls start from the step's "
                               "metadata and are reported in its worker "
                               "metadata", rank, e)

    @property
    def _held(self) -> dict:
        """id -> (attempt, tensor): what this rank holds."""
        return self._pulls.held

    def _ensure_producer(self) -> ecx.Producer:
        p = self._producer  # made once (shutdown clears it): read unlocked
        if p is not None:
            return p
        with self._lock:
            if self._producer is None:
                c = self._cfg
                self._producer = ecx.Producer(
                    capacity_bytes=c.capacity_bytes, bind_host=c.bind_host,
                    advertise_host=c.reach_host(c.bind_host),
                    registry_port=None if c.registry else
                    c.registry_http_port,
                    registry=c.registry, token=c.token,
                    transport=c.transport, timeout_ms=c.timeout_ms,
                    lease_max_ms=c.lease_max_ms,
                    lease_share_pct=c.lease_share_pct,
                    integrity=c.integrity)
                logger.info("ECXConnector producer at %s, registry %s, "
                            "arena %d bytes", self._producer.address,
                            mask_urls(c.registry) if c.registry else
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
                    recv_capacity=c.recv_capacity_bytes,
                    mooncake_host=c.reach_host())
            return self._consumer

    def save_caches(self, encoder_cache: dict, mm_hash: str,
                    metadata=None, **kwargs: Any) -> None:
        # Every instance calls this for what it encoded; only a producer's
        # workers keep it.
        if not self._is_producer:
            return
        if not first_rank():
            return  # tensor-parallel ranks hold the same output
        if self._pushes is not None:
            self._pushes.from_metadata(metadata)
        # A CUDA tensor is copied once, from the device straight into its
        # place in the producer's (page-locked) arena.
        tensor = encoder_cache[mm_hash]
        try:
            self._save(mm_hash, tensor)
        except Exception as e:  # noqa: BLE001 - logged, never raised
            # An item that cannot be kept (arena full, a dtype ecx does not
            # carry, a CUDA error) is one consumers encode again; it must
            # not fail the encoder's request (its pushes fail, with
            # abandon, when they find it not held).
            logger.warning("ECXConnector: not saving %s: %s: %s", mm_hash,
                           type(e).__name__, e)
        if self._pushes is not None:
            self._pushes.bind(mm_hash, tensor)

    def start_save_caches(self, metadata, encoder_cache=None) -> None:
        """An encoder's step begins: its push plans are reserved now; an
        item it encoded before (in encoder_cache) is saved and pushed at
        once."""
        if self._pushes is None or not first_rank():
            return
        self._pushes.from_metadata(metadata)
        if isinstance(encoder_cache, dict):
            for p in getattr(metadata, "pushes", None) or ():
                if p.mm_hash in encoder_cache:
                    self.save_caches(encoder_cache, p.mm_hash)

    def get_finished(self, finished_req_ids) -> None:
        if self._pushes is not None:
            self._pushes.finished(set(finished_req_ids or ()))

    def _start_device(self, vllm_config) -> None:
        """Where this worker's tensors live, and its arenas page-locked for
        them, decided now: a bad setting or a failed pin ends the start,
        not a step (page-locking GiBs takes seconds, logged)."""
        model = model_device_type(vllm_config)
        if self._is_consumer:
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
        self._pulls.from_metadata(meta)

    def start_load_caches(self, get_metadata, encoder_cache: dict,
                          **kwargs: Any) -> None:
        if not self._is_consumer:
            return
        metadata = get_metadata()
        assert isinstance(metadata, ECXConnectorMetadata)
        self._poll_copies()  # arena ranges whose copies have completed
        if metadata.ready and metadata is not self._seen_meta:
            # The hand-over comes before the step's releases: an item one
            # request lets go of may be the one another starts using.
            self._hand_over(encoder_cache, metadata.ready)
        if self._push is not None and metadata is not self._seen_meta:
            self._push_step(encoder_cache, metadata)
        self._process_metadata(metadata)
        if metadata.loads:
            self._load_now(encoder_cache, metadata.loads)
        self._pulls.poll()

    def _push_step(self, encoder_cache: dict, metadata) -> None:
        """Pushed items: the step's takes handed to encoder_cache (the
        arena bytes themselves on the CPU, one device copy on a GPU), then
        what the engine freed retired on the shard."""
        takes = getattr(metadata, "takes", None)
        if takes:
            device = self._device()
            self._push_failed.update(self._push.take(
                takes, encoder_cache, lambda t: self._to_device(t, device)))
            self._stats.add("items_pushed_taken", len(takes))
        freed = getattr(metadata, "freed", None)
        if freed:
            self._push.release(freed)

    def _hand_over(self, encoder_cache: dict, ready: list) -> None:
        t0 = time.perf_counter()
        device = self._device()
        self._pulls.poll()
        for h in ready:
            if h in encoder_cache:
                continue
            held = self._held.get(h)
            if held is None and h in self._pulls.want:
                # The scheduler says every rank holds it.
                self._pulls.wait_for(h)
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

    def build_connector_worker_meta(self, metadata):
        pushes = None
        if self._pushes is not None:
            self._pushes.from_metadata(metadata)
            pending, refused, seq = self._pushes.report()
            pushes = {"pushes_pending": pending, "saves_failed": refused,
                      "pushes_seq": seq}
        # Every role logs its counters, a producer's pushes and saves too.
        self._stats.maybe_log(self._cfg.log_interval_s,
                              f"worker rank {self._rank}")
        if not self._is_consumer or not (self._async or self._push):
            if not pushes:
                return None
            return ECXWorkerMetadata(stats=self._stats.take_interval(),
                                     **pushes)
        if metadata is not None:
            self._process_metadata(metadata)
        self._poll_copies()
        held, failed = self._pulls.report()
        # Always an object, so a rank holding nothing is not skipped
        # when ranks are merged.
        push_failed, self._push_failed = self._push_failed, {}
        return ECXWorkerMetadata(held=held, failed=failed,
                                 push_failed=push_failed,
                                 stats=self._stats.take_interval(),
                                 **(pushes or {}))

    def start_worker_services(self) -> None:
        if self._push is not None:
            self._push.start()

    def shutdown(self):
        if self._channel is not None:
            self._channel.close()  # no start comes in after this
            self._channel = None
        self._pulls.shutdown()
        if self._pushes is not None:
            self._pushes.close()  # before the saves and the producer go
            self._pushes = None
        if self._push is not None:
            self._push.stop()  # before its consumer's arena goes
            self._push = None
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
        with self._lock:
            for h in (self._producer, self._consumer):
                if h is not None:
                    h.close()
            self._producer = self._consumer = None


def _device_api():
    """The device interface of the worker's copies (ecx.cuda.TorchCuda;
    tests put a stand-in here)."""
    return ecx.cuda.TorchCuda()
