"""Mooncake TransferEngine's TCP wire, as its own source defines it.

A small, independent implementation for the interop peers in this folder
(ref_consumer.py, ref_producer.py). It is written from Mooncake's source
(kvcache-ai/Mooncake, mooncake-transfer-engine/) and ../../../shared/MOONCAKE.md,
never from ecx's code. Every wire detail names the Mooncake file (and
function) it follows. Paths below are relative to mooncake-transfer-engine/.

What is here:
  - handshake frames (include/common.h writeString/readString),
  - the TCP segment descriptor (src/transfer_metadata.cpp encodeSegmentDesc/
    decodeSegmentDesc),
  - session names host:port (include/common.h parseHostNameWithPort,
    buildHostNameWithPort),
  - a handshake server (src/transfer_metadata_plugin.cpp
    SocketHandShakePlugin::startDaemon) and client (doSendMetadata),
  - the data port's 24-byte header and 8-byte status (src/transport/
    tcp_transport/tcp_transport_session_impl.h SessionHeader, kStatus*),
    a receiver (ServerSession) and a writer (ClientSession, v2 WRITE).

What is not: RDMA queue-pair exchange (handshake type 0 / old protocol),
a metadata server (etcd, HTTP), the connection pool.
"""
import json
import socket
import struct
import threading
import time

# include/common.h enum class HandShakeRequestType.
HS_CONNECTION = 0
HS_METADATA = 1
HS_NOTIFY = 2
HS_PROBE = 3
# include/common.h kDefaultHandshakeMaxLength: readString refuses a longer
# length (and a zero one).
HS_MAX_LENGTH = 1 << 20
# src/transfer_metadata_plugin.cpp startDaemon: SO_RCVTIMEO of 5 s on each
# accepted handshake connection.
HS_RECV_TIMEOUT_S = 5.0

# src/transport/tcp_transport/tcp_transport_session_impl.h struct
# SessionHeader {uint64_t size; uint64_t addr; uint8_t opcode;}: 24 bytes
# with the compiler's padding, written with htole64 on size and addr.
HEADER = struct.Struct("<QQB7x")
assert HEADER.size == 24
# include/transport/transport.h TransferRequest::OpCode {READ, WRITE}.
OP_READ = 0
OP_WRITE = 1
# tcp_transport_session_impl.h kOpcodeV2Flag: acknowledged framing.
OP_V2 = 0x80
# tcp_transport_session_impl.h kStatusMagic ("MCTV" in the high half),
# kStatusOk, kStatusAddrRejected; sent as htole64 (8 bytes).
STATUS_MAGIC = 0x4D435456 << 32
STATUS_OK = STATUS_MAGIC | 0
STATUS_ADDR_REJECTED = STATUS_MAGIC | 1
STATUS = struct.Struct("<Q")
# tcp_transport_session_impl.h getChunkSize: 64 KiB default, the unit the
# receiver reads and writes the body in.
CHUNK = 65536


class WireError(Exception):
    """A frame or descriptor that Mooncake's code would refuse."""


# ---------------------------------------------------------------- frames

def encode_frame(ftype, body):
    """include/common.h writeString: u64 length in native byte order (the
    length counts the type byte), u8 type, then the body."""
    return struct.pack("=Q", len(body) + 1) + bytes([ftype]) + body


def json_body(obj):
    """The JSON text Mooncake's handshake sends: Json::FastWriter{}.write
    (src/transfer_metadata_plugin.cpp startDaemon, doSendMetadata) is
    compact, keys in jsoncpp's (sorted) map order, and ends with '\\n'."""
    return (json.dumps(obj, separators=(",", ":"), sort_keys=True)
            + "\n").encode()


