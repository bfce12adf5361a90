"""Stand-in for vllm/distributed/ec_transfer/ec_connector/metrics.py."""
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass
class ECConnectorStats:
    """Base of a connector's stats: serializable, aggregated over workers,
    reduced to numbers by the logger."""
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other: "ECConnectorStats") -> "ECConnectorStats":
        raise NotImplementedError

    def reduce(self) -> dict[str, Union[int, float]]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError
