"""The push scheduler's discovery (pushflow/control.py) with a shard that
does not answer: the live shards' event endpoints are handed over at
once, with the number of shards peers gave, and the silent one's once it
answers, so a failure event from a live shard is heard while another
rank is down. Real REP sockets on 127.0.0.1."""
import json
import os
import sys
import threading
import time

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.join(HERE, "vllm_stub") not in sys.path:
    sys.path.insert(0, os.path.join(HERE, "vllm_stub"))

from ecx.vllm.pushflow.control import Control  # noqa: E402

SCALE = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))


def serve(ctx, sock, answers, stop):
    """Answers each request on sock with answers[op] until stop."""
    while not stop.is_set():
        if not sock.poll(20):
            continue
        op = json.loads(sock.recv())["op"]
        sock.send(json.dumps({"ok": True, "result": answers[op]}).encode())


def test_a_silent_shard_does_not_hide_the_live_ones():
    ctx = zmq.Context()
    stop = threading.Event()
    base = ctx.socket(zmq.REP)
    p0 = base.bind_to_random_port("tcp://127.0.0.1")
    # rank 1's port: bound later, so its event_port goes unanswered first
    probe = ctx.socket(zmq.REP)
    p1 = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)
    th = threading.Thread(target=serve, args=(ctx, base, {
        "peers": {"ports": [p0, p1]}, "event_port": 40001}, stop))
    th.start()
    got = []
    c = Control(f"tcp://127.0.0.1:{p0}", 0.3, None,
                lambda found, n: got.append((found, n)))
    late = None
    try:
        t0 = time.monotonic()
        while not got and time.monotonic() - t0 < 3 * SCALE:
            time.sleep(0.01)
        assert got, "the live shard was never handed over"
        assert got[0] == ([(p0, "tcp://127.0.0.1:40001")], 2)
        # rank 1 comes up: it is handed over too
        late = ctx.socket(zmq.REP)
        late.bind(f"tcp://127.0.0.1:{p1}")
        th2 = threading.Thread(target=serve, args=(ctx, late, {
            "event_port": 40002}, stop))
        th2.start()
        t1 = time.monotonic()
        while len(got) < 2 and time.monotonic() - t1 < 5 * SCALE:
            time.sleep(0.01)
        assert got[1:] == [([(p1, "tcp://127.0.0.1:40002")], 2)], got
        assert c.shards == [f"tcp://127.0.0.1:{p0}", f"tcp://127.0.0.1:{p1}"]
    finally:
        stop.set()
        th.join()
        c.close()
        base.close(0)
        if late is not None:
            th2.join()
            late.close(0)
        ctx.term()


def test_close_waits_for_no_gone_shard():
    """vLLM stops its workers (the shards) before the scheduler: cancels
    queued for shards that are gone must not hold close() for their
    timeouts (2 tries x shards x cancels x control_timeout_s)."""
    ctx = zmq.Context()
    stop = threading.Event()
    base = ctx.socket(zmq.REP)
    p0 = base.bind_to_random_port("tcp://127.0.0.1")
    th = threading.Thread(target=serve, args=(ctx, base, {
        "peers": {"ports": [p0]}, "event_port": 40001}, stop))
    th.start()
    got = []
    c = Control(f"tcp://127.0.0.1:{p0}", 2.0, None,
                lambda found, n: got.append(found))
    try:
        t0 = time.monotonic()
        while not got and time.monotonic() - t0 < 3 * SCALE:
            time.sleep(0.01)
        assert got, "the shard was never handed over"
    finally:
        stop.set()
        th.join()
        base.close(0)  # the shard is gone
    c.cancel([f"t{k}" for k in range(5)])
    time.sleep(0.3)  # the first cancel sent, its reply awaited
    t0 = time.monotonic()
    c.close()
    took = time.monotonic() - t0
    ctx.term()
    # 5 cancels x 2 tries x 2 s before; now the call in flight gives up
    assert took < 1.0 * SCALE, f"close took {took:.2f} s"
    assert not c._thread.is_alive()
    assert c.pending == 0  # nothing left to wait for
