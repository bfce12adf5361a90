"""Shared fixtures: the ecx binary, free ports, an `ecx serve` process, and
producers of the test's own process."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

# These tests drive the connector through tests/python/vllm_stub, the
# small stand-ins of vLLM's names: first on sys.path before any test
# module is collected, so that one importing vllm early cannot bring in the
# venv's real vLLM (installed for the tests that start it) for the others.
_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_stub")
if _STUB not in sys.path:
    sys.path.insert(0, _STUB)
# And this checkout's binding (ctest sets PYTHONPATH to it too), so that
# `.venv/bin/python -m pytest tests/python` runs as it is; the binding then
# finds this checkout's build/libecx.so unless ECX_LIBRARY says otherwise.
_BINDING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                        "python")
if os.path.abspath(_BINDING) not in map(os.path.abspath, sys.path):
    sys.path.insert(1, os.path.abspath(_BINDING))


def ecx_bin():
    path = os.environ.get("ECX_BIN") or shutil.which("ecx")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "build", "tools", "ecx")
    return os.path.abspath(path)


def stop_process(pid, timeout=1.0):
    """SIGSTOPs pid and returns once every thread of it is stopped. kill()
    returns before the signal has taken effect: one thread takes it and
    then stops the others, which until then may still answer requests."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, IndexError):
                pass
        if states and all(s == "T" for s in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop within {timeout} s")


class Serve:
    """An `ecx serve` process with its embedded registry on 127.0.0.1."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [ecx_bin(), "serve", "--bind", "127.0.0.1", "--port", "0",
             "--capacity", "64MiB", "--json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line or line.startswith("{"):
                break
        if not line.startswith("{"):
            self.stop()
            raise RuntimeError("ecx serve did not start: " + line +
                               self.proc.stderr.read())
        info = json.loads(line)
        self.registry = info["registry"]
        self.producer = info["producer"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def serve():
    started = []

    def start(*args):
        s = Serve(*args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


class Registry:
    """A standalone `ecx registry` process on 127.0.0.1, a free port."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [ecx_bin(), "registry", "--bind", "127.0.0.1", "--port", "0",
             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError("ecx registry did not start: " + line +
                               self.proc.stderr.read())
        self.url = line.split()[-1]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def registry():
    started = []

    def start(*args):
        r = Registry(*args)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def local_producer():
    """Makes ecx.Producer(capacity_bytes, **kw)s of this process on
    127.0.0.1 with a registry on a free port; closes them after the
    test, the last made first."""
    made = []

    def make(capacity_bytes, **kw):
        import ecx
        p = ecx.Producer(capacity_bytes=capacity_bytes,
                         bind_host="127.0.0.1", registry_port=0, **kw)
        made.append(p)
        return p

    yield make
    for p in reversed(made):
        p.close()
