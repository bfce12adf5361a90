"""Push mode, the control shard's sockets and each op's envelope exactly
(docs/protocol.md, "Push mode"): one JSON frame each way, ok/result or
ok/error, the port formula, binding to ec_ip only, IPv6."""
import json
import re
import socket
import time

import pytest
import zmq

from pushkit import Ctl, item, pull, recv_events, start_shards
from ecx.vllm.push import ControlShard, BufferPool

RESERVATION_KEYS = {"reservation_id", "dst_session", "dst_ptr", "nbytes",
                    "write", "ready", "cached"}


@pytest.fixture
def one():
    (s,), clock = start_shards()
    c = Ctl(s.endpoint)
    yield s, clock, c
    c.close()
    s.stop(0)


def test_peers_and_event_port_and_port_formula():
    shards, _ = start_shards(tp=2, dp=1)
    try:
        base = shards[0].base_port
        assert [s.port for s in shards] == [base, base + 1]
        # ec_port + dp*tp + rank, dp = 1, tp = 2
        assert shards[1].port == (base - 2) + 1 * 2 + 1
        for s in shards:
            c = Ctl(s.endpoint)
            assert c.call("peers") == {"ok": True,
                                       "result": {"ports": [base, base + 1]}}
            ep = c.call("event_port")
            assert ep == {"ok": True, "result": s.event_port}
            assert isinstance(ep["result"], int) and ep["result"] > 0
            c.close()
    finally:
        for s in shards:
            s.stop(0)


def test_reserve_envelope(one):
    s, _, c = one
    reply = c.call("reserve", **item("t1"))
    assert reply["ok"] is True and set(reply) == {"ok", "result"}
    r = reply["result"]
    assert set(r) == RESERVATION_KEYS
    assert re.fullmatch(r"[0-9a-f]{32}", r["reservation_id"])
    assert r["dst_session"] == "127.0.0.1:17777"
    assert s.pool.base <= r["dst_ptr"] < s.pool.base + s.pool.size
    assert (r["nbytes"], r["write"], r["ready"], r["cached"]) == \
        (64, True, False, False)
    again = c.result("reserve", **item("t1"))
    assert again == dict(r, write=False)


def test_reserve_batch_envelope_in_order(one):
    s, _, c = one
    bad = dict(item("t2"), nbytes=63)
    res = c.result("reserve_batch",
                   items=[item("t1"), bad, item("t3", mm="x")])
    assert set(res) == {"items"} and len(res["items"]) == 3
    a, b, d = res["items"]
    assert a["ok"] is True and set(a) == {"ok", "result"}
    assert set(a["result"]) == RESERVATION_KEYS and a["result"]["write"]
    assert b == {"ok": False, "error": "shape and dtype do not match nbytes"}
    assert d["ok"] is True and d["result"]["dst_ptr"] != a["result"][
        "dst_ptr"]
    assert s.table.state("t2") is None


def test_complete_and_batch_envelopes(one):
    s, _, c = one
    r1 = c.result("reserve", **item("t1", mm="a"))
    r2 = c.result("reserve", **item("t2", mm="b"))
    assert c.call("complete", transfer_id="t1",
                  reservation_id=r1["reservation_id"]) == {
        "ok": True, "result": {"completed": True, "became_ready": True}}
    assert c.call("complete_batch", items=[
        {"transfer_id": "t1", "reservation_id": r1["reservation_id"]},
        {"transfer_id": "t2", "reservation_id": r2["reservation_id"]},
        {"transfer_id": "nope", "reservation_id": "x"}]) == {
        "ok": True, "result": {"items": [
            {"completed": True, "became_ready": False},
            {"completed": True, "became_ready": True},
            {"completed": False, "became_ready": False}]}}


def test_cancel_and_status_envelopes(one):
    s, _, c = one
    assert c.call("status", transfer_id="t1") == {"ok": True,
                                                  "result": None}
    r = c.result("reserve", **item("t1"))
    assert c.call("status", transfer_id="t1") == {"ok": True, "result": {
        "mm_hash": "m" * 64, "ready": False,
        "reservation_id": r["reservation_id"], "nbytes": 64,
        "shape": [4, 8], "dtype": "bfloat16"}}
    assert c.call("cancel", transfer_id="t1", reservation_id="",
                  abandon=True) == {"ok": True,
                                    "result": {"cancelled": True}}
    assert c.call("status", transfer_id="t1") == {"ok": True,
                                                  "result": None}
    assert c.call("cancel", transfer_id="t1", reservation_id="zz") == {
        "ok": True, "result": {"cancelled": False}}


def test_event_fields_exactly(one):
    s, _, c = one
    p = pull(s.event_endpoint)
    r = c.result("reserve", **item("t1"))
    c.result("complete", transfer_id="t1",
             reservation_id=r["reservation_id"])
    (ev,) = recv_events(p, 1)
    assert ev == {"transfer_id": "t1", "mm_hash": "m" * 64, "ready": True,
                  "reservation_id": r["reservation_id"], "nbytes": 64,
                  "shape": [4, 8], "dtype": "bfloat16", "shard": s.port}
    p.close(0)


