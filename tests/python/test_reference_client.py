"""A client written for the reference connector works against ecx unchanged.

The reference's consumer reads only nbytes, shape, dtype and producer_zmq
from GET /ec/info/{mm_hash} (has_cache_item), treats any non-200 as a miss,
and sends {"op": "pull", ...} to producer_zmq with ZeroMQ. This test is such
a client, on Python's standard library (and pyzmq for the pull), not ecx's.
"""
import json
import socket
import urllib.error
import urllib.request

import pytest


def reference_has_cache_item(registry_url, identifier):
    """The reference's has_cache_item, with urllib in place of httpx."""
    url = registry_url.rstrip("/") + f"/ec/info/{identifier}"
    try:
        with urllib.request.urlopen(url, timeout=5.0) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        return None, e.code, json.loads(e.read())
    if status != 200:
        return None, status, None
    data = json.loads(body)
    spec = dict(nbytes=int(data["nbytes"]),
                shape=tuple(int(x) for x in data["shape"]),
                dtype=str(data["dtype"]),
                producer_zmq=str(data["producer_zmq"]))
    return spec, status, data


def test_info_route_reads_like_the_reference(serve):
    s = serve("--synthetic", "2", "--shape", "529x3584", "--dtype", "bfloat16")
    spec, status, raw = reference_has_cache_item(s.registry, "synthetic-1")
    assert status == 200
    assert spec == dict(nbytes=529 * 3584 * 2, shape=(529, 3584),
                        dtype="bfloat16", producer_zmq=s.producer)
    # The four fields are plain JSON integers and strings, as FastAPI wrote.
    assert isinstance(raw["nbytes"], int)
    assert all(isinstance(x, int) for x in raw["shape"])


def test_unknown_id_is_the_reference_404(serve):
    s = serve("--synthetic", "1", "--shape", "4", "--dtype", "uint8")
    spec, status, body = reference_has_cache_item(s.registry, "f" * 64)
    assert spec is None and status == 404
    assert body == {"detail": "unknown mm_hash"}


def test_malformed_id_is_400_with_detail(serve):
    s = serve("--synthetic", "1", "--shape", "4", "--dtype", "uint8")
    spec, status, body = reference_has_cache_item(s.registry, "a%20b")
    assert spec is None and status == 400
    assert "detail" in body


def test_reference_pull_gets_the_reference_reply_shape(serve):
    zmq = pytest.importorskip("zmq")
    s = serve("--synthetic", "1", "--shape", "16x16", "--dtype", "float32")
    ctx = zmq.Context()
    try:
        def pull(**req):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(s.producer)
            try:
                sock.send_json(req)
                return sock.recv_json()
            finally:
                sock.close()

        # A Mooncake session nobody listens at: the write is tried and
        # fails as a transfer (ok false, mooncake_ret -1), on loopback.
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
        probe.close()
        base = dict(op="pull", dst_session=f"127.0.0.1:{closed}",
                    dst_ptr=140737488355328)
        r = pull(mm_hash="nope", nbytes=1024, **base)
        assert r["ok"] is False and r["err"] == "unknown mm_hash"
        r = pull(mm_hash="synthetic-0", nbytes=3, **base)
        assert r["ok"] is False and r["err"] == "size mismatch"
        r = pull(mm_hash="synthetic-0", nbytes=1024, **base)
        assert r["ok"] is False and r["mooncake_ret"] == -1
        assert "cannot connect" in r["err"]
        r = pull(op="push")
        assert r == {"ok": False, "err": "unknown op", "code": "EUNSUPPORTED"}
        # Garbage, then a good request on a fresh socket: still answered.
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.producer)
        sock.send(b"\xff\x00not json")
        assert sock.recv_json()["ok"] is False
        sock.close()
        r = pull(mm_hash="nope", nbytes=1, **base)
        assert r["err"] == "unknown mm_hash"
    finally:
        ctx.term()
