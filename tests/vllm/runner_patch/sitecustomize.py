"""The one-branch patch that vLLM's own ECMooncakeConnector needs as a
consumer on vLLM 0.32's V1 model runner, applied in this process tree
only (tests/vllm/test_mooncake.py puts this folder on PYTHONPATH of the
one instance it starts with upstream's consumer; ecx's rows never have it).

Why: a consumer step that schedules no tokens (every request still waits
for its pushed embeddings) returns EMPTY_MODEL_RUNNER_OUTPUT from
GPUModelRunner.execute_model before the EC connector's worker hooks run
when no KV connector exists, so upstream's worker never loads what was
pushed, and the request fails after push_wait_timeout_s. The patch runs
the EC connector's hooks in that branch, as the step does when it has
tokens, and returns their output.

The installed file is not changed: the module is compiled from its
source with the branch replaced when it is imported. A source that does
not hold the branch exactly once stops the process with an error.
"""

import importlib.abc
import importlib.machinery
import sys

_NAME = "vllm.v1.worker.gpu_model_runner"
_OLD = """                if not has_kv_transfer_group():
                    # Return empty ModelRunnerOutput if no work to do.
                    return EMPTY_MODEL_RUNNER_OUTPUT
"""
_NEW = """                if not has_kv_transfer_group():
                    # ecx runner patch (tests/vllm/runner_patch): run the
                    # EC connector's hooks in a step with no tokens.
                    if has_ec_transfer():
                        with self.maybe_get_ec_connector_output(
                            scheduler_output, encoder_cache=self.encoder_cache
                        ) as ec_connector_output:
                            pass
                        return ModelRunnerOutput.with_ec_conn_output_only(
                            ec_connector_output)
                    return EMPTY_MODEL_RUNNER_OUTPUT
"""


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        src = self.get_data(self.path).decode("utf-8")
        if src.count(_OLD) != 1:
            raise ImportError("runner_patch: %s does not hold the branch to "
                              "patch exactly once (another vLLM?)" % self.path)
        return compile(src.replace(_OLD, _NEW), self.path, "exec",
                       dont_inherit=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return spec
        spec.loader = _Loader(fullname, spec.origin)
        return spec


sys.meta_path.insert(0, _Finder())
