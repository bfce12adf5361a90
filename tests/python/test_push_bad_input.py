"""Push mode, bad input on the control port: each is answered with the
error envelope {"ok": false, "error": text} (exactly those two keys), and
nothing is reserved, completed, cancelled or written."""
import json

import pytest

from pushkit import Ctl, item, start_shards
from ecx.vllm.push import READY, WRITING


@pytest.fixture
def env():
    (s,), clock = start_shards(pool_size=4096)
    c = Ctl(s.endpoint)
    # something to disturb: a retired resident copy, a writer, a READY one
    r = c.result("reserve", **item("res", mm="resident"))
    c.result("complete", transfer_id="res", reservation_id=r["reservation_id"])
    s.take("res", "resident")
    s.release("resident")
    w = c.result("reserve", **item("w", mm="writing"))
    d = c.result("reserve", **item("d", mm="done"))
    c.result("complete", transfer_id="d", reservation_id=d["reservation_id"])
    before = (s.pool.used_bytes(), s.table.counts(),
              s.pool.read(s.pool.base, s.pool.size), list(s.pool.opened))
    yield s, c, w, before
    after = (s.pool.used_bytes(), s.table.counts(),
             s.pool.read(s.pool.base, s.pool.size), list(s.pool.opened))
    assert after == before, "a refused request changed the shard"
    assert s.table.resident("resident") is not None
    assert s.table.state("w") == WRITING and s.table.state("d") == READY
    c.close()
    s.stop(0)


def refused(reply, text=None):
    assert set(reply) == {"ok", "error"}, reply
    assert reply["ok"] is False and isinstance(reply["error"], str)
    assert reply["error"]
    if text is not None:
        assert text in reply["error"], reply


@pytest.mark.parametrize("frames", [
    [b'{"op": "peers"}', b'{"op": "peers"}'],  # two frames
    [b"\xff\xfe{}"],                            # not UTF-8
    [b"not json"],
    [b""],
    [b'{"op": "reserve", '],                   # cut short
    [b"[1, 2, 3]"],                            # not an object
    [b'"peers"'],
    [b"{}"],                                   # no op
    [b'{"op": 7}'],
    [b"[" * 100000 + b"]" * 100000],           # nested too deep
])
def test_malformed(env, frames):
    s, c, _, _ = env
    reply = c.send_frames(frames)
    assert reply is not None and len(reply) == 1
    refused(json.loads(reply[0]), "malformed control request")


def test_unknown_op(env):
    s, c, _, _ = env
    refused(c.call("reserve_all"), "reserve_all")
    refused(c.call("RESERVE", **item("x")))


@pytest.mark.parametrize("nbytes", [1 << 40, 2 ** 70, 4097])
def test_huge_nbytes(env, nbytes):
    s, c, _, _ = env
    # a shape that agrees, so only the size is wrong
    reply = c.call("reserve", transfer_id="x", mm_hash="big",
                   nbytes=nbytes, shape=[nbytes], dtype="uint8")
    refused(reply, "larger than the receive pool")


@pytest.mark.parametrize("change", [
    {"nbytes": 63}, {"nbytes": 128}, {"shape": [4, 4]}, {"shape": [64]},
    {"dtype": "float32"}])
def test_shape_and_nbytes_disagree(env, change):
    s, c, _, _ = env
    refused(c.call("reserve", **dict(item("x"), **change)),
            "shape and dtype do not match nbytes")


@pytest.mark.parametrize("change", [
    {"shape": [-4, -8]}, {"shape": [0, 8], "nbytes": 0},
    {"shape": []}, {"shape": [1] * 9 + [64], "dtype": "uint8"},
    {"shape": [4.0, 8]}, {"shape": [True, 64], "dtype": "uint8"},
    {"shape": "4,8"}, {"nbytes": 0}, {"nbytes": -64},
    {"dtype": "bf16"}, {"dtype": "torch.bfloat16"}, {"dtype": 5},
    {"nbytes": 64.0}, {"nbytes": "64"}, {"nbytes": True},
    {"transfer_id": 7}, {"transfer_id": ""}, {"transfer_id": "x" * 257},
    {"mm_hash": None}, {"mm_hash": ""}, {"mm_hash": ["m"]},
])
def test_bad_values(env, change):
    s, c, _, _ = env
    refused(c.call("reserve", **dict(item("x"), **change)))
    reply = c.result("reserve_batch", items=[dict(item("x"), **change)])
    assert len(reply["items"]) == 1
    refused(reply["items"][0])


@pytest.mark.parametrize("value", ["yes", 1, None, {}])
def test_bad_hashed_ask(env, value):
    """ecx_hashed is true, false or absent; anything else is refused with
    nothing reserved, alone or for a whole batch."""
    s, c, _, _ = env
    refused(c.call("reserve", **item("hx"), ecx_hashed=value),
            "ecx_hashed must be true or false")
    refused(c.call("reserve_batch", items=[item("hx")], ecx_hashed=value),
            "ecx_hashed must be true or false")
    assert c.result("status", transfer_id="hx") is None


@pytest.mark.parametrize("missing", ["transfer_id", "mm_hash", "nbytes",
                                     "shape", "dtype"])
def test_missing_reserve_fields(env, missing):
    s, c, _, _ = env
    req = item("x")
    del req[missing]
    refused(c.call("reserve", **req), missing)


def test_conflicting_transfer_id(env):
    s, c, w, _ = env
    refused(c.call("reserve", **item("w", mm="other")),
            "conflicting reservation for transfer_id")
    refused(c.call("reserve", **item("d", mm="done", tokens=8)),
            "conflicting reservation for transfer_id")


def test_bad_batches(env):
    s, c, w, _ = env
    for items in ("x", {"a": 1}, None, 5):
        refused(c.call("reserve_batch", items=items))
        refused(c.call("complete_batch", items=items))
    refused(c.call("reserve_batch"), "items")
    refused(c.call("reserve_batch", items=[item(f"x{k}", mm=f"y{k}")
                                           for k in range(4097)]),
            "at most 4096")
    # one bad entry refuses the whole complete_batch: the good one stays
    refused(c.call("complete_batch", items=[
        {"transfer_id": "w", "reservation_id": w["reservation_id"]},
        {"transfer_id": "w"}]), "reservation_id")
    reply = c.result("reserve_batch", items=[7, "x", None, []])
    for r in reply["items"]:
        refused(r)


@pytest.mark.parametrize("req", [
    {"op": "complete"}, {"op": "complete", "transfer_id": "w"},
    {"op": "complete", "transfer_id": "w", "reservation_id": 5},
    {"op": "cancel"}, {"op": "cancel", "transfer_id": "w"},
    {"op": "cancel", "transfer_id": "w", "reservation_id": None},
    {"op": "cancel", "transfer_id": "w", "reservation_id": "",
     "abandon": 1},
    {"op": "cancel", "transfer_id": "w", "reservation_id": "",
     "abandon": True, "refresh": "yes"},
    {"op": "cancel", "transfer_id": 3, "reservation_id": ""},
    {"op": "status"}, {"op": "status", "transfer_id": 1},
])
def test_bad_complete_cancel_status(env, req):
    s, c, _, _ = env
    refused(c.call(req.pop("op"), **req))


def test_frame_over_the_limit_is_dropped_and_the_shard_serves_on(env):
    s, c, _, _ = env
    short = Ctl(s.endpoint, timeout_ms=500)
    big = json.dumps({"op": "peers", "pad": "x" * (5 << 20)}).encode()
    assert short.send_frames([big]) is None
    short.close()
    assert c.result("peers") == {"ports": [s.port]}
