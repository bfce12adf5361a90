"""The interop peers checked against each other and against byte-level
fixtures written from Mooncake's source (each names the file it follows),
so that the cross tests with ecx test ecx, not the peers.

Real processes and sockets on 127.0.0.1, port 0; every wait bounded."""
import json
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import items  # noqa: E402
import mcwire  # noqa: E402
import ref_consumer  # noqa: E402

PY = os.environ.get("ECX_PYTHON") or sys.executable
ITEMS = ["a:64x64:float32", "big:1024x3584:bfloat16", "one:1:uint8",
         "odd:3x5x7:int16"]


# ------------------------------------------------------------- fixtures

def test_handshake_frame_bytes():
    # mooncake-transfer-engine/include/common.h writeString: u64 length
    # (native order; x86-64 and aarch64 are little-endian) counting the type
    # byte, the type (HandShakeRequestType::Metadata = 1), the JSON.
    assert mcwire.encode_frame(1, b'{}\n') == \
        b"\x04\x00\x00\x00\x00\x00\x00\x00\x01{}\n"
    # HandShakeRequestType::Probe = 3.
    assert mcwire.encode_frame(3, b"{}") == \
        b"\x03\x00\x00\x00\x00\x00\x00\x00\x03{}"


def test_read_frame_refusals():
    # include/common.h readString: zero length and length over 1 MiB are
    # refused; a first byte above Probe (3) is the old untyped protocol.
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack("=Q", 0))
        with pytest.raises(mcwire.WireError, match="zero"):
            mcwire.read_frame(a)
        b.sendall(struct.pack("=Q", (1 << 20) + 1))
        with pytest.raises(mcwire.WireError, match="over"):
            mcwire.read_frame(a)
        b.sendall(struct.pack("=Q", 3) + b"{}\n")
        assert mcwire.read_frame(a) == (None, b"{}\n")
        b.sendall(struct.pack("=Q", 1 << 20) + b"\x01")
        b.close()
        with pytest.raises(mcwire.WireError, match="closed"):
            mcwire.read_frame(a)


def test_data_header_and_status_bytes():
    # src/transport/tcp_transport/tcp_transport_session_impl.h SessionHeader
    # {u64 size; u64 addr; u8 opcode} = 24 bytes, size and addr htole64;
    # WRITE = 1 | kOpcodeV2Flag 0x80.
    h = mcwire.HEADER.pack(0x10000, 0x7F0012345678, mcwire.OP_WRITE |
                           mcwire.OP_V2)
    assert h == (b"\x00\x00\x01\x00\x00\x00\x00\x00"
                 b"\x78\x56\x34\x12\x00\x7f\x00\x00"
                 b"\x81" + b"\x00" * 7)
    # kStatusOk = "MCTV" << 32, kStatusAddrRejected = kStatusOk | 1, htole64.
    assert mcwire.STATUS.pack(mcwire.STATUS_OK) == b"\x00\x00\x00\x00VTCM"
    assert mcwire.STATUS.pack(mcwire.STATUS_ADDR_REJECTED) == \
        b"\x01\x00\x00\x00VTCM"


def test_segment_descriptor():
    # src/transfer_metadata.cpp encodeSegmentDesc ("tcp") / decodeSegmentDesc.
    d = mcwire.encode_segment("127.0.0.1:15001", 16002, [(4096, 100)])
    assert set(d) == {"name", "protocol", "tcp_data_port",
                      "tcp_proto_version", "timestamp", "buffers"}
    assert d["buffers"] == [{"name": "127.0.0.1:15001", "addr": 4096,
                             "length": 100}]
    body = mcwire.json_body(d)
    # Json::FastWriter: compact, sorted keys, a newline at the end.
    assert body.endswith(b"\n") and b'": ' not in body
    assert body.index(b'"buffers"') < body.index(b'"name"')
    back = mcwire.decode_segment(json.loads(body))
    assert back["tcp_proto_version"] == 2 and back["buffers"] == [(4096, 100)]
    # A missing tcp_proto_version is version 1; a buffer with no name, a zero
    # address or a zero length refuses the whole descriptor.
    del d["tcp_proto_version"]
    assert mcwire.decode_segment(d)["tcp_proto_version"] == 1
    for bad in ({"name": ""}, {"addr": 0}, {"length": 0}):
        e = dict(d, buffers=[dict(d["buffers"][0], **bad)])
        with pytest.raises(mcwire.WireError, match="corrupted"):
            mcwire.decode_segment(e)


