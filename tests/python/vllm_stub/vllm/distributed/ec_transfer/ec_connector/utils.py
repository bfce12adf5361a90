"""Stand-in for vllm/distributed/ec_transfer/ec_connector/utils.py: the
placeholder metadata an encoder's request_finished publishes per item
(upstream's names and signatures; the fields a model wants come from its
multimodal processor in vLLM, here from model_config.placeholder_fields,
{modality: set of field names})."""
from typing import Any

import torch


class PlaceholderMetadataResolver:

    def __init__(self, model_config) -> None:
        self._model_config = model_config

    def fields_for(self, modality: str) -> set:
        return set(getattr(self._model_config, "placeholder_fields",
                           {}).get(modality, ()))


def collect_ec_item_metadata(mm_features, resolver
                             ) -> dict[str, dict[str, Any]]:
    """{mm_hash: {"metadata": {field: value as lists}}}, one per feature;
    a feature without data (served from the processor cache) has none."""
    items: dict[str, dict[str, Any]] = {}
    for feature in mm_features:
        metadata: dict[str, Any] = {}
        if feature.data is not None:
            wanted = resolver.fields_for(feature.modality)
            metadata = {k: v.tolist()
                        for k, v in feature.data.get_data().items()
                        if k in wanted and isinstance(v, torch.Tensor)}
        items[feature.identifier] = {"metadata": metadata}
    return items
