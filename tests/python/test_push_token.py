"""Push mode, authenticated control (ecx's, not upstream's): with a token
every op needs "ecx_token", and the event socket serves only PLAIN peers
whose password is the token. Without one it is upstream's: no field
needed, and any PULL takes its share of the events."""
import json

import pytest

from pushkit import Ctl, item, pull, recv_events, start_shards
from ecx.vllm.push import TOKEN_FIELD

TOKEN = "s3cret-token"
OPS = [("peers", {}), ("event_port", {}), ("reserve", item("t1")),
       ("reserve_batch", {"items": [item("t1")]}),
       ("complete", {"transfer_id": "t1", "reservation_id": "r"}),
       ("complete_batch", {"items": []}),
       ("cancel", {"transfer_id": "t9", "reservation_id": ""}),
       ("status", {"transfer_id": "t1"})]


@pytest.fixture
def shard():
    (s,), _ = start_shards(token=TOKEN)
    yield s
    s.stop(0)


def test_field_name():
    assert TOKEN_FIELD == "ecx_token"


@pytest.mark.parametrize("extra", [{}, {"ecx_token": "wrong"},
                                   {"ecx_token": ""}, {"ecx_token": None},
                                   {"ecx_token": [TOKEN]},
                                   {"token": TOKEN}])
def test_every_op_refused_without_the_token(shard, extra):
    c = Ctl(shard.endpoint, extra)
    for op, fields in OPS:
        reply = c.call(op, **fields)
        assert set(reply) == {"ok", "error"} and reply["ok"] is False, op
        assert "unauthorized" in reply["error"]
    c.close()
    # nothing happened: no reservation, no tombstone, nothing learnt
    assert shard.table.counts() == {} and shard.pool.used_bytes() == 0
    good = Ctl(shard.endpoint, {"ecx_token": TOKEN})
    assert good.result("reserve", **item("t9"))["write"] is True
    good.close()


def test_malformed_frames_still_get_the_envelope(shard):
    c = Ctl(shard.endpoint)
    reply = json.loads(c.send_frames([b"garbage"])[0])
    assert reply == {"ok": False, "error": "malformed control request"}
    c.close()


def landed_hash(shard, r):
    """The hash of what a reservation's range holds, as its writer
    would send it ("ecx_xxh3")."""
    return f"{shard.pool.xxh3(r['dst_ptr'], r['nbytes']):016x}"


def test_every_op_served_with_the_token(shard):
    c = Ctl(shard.endpoint, {"ecx_token": TOKEN})
    assert c.result("peers") == {"ports": [shard.port]}
    assert c.result("event_port") == shard.event_port
    r = c.result("reserve", **item("t1"))
    assert c.result("complete", transfer_id="t1",
                    reservation_id=r["reservation_id"],
                    ecx_xxh3=landed_hash(shard, r)) == {
        "completed": True, "became_ready": True}
    assert c.result("status", transfer_id="t1")["ready"] is True
    assert c.result("cancel", transfer_id="t1", reservation_id="") == {
        "cancelled": True}
    c.close()


def test_completes_need_the_hash_with_a_token(shard):
    """Mooncake's wire carries no token, so with one every complete entry
    must carry its writer's hash (test_push_mooncake.py shows a
    stranger's write then caught); one without is refused whole, and
    nothing completes."""
    c = Ctl(shard.endpoint, {"ecx_token": TOKEN})
    r = c.result("reserve", **item("t1"))
    r2 = c.result("reserve", **item("t2", mm="n" * 64))
    for op, fields in [
            ("complete", {"transfer_id": "t1",
                          "reservation_id": r["reservation_id"]}),
            ("complete_batch", {"items": [
                {"transfer_id": "t2", "reservation_id": r2["reservation_id"],
                 "ecx_xxh3": landed_hash(shard, r2)},
                {"transfer_id": "t1",
                 "reservation_id": r["reservation_id"]}]})]:
        reply = c.call(op, **fields)
        assert reply["ok"] is False and "ecx_xxh3" in reply["error"], op
    for tid in ("t1", "t2"):
        assert c.result("status", transfer_id=tid)["ready"] is False
    c.close()


def complete_n(shard, c, n):
    for k in range(n):
        r = c.result("reserve", **item(f"t{k}", mm=f"m{k}"))
        c.result("complete", transfer_id=f"t{k}",
                 reservation_id=r["reservation_id"],
                 ecx_xxh3=landed_hash(shard, r))


def test_events_only_to_the_token_holder(shard):
    thief = pull(shard.event_endpoint)                    # NULL mechanism
    guesser = pull(shard.event_endpoint, password="guess")  # wrong PLAIN
    good = pull(shard.event_endpoint, password=TOKEN)
    c = Ctl(shard.endpoint, {"ecx_token": TOKEN})
    complete_n(shard, c, 6)
    got = recv_events(good, 6)
    assert sorted(e["transfer_id"] for e in got) == [f"t{k}"
                                                    for k in range(6)]
    assert recv_events(thief, 1, 0.5) == []
    assert recv_events(guesser, 1, 0.2) == []
    for s in (thief, guesser, good):
        s.close(0)
    c.close()


def test_without_a_token_any_pull_steals_events():
    """upstream's behaviour, which the token closes: two PULLs share the
    events round-robin."""
    (s,), _ = start_shards()
    try:
        a = pull(s.event_endpoint)
        b = pull(s.event_endpoint)
        c = Ctl(s.endpoint)
        got_a, got_b = [], []
        for k in range(40):  # until both have connected and been served
            r = c.result("reserve", **item(f"t{k}", mm=f"m{k}"))
            c.result("complete", transfer_id=f"t{k}",
                     reservation_id=r["reservation_id"])
            got_a += recv_events(a, 40, 0.05)
            got_b += recv_events(b, 40, 0.05)
            if got_a and got_b:
                break
        assert got_a and got_b, "one PULL took every event"
        a.close(0)
        b.close(0)
        c.close()
    finally:
        s.stop(0)
