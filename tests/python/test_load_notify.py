"""ecx_consumer_load_notify (Consumer.load_notify): a load that libecx
starts, waits for and ends in a thread of its own, and whose end it says
on a socket: the message once, the caller's bytes then each item's
status; bytes checked, failures named, a stopped producer bounded, a
thread of Python's never needed."""
import os
import select
import socket
import subprocess
import sys
import time

import pytest
import torch

import ecx
from conftest import stop_process
from ecx.consumer import notify_statuses

SCALE = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))


def tensor(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


@pytest.fixture
def producer(local_producer):
    return local_producer(64 << 20)


def recv(sock, timeout_s):
    r, _, _ = select.select([sock], [], [], timeout_s)
    return sock.recv(1 << 20) if r else None


def test_the_end_is_sent_once_with_every_status(producer):
    sent = {f"nt-{i}": tensor((256, 512), i) for i in range(4)}
    for k, t in sent.items():
        producer.put(k, t)
    url = f"http://127.0.0.1:{producer.registry_port}"
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ecx.Consumer(url, recv_capacity=8 << 20, timeout_ms=2000) as c:
        found = c.lookup(list(sent) + ["nt-gone"])
        producer.put("nt-gone", torch.ones(8))
        found[-1] = c.lookup(["nt-gone"])[0]
        producer.remove("nt-gone")  # gone between lookup and load
        pairs = [(it, it.empty()) for it in found]
        load = c.load_notify(pairs, a, b"tag:1")
        a.close()  # libecx sends on a duplicate of its own
        data = recv(b, 5 * SCALE)
        assert data is not None
        msg, st = notify_statuses(data, len(pairs))
        assert msg == b"tag:1"
        assert st[:4] == [0] * 4 and st[4] == ecx.errors.CODES["ENOTFOUND"]
        assert recv(b, 0.05) is None  # once
        assert load.test()  # ended: the statuses were final when sent
        errs = load.wait()
        assert errs[:4] == [None] * 4 and isinstance(errs[4], ecx.NotFound)
        for (it, t) in pairs[:4]:
            assert torch.equal(t.view(torch.uint8),
                               sent[it.id].view(torch.uint8))
        # Connected now: its pulls go from the call, and the test that
        # finds them loaded ends it and says so (or its thread does).
        a2, b2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        pairs = [(it, it.empty()) for it in found[:4]]
        load = c.load_notify(pairs, a2, b"tag:2")
        deadline = time.monotonic() + 5 * SCALE
        while not load.test():
            assert time.monotonic() < deadline
        msg, st = notify_statuses(recv(b2, 1 * SCALE), len(pairs))
        a2.close()
        b2.close()
        assert (msg, st) == (b"tag:2", [0] * 4)
        assert load.wait() == [None] * 4
        for (it, t) in pairs:
            assert torch.equal(t.view(torch.uint8),
                               sent[it.id].view(torch.uint8))
    b.close()


def test_it_ends_while_python_holds_the_gil(producer):
    """The load ends and its message is sent while this thread never lets
    the GIL go (a busy loop of Python, with a 1 s switch interval): no
    thread of Python's takes part."""
    producer.put("nt-gil", tensor((1024, 1024), 9))
    url = f"http://127.0.0.1:{producer.registry_port}"
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.setblocking(False)
    old = sys.getswitchinterval()
    with ecx.Consumer(url, recv_capacity=8 << 20) as c:
        (it,) = c.lookup(["nt-gil"])
        c.load_into([(it, it.empty())])  # connected: no handshake below
        sys.setswitchinterval(1.0)
        try:
            load = c.load_notify([(it, it.empty())], a, b"x")
            t0 = time.perf_counter()
            data = None
            while data is None and time.perf_counter() - t0 < 5 * SCALE:
                try:
                    data = b.recv(64)  # never blocks, never lets go long
                except BlockingIOError:
                    pass
            took = time.perf_counter() - t0
        finally:
            sys.setswitchinterval(old)
        assert data is not None and notify_statuses(data, 1) == (b"x", [0])
        assert load.wait() == [None]
        print(f"ended {took * 1e3:.2f} ms after the start")
        assert took < 0.5 * SCALE, took
    a.close()
    b.close()


PRODUCER = """
import sys, torch, ecx
p = ecx.Producer(capacity_bytes=32 << 20, bind_host="127.0.0.1",
                 registry_port=0)
for i in range(2):
    p.put(f"nt-stop-{i}", torch.ones(1024, 1024, dtype=torch.bfloat16))
print(p.registry_port, flush=True)
sys.stdin.read()
"""


def test_a_stopped_producer_ends_by_the_timeout():
    """The producer is stopped (every thread) after a first load connected
    to it: the load's message comes, with ETIMEDOUT, within the timeout
    (and its 200 ms), and the load is final."""
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        timeout_ms = int(800 * SCALE)
        with ecx.Consumer(url, timeout_ms=timeout_ms) as c:
            first, second = c.lookup(["nt-stop-0", "nt-stop-1"])
            assert c.load_into([(first, first.empty())]) == [None]
            stop_process(proc.pid)
            t0 = time.monotonic()
            load = c.load_notify([(second, second.empty())], a, b"s")
            assert time.monotonic() - t0 < 0.1 * SCALE  # returns at once
            data = recv(b, 5 * SCALE)
            took = time.monotonic() - t0
            assert data is not None
            assert notify_statuses(data, 1) == (b"s", [ecx.errors.CODES["ETIMEDOUT"]])
            assert took < timeout_ms / 1e3 + 0.2 + 0.3 * SCALE, took
            assert load.test()
            assert isinstance(load.wait()[0], ecx.errors.Timeout)
    finally:
        proc.kill()
        proc.wait()
        a.close()
        b.close()


def test_a_stalled_load_does_not_hold_back_another(producer):
    """One notified load's thread drives the consumer's worker at a time
    (notify.c, bg_driver): a load from a stopped producer, started first,
    drives until its timeout, and a load from a live producer started
    after it must still end at once (its bytes moved by the driver's
    progress) and be said at once; then the stalled one ends by its
    timeout, and a third load, after both, ends at once too."""
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    producer.put("nt-live", tensor((256, 512), 7))
    live_url = f"http://127.0.0.1:{producer.registry_port}"
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        timeout_ms = int(1500 * SCALE)
        with ecx.Consumer(url) as c1:
            first, second = c1.lookup(["nt-stop-0", "nt-stop-1"])
        with ecx.Consumer(live_url) as c2:
            [live] = c2.lookup(["nt-live"])
        # One consumer loads from both producers (Items carry where).
        with ecx.Consumer(None, timeout_ms=timeout_ms) as c:
            assert c.load_into([(first, first.empty())]) == [None]
            assert c.load_into([(live, live.empty())]) == [None]
            stop_process(proc.pid)
            t0 = time.monotonic()
            stalled = c.load_notify([(second, second.empty())], a, b"s")
            time.sleep(0.05)  # its thread drives by now
            t1 = time.monotonic()
            quick = c.load_notify([(live, live.empty())], a, b"q")
            data = recv(b, 5 * SCALE)
            assert data is not None
            assert notify_statuses(data, 1) == (b"q", [0])
            assert time.monotonic() - t1 < timeout_ms / 2e3, \
                "the live producer's load waited for the stalled one"
            assert quick.wait() == [None]
            assert torch.equal(quick.tensors[0], tensor((256, 512), 7))
            data = recv(b, 5 * SCALE)
            assert data is not None
            assert notify_statuses(data, 1) == (
                b"s", [ecx.errors.CODES["ETIMEDOUT"]])
            assert time.monotonic() - t0 < (timeout_ms / 1e3 + 0.2
                                            + 0.3 * SCALE)
            assert isinstance(stalled.wait()[0], ecx.errors.Timeout)
            t2 = time.monotonic()
            again = c.load_notify([(live, live.empty())], a, b"a")
            data = recv(b, 5 * SCALE)
            assert data is not None and notify_statuses(data, 1) == (
                b"a", [0])
            assert time.monotonic() - t2 < timeout_ms / 2e3
            assert again.wait() == [None]
    finally:
        proc.kill()
        proc.wait()
        a.close()
        b.close()


def test_no_socket_no_message_and_a_bad_descriptor(producer):
    producer.put("nt-quiet", torch.ones(64))
    url = f"http://127.0.0.1:{producer.registry_port}"
    with ecx.Consumer(url) as c:
        (it,) = c.lookup(["nt-quiet"])
        load = c.load_notify([(it, it.empty())])
        assert load.wait() == [None]
        r, w = os.pipe()
        try:
            with pytest.raises(ecx.EcxError) as e:
                c.load_notify([(it, it.empty())], w, b"")
            assert e.value.name == "EINVAL" and "not a socket" in str(e.value)
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            with pytest.raises(ecx.EcxError) as e:
                c.load_notify([(it, it.empty())], a, b"x" * 70000)
            assert e.value.name == "EINVAL"
            a.close()
            b.close()
        finally:
            os.close(r)
            os.close(w)
