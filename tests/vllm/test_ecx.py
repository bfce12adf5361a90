"""ecx inside real vLLM: an encoder instance (ECXConnector, ec_producer,
--mm-encoder-only), a prefill+decode instance (ECXConnector, ec_consumer,
pull from the encoders' registries and push beside it), ecx's router in
front, and the tokens compared with one aggregated instance.

A prefill that finds no embedding encodes the image itself and gets the
same tokens, so equal tokens alone prove nothing: a second encoder serves
the same model with its vision merger negated, and its outputs must change
every answer (the negative control), and the prefill's own counters must
show the items arriving from outside.

vLLM's V1 model runner is the one installed, unpatched.
"""

import os
import time

import pytest

import harness
from conftest import group


@pytest.fixture(scope="module")
def ecx(workdir, logs, aggregated):
    good, poison = str(workdir / "good"), str(workdir / "poison")
    reg_good, reg_poison, ec_port = harness.free_ports(3)

    def producer(port):
        return {"ec_connector": "ECXConnector",
                "ec_connector_module_path": "ecx.vllm",
                "ec_role": "ec_producer",
                "ec_connector_extra_config": {
                    "registry_http_port": port, "bind_host": "127.0.0.1",
                    "capacity_bytes": "256MiB", "log_interval_s": 1}}

    enc = harness.Instance("ecx-encoder", good, logs, core=0,
                           ec=producer(reg_good), extra_args=["--mm-encoder-only"])
    bad = harness.Instance("ecx-encoder-poisoned", poison, logs, core=0,
                           ec=producer(reg_poison), extra_args=["--mm-encoder-only"])
    pre = harness.Instance("ecx-prefill", good, logs, core=1, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_consumer", "ec_buffer_device": "cpu",
        "ec_ip": "127.0.0.1", "ec_port": ec_port,
        "ec_connector_extra_config": {
            "remote_registry_url": ["http://127.0.0.1:%d" % reg_good,
                                    "http://127.0.0.1:%d" % reg_poison],
            "push": True, "push_fallback_ms": 10000,
            "recv_capacity_bytes": "256MiB",
            "log_interval_s": 1}})
    procs = [enc, bad, pre]
    try:
        group(procs)
        zmq = ["tcp://127.0.0.1:%d" % ec_port]
        routers = {
            "pull": harness.Router("router-pull", logs, good, "pull",
                                   [enc.url], [pre.url]),
            "pull-poisoned": harness.Router("router-pull-poisoned", logs, good,
                                            "pull", [bad.url], [pre.url]),
            "push": harness.Router("router-push", logs, good, "push",
                                   [enc.url], [pre.url], zmq),
            "push-poisoned": harness.Router("router-push-poisoned", logs, good,
                                            "push", [bad.url], [pre.url], zmq),
        }
        procs += routers.values()
        yield {"encoder": enc, "poisoned": bad, "prefill": pre,
               "routers": routers}
    finally:
        for p in procs:
            p.stop()


def check(ecx, aggregated, table, name, mode, seed, want_equal, counter):
    bodies = harness.requests_set(seed)
    n_images = sum(len(b["messages"][0]["content"]) - 1 for b in bodies)
    want = aggregated.tokens(bodies)
    before = harness.fresh_counters(ecx["prefill"])
    got = harness.tokens_many(ecx["routers"][mode].url, bodies, parallel=4)
    after = harness.fresh_counters(ecx["prefill"])
    equal = [g == w for g, w in zip(got, want)]
    table(name, mode, bodies, equal)
    arrived = after.get(counter, 0) - before.get(counter, 0)
    assert arrived == n_images, (
        "%s: %d of %d images arrived from an encoder (%s); counters %s" %
        (mode, arrived, n_images, counter, after))
    if want_equal:
        assert all(equal), "%s: tokens differ from the aggregated instance's " \
            "for %s" % (mode, [harness.describe(b) for b, e in zip(bodies, equal)
                               if not e])
    else:
        assert not any(equal), "%s: the poisoned encoder's outputs left the " \
            "tokens of %s unchanged" % (mode, [harness.describe(b) for b, e in
                                               zip(bodies, equal) if e])


