"""Fixtures of tests/vllm/: the tiny model (made once), one aggregated
vLLM instance (the reference every disaggregated answer is compared
with), and the table of results.

Run with the test venv's Python (ctest's vllm.* tests do):
    .venv/bin/python -m pytest tests/vllm -v
ECX_VLLM_TABLE=FILE appends one line a request: connector, images, case,
and whether its tokens equal the aggregated instance's.
"""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """good/tiny and poison/tiny (the vision merger negated), made here;
    logs/ for every process's output."""
    root = tmp_path_factory.mktemp("vllm")
    for name, extra in (("good", []), ("poison", ["--poison"])):
        os.makedirs(root / name)
        subprocess.run([harness.PYTHON, os.path.join(harness.HERE, "make_model.py"),
                        str(root / name / "tiny")] + extra, check=True,
                       stdout=subprocess.DEVNULL, env=harness.clean_env())
    os.makedirs(root / "logs")
    return root


@pytest.fixture(scope="session")
def logs(workdir):
    return str(workdir / "logs")


@pytest.fixture(scope="session")
def aggregated(workdir, logs):
    """One instance that encodes and decodes itself: the reference. It is
    started here and waited for at its first use, so that it comes up
    beside the instances of the first module (which ask for it first)."""
    inst = harness.Instance("aggregated", str(workdir / "good"), logs, core=0)
    try:
        yield Reference(inst)
    finally:
        inst.stop()


class Reference:
    """The aggregated instance's tokens of each body, asked once."""

    def __init__(self, inst):
        self.inst = inst
        self.url = inst.url
        self._seen = {}
        self._up = False

    def tokens(self, bodies):
        if not self._up:
            harness.wait_healthy([self.inst])
            self._up = True
        todo = [b for b in bodies if self._key(b) not in self._seen]
        for b, t in zip(todo, harness.tokens_many(self.url, todo)):
            self._seen[self._key(b)] = t
        return [self._seen[self._key(b)] for b in bodies]

    @staticmethod
    def _key(body):
        return repr(body["messages"])


@pytest.fixture(scope="session")
def table():
    path = os.environ.get("ECX_VLLM_TABLE")
    if path:
        with open(path, "w") as f:
            f.write("connector\timages\tcase\ttokens\n")

    def add(connector, case, bodies, equal):
        if not path:
            return
        with open(path, "a") as f:
            for b, e in zip(bodies, equal):
                f.write("%s\t%s\t%s\t%s\n" % (connector, harness.describe(b),
                                              case, "equal" if e else "differ"))
    return add


def group(instances):
    """Starts nothing; waits for instances already started, stopping all of
    them if one fails."""
    try:
        harness.wait_healthy(instances)
    except Exception:
        for inst in instances:
            inst.stop(5)
        raise

