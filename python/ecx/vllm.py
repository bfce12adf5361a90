"""ECXConnector: vLLM's EC connector on ecx.

Start vLLM with

    --ec-transfer-config '{"ec_connector": "ECXConnector",
      "ec_connector_module_path": "ecx.vllm", "ec_role": "ec_producer",
      "ec_connector_extra_config": {"registry_http_port": 9018}}'

on an encoder instance, and with "ec_role": "ec_consumer" and
{"remote_registry_url": "http://ENCODER:9018"} on a prefill instance.
../docs/vllm.md has the full guide and the mapping of the reference
connector's keys.

It does what vLLM's ECMooncakeConnector does, on libecx: the producer keeps
encoder outputs in an arena registered once (LRU eviction, pins while a
pull reads) and publishes them to an HTTP registry whose GET
/ec/info/{mm_hash} is the reference's; the consumer's scheduler asks the
registry over a persistent connection, and its workers load all of a
step's items in one batched call, each failure typed, every wait bounded.
"""
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase, ECConnectorMetadata, ECConnectorRole)

import ecx

logger = logging.getLogger(__name__)

_ROLES = ("ec_producer", "ec_consumer", "ec_both")


@dataclass
class ECXLoadSpec:
    """One item for a worker to load (pickled from scheduler to worker)."""
    mm_hash: str
    num_token: int
    nbytes: int
    shape: tuple
    dtype: str
    producer_zmq: str
    epoch: int = 0

    def item(self) -> ecx.Item:
        return ecx.Item(self.mm_hash, self.dtype, self.shape, self.nbytes,
                        self.producer_zmq, self.epoch)


@dataclass
class ECXConnectorMetadata(ECConnectorMetadata):
    """The loads of one scheduler step."""
    loads: list = field(default_factory=list)

    def add_load(self, spec: ECXLoadSpec) -> None:
        self.loads.append(spec)


