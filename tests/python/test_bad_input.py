"""Bad input on every port of a producer (its HTTP registry and its ZeroMQ
socket): each bad request gets a clear error (or, where the protocol has no
way to answer, a closed connection), and the server keeps answering good
clients after each one."""
import json
import socket
import urllib.error
import urllib.request

import pytest

zmq = pytest.importorskip("zmq")

GOOD_ID = "synthetic-0"


def http_raw(port, data, timeout=5.0):
    """Sends raw bytes to the registry; returns what came back (b"" when the
    server closed the connection without an answer)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed on us mid-request: read what it said
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        s.close()


def http_good(url):
    with urllib.request.urlopen(f"{url}/ec/info/{GOOD_ID}", timeout=5) as r:
        assert r.status == 200
        assert json.loads(r.read())["dtype"] == "float32"


def status_and_body(resp):
    head, _, body = resp.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_http_bad_input(serve):
    s = serve("--synthetic", "2", "--shape", "16x16", "--dtype", "float32")
    url = s.registry
    port = int(url.rsplit(":", 1)[1])
    big = b"x" * (2 << 20)
    def req(method, path, body=b""):
        return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n"
                b"Connection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                + body)

    cases = [
        # (request, expected status; 0 = the server may just close)
        (req(b"PUT", b"/ec/info/a", b"{oops"), 400),
        (req(b"PUT", b"/ec/info/a", b"[1,2,3,4]"), 400),
        (req(b"PUT", b"/ec/info/a", b'{"nbytes":-4,"shape":[1],"dtype":'
             b'"uint8","producer_zmq":"tcp://h:1"}'), 400),
        (req(b"PUT", b"/ec/info/a", b'{"nbytes":1e300,"shape":[1e300],'
             b'"dtype":"uint8","producer_zmq":"tcp://h:1"}'), 400),
        (req(b"PUT", b"/ec/info/a", b'{"nbytes":"1","shape":[1],"dtype":'
             b'"uint8","producer_zmq":"tcp://h:1"}'), 400),
        (req(b"PUT", b"/ec/info/a", b'{"nbytes":8,"shape":[1],"dtype":'
             b'"uint8","producer_zmq":"tcp://h:1"}'), 400),
        (req(b"PUT", b"/ec/info/a", b'{"nbytes":1,"shape":[1],"dtype":'
             b'"complex32","producer_zmq":"tcp://h:1"}'), 400),
        (req(b"GET", b"/ec/info/a%00b"), 400),
        (req(b"GET", b"/ec/info/" + b"a" * 300), 400),
        (req(b"POST", b"/ec/lookup", b'{"ids":"a"}'), 400),
        (req(b"POST", b"/ec/lookup", b'{"ids":[1,2]}'), 400),
        (req(b"POST", b"/ec/lookup", big), 413),
        (b"POST /ec/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
         b"\r\n" b'{"ids":[', 0),  # truncated: no whole request to answer
        (req(b"FROB", b"/ec/info/a"), 405),
        (req(b"GET", b"/ec/list?limit=-3"), 400),
        (req(b"GET", b"/ec/list?limit=99999999999999999999"), 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
         0),
        (b"GET / HTTP/1.1\r\n" + b"X-Long: " + b"y" * 100000 + b"\r\n\r\n",
         0),
        (b"\r\n\r\n\r\n", 0),
    ]
    for req, want in cases:
        # Where nothing can be answered the server waits for the rest of
        # the request; the client gives up after a second.
        resp = http_raw(port, req, timeout=5.0 if want else 1.0)
        if want:
            code, body = status_and_body(resp)
            assert code == want, (req[:60], resp[:200])
            assert "detail" in json.loads(body), body
        else:
            assert resp == b"" or resp.startswith(b"HTTP/1.1 4"), resp[:100]
        http_good(url)
    # A flood of connections, some left open and idle.
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    for _ in range(100):
        socket.create_connection(("127.0.0.1", port)).close()
    http_good(url)
    for c in idle:
        c.close()
    http_good(url)


def test_zmq_bad_input(serve):
    s = serve("--synthetic", "2", "--shape", "16x16", "--dtype", "float32")
    ctx = zmq.Context()

    def ask(*frames):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.producer)
        try:
            sock.send_multipart(list(frames))
            return json.loads(sock.recv())
        finally:
            sock.close()

    def good():
        r = ask(json.dumps({"op": "pull", "mm_hash": GOOD_ID,
                            "dst_session": "h:1", "dst_ptr": 4096,
                            "nbytes": 3}).encode())
        assert r["ok"] is False and r["err"] == "size mismatch"

    bad = [
        b"", b"{", b"null", b"[]", b'"pull"', b"\xff\xfe\x00",
        b'{"op": 7}', b'{"op": "launch"}', b'{"op": "hello"}',
        b'{"op": "hello", "worker": 12}',
        b'{"op": "hello", "worker": "!!notbase64!!"}',
        b'{"op": "pull"}',
        b'{"op": "pull", "mm_hash": 5, "dst_session": "h", "dst_ptr": 1,'
        b' "nbytes": 1}',
        b'{"op": "pull", "mm_hash": "a/b", "dst_session": "h",'
        b' "dst_ptr": 1, "nbytes": 1}',
        b'{"op": "pull", "mm_hash": "a", "dst_session": "h",'
        b' "dst_ptr": -1, "nbytes": 1}',
        b'{"op": "pull", "mm_hash": "a", "dst_session": "h",'
        b' "dst_ptr": 1, "nbytes": 1e30}',
        b'{"op": "pull", "mm_hash": "' + b"x" * 300 + b'", "dst_session":'
        b' "h", "dst_ptr": 1, "nbytes": 1}',
        b'{"op": "pull", "mm_hash": "a", "dst_session": "h", "dst_ptr": 1,'
        b' "nbytes": 1} trailing',
    ]
    for msg in bad:
        r = ask(msg)
        assert r["ok"] is False and r["err"], (msg, r)
        good()
    r = ask(b'{"op": "pull"}', b"second frame")
    assert r["ok"] is False and "frame" in r["err"]
    good()
    # Over the 64 KiB frame limit: ZeroMQ drops the peer, nothing answers.
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(s.producer)
    sock.send(b"{" + b" " * (1 << 20) + b"}")
    with pytest.raises(zmq.Again):
        sock.recv()
    sock.close()
    good()
    # Many peers at once.
    socks = []
    for _ in range(100):
        k = ctx.socket(zmq.DEALER)
        k.setsockopt(zmq.LINGER, 0)
        k.connect(s.producer)
        k.send_multipart([b"", b"garbage"])
        socks.append(k)
    good()
    for k in socks:
        k.close()
    ctx.term()