def test_session_names():
    # include/common.h parseHostNameWithPort / buildHostNameWithPort.
    assert mcwire.parse_session("10.0.0.2:15001") == ("10.0.0.2", 15001)
    assert mcwire.parse_session("[::1]:15001") == ("::1", 15001)
    assert mcwire.session_name("::1", 7) == "[::1]:7"
    for bad in ("host", "::1", "[::1]", "h:0", "h:x"):
        with pytest.raises(mcwire.WireError):
            mcwire.parse_session(bad)


# ------------------------------------------------------ the receiver

@pytest.fixture
def receiver():
    r = ref_consumer.Receiver("127.0.0.1")
    yield r
    r.close()


def raw_request(port, header, body=b"", timeout=5):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(header + body)
        try:
            return mcwire.recv_exact(s, 8)
        except (mcwire.WireError, OSError):
            return None


def test_receiver_handshake_and_write(receiver):
    buf = np.zeros(1000, dtype=np.uint8)
    receiver.register(buf)
    desc = mcwire.fetch_segment(receiver.session, {"name": "x"}, 5)
    assert desc["buffers"] == [(buf.ctypes.data, 1000)]
    assert desc["tcp_proto_version"] == 2
    host, _ = mcwire.parse_session(desc["name"])
    assert mcwire.write(host, desc["tcp_data_port"], 2, b"\x07" * 10,
                        buf.ctypes.data + 990, 5) is None
    assert buf[990:].tolist() == [7] * 10 and not buf[:990].any()
    # src/transport/tcp_transport/tcp_transport.cpp validateTcpAddress: past
    # the buffer's end, size 0 and a size of 2^63 are rejected with
    # kStatusAddrRejected (v2) and nothing is written.
    rej = mcwire.STATUS.pack(mcwire.STATUS_ADDR_REJECTED)
    p = receiver.data.port
    op = mcwire.OP_WRITE | mcwire.OP_V2
    assert raw_request(p, mcwire.HEADER.pack(11, buf.ctypes.data + 990, op),
                       b"\x09" * 11) == rej
    assert raw_request(p, mcwire.HEADER.pack(0, buf.ctypes.data, op)) == rej
    assert raw_request(p, mcwire.HEADER.pack(1 << 63, buf.ctypes.data,
                                             op)) == rej
    assert mcwire.write(host, desc["tcp_data_port"], 2, b"\x01", 8, 5) == \
        "write rejected by the receiver, status 1"
    assert buf[990:].tolist() == [7] * 10 and not buf[:990].any()
    assert receiver.stats()["rejected"] == 4
    assert receiver.stats()["writes"] == 1
    # Probe and notify (src/transfer_metadata.cpp receivePeerProbe,
    # receivePeerNotify); garbage JSON is dropped and the server lives on.
    for ftype, want in ((mcwire.HS_PROBE, {"status": "success"}),
                        (mcwire.HS_NOTIFY, {"name": "",
                                            "notify_msg": "success"})):
        with socket.create_connection(("127.0.0.1", receiver.hs.port),
                                      timeout=5) as s:
            s.sendall(mcwire.encode_frame(ftype, b"{}\n"))
            t, body = mcwire.read_frame(s)
        assert t == ftype and json.loads(body) == want
    with socket.create_connection(("127.0.0.1", receiver.hs.port),
                                  timeout=5) as s:
        s.sendall(mcwire.encode_frame(mcwire.HS_METADATA, b"{nope"))
        assert s.recv(1) == b""
    assert mcwire.fetch_segment(receiver.session, {}, 5)["buffers"]


# ------------------------------------------- the two peers, as processes