def test_pull_tokens_equal(ecx, aggregated, table):
    check(ecx, aggregated, table, "ecx", "pull", 1, True, "items_remote")


def test_push_tokens_equal(ecx, aggregated, table):
    check(ecx, aggregated, table, "ecx", "push", 2, True, "push_items_ready")


def test_pull_poisoned_encoder_changes_tokens(ecx, aggregated, table):
    check(ecx, aggregated, table, "ecx", "pull-poisoned", 3, False, "items_remote")


def test_push_poisoned_encoder_changes_tokens(ecx, aggregated, table):
    check(ecx, aggregated, table, "ecx", "push-poisoned", 4, False,
          "push_items_ready")


def test_items_no_encoder_has_are_encoded_locally(ecx, aggregated, table):
    bodies = harness.requests_set(5)
    want = aggregated.tokens(bodies)
    before = harness.fresh_counters(ecx["prefill"])
    got = harness.tokens_many(ecx["prefill"].url, bodies, parallel=4)
    after = harness.fresh_counters(ecx["prefill"])
    equal = [g == w for g, w in zip(got, want)]
    table("ecx", "local", bodies, equal)
    assert all(equal)
    assert after.get("items_remote", 0) == before.get("items_remote", 0)
    assert after.get("lookups", 0) > before.get("lookups", 0)


def test_streaming_through_the_router(ecx, aggregated):
    body = harness.requests_set(6, sizes=harness.SIZES[1:2], pairs=False)[0]
    want = aggregated.tokens([body])[0]
    import json
    import urllib.request

    req = urllib.request.Request(
        ecx["routers"]["pull"].url + "/v1/chat/completions",
        json.dumps(dict(body, stream=True)).encode(),
        {"Content-Type": "application/json"})
    ids, chunks = [], 0
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunks += 1
            for choice in json.loads(line[6:])["choices"]:
                ids += choice.get("token_ids") or []
    assert chunks > 1
    assert ids == want


def test_counters_in_vllm_s_own_metrics(ecx, aggregated):
    """ecx's counters are in each instance's /metrics (vLLM's endpoint,
    fed through the connector's build_prom_metrics): the items a pull
    brought and the bytes loaded count up there as in the connector's
    own log line."""
    pre, enc = ecx["prefill"], ecx["encoder"]
    bodies = harness.requests_set(7, pairs=False)
    before = harness.prometheus(pre)
    for name in ("vllm:ecx_items_remote_total", "vllm:ecx_bytes_loaded_total",
                 "vllm:ecx_request_wait_seconds_total"):
        assert name in before, "%s not in the prefill's /metrics" % name
    assert "vllm:ecx_pushes_done_total" in harness.prometheus(enc)
    want = aggregated.tokens(bodies)
    assert harness.tokens_many(ecx["routers"]["pull"].url, bodies) == want
    harness.fresh_counters(pre)  # one step more: the last stats sent
    deadline = time.monotonic() + 10
    while True:
        after = harness.prometheus(pre)
        grew = (after["vllm:ecx_items_remote_total"] -
                before["vllm:ecx_items_remote_total"])
        if grew >= len(bodies) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert grew == len(bodies), (before, after)
    loaded = (after["vllm:ecx_bytes_loaded_total"] -
              before["vllm:ecx_bytes_loaded_total"])
    assert loaded > 0
    # the same count as the connector's own log line
    log = harness.counters(pre)
    assert after["vllm:ecx_items_remote_total"] == log["items_remote"], log


def test_a_bad_image_is_the_client_s_error(ecx):
    body = harness.chat(["data:image/png;base64,bm90IGFuIGltYWdl"])
    status, out = harness.post(ecx["routers"]["pull"].url, body)
    assert status == 400, (status, out)
    assert "error" in out


def test_v1_runner_is_vllm_s_own():
    """Every ecx row above ran on the installed model runner: the branch
    that upstream's Mooncake consumer needs patched is still upstream's."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")
    src = open(spec.origin).read()
    assert "# Return empty ModelRunnerOutput if no work to do.\n" \
        "                    return EMPTY_MODEL_RUNNER_OUTPUT" in src
    assert "ecx runner patch" not in src
    assert not os.environ.get("PYTHONPATH")
