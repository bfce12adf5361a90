"""ecx.Client against a real `ecx registry` process and a real producer."""
import http.server
import os
import signal
import threading
import time

import pytest
import torch

import ecx
from conftest import stop_process


def item(i, producer="tcp://127.0.0.1:1"):
    return ecx.Item(f"id-{i:03d}", "bfloat16", (i + 1, 8), (i + 1) * 16,
                    producer, epoch=7)


def test_publish_lookup_list_remove(registry):
    r = registry()
    with ecx.Client(r.url) as c:
        epoch = c.health()
        assert isinstance(epoch, int) and epoch > 0
        for i in range(5):
            c.publish(item(i))
        found = c.lookup(["id-001", "nope", "id-004"])
        assert found.ids == ["id-001", "nope", "id-004"]
        assert found[1] is None and found.missing() == ["nope"]
        a = found[0]
        assert (a.id, a.dtype, a.shape, a.nbytes, a.producer, a.epoch) == \
            ("id-001", "bfloat16", (2, 8), 32, "tcp://127.0.0.1:1", 7)
        # Every page, in id order.
        ids = [x.id for x in c.list(limit=2)]
        assert ids == [f"id-{i:03d}" for i in range(5)]
        assert c.last_total == 5
        assert [x.id for x in c.list(after="id-002")] == ["id-003", "id-004"]
        with pytest.raises(ValueError):
            next(c.list(limit=0))
        # Remove: only the named producer's entry.
        with pytest.raises(ecx.NotFound):
            c.remove("id-001", producer="tcp://10.0.0.9:5")
        c.remove("id-001", producer="tcp://127.0.0.1:1")
        c.remove("id-002")
        with pytest.raises(ecx.NotFound):
            c.remove("id-002")
        assert c.lookup(["id-001", "id-002"]) == [None, None]
        # One persistent connection for all of it.
        assert c.connections == 1
    assert c._h is None
    with pytest.raises(ecx.EcxError):
        c.lookup(["id-000"])


def test_bad_url_fails_at_construction():
    with pytest.raises(ecx.EcxError) as e:
        ecx.Client("10.0.0.1:9018")
    assert e.value.name == "EINVAL"
    with pytest.raises(ValueError):
        ecx.Client("")


def test_a_sentinel_url_with_no_sentinel_is_bounded():
    # Nothing listens on these ports: the URL is taken, nothing connects
    # until the first call, which fails within its timeout.
    with ecx.Client("redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster,"
                    "http://127.0.0.1:3", timeout_ms=400) as c:
        t0 = time.monotonic()
        with pytest.raises(ecx.EcxError) as e:
            c.health()
        assert time.monotonic() - t0 < 0.4 + 0.5
        assert e.value.name == "ECONNECT"
        assert "no master within 400 ms" in str(e.value)
    with pytest.raises(ecx.EcxError) as e:
        ecx.Client("redis+sentinel://127.0.0.1:1")
    assert e.value.name == "EINVAL" and "MASTER" in str(e.value)


def test_items_a_client_finds_load_in_a_consumer(registry):
    r = registry()
    p = ecx.Producer(capacity_bytes=4 << 20, bind_host="127.0.0.1",
                     registry=r.url, registry_port=None)
    t = torch.randn(33, 17).to(torch.bfloat16)
    assert p.put("shared", t)
    c = ecx.Client([r.url])
    it = c.lookup(["shared"])[0]
    assert it.producer == p.address
    # Items pickle across processes; here straight into a consumer.
    with ecx.Consumer(r.url) as cons:
        got = cons.load([it])[0]
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    p.close()  # unpublishes
    assert c.lookup(["shared"]) == [None]
    c.close()


def test_registry_down_is_an_error_with_what_others_found(registry):
    r1, r2 = registry(), registry()
    c = ecx.Client(f"{r1.url},{r2.url}", timeout_ms=1000,
                   connect_timeout_ms=500)
    c.publish(item(1))  # to the first registry
    r2.stop()
    t0 = time.monotonic()
    with pytest.raises(ecx.EcxError) as e:
        c.lookup(["id-001", "id-009"])  # id-009 is asked of r2 too
    assert time.monotonic() - t0 < 2.0
    assert e.value.found[0].id == "id-001" and e.value.found[1] is None
    r1.stop()
    with pytest.raises(ecx.EcxError):
        c.health()
    c.close()


def test_consumer_lookup_with_a_registry_down_keeps_what_others_found(
        registry):
    # Consumer.lookup and Client.lookup share one path: both attach what
    # the registries that answered found to the error.
    r1, r2 = registry(), registry()
    with ecx.Client(r1.url) as c:
        c.publish(item(1))
    r2.stop()
    with ecx.Consumer(f"{r1.url},{r2.url}", timeout_ms=1000) as cons:
        with pytest.raises(ecx.EcxError) as e:
            cons.lookup(["id-001", "id-009"])
    assert e.value.found[0].id == "id-001" and e.value.found[1] is None
    r1.stop()


def test_registry_entry_json_round_trips():
    a = item(3, "tcp://10.1.2.3:4567")
    text = a.to_json()
    assert '"producer_zmq"' in text and '"bfloat16"' in text
    b = ecx.Item.from_json(a.id, text)
    assert (b.dtype, b.shape, b.nbytes, b.producer, b.epoch) == \
        (a.dtype, a.shape, a.nbytes, a.producer, a.epoch)
    with pytest.raises(ecx.EcxError) as e:
        ecx.Item.from_json("x", "{not json")
    assert e.value.name == "EPROTO"


