"""Faults inside real vLLM: an ecx encoder stopped (SIGSTOP: it answers
nothing, its sockets stay open) or killed (SIGKILL, the whole process
group) while a prefill has requests for its items in flight.

What must hold (docs/vllm.md, "When an encoder fails"): the prefill
engine never dies; each affected request either completes with the
aggregated instance's tokens (its items encoded locally) or fails with an
HTTP error, and does so within the bound (`load_timeout_s` plus the
prefill's own time); every later request succeeds with equal tokens.
"""

import concurrent.futures
import os
import signal
import time

import pytest

import harness
from conftest import group

TIMEOUT_MS = 2000  # the connector's bound on each registry call and pull
LOAD_TIMEOUT_S = 10  # its bound on a request's wait for its items
SLACK_S = 20  # the prefill's own work on a loaded 2-core machine
BOUND_S = LOAD_TIMEOUT_S + SLACK_S


@pytest.fixture(scope="module")
def prefill(workdir, logs):
    good = str(workdir / "good")
    reg = harness.free_port()
    pre = harness.Instance("faults-prefill", good, logs, core=1, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_consumer", "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {
            "remote_registry_url": "http://127.0.0.1:%d" % reg,
            "recv_capacity_bytes": "256MiB", "timeout_ms": TIMEOUT_MS,
            "load_timeout_s": LOAD_TIMEOUT_S, "log_interval_s": 1}})
    try:
        yield pre, reg
    finally:
        pre.stop()


def encoder(workdir, logs, reg, name):
    return harness.Instance(name, str(workdir / "good"), logs, core=0, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_producer", "ec_connector_extra_config": {
            "registry_http_port": reg, "bind_host": "127.0.0.1",
            "capacity_bytes": "256MiB", "log_interval_s": 1}},
        extra_args=["--mm-encoder-only"])


def timed(url, body):
    t0 = time.monotonic()
    status, out = harness.post(url, body, timeout=BOUND_S + 60)
    return status, out, time.monotonic() - t0


def fault(workdir, logs, aggregated, prefill, name, sig, seed):
    """Items published by an encoder, then the prefill asked for them and
    the encoder's process group sent sig 50 ms later. Returns what each
    request got: (status, equal to the aggregated tokens, seconds)."""
    pre, reg = prefill
    enc = encoder(workdir, logs, reg, name)
    try:
        group([enc, pre])
        bodies = harness.requests_set(seed)
        want = aggregated.tokens(bodies)
        for b in bodies:  # the encoder's step: encode and publish
            status, out = harness.post(enc.url, dict(b, max_tokens=1))
            assert status == 200, (status, out)
        before = harness.fresh_counters(pre)
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futs = [pool.submit(timed, pre.url, b) for b in bodies]
            time.sleep(0.05)
            os.killpg(enc.proc.pid, sig)
            got = [f.result() for f in futs]
        out = []
        for (status, body, secs), w in zip(got, want):
            equal = status == 200 and \
                body["choices"][0]["token_ids"] == w
            out.append((status, equal, secs))
            assert secs <= BOUND_S, (name, status, secs, body)
            assert status == 200 and equal or status >= 400, \
                (name, status, body)
        assert pre.alive() and pre.healthy(), pre.tail()
        after = harness.fresh_counters(pre)
        # every request asked for its items (looked up); nothing passed
        # as remote that did not land or fail
        assert after.get("lookups", 0) > before.get("lookups", 0)
        return out, bodies, want, enc
    except BaseException:
        enc.stop()
        raise


def later_requests_succeed(pre, aggregated, seed):
    bodies = harness.requests_set(seed)
    assert harness.tokens_many(pre.url, bodies) == aggregated.tokens(bodies)


def test_an_encoder_stopped_mid_flight(workdir, logs, aggregated, prefill):
    """SIGSTOP: registry calls and pulls to it wait their timeout_ms; no
    request waits past the bound, none is answered wrongly; once it
    continues, its items are pulled again."""
    out, bodies, want, enc = fault(workdir, logs, aggregated, prefill,
                                   "faults-encoder-stopped", signal.SIGSTOP,
                                   seed=41)
    try:
        print("stopped encoder:", out)
        later_requests_succeed(prefill[0], aggregated, 42)
        os.killpg(enc.proc.pid, signal.SIGCONT)
        pre = prefill[0]
        before = harness.fresh_counters(pre)
        again = harness.requests_set(43)
        for b in again:
            status, o = harness.post(enc.url, dict(b, max_tokens=1))
            assert status == 200, (status, o)
        assert harness.tokens_many(pre.url, again) == aggregated.tokens(again)
        after = harness.fresh_counters(pre)
        n = sum(len(b["messages"][0]["content"]) - 1 for b in again)
        assert after["items_remote"] - before.get("items_remote", 0) == n
    finally:
        os.killpg(enc.proc.pid, signal.SIGCONT)
        enc.stop()


def test_an_encoder_killed_mid_flight(workdir, logs, aggregated, prefill):
    """SIGKILL: its registry refuses at once and its pulls break; each
    request ends within the bound, and the same requests sent again are
    answered, encoded by the prefill itself."""
    out, bodies, want, enc = fault(workdir, logs, aggregated, prefill,
                                   "faults-encoder-killed", signal.SIGKILL,
                                   seed=44)
    try:
        print("killed encoder:", out)
        pre = prefill[0]
        assert harness.tokens_many(pre.url, bodies) == want
        later_requests_succeed(pre, aggregated, 45)
    finally:
        enc.stop()
