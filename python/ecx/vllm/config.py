"""ec_connector_extra_config: its keys, their defaults and checks, and what
the connector reads of vLLM's config (ranks, devices)."""
import ctypes
import logging
import math
import os
import re
from typing import Optional

import torch

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

from .. import _cdefs
from ..errors import mask_urls

logger = logging.getLogger("ecx.vllm")

_ROLES = ("ec_producer", "ec_consumer", "ec_both")

# True where vLLM's scheduler calls ensure_cache_available and friends.
VLLM_HAS_ASYNC_HOOKS = all(
    hasattr(ECConnectorBase, n) for n in
    ("ensure_cache_available", "take_unavailable_requests",
     "build_connector_worker_meta"))


# ---- configuration ---------------------------------------------------------

def parse_size(value, key="size"):
    """Bytes from an int, a float, or a string that libecx's
    ecx_size_parse reads, the parser of the ecx command's sizes too: a
    number and a unit, B, KiB, MiB, GiB, TiB (and K, M, G, T; powers of
    1024) or KB, MB, GB, TB (powers of 1000). "8GiB", "1.5 GB", 1 << 30.
    Raises ValueError naming key otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{key}: a size is a finite number of bytes, "
                             f"0 or more ({value!r})")
        return int(value)
    if isinstance(value, str):
        out = ctypes.c_uint64()
        why = ctypes.create_string_buffer(256)
        text = value.encode("utf-8", "replace")
        if b"\0" not in text and _cdefs.ecx_size_parse(
                text, ctypes.byref(out), why, len(why)) == 0:
            return out.value
        raise ValueError(f"{key}: {why.value.decode(errors='replace')}"
                         if why.value else
                         f"{key}: {value!r} is not a size (a NUL byte)")
    raise ValueError(f"{key}: expected a size (bytes, or a string such as "
                     f"\"8GiB\"), got {value!r}")


def split_urls(urls):
    """A comma-separated list of registry URLs, split as libecx splits it:
    a redis+sentinel:// URL runs up to the comma before the next SCHEME://
    (its sentinels are comma-separated), any other URL to its first
    comma."""
    out = []
    for part in urls.split(","):
        starts = re.match(r"\s*[A-Za-z][A-Za-z0-9+.-]*://", part)
        if out and out[-1].lstrip().lower().startswith(
                "redis+sentinel://") and not starts:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def _check_urls(urls, key):
    for u in split_urls(urls):
        u = u.strip()
        if not (u.startswith("http://") or u.startswith("redis://") or
                u.startswith("redis+sentinel://")):
            raise ValueError(
                f"ECXConnector: ec_connector_extra_config[{key!r}] has "
                f"{mask_urls(u)!r}, which is not a registry URL: write "
                f"http://HOST:PORT, redis://HOST:PORT[/DB] or "
                f"redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER")


_KEYS = {"remote_registry_url", "registry", "registry_http_port",
         "capacity_bytes", "recv_capacity_bytes", "token", "timeout_ms",
         "bind_host", "advertise_host", "transport", "mooncake_protocol",
         "load_timeout_s", "async_load", "log_interval_s", "lease_ms",
         "lease_max_ms", "lease_share_pct", "pull_wait_ms", "integrity",
         "idle_wait_ms",
         # push mode (pushflow/config.py)
         "push", "push_token", "control_timeout_s", "push_wait_timeout_s",
         "push_fallback_ms"}


class Config:
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
        # An encoder's Producer hashes each item at put (XXH3): consumers
        # that check pulls can, and a push asks for a hashed window and
        # sends that hash as ecx_xxh3; without it a push is unchecked, as
        # a pull is.
        self.integrity = extra.get("integrity", False)
        if not isinstance(self.integrity, bool):
            raise ValueError("ECXConnector: integrity is true or false, "
                             f"not {self.integrity!r}")
        # Today's flow: how long, in all, a step's ensure_cache_available
        # may wait for the pulls it has just started (0: never waits; the
        # items are then schedulable in the next step).
        # A consumer's scheduler in an engine whose last step ran nothing
        # (every request waits for its items) waits up to this long in a
        # step for an item to land, instead of the engine spinning
        # through empty steps on a core the encoder may need (0: never).
        self.idle_wait_ms = float(extra.get("idle_wait_ms", 2))
        if not 0 <= self.idle_wait_ms <= 100:
            raise ValueError("ECXConnector: idle_wait_ms is 0 to 100, not "
                             f"{self.idle_wait_ms:g}")
        self.pull_wait_ms = float(extra.get("pull_wait_ms", 0))
        if not 0 <= self.pull_wait_ms <= 1000:
            raise ValueError("ECXConnector: pull_wait_ms is 0 to 1000, not "
                             f"{self.pull_wait_ms:g}")
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

    def reach_host(self, bind_host=None) -> Optional[str]:
        """The host peers reach this instance at (the producer's address
        in the registry; the consumer's Mooncake session, which upstream's
        encoder and the reference producer write to): advertise_host;
        else, listening on a given address (bind_host other than libecx's
        wildcards 0.0.0.0 and ::), None (libecx advertises that address);
        else vLLM's VLLM_HOST_IP, which upstream's Mooncake engine names
        itself by where it is set; else None (libecx's default: the first
        non-loopback IPv4 address, 127.0.0.1 if there is none)."""
        if self.advertise_host:
            return self.advertise_host
        if bind_host and bind_host not in ("0.0.0.0", "::"):
            return None
        return os.environ.get("VLLM_HOST_IP") or None


def tp_size(vllm_config) -> int:
    pc = getattr(vllm_config, "parallel_config", None)
    return max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1))


def pp_size(vllm_config) -> int:
    pc = getattr(vllm_config, "parallel_config", None)
    return max(1, int(getattr(pc, "pipeline_parallel_size", 1) or 1))


def model_device_type(vllm_config):
    """The device type the model runs on, from vLLM's device_config
    ("cuda", "cpu", ...), or None where the config does not say."""
    dc = getattr(vllm_config, "device_config", None)
    kind = getattr(dc, "device_type", None)
    if not kind:
        kind = getattr(getattr(dc, "device", None), "type", None)
    return str(kind) if kind else None


def rank(vllm_config) -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    pc = getattr(vllm_config, "parallel_config", None)
    return int(getattr(pc, "rank", 0) or 0)


def first_rank() -> bool:
    """True on the first tensor-parallel rank (or outside torch.distributed):
    the ranks of an encoder instance compute the same outputs."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True
