"""Stand-in for vllm.config: ECTransferConfig and a VllmConfig holder."""
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ECTransferConfig:
    ec_connector: Optional[str] = None
    engine_id: Optional[str] = None
    ec_buffer_device: Optional[str] = "cuda"
    ec_buffer_size: float = 1e9
    ec_role: Optional[str] = None
    ec_rank: Optional[int] = None
    ec_parallel_size: int = 1
    ec_ip: str = "127.0.0.1"
    ec_port: int = 14579
    ec_connector_extra_config: dict = field(default_factory=dict)
    ec_connector_module_path: Optional[str] = None

    def __post_init__(self):
        # As vLLM's: a fresh id per config; the engine's processes share
        # one config, and so one id.
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())

    @property
    def is_ec_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    def get_from_extra_config(self, key, default) -> Any:
        return self.ec_connector_extra_config.get(key, default)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_rank: int = 0
    rank: int = 0


@dataclass
class VllmConfig:
    ec_transfer_config: Optional[ECTransferConfig] = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