def recv_exact(sock, n):
    """n bytes from sock, or WireError when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"peer closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_frame(sock, max_length=HS_MAX_LENGTH):
    """include/common.h readString: a zero length or one over max_length is
    refused; a first body byte <= HS_PROBE is the type, a larger one is the
    old untyped protocol (returned as type None with the whole body)."""
    (length,) = struct.unpack("=Q", recv_exact(sock, 8))
    if length == 0:
        raise WireError("zero handshake length")
    if length > max_length:
        raise WireError(f"handshake length {length} over {max_length}")
    body = recv_exact(sock, length)
    if body[0] <= HS_PROBE:
        return body[0], body[1:]
    return None, body


# ------------------------------------------------------- session names

def parse_session(name):
    """include/common.h parseHostNameWithPort: '[v6]:port', 'host:port' (the
    last colon splits). Mooncake falls back to its default handshake port
    when none is given; these peers always need an explicit one."""
    if name.startswith("["):
        end = name.find("]")
        if end < 0 or name[end + 1:end + 2] != ":":
            raise WireError(f"session {name!r}: no port")
        host, port = name[1:end], name[end + 2:]
    else:
        if name.count(":") != 1:
            raise WireError(f"session {name!r}: not host:port")
        host, port = name.rsplit(":", 1)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError(f"session {name!r}: bad port")
    return host, int(port)


def session_name(host, port):
    """include/common.h buildHostNameWithPort: maybeWrapIpV6(host):port."""
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


# --------------------------------------------------------- descriptors

def timestamp():
    """include/common.h getCurrentDateTime: local time
    'YYYY-MM-DD HH:MM:SS.uuuuuu'."""
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + \
        ".%06d" % int((now % 1) * 1e6)


def encode_segment(name, data_port, buffers):
    """src/transfer_metadata.cpp encodeSegmentDesc, protocol "tcp": name,
    protocol, tcp_data_port, tcp_proto_version (2: src/transport/
    tcp_transport/tcp_transport.cpp allocateLocalSegmentID), timestamp and
    buffers [{name, addr, length}]; buffers (list of (addr, length)) are
    named after the segment (tcp_transport.cpp registerLocalMemory)."""
    return {
        "name": name,
        "protocol": "tcp",
        "tcp_data_port": data_port,
        "tcp_proto_version": 2,
        "timestamp": timestamp(),
        "buffers": [{"name": name, "addr": a, "length": n}
                    for a, n in buffers],
    }


def decode_segment(obj):
    """src/transfer_metadata.cpp decodeSegmentDesc, protocol "tcp": a buffer
    with an empty name or a zero addr or length refuses the whole
    descriptor; a missing tcp_proto_version is version 1."""
    if not isinstance(obj, dict):
        raise WireError("segment descriptor is not an object")
    desc = {
        "name": str(obj.get("name", "")),
        "protocol": str(obj.get("protocol", "")),
        "tcp_data_port": int(obj.get("tcp_data_port", 0)),
        "tcp_proto_version": int(obj.get("tcp_proto_version", 1)),
        "buffers": [],
    }
    if desc["protocol"] != "tcp":
        raise WireError(f"segment protocol {desc['protocol']!r}, not tcp")
    for b in obj.get("buffers", []) or []:
        name, addr, length = (str(b.get("name", "")), int(b.get("addr", 0)),
                              int(b.get("length", 0)))
        if not name or not addr or not length:
            raise WireError("corrupted segment descriptor (a buffer with no "
                            "name, address or length)")
        desc["buffers"].append((addr, length))
    return desc


# ---------------------------------------------------- handshake server

class HandshakeServer:
    """src/transfer_metadata_plugin.cpp SocketHandShakePlugin::startDaemon:
    one connection at a time, one request per connection, 5 s receive
    timeout; answers metadata (src/transfer_metadata.cpp
    receivePeerMetadata: the local segment), probe (receivePeerProbe:
    {"status":"success"}) and notify (receivePeerNotify:
    {"name":"","notify_msg":"success"}), writes the answer in a frame of the
    request's type, shuts its write side down and waits for the client to
    close. A bad frame or bad JSON closes the connection unanswered; so does
    a connection (RDMA) request, which TCP peers do not serve.

    describe() returns the segment descriptor (a dict) to answer with."""

    def __init__(self, host, describe):
        self.describe = describe
        self.served = 0
        self.refused = 0
        self._sock = listen(host)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="mc-handshake")
        self._thread.start()

    def close(self):
        self._stop = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _loop(self):
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._serve(conn)
                except (OSError, WireError, ValueError):
                    self.refused += 1

    def _serve(self, conn):
        conn.settimeout(HS_RECV_TIMEOUT_S)
        ftype, body = read_frame(conn)
        json.loads(body.decode() or "null")  # startDaemon: parseJsonString
        if ftype == HS_METADATA:
            reply = self.describe()
        elif ftype == HS_PROBE:
            reply = {"status": "success"}
        elif ftype == HS_NOTIFY:
            reply = {"name": "", "notify_msg": "success"}
        else:
            raise WireError("connection (RDMA) handshake: not served")
        conn.sendall(encode_frame(ftype, json_body(reply)))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the client closes
        self.served += 1


def fetch_segment(session, local_desc, timeout):
    """src/transfer_metadata_plugin.cpp doSendMetadata, as called by
    src/transfer_metadata.cpp getSegmentDesc in P2P mode: connect to the
    session's handshake port, send a metadata frame carrying our own
    segment descriptor, read a metadata frame back, decode it."""
    host, port = parse_session(session)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(encode_frame(HS_METADATA, json_body(local_desc)))
        ftype, body = read_frame(s)
    if ftype != HS_METADATA:
        raise WireError(f"handshake answered with type {ftype}, not metadata")
    return decode_segment(json.loads(body.decode()))


# ------------------------------------------------------------ data port

def listen(host):
    """A listening TCP socket on host, port 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(64)
    return s


