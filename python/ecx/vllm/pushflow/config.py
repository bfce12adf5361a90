"""Push mode's configuration: upstream's keys of ec_transfer_config
(ec_ip, ec_port, ec_buffer_size, ec_buffer_device) and of
ec_connector_extra_config (control_timeout_s, push_wait_timeout_s), with
upstream's defaults and checks (PUSH.md section 8), and ecx's own: push
("auto": on for a consumer without a registry URL, which is how upstream
configures one; true: on beside pulls; false: off), push_token (None:
upstream's unauthenticated wire) and push_fallback_ms (beside pulls: how
long a request waits for a push before its item is looked up in the
registry and pulled instead; 0: never)."""
import math

TTL_S = 300.0
FALLBACK_MS = 100


def _positive(extra, key, default):
    v = extra.get(key, default)
    try:
        if isinstance(v, bool):  # float(True) is 1.0: a mistake, not 1 s
            raise TypeError
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"ECXConnector: {key} is a number of seconds > 0, "
                         f"not {v!r}") from None
    if not (f > 0 and math.isfinite(f)):
        raise ValueError(f"ECXConnector: {key} is a number of seconds > 0, "
                         f"not {v!r}")
    return f


def buffer_size(value):
    """ec_buffer_size as upstream checks it: a positive integer (an
    integral float allowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            value <= 0 or int(value) != value:
        raise ValueError(f"ECXConnector: ec_buffer_size is a positive "
                         f"integer, not {value!r}")
    return int(value)


class PushConfig:
    """ec: vllm's ec_transfer_config; extra: its ec_connector_extra_config;
    has_registry: whether a registry URL is configured (pulls)."""

    def __init__(self, ec, extra, has_registry):
        extra = dict(extra or {})
        mode = extra.get("push", "auto")
        if mode is not True and mode is not False and mode != "auto":
            raise ValueError("ECXConnector: push is \"auto\", true or false, "
                             f"not {mode!r}")
        self.enabled = (not has_registry) if mode == "auto" else mode
        self.ec_ip = str(getattr(ec, "ec_ip", None) or "127.0.0.1")
        port = getattr(ec, "ec_port", None)
        try:
            if isinstance(port, bool) or isinstance(port, float):
                raise ValueError
            self.ec_port = 14579 if port is None else int(port)
        except (TypeError, ValueError):
            raise ValueError(f"ECXConnector: ec_port is a port number (an "
                             f"integer), not {port!r}") from None
        size = getattr(ec, "ec_buffer_size", None)
        self.buffer_size = buffer_size(1e9 if size is None else size) \
            if self.enabled else None
        self.buffer_device = str(
            getattr(ec, "ec_buffer_device", None) or "cuda").lower()
        self.control_timeout_s = _positive(extra, "control_timeout_s", 30)
        self.push_wait_timeout_s = _positive(extra, "push_wait_timeout_s",
                                             60)
        self.token = extra.get("push_token") or None
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError(f"ECXConnector: push_token is a string (the "
                             f"shared secret), not {self.token!r}")
        fb = extra.get("push_fallback_ms", FALLBACK_MS)
        if isinstance(fb, bool) or not isinstance(fb, (int, float)) or \
                not (fb >= 0 and math.isfinite(fb)):
            raise ValueError(f"ECXConnector: push_fallback_ms is a number "
                             f"of milliseconds >= 0, not {fb!r}")
        self.fallback_s = float(fb) / 1e3
        self.ttl_s = TTL_S

    def check_ports(self, dp_rank, tp):
        """upstream's check: 1 <= ec_port + dp*tp and the highest shard
        port <= 65535."""
        base = self.ec_port + dp_rank * tp
        if base < 1 or base + tp - 1 > 65535:
            raise ValueError(
                f"ECXConnector: ec_port {self.ec_port}: the shard ports "
                f"{base}..{base + tp - 1} (data-parallel rank {dp_rank}, "
                f"tensor-parallel size {tp}) are not all in 1..65535")
        return base

    def base_addr(self, dp_rank, tp):
        """tcp://ec_ip:port of this replica's tensor-parallel rank 0: the
        address upstream's proxy is given (--ec-consumer-zmq-addrs)."""
        from ..push.wire import host_for_url
        return f"tcp://{host_for_url(self.ec_ip)}:" \
               f"{self.check_ports(dp_rank, tp)}"