class _Config:
    """ec_connector_extra_config, with the reference's keys kept."""

    def __init__(self, extra: dict):
        extra = dict(extra or {})
        urls = extra.get("remote_registry_url") or extra.get("registry")
        if isinstance(urls, (list, tuple)):
            urls = ",".join(urls)
        # http://HOST:PORT or redis://HOST:PORT[/DB], one or several.
        self.registry: Optional[str] = urls or None
        self.registry_http_port = int(extra.get("registry_http_port", 9018))
        self.capacity_bytes = int(extra.get("capacity_bytes", 1 << 30))
        self.token = extra.get("token") or None
        self.timeout_ms = int(extra.get("timeout_ms", 5000))
        self.bind_host = extra.get("bind_host", "0.0.0.0")
        self.advertise_host = extra.get("advertise_host")
        self.transport = extra.get("transport")
        # The worker's receive arena: loads land in it (registered once,
        # shared-memory mapped) while it has room, in fresh tensors after.
        self.recv_capacity_bytes = int(extra.get("recv_capacity_bytes",
                                                 512 << 20))
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
        unknown = set(extra) - {
            "remote_registry_url", "registry", "registry_http_port",
            "capacity_bytes", "token", "timeout_ms", "bind_host",
            "advertise_host", "transport", "mooncake_protocol",
            "recv_capacity_bytes"}
        if unknown:
            logger.warning("ECXConnector: ignoring unknown "
                           "ec_connector_extra_config keys %s",
                           sorted(unknown))


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
        self._cfg = _Config(cfg.ec_connector_extra_config)
        if self.is_consumer and not self._cfg.registry:
            raise ValueError(
                "an ec_consumer with ECXConnector needs "
                "ec_connector_extra_config['remote_registry_url'] (one URL, "
                "a list, or a comma-separated string)")
        self._lock = threading.Lock()
        # Scheduler (consumer): what has_cache_item found, and this step's
        # loads.
        self._pending_specs: dict[str, ECXLoadSpec] = {}
        self._loads: dict[str, int] = {}
        self._lookup: Optional[ecx.Consumer] = None
        # Worker.
        self._producer: Optional[ecx.Producer] = None
        self._consumer: Optional[ecx.Consumer] = None
        if self.is_consumer and role == ECConnectorRole.WORKER:
            # Now, not at the first load: populating the arena takes a
            # moment (first-touch page faults).
            self._ensure_consumer()

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
                    transport=c.transport, timeout_ms=c.timeout_ms)
                logger.info("ECXConnector producer at %s, registry %s",
                            self._producer.address,
                            c.registry or
                            f"embedded on port {c.registry_http_port}")
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
        tensor = encoder_cache[mm_hash]
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        try:
            self._ensure_producer().put(mm_hash, tensor)
        except ecx.EcxError as e:
            # An item that cannot be kept is one consumers encode again;
            # it must not fail the encoder's request.
            logger.warning("ECXConnector: not saving %s: %s", mm_hash, e)

    def start_load_caches(self, encoder_cache: dict, **kwargs: Any) -> None:
        if not self.is_consumer:
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECXConnectorMetadata)
        specs = [s for s in metadata.loads if s.mm_hash not in encoder_cache]
        if not specs:
            return
        device = torch.device(self._ec_cfg.ec_buffer_device or "cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("ECXConnector: ec_buffer_device is cuda but "
                               "CUDA is not available")
        # Loads land in host memory, in the receive arena while it has
        # room; a GPU buffer device gets a copy.
        cons = self._ensure_consumer()
        outs = []
        for s in specs:
            t = cons.arena_tensor(s.item())
            outs.append(t if t is not None else torch.empty(
                tuple(s.shape), dtype=getattr(torch, s.dtype)))
        errors = cons.load_into([(s.item(), t) for s, t in zip(specs, outs)])
        failed = [(s.mm_hash, e) for s, e in zip(specs, errors)
                  if e is not None]
        for s, t, e in zip(specs, outs, errors):
            if e is None:
                encoder_cache[s.mm_hash] = (
                    t if device.type == "cpu" else
                    t.to(device, non_blocking=True))
        if failed:
            raise RuntimeError(
                f"ECXConnector: {len(failed)} of {len(specs)} encoder "
                f"outputs could not be loaded: " +
                "; ".join(f"{h}: {e}" for h, e in failed[:4]))

    # ---- scheduler side ----

    def has_cache_item(self, identifier: str) -> bool:
        if not self.is_consumer or self._role != ECConnectorRole.SCHEDULER:
            return False
        with self._lock:
            if self._lookup is None:
                # One handle for the life of the scheduler: a persistent
                # HTTP connection per registry, no receive arena.
                c = self._cfg
                self._lookup = ecx.Consumer(c.registry, token=c.token,
                                            timeout_ms=c.timeout_ms,
                                            transport=c.transport)
        try:
            found = self._lookup.lookup([identifier])[0]
        except ecx.EcxError as e:
            logger.warning("ECXConnector: registry lookup of %s failed: %s",
                           identifier, e)
            return False
        if found is None:
            return False
        self._pending_specs[identifier] = ECXLoadSpec(
            mm_hash=identifier, num_token=0, nbytes=found.nbytes,
            shape=tuple(found.shape), dtype=found.dtype,
            producer_zmq=found.producer, epoch=found.epoch)
        return True

    def update_state_after_alloc(self, request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if mm_hash in self._pending_specs:  # only its own hits
            self._loads[mm_hash] = request.get_num_encoder_embeds(index)

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        meta = ECXConnectorMetadata()
        for mm_hash, num_token in self._loads.items():
            spec = self._pending_specs[mm_hash]
            spec.num_token = num_token
            meta.add_load(spec)
        # has_cache_item asks again in a later step, so nothing stale
        # (an item evicted since) is scheduled from an old answer.
        self._pending_specs.clear()
        self._loads.clear()
        return meta

    def request_finished(self, request):
        return False, None

    def shutdown(self):
        with self._lock:
            for h in (self._producer, self._consumer, self._lookup):
                if h is not None:
                    h.close()
            self._producer = self._consumer = self._lookup = None


def _first_rank() -> bool:
    """True on the first tensor-parallel rank (or outside torch.distributed):
    the ranks of an encoder instance compute the same outputs."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True