class DataServer:
    """src/transport/tcp_transport/tcp_transport_session_impl.h TcpContext
    and ServerSession: each accepted connection (TCP_NODELAY) reads a
    24-byte header; validate(addr, size) (src/transport/tcp_transport/
    tcp_transport.cpp validateTcpAddress) must hold or the request is
    refused: a v2 request gets STATUS_ADDR_REJECTED, then the connection
    closes. A WRITE reads the body into memory (in CHUNK pieces) and, v2,
    answers STATUS_OK once all of it is in place; anything else is READ
    (v2: STATUS_OK, then the bytes). Then the next header on the same
    connection.

    resolve(addr, size) returns a writable memoryview of exactly that range,
    or None when no registered buffer holds it (the validation)."""

    def __init__(self, host, resolve):
        self.resolve = resolve
        self.writes = 0
        self.bytes = 0
        self.rejected = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._sock = listen(host)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._loop, daemon=True,
                         name="mc-data").start()

    def close(self):
        self._stop = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _loop(self):
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._session, args=(conn,),
                             daemon=True, name="mc-session").start()

    def _session(self, conn):
        with conn:
            try:
                while True:
                    try:
                        hdr = recv_exact(conn, HEADER.size)
                    except WireError:
                        return  # the writer closed between requests
                    size, addr, opcode = HEADER.unpack(hdr)
                    v2 = bool(opcode & OP_V2)
                    op = opcode & ~OP_V2
                    view = self.resolve(addr, size) if size else None
                    if view is None:
                        with self._lock:
                            self.rejected += 1
                        if v2:
                            conn.sendall(STATUS.pack(STATUS_ADDR_REJECTED))
                        return
                    if op == OP_WRITE:
                        got = 0
                        while got < size:
                            k = conn.recv_into(view[got:got + CHUNK],
                                               min(CHUNK, size - got))
                            if k == 0:
                                return  # writer stopped mid-body
                            got += k
                        with self._lock:
                            self.writes += 1
                            self.bytes += size
                        if v2:
                            conn.sendall(STATUS.pack(STATUS_OK))
                    else:
                        if v2:
                            conn.sendall(STATUS.pack(STATUS_OK))
                        conn.sendall(view)
                        with self._lock:
                            self.reads += 1
            except OSError:
                return


def write(host, port, version, src, dst_addr, timeout):
    """One WRITE the way src/transport/tcp_transport/tcp_transport.cpp
    startTransfer does it with the connection pool off: a new connection
    (getConnection: TCP_NODELAY) to the data port, the header (opcode WRITE,
    | OP_V2 when the segment advertises tcp_proto_version >= 2), the body,
    and for v2 the 8-byte status (tcp_transport_session_impl.h ClientSession
    readWriteAck: a frame without the magic, or not STATUS_OK, fails).
    src is a bytes-like object. Returns None on success, else why not."""
    v2 = version >= 2
    opcode = OP_WRITE | (OP_V2 if v2 else 0)
    src = memoryview(src).cast("B")
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        return f"cannot connect to the data port {host}:{port}: {e}"
    with s:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_err = None
        try:
            s.sendall(HEADER.pack(len(src), dst_addr, opcode))
            s.sendall(src)
        except OSError as e:
            # ClientSession reads the ack concurrently with the body: an
            # early rejection may be waiting in the socket.
            send_err = e
        if not v2:
            return None if send_err is None else f"send failed: {send_err}"
        try:
            (frame,) = STATUS.unpack(recv_exact(s, STATUS.size))
        except (OSError, WireError) as e:
            return f"no status frame: {send_err or e}"
    if frame & 0xFFFFFFFF00000000 != STATUS_MAGIC:
        return f"malformed status frame {frame:#x}"
    if frame != STATUS_OK:
        return f"write rejected by the receiver, status {frame & 0xFFFFFFFF}"
    return None
