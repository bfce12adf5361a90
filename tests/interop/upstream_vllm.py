"""What stands in for vLLM when run_upstream_push.py runs upstream's
Mooncake EC connector files (the minimum their imports and calls need),
and the requests and config objects both connectors are given.

install_stubs(source) puts source's
vllm/distributed/ec_transfer/ec_connector/ first on the stub package's
__path__ (so upstream's files import unmodified as
vllm.distributed.ec_transfer.ec_connector.*, its utils.py in the place of
the stub's, for both connectors) and supplies:
  tests/python/vllm_stub: ECConnectorBase, ECConnectorMetadata,
    ECConnectorWorkerMetadata, ECConnectorRole, ECTransferConfig,
    ECConnectorOutput;
  vllm.logger.init_logger = logging.getLogger; vllm.utils.network_utils:
    get_ip() = 127.0.0.1, make_zmq_path (vLLM's rule: brackets for IPv6);
  vllm.utils.collection_utils.is_list_of;
  vllm.v1.outputs.ModelRunnerOutput (a name only: utils.py imports it);
  vllm.v1.core.sched.output.SchedulerOutput (free_encoder_mm_hashes);
  vllm.distributed.ec_transfer.ec_connector.cpu.common.
    _get_encoder_cache_hidden_dim = model_config.get_inputs_embeds_size()
    (vLLM's own for a model without deepstack);
  vllm.distributed.parallel_state: get_tp_group/get_pp_group raise
    AssertionError, as vLLM's do outside a distributed run (TP 1, PP 1);
  vllm.multimodal.MULTIMODAL_REGISTRY: fields {image_grid_thw} for images;
  torch 1.13 (Debian 12) lacks Tensor.nbytes and dtype.itemsize (2.1) and
    torch.OutOfMemoryError: added (the last only reached on a failed
    registration).
vllm_config(): ec_transfer_config, parallel_config (TP/PP/DP 1,
data_parallel_index 0), model_config (dtype bfloat16, hidden 2048);
ec_buffer_device is "cpu", so no CUDA path runs. Request and Feature: a
request of image items as vLLM's scheduler hands it to a connector.
"""
import ctypes
import gc
import logging
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.path.join(HERE, "..", "python", "vllm_stub")
EC = "vllm.distributed.ec_transfer.ec_connector"
HIDDEN = 2048


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, mod)
    return mod


def install_stubs(source):
    """vLLM's names that upstream's files import, and torch 1.13's gaps."""
    import torch
    sys.path.insert(0, STUB)
    import vllm.distributed.ec_transfer.ec_connector as ecpkg
    import vllm.v1.outputs as outputs
    ecpkg.__path__.insert(0, os.path.join(
        source, "vllm", "distributed", "ec_transfer", "ec_connector"))
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.utils", __path__=[])

    def make_zmq_path(scheme, host, port=None):
        path = f"{scheme}://[{host}]" if ":" in host else f"{scheme}://{host}"
        return path if port is None else f"{path}:{port}"
    _module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
            make_zmq_path=make_zmq_path)
    _module("vllm.utils.collection_utils", is_list_of=lambda v, t: (
        isinstance(v, list) and all(isinstance(x, t) for x in v)))
    outputs.ModelRunnerOutput = type("ModelRunnerOutput", (), {})
    for name in ("vllm.v1.core", "vllm.v1.core.sched"):
        _module(name, __path__=[])
    _module("vllm.v1.core.sched.output", SchedulerOutput=SchedulerOutput)
    _module(EC + ".cpu", __path__=[])
    _module(EC + ".cpu.common", _get_encoder_cache_hidden_dim=lambda c: (
        c.model_config.get_inputs_embeds_size()))

    def no_group():
        raise AssertionError("group is not initialized")
    _module("vllm.distributed.parallel_state", get_tp_group=no_group,
            get_pp_group=no_group)
    info = types.SimpleNamespace(data_parser=types.SimpleNamespace(
        placeholder_metadata_fields=lambda m: (
            {"image_grid_thw"} if m == "image" else set())))
    _module("vllm.multimodal", MULTIMODAL_REGISTRY=types.SimpleNamespace(
        create_processor=lambda mc: types.SimpleNamespace(info=info)))
    if not hasattr(torch.Tensor, "nbytes"):
        torch.Tensor.nbytes = property(
            lambda t: t.numel() * t.element_size())
    if not hasattr(torch.bfloat16, "itemsize"):  # an immutable C type
        gc.get_referents(torch.dtype.__dict__)[0]["itemsize"] = property(
            lambda d: torch.empty((), dtype=d).element_size())
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(torch.dtype))
    if not hasattr(torch, "OutOfMemoryError"):
        torch.OutOfMemoryError = getattr(torch.cuda, "OutOfMemoryError",
                                         MemoryError)


class SchedulerOutput:
    def __init__(self, freed=()):
        self.free_encoder_mm_hashes = list(freed)


class ModelConfig:
    def __init__(self, dtype):
        self.dtype = dtype
        self.hf_config = None

    def get_inputs_embeds_size(self):
        return HIDDEN


def vllm_config(connector, role, port, size, extra):
    import torch
    from vllm.config import ECTransferConfig
    ec = ECTransferConfig(
        ec_connector=connector, ec_role=role, ec_ip="127.0.0.1",
        ec_port=port, ec_buffer_size=size, ec_buffer_device="cpu",
        ec_connector_module_path="ecx.vllm" if connector == "ECXConnector"
        else None, ec_connector_extra_config=dict(extra))
    par = types.SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1,
        data_parallel_size=1, data_parallel_index=0, data_parallel_rank=0,
        rank=0)
    return types.SimpleNamespace(ec_transfer_config=ec, parallel_config=par,
                                 model_config=ModelConfig(torch.bfloat16))


class Feature:
    def __init__(self, mm_hash, tokens, offset):
        import torch
        self.identifier = mm_hash
        self.modality = "image"
        self.mm_position = types.SimpleNamespace(offset=offset, length=tokens)
        grid = torch.tensor([[1, tokens // 4 or 1, 4]])
        self.data = types.SimpleNamespace(
            get_data=lambda: {"image_grid_thw": grid})


class Request:
    """A request of items [(mm_hash, tensor)]: the encoder's (ec_items
    with transfer_id, consumer_zmq) or the consumer's (ec_items with
    mm_hash)."""

    def __init__(self, rid, items, params):
        self.request_id = rid
        self.mm_features, off = [], 1
        for mm_hash, t in items:
            self.mm_features.append(Feature(mm_hash, t.shape[0], off))
            off += t.shape[0] + 1
        self.ec_transfer_params = params

    def get_num_encoder_embeds(self, index):
        return self.mm_features[index].mm_position.length