def test_events_wait_for_a_subscriber_and_backlog_bounded():
    (s,), _ = start_shards(event_backlog=3)
    c = Ctl(s.endpoint)
    try:
        for k in range(5):
            r = c.result("reserve", **item(f"t{k}", mm=f"m{k}"))
            c.result("complete", transfer_id=f"t{k}",
                     reservation_id=r["reservation_id"])
        assert s.events_dropped == 2
        p = pull(s.event_endpoint)
        got = recv_events(p, 5, timeout_s=1.5)
        assert [e["transfer_id"] for e in got] == ["t2", "t3", "t4"]
        p.close(0)
    finally:
        c.close()
        s.stop(0)


def test_bound_to_ec_ip_only(one):
    s, _, c = one
    # 127.0.0.2 is this host's loopback too: a socket bound to every
    # interface would answer there.
    other = Ctl(f"tcp://127.0.0.2:{s.port}", timeout_ms=300)
    assert other.send_frames([b'{"op":"peers"}']) is None
    other.close()
    for port in (s.port, s.event_port):
        with socket.socket() as t:
            t.settimeout(1)
            assert t.connect_ex(("127.0.0.2", port)) != 0
    assert c.result("peers") == {"ports": [s.port]}


def test_ipv6_in_brackets():
    try:
        with socket.socket(socket.AF_INET6) as t:
            t.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    (s,), _ = start_shards(ip="::1")
    try:
        assert s.endpoint == f"tcp://[::1]:{s.port}"
        c = Ctl(s.endpoint)
        assert c.result("peers") == {"ports": [s.port]}
        p = pull(s.event_endpoint)
        r = c.result("reserve", **item("t1"))
        c.result("complete", transfer_id="t1",
                 reservation_id=r["reservation_id"])
        assert [e["transfer_id"] for e in recv_events(p, 1)] == ["t1"]
        p.close(0)
        c.close()
    finally:
        s.stop(0)


def test_port_range_checked():
    pool = BufferPool(bytearray(4096), "x:1")
    with pytest.raises(ValueError):
        ControlShard(pool, ec_port=65535, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError):
        ControlShard(pool, ec_port=0, tp_size=1)
    with pytest.raises(ValueError):
        ControlShard(pool, ec_port=1000, tp_size=2, tp_rank=2)


def test_bind_failure_reported():
    with socket.socket() as t:
        t.bind(("127.0.0.1", 0))
        t.listen()
        port = t.getsockname()[1]
        s = ControlShard(BufferPool(bytearray(4096), "x:1"), ec_port=port)
        with pytest.raises(RuntimeError, match=str(port)):
            s.start()
    # a host name: ZeroMQ takes it for an interface, and the error says so
    # (libzmq 4.3.5 binds "localhost" itself, so another name)
    s = ControlShard(BufferPool(bytearray(4096), "x:1"), ec_ip="encoder-a",
                     ec_port=14579)
    with pytest.raises(RuntimeError, match="does not look up host names"):
        s.start()


def test_one_frame_replies_to_raw_json(one):
    s, _, c = one
    frames = c.send_frames([json.dumps({"op": "peers"}).encode()])
    assert len(frames) == 1
    assert json.loads(frames[0].decode("utf-8")) == {
        "ok": True, "result": {"ports": [s.port]}}
    assert zmq.REQ  # the client is a plain REQ, as upstream's


def test_event_from_another_thread_wakes_the_loop():
    """A data plane that completes through the table (not the REP socket)
    gets its event out at once, not when the loop's poll times out; stop
    wakes the loop too."""
    (s,), _ = start_shards(poll_ms=20000)
    try:
        c = Ctl(s.endpoint)
        p = pull(s.event_endpoint)
        r = c.result("reserve", **item("t1"))
        time.sleep(0.3)  # the loop is in its long poll again
        t0 = time.monotonic()
        assert s.table.complete("t1", r["reservation_id"]) == (True, True)
        assert [e["transfer_id"] for e in recv_events(p, 1, 5.0)] == ["t1"]
        assert time.monotonic() - t0 < 5.0
        p.close(0)
        c.close()
    finally:
        t0 = time.monotonic()
        s.stop(0)
        assert time.monotonic() - t0 < 5.0


def test_buffer_pool_refuses_writes_past_the_deadline():
    (s,), clock = start_shards()
    try:
        c = Ctl(s.endpoint)
        r = c.result("reserve", **item("t1"))
        s.pool.receive(r["dst_ptr"], b"\1" * 64)
        with pytest.raises(PermissionError):  # one byte past the range
            s.pool.receive(r["dst_ptr"] + 1, b"\1" * 64)
        clock.advance(300)  # the deadline, before the reaper has run
        with pytest.raises(PermissionError):
            s.pool.receive(r["dst_ptr"], b"\2" * 64)
        assert s.pool.read(r["dst_ptr"], 64) == b"\1" * 64
        c.close()
    finally:
        s.stop(0)
