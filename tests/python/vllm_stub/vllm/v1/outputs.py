"""Stand-in for the EC part of vllm/v1/outputs.py."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class ECConnectorOutput:
    """Worker -> scheduler, once per step: the workers' metadata, merged
    over ranks with ECConnectorWorkerMetadata.aggregate."""
    finished_sending: Optional[set] = None
    finished_recving: Optional[set] = None
    ec_connector_worker_meta: Optional[object] = None

    def is_empty(self) -> bool:
        return (not self.finished_sending and not self.finished_recving
                and not self.ec_connector_worker_meta)
