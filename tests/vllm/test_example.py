"""vLLM's own ECExampleConnector inside real vLLM, the control beside
ecx's rows: encoders write each output to a shared folder, the prefill
reads it from there; ecx's router (pull mode: it only has the encoders
encode first) in front. Tokens equal the aggregated instance's; a
poisoned encoder writing to the same folder changes them."""

import os

import pytest

import harness
from conftest import group


@pytest.fixture(scope="module")
def example(workdir, logs, aggregated):
    good, poison = str(workdir / "good"), str(workdir / "poison")
    shared = str(workdir / "example-storage")
    os.makedirs(shared, exist_ok=True)

    def ec(role):
        return {"ec_connector": "ECExampleConnector", "ec_role": role,
                "ec_connector_extra_config": {"shared_storage_path": shared}}

    enc = harness.Instance("example-encoder", good, logs, core=1,
                           ec=ec("ec_producer"), extra_args=["--mm-encoder-only"])
    bad = harness.Instance("example-encoder-poisoned", poison, logs, core=0,
                           ec=ec("ec_producer"), extra_args=["--mm-encoder-only"])
    pre = harness.Instance("example-prefill", good, logs, core=1,
                           ec=ec("ec_consumer"))
    procs = [enc, bad, pre]
    try:
        group(procs)
        routers = {
            "pull": harness.Router("example-router", logs, good, "pull",
                                   [enc.url], [pre.url]),
            "pull-poisoned": harness.Router("example-router-poisoned", logs,
                                            good, "pull", [bad.url], [pre.url]),
        }
        procs += routers.values()
        yield {"prefill": pre, "routers": routers, "storage": shared}
    finally:
        for p in procs:
            p.stop()


def stored(folder):
    return sum(len(files) for _, _, files in os.walk(folder))


def run(example, aggregated, table, mode, seed):
    bodies = harness.requests_set(seed)
    want = aggregated.tokens(bodies)
    before = stored(example["storage"])
    got = harness.tokens_many(example["routers"][mode].url, bodies, parallel=4)
    equal = [g == w for g, w in zip(got, want)]
    table("ECExampleConnector", mode, bodies, equal)
    n_images = sum(len(b["messages"][0]["content"]) - 1 for b in bodies)
    assert stored(example["storage"]) - before == n_images
    return equal


def test_example_connector_tokens_equal(example, aggregated, table):
    assert all(run(example, aggregated, table, "pull", 11))


def test_example_connector_poisoned_encoder_changes_tokens(example, aggregated,
                                                           table):
    assert not any(run(example, aggregated, table, "pull-poisoned", 12))