def start_producer(tmp_path, *specs, seed="7"):
    ready = tmp_path / "ready.json"
    err = open(tmp_path / "producer.err", "w")
    p = subprocess.Popen([PY, os.path.join(HERE, "ref_producer.py"),
                          "--seed", seed, "--ready-file", str(ready),
                          "--max-seconds", "120", *specs],
                         stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail("ref_producer did not start: " +
                        (tmp_path / "producer.err").read_text())
        time.sleep(0.05)
    return p, json.loads(ready.read_text())


@pytest.fixture
def producer(tmp_path):
    p, info = start_producer(tmp_path, *ITEMS)
    yield info
    p.terminate()
    try:
        assert p.wait(10) == 0
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def consume(info, *args):
    r = subprocess.run([PY, os.path.join(HERE, "ref_consumer.py"),
                        "--registry", info["registry"], "--timeout", "20",
                        *args], capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(r.stdout), r.stderr


def test_consumer_loads_from_producer(producer, tmp_path):
    ids = [s.split(":")[0] for s in ITEMS]
    rc, out, err = consume(producer, "--seed", "7", *ids)
    assert rc == 0, (out, err)
    assert [r["bytes_ok"] for r in out["items"]] == [True] * len(ids)
    assert all(r["reply"] == {"ok": True, "mooncake_ret": 0}
               for r in out["items"])
    assert out["receiver"]["writes"] == len(ids)
    assert out["receiver"]["rejected"] == 0
    # The same bytes checked as a file and as a hash.
    f = tmp_path / "a.bin"
    f.write_bytes(items.item_bytes("7", "a", 16384))
    import hashlib
    h = hashlib.sha256(items.item_bytes("7", "odd", 210)).hexdigest()
    rc, out, err = consume(producer, "--file", f"a={f}", "--sha256",
                           f"odd={h}", "a", "odd")
    assert rc == 0 and [r["checked"] for r in out["items"]] == \
        ["file", "sha256"], (out, err)


def test_consumer_check_can_fail(producer):
    # Another seed: the bytes arrive and the check says they differ.
    rc, out, _ = consume(producer, "--seed", "8", "a", "missing")
    assert rc == 1
    a, missing = out["items"]
    assert a["reply"]["ok"] and a["bytes_ok"] is False
    assert a["error"] == "bytes differ from offset 0"
    assert missing == dict(missing, found=False, error="not in the registry")


def req(info, msg, timeout=10):
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.RCVTIMEO, timeout * 1000)
    s.connect(info["producer_zmq"])
    try:
        if isinstance(msg, bytes):
            s.send(msg)
        else:
            s.send_json(msg)
        return s.recv_json()
    finally:
        s.close(linger=0)
        ctx.term()


def test_producer_replies_as_the_reference(producer, receiver):
    buf = np.zeros(16384, dtype=np.uint8)
    receiver.register(buf)
    ok = {"op": "pull", "mm_hash": "a", "dst_session": receiver.session,
          "dst_ptr": buf.ctypes.data, "nbytes": 16384}
    assert req(producer, {"op": "hello"}) == {"ok": False,
                                              "err": "unknown op"}
    assert req(producer, dict(ok, mm_hash="zz")) == \
        {"ok": False, "err": "unknown mm_hash"}
    assert req(producer, dict(ok, nbytes=16383)) == \
        {"ok": False, "err": "size mismatch"}
    # The reference answers str(exception) for a missing field.
    bad = dict(ok)
    del bad["dst_ptr"]
    assert req(producer, bad) == {"ok": False, "err": "'dst_ptr'"}
    assert req(producer, b"{not json")["ok"] is False
    # Outside the consumer's buffers: the receiver rejects, the write fails
    # (mooncake_ret -1) and nothing is written.
    assert req(producer, dict(ok, dst_ptr=buf.ctypes.data + 1)) == \
        {"ok": False, "mooncake_ret": -1}
    assert not buf.any() and receiver.stats()["rejected"] == 1
    assert req(producer, ok) == {"ok": True, "mooncake_ret": 0}
    assert buf.tobytes() == items.item_bytes("7", "a", 16384)


def test_producer_registry_shapes(producer):
    import urllib.error
    import urllib.request
    url = producer["registry"]
    with urllib.request.urlopen(url + "/ec/info/odd", timeout=5) as r:
        assert json.loads(r.read()) == {
            "nbytes": 210, "shape": [3, 5, 7], "dtype": "int16",
            "producer_zmq": producer["producer_zmq"]}
    for path, method, code, detail in (
            ("/ec/info/zz", "GET", 404, "unknown mm_hash"),
            ("/ec/lookup", "POST", 404, "Not Found"),
            ("/ec/info/a", "PUT", 405, "Method Not Allowed")):
        rq = urllib.request.Request(url + path, method=method, data=b"{}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(rq, timeout=5)
        assert e.value.code == code
        assert json.loads(e.value.read()) == {"detail": detail}
