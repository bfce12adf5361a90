"""Cross cases with vLLM's own ECMooncakeConnector (push over Mooncake's
TCP wire, upstream's ec_transfer_params), inside real vLLM, ecx's router
in push mode in front:

- vLLM's Mooncake encoder pushes into an ecx prefill (unpatched vLLM);
- an ecx encoder pushes into vLLM's Mooncake prefill. That prefill needs
  the one-branch patch of vLLM's V1 model runner in runner_patch/ (read
  its docstring): it runs with that folder on PYTHONPATH, and no other
  instance does.

Tokens equal the aggregated instance's; the counters show the items came
by push."""

import os

import pytest

import harness
from conftest import group

PATCH = os.path.join(harness.HERE, "runner_patch")
MOONCAKE_ENV = {"MC_FORCE_TCP": "1"}


@pytest.fixture(scope="module")
def cross(workdir, logs, aggregated):
    good = str(workdir / "good")
    ecx_port, mc_port = harness.free_ports(2)
    # Encoders on core 0, prefills on core 1: no encoder shares a core with
    # a prefill it pushes into. A vLLM worker spins on os.sched_yield for a
    # second after every step it is given, and a prefill whose requests
    # wait for their items is given a step every few milliseconds, so its
    # worker holds its core while it waits; an encoder pinned beside it was
    # starved there (Mooncake's writer threads runnable at 0 % CPU, a batch
    # write of 4 KiB taking 15-17 s, a push abandoned: tests/vllm/README.md).
    mc_enc = harness.Instance("mooncake-encoder", good, logs, core=0, ec={
        "ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
        "ec_buffer_device": "cpu", "ec_buffer_size": 2 ** 28,
        "ec_connector_extra_config": {"mooncake_protocol": "tcp"}},
        extra_args=["--mm-encoder-only"], env=MOONCAKE_ENV)
    ecx_enc = harness.Instance("ecx-encoder-push", good, logs, core=0, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {
            "registry_http_port": harness.free_port(), "bind_host": "127.0.0.1",
            "capacity_bytes": "256MiB", "log_interval_s": 1}},
        extra_args=["--mm-encoder-only"], env=MOONCAKE_ENV)
    ecx_pre = harness.Instance("ecx-prefill-push", good, logs, core=1, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_consumer", "ec_buffer_device": "cpu",
        "ec_ip": "127.0.0.1", "ec_port": ecx_port,
        "ec_connector_extra_config": {"recv_capacity_bytes": "256MiB",
                                      "log_interval_s": 1}}, env=MOONCAKE_ENV)
    mc_pre = harness.Instance("mooncake-prefill-patched", good, logs, core=1, ec={
        "ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer",
        "ec_buffer_device": "cpu", "ec_buffer_size": 2 ** 28,
        "ec_ip": "127.0.0.1", "ec_port": mc_port,
        "ec_connector_extra_config": {"mooncake_protocol": "tcp",
                                      "push_wait_timeout_s": 60}},
        env=dict(MOONCAKE_ENV, PYTHONPATH=PATCH))
    procs = [mc_enc, ecx_enc, ecx_pre, mc_pre]
    try:
        group(procs)
        routers = {
            "mooncake->ecx": harness.Router(
                "router-mooncake-to-ecx", logs, good, "push", [mc_enc.url],
                [ecx_pre.url], ["tcp://127.0.0.1:%d" % ecx_port]),
            "ecx->mooncake": harness.Router(
                "router-ecx-to-mooncake", logs, good, "push", [ecx_enc.url],
                [mc_pre.url], ["tcp://127.0.0.1:%d" % mc_port]),
            # Two encoders, one of each, items round-robin between them.
            "both->ecx": harness.Router(
                "router-both-to-ecx", logs, good, "push",
                [mc_enc.url, ecx_enc.url], [ecx_pre.url],
                ["tcp://127.0.0.1:%d" % ecx_port]),
        }
        procs += routers.values()
        yield {"ecx-prefill": ecx_pre, "ecx-encoder": ecx_enc,
               "mooncake-encoder": mc_enc, "routers": routers}
    finally:
        for p in procs:
            p.stop()


def run(cross, aggregated, table, case, seed):
    bodies = harness.requests_set(seed)
    want = aggregated.tokens(bodies)
    got = harness.tokens_many(cross["routers"][case].url, bodies, parallel=4)
    equal = [g == w for g, w in zip(got, want)]
    table("ECMooncakeConnector x ecx", case, bodies, equal)
    assert all(equal), "%s: tokens differ for %s" % (
        case, [harness.describe(b) for b, e in zip(bodies, equal) if not e])
    return sum(len(b["messages"][0]["content"]) - 1 for b in bodies)


def test_vllm_mooncake_encoder_into_ecx_prefill(cross, aggregated, table):
    pre = cross["ecx-prefill"]
    before = harness.fresh_counters(pre).get("push_items_ready", 0)
    n = run(cross, aggregated, table, "mooncake->ecx", 21)
    after = harness.fresh_counters(pre).get("push_items_ready", 0)
    assert after - before == n, (after, before, n)


def test_ecx_encoder_into_vllm_mooncake_prefill(cross, aggregated, table):
    enc = cross["ecx-encoder"]
    n = run(cross, aggregated, table, "ecx->mooncake", 22)
    # An image of its own makes the encoder step (and log) once more.
    poke = harness.chat([harness.image(64, 64, 2299)])
    done = harness.fresh_counters(enc, "worker rank 0", poke)
    assert done.get("pushes_done", 0) == n, done


def test_two_encoders_of_both_kinds_into_ecx_prefill(cross, aggregated, table):
    """The router spreads a request's images over several encoders: here
    vLLM's Mooncake encoder and ecx's, both pushing into one ecx prefill."""
    pre = cross["ecx-prefill"]
    encs = [cross["mooncake-encoder"], cross["ecx-encoder"]]
    posts = [e.text().count("POST /v1/chat/completions") for e in encs]
    before = harness.fresh_counters(pre).get("push_items_ready", 0)
    n = run(cross, aggregated, table, "both->ecx", 23)
    after = harness.fresh_counters(pre).get("push_items_ready", 0)
    assert after - before == n, (after, before, n)
    got = [e.text().count("POST /v1/chat/completions") - p
           for e, p in zip(encs, posts)]
    assert sum(got) == n and min(got) >= n // 2, got