@pytest.mark.parametrize("spin_us", [None, 0, 100000])
def test_a_stopped_registry_costs_the_timeout_whatever_the_spin(registry,
                                                                spin_us):
    # The client polls for an answer before sleeping (spin_us); neither
    # way may outlast the request's timeout when the registry never
    # answers (SIGSTOP: the connection is up, nothing comes back).
    r = registry()
    c = ecx.Client(r.url, timeout_ms=400, spin_us=spin_us)
    c.publish(item(2))
    assert c.lookup(["id-002"])[0].nbytes == item(2).nbytes
    stop_process(r.proc.pid)
    try:
        t0 = time.monotonic()
        with pytest.raises(ecx.EcxError) as e:
            c.lookup(["id-002"])
        took = time.monotonic() - t0
        assert e.value.name == "ETIMEDOUT", e.value
        assert 0.35 < took < 1.5, took
    finally:
        os.kill(r.proc.pid, signal.SIGCONT)
    c.close()


@pytest.mark.parametrize("spin_us", [-1, 100001])
def test_a_spin_out_of_range_is_refused(spin_us):
    with pytest.raises(ecx.EcxError) as e:
        ecx.Client("http://127.0.0.1:1", spin_us=spin_us)
    assert e.value.name == "EINVAL"
    assert "spin is 0 to 100000 us" in str(e.value)


class _Http404(http.server.BaseHTTPRequestHandler):
    """A web server that is no registry: 404 with an HTML page for
    everything (or, as the reference registry, its JSON miss for GET
    /ec/info/{id} and FastAPI's 404 for the rest)."""
    reference = False

    def _answer(self):
        if self.reference and self.command == "GET" and \
                self.path.startswith("/ec/info/"):
            body, ctype = b'{"detail":"unknown mm_hash"}', "application/json"
        elif self.reference:
            body, ctype = b'{"detail":"Not Found"}', "application/json"
        else:
            body, ctype = b"<html><body>Not here</body></html>", "text/html"
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        self.send_response(404)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def http404():
    servers = []

    def start(reference=False):
        handler = type("H", (_Http404,), {"reference": reference})
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        return f"http://127.0.0.1:{s.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("ids", [["a"], ["a", "b"]])
def test_a_server_that_is_no_registry_is_an_error_not_a_miss(http404, ids):
    url = http404()
    with ecx.Client(url) as c:
        with pytest.raises(ecx.EcxError) as e:
            c.lookup(ids)
        assert not isinstance(e.value, ecx.NotFound)
        assert f"{url} is not an ecx or reference registry" in str(e.value)
        # Said the same the next time (no back-off hides it).
        with pytest.raises(ecx.EcxError) as e:
            c.lookup(ids)
        assert "is not an ecx or reference registry" in str(e.value)
    with ecx.Consumer(url) as cons:
        with pytest.raises(ecx.EcxError) as e:
            cons.lookup(ids)
        assert not isinstance(e.value, ecx.NotFound)
        assert f"{url} is not an ecx or reference registry" in str(e.value)


def test_a_path_after_the_port_of_a_real_registry_is_an_error(registry):
    r = registry()
    with ecx.Client(r.url) as c:
        c.publish(item(1))
        assert c.lookup(["id-001"])[0] is not None
    with ecx.Client(r.url + "/foo") as c:
        for ids in (["id-001"], ["id-001", "id-002"]):
            with pytest.raises(ecx.EcxError) as e:
                c.lookup(ids)
            assert "/foo is not an ecx or reference registry" in \
                str(e.value)


def test_a_reference_registry_misses_are_misses(http404):
    # Its only route is GET /ec/info/{id}: a lookup of several asks each.
    url = http404(reference=True)
    with ecx.Client(url) as c:
        assert c.lookup(["a"]) == [None]
        assert c.lookup(["a", "b", "c"]) == [None, None, None]


def test_embedded_registry_lists_exactly_what_its_producer_holds():
    # Puts that evict, while another client DELETEs every entry it lists:
    # once the DELETEs stop, within one renew period (2 s) the embedded
    # registry lists every item held again, and none that was evicted
    # (the put back never races an eviction's unpublish).
    scale = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))
    p = ecx.Producer(capacity_bytes=1 << 20, bind_host="127.0.0.1",
                     registry_port=0)
    url = f"http://127.0.0.1:{p.registry_port}"
    stop = threading.Event()
    deleted = [0]

    def delete_all():
        with ecx.Client(url) as c:
            while not stop.is_set():
                for x in list(c.list()):
                    try:
                        c.remove(x.id)
                        deleted[0] += 1
                    except ecx.NotFound:
                        pass
                time.sleep(0.01)

    t = threading.Thread(target=delete_all)
    t.start()
    try:
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < 5 * scale:
            p.put(f"e-{i}", torch.full((16384,), i, dtype=torch.float32))
            i += 1
            if i % 50 == 0:
                time.sleep(0.05)
    finally:
        stop.set()
        t.join()
    assert deleted[0] > 0 and p.stats()["evictions"] > 0
    held = p.stats()["items"]
    with ecx.Client(url) as c, ecx.Consumer(url) as cons:
        deadline = time.monotonic() + 2.0 * scale + 1.5
        while True:
            listed = [x.id for x in c.list()]
            if len(listed) == held or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(listed) == held, (len(listed), held)
        # Each listed id is held (a load finds it): no evicted one is back.
        got = cons.load(c.lookup(listed))
        assert len(got) == held
    p.close()
