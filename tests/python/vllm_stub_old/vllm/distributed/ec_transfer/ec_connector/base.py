"""Stand-in for vllm/distributed/ec_transfer/ec_connector/base.py."""
import enum
from abc import ABC, abstractmethod
from typing import Any, Optional


class ECConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class ECConnectorMetadata:  # noqa: B903 - an empty base, as in vLLM
    """Each connector defines a dataclass of its own, pickled into the
    scheduler's output and sent to the workers."""


class ECConnectorBase(ABC):

    def __init__(self, vllm_config, role: ECConnectorRole):
        self._connector_metadata: Optional[ECConnectorMetadata] = None
        self._vllm_config = vllm_config
        self._role = role
        if vllm_config.ec_transfer_config is not None:
            self._is_producer = vllm_config.ec_transfer_config.is_ec_producer
            self._is_consumer = vllm_config.ec_transfer_config.is_ec_consumer
        else:
            raise ValueError("ec_transfer_config must be set for "
                             "ECConnectorBase")

    @property
    def role(self) -> ECConnectorRole:
        return self._role

    @property
    def is_producer(self) -> bool:
        return self._is_producer

    @property
    def is_consumer(self) -> bool:
        return self._is_consumer

    # ---- worker side ----

    def bind_connector_metadata(self, connector_metadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> ECConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def register_caches(self, ec_caches) -> None:
        return

    @abstractmethod
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        pass

    @abstractmethod
    def save_caches(self, encoder_cache, mm_hash: str, **kwargs) -> None:
        pass

    def get_finished(self, finished_req_ids):
        return None, None

    # ---- scheduler side ----

    @abstractmethod
    def has_cache_item(self, identifier: str) -> bool:
        pass

    @abstractmethod
    def update_state_after_alloc(self, request, index: int):
        pass

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        pass

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

    def shutdown(self):
        return
