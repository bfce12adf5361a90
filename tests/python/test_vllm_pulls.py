"""A consumer worker's background pulls (ecx.vllm.pulls.Pulls) with the
step channel's real sockets: a real producer and consumer, the worker's
end of the channel and the scheduler's, as the connector wires them."""
import hashlib
import os
import sys
import time
import uuid

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "vllm_stub"))

import ecx  # noqa: E402
from ecx.vllm.channel import (NOTIFY_MSG_MAX, SchedulerChannel,  # noqa: E402
                              WorkerChannel, news_pieces, news_tag)
from ecx.vllm.metadata import Counters, ECXLoadSpec  # noqa: E402
from ecx.vllm.pulls import Pulls  # noqa: E402

SCALE = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))


@pytest.fixture
def producer(local_producer):
    return local_producer(32 << 20)


@pytest.fixture
def ipc_dir(tmp_path, monkeypatch):
    d = tmp_path / "ipc"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("ECX_VLLM_IPC_DIR", str(d))
    return d


def item_bytes(i):
    return torch.arange(16, dtype=torch.int32) + i


@pytest.mark.parametrize("n", [1000, 4000])
def test_a_pull_of_more_ids_than_one_message_names(producer, ipc_dir, n):
    """n ids of 64 characters from one producer: their tag is past
    libecx's 64 KiB, so the pull goes in pieces, and every item lands
    and is said on the channel (4000: five pieces, whose news all wait
    in the socket's buffer before the scheduler reads one)."""
    ids = [hashlib.sha256(f"big-{i}".encode()).hexdigest()
           for i in range(n)]
    for i, h in enumerate(ids):
        producer.put(h, item_bytes(i))
    pairs = [(h, 1) for h in ids]
    assert len(news_tag(0, pairs)) > NOTIFY_MSG_MAX  # one would not do
    url = f"http://127.0.0.1:{producer.registry_port}"
    eid = str(uuid.uuid4())
    sched = SchedulerChannel(eid, 0)
    cons = ecx.Consumer(url, recv_capacity=64 << 20, timeout_ms=4000)
    stats = Counters()
    # Into the receive arena, as the worker's pulls go.
    pulls = Pulls(None, stats, lambda: cons,
                  lambda c, s: c.arena_tensor(s.item()))
    chan = WorkerChannel(eid, 0, 0, pulls.from_channel, ECXLoadSpec)
    pulls.channel = chan
    try:
        specs = [ECXLoadSpec.of(it, attempt=1) for it in cons.lookup(ids)]
        pulls.from_channel(specs)
        assert stats.total.get("items_failed", 0) == 0
        # The scheduler reads only once every pull has ended.
        deadline = time.monotonic() + 10 * SCALE
        while pulls._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
            pulls.poll()
        assert set(pulls.held) == set(ids) and not pulls.want
        time.sleep(0.1 * SCALE)  # libecx's thread says it after the end
        said = set()
        for rank, held, failed in sched.news(0.1):
            assert rank == 0 and failed == []
            said.update(held)
        assert said == set(pairs)
        for i, h in enumerate(ids):
            assert torch.equal(pulls.held[h][1], item_bytes(i))
        assert stats.total["pulls_started"] >= 2
    finally:
        chan.close()
        pulls.shutdown()
        sched.close()
        cons.close()


def test_news_pieces_each_fit_and_keep_the_order():
    pairs = [(hashlib.sha256(str(i).encode()).hexdigest(), i)
             for i in range(3000)]
    pieces = news_pieces(7, pairs)
    assert [p for piece in pieces for p in piece] == pairs
    assert len(pieces) > 1
    for piece in pieces:
        assert len(news_tag(7, piece)) <= NOTIFY_MSG_MAX
    assert news_pieces(0, pairs[:10]) == [pairs[:10]]
    assert news_pieces(0, []) == [[]]


SENDER = r"""
import json, socket, struct, sys, time
def news_tag(rank, pairs):  # the worker's tag (channel.news_tag)
    j = json.dumps({"rank": rank, "ids": [list(p) for p in pairs]}).encode()
    return b"ecx1" + struct.pack("<I", len(j)) + j
path, n, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.connect(path)
lost = 0
for i in range(n):
    try:
        s.send(news_tag(i % 4, [(f"news-{i}", 1)]) + struct.pack("i", 0),
               socket.MSG_DONTWAIT)  # as libecx sends: never blocking
    except BlockingIOError:
        lost += 1
    time.sleep(gap)
print(lost, flush=True)
"""


def test_news_past_the_sockets_queue_is_not_lost():
    """Thirty messages from another process, 2 ms apart, while the
    scheduler's thread computes (it calls news() only at the end, as a
    step's forward pass keeps it away): the socket queues at most
    net.unix.max_dgram_qlen (10 here) unread ones and the sender never
    blocks, so without the channel's own reader twenty were lost."""
    import subprocess
    from ecx.vllm.channel import endpoints
    engine = f"news-{uuid.uuid4().hex[:12]}"
    ch = SchedulerChannel(engine, 0)
    try:
        path = endpoints(engine, 0)[1]
        n = 30
        proc = subprocess.Popen(
            [sys.executable, "-c", SENDER, path, str(n), str(0.002 * SCALE)],
            stdout=subprocess.PIPE, text=True)
        end = time.monotonic() + 10 * SCALE
        spin = 0
        while proc.poll() is None and time.monotonic() < end:
            spin += 1  # this thread busy, holding the lock between switches
        lost = int(proc.communicate(timeout=10 * SCALE)[0])
        got = []
        while len(got) < n and time.monotonic() < end:
            got += ch.news(0.1)
        assert lost == 0, f"{lost} of {n} messages dropped"
        assert sorted(h for _, held, _ in got for h, _ in held) == sorted(
            f"news-{i}" for i in range(n))
        assert {r for r, _, _ in got} == {0, 1, 2, 3}
    finally:
        ch.close()
