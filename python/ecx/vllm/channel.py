"""The step channel between a consumer's scheduler connector and its
worker connectors, which vLLM runs in different processes: sockets in a
directory only this user can enter, named from vLLM's engine_id and the
data-parallel rank (vLLM hands its workers the scheduler's config, so both
sides derive the same names).

- starts, scheduler PUB -> every worker's SUB (ZeroMQ over ipc://): the
  pulls to start, sent the moment ensure_cache_available has looked the
  items up, so every rank starts them without waiting for the step's
  metadata;
- news, every worker -> the scheduler's datagram socket (AF_UNIX,
  SOCK_DGRAM): one message per pull the moment it ends, sent by libecx's
  own thread (ecx_consumer_load_notify), never by a thread of Python's:
  the worker's tag (its rank, the pull's (id, attempt) pairs), then each
  item's status. The scheduler learns an item landed without waiting for
  the step's report, and without a Python thread of the worker having to
  win its GIL first.

Both are a fast path beside the step's metadata, which still carries every
start and every report: a message lost (a worker not subscribed yet, a
worker on another host, where these sockets do not reach, a full queue)
costs a step or two, never an item. Tags are JSON, never pickles: a peer
that can connect can at most make a worker pull an item or the scheduler
count an item landed early (or failed), and the directory's mode keeps
other users out."""
import array
import collections
import hashlib
import json
import logging
import os
import select
import socket
import stat
import struct
import tempfile
import threading

import zmq

from ecx.errors import error, strerror

logger = logging.getLogger("ecx.vllm")

_HWM = 100000
_FIELDS = ("mm_hash", "nbytes", "shape", "dtype", "producer_zmq", "epoch",
           "attempt")


def _directory():
    d = os.environ.get("ECX_VLLM_IPC_DIR") or os.path.join(
        tempfile.gettempdir(), f"ecx-vllm-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or \
            st.st_mode & 0o077:
        raise OSError(f"{d} is not a directory of this user's alone "
                      f"(mode 0700)")
    return d


def endpoints(engine_id, dp_rank):
    """(starts ipc:// endpoint, news socket path) of one engine's
    data-parallel rank, or None where there is no engine_id to name them
    by."""
    if not engine_id:
        return None
    key = hashlib.sha256(f"{engine_id}/{dp_rank}".encode()).hexdigest()[:24]
    d = _directory()
    return (f"ipc://{d}/{key}.go", f"{d}/{key}.nw")


_MAGIC = b"ecx1"
# The bounds of one news message: libecx takes a tag of at most
# NOTIFY_MSG_MAX bytes (ecx_consumer_load_notify, ECX_EINVAL above it) and
# appends 4 bytes of status per id; the scheduler reads a datagram of at
# most _NEWS_MAX bytes (the rest of a longer one is cut off). A pull of
# more ids than one message names is started in pieces (news_pieces).
NOTIFY_MSG_MAX = 65536
_NEWS_MAX = 1 << 17
_NEWS_SNDBUF = 1 << 20


def news_tag(rank, pairs):
    """A worker's tag of one pull's news: the magic, the JSON's length,
    then {"rank", "ids": [[id, attempt], ...]} (libecx appends a status
    per id)."""
    j = json.dumps({"rank": rank, "ids": [list(p) for p in pairs]}).encode()
    return _MAGIC + struct.pack("<I", len(j)) + j


def news_pieces(rank, pairs):
    """pairs, in order, cut into lists whose news messages (news_tag and
    a status per id) each fit the bounds above; one list where they all
    fit."""
    def size(p):
        return len(json.dumps(list(p))) + 2  # and its ", "
    base = len(news_tag(rank, []))
    pieces, cur, used = [], [], base
    for p in pairs:
        n = size(p)
        if cur and (used + n > NOTIFY_MSG_MAX or
                    used + n + 4 * (len(cur) + 1) > _NEWS_MAX):
            pieces.append(cur)
            cur, used = [], base
        cur.append(p)
        used += n
    if cur or not pieces:
        pieces.append(cur)
    return pieces


def parse_news(data):
    """(rank, held, failed) of one news message: held (id, attempt) pairs,
    failed (id, attempt, why) triples. Raises ValueError."""
    if data[:4] != _MAGIC or len(data) < 8:
        raise ValueError("no ecx news")
    (n,) = struct.unpack("<I", data[4:8])
    m = json.loads(data[8:8 + n])
    ids = [(str(h), int(a)) for h, a in m["ids"]]
    st = array.array("i")
    st.frombytes(data[8 + n:])
    if len(st) != len(ids):
        raise ValueError(f"{len(ids)} ids, {len(st)} statuses")
    held = [p for p, s in zip(ids, st) if s == 0]
    failed = [(h, a, _why(s)) for (h, a), s in zip(ids, st) if s != 0]
    return int(m["rank"]), held, failed


def _why(status):
    return str(error(status, strerror(status)))


def engine_key(vllm_config):
    """(engine_id, data-parallel rank) of vllm_config."""
    ec = vllm_config.ec_transfer_config
    pc = getattr(vllm_config, "parallel_config", None)
    return (getattr(ec, "engine_id", None),
            int(getattr(pc, "data_parallel_rank", 0) or 0))


def spec_to_wire(s):
    d = {f: getattr(s, f) for f in _FIELDS}
    d["shape"] = list(d["shape"])
    return d


def spec_from_wire(d, cls):
    return cls(mm_hash=str(d["mm_hash"]), num_token=0,
               nbytes=int(d["nbytes"]),
               shape=tuple(int(x) for x in d["shape"]),
               dtype=str(d["dtype"]), producer_zmq=str(d["producer_zmq"]),
               epoch=int(d["epoch"]), attempt=int(d["attempt"]))


class SchedulerChannel:
    """The scheduler's end: binds both sockets (a stale socket file of an
    earlier run is replaced). A thread of its own takes the news off the
    socket as it comes: the socket queues at most net.unix.max_dgram_qlen
    unread messages (10 by default) from every rank together, and libecx
    drops what does not fit (it never blocks to send), so news left there
    for a whole step (a step's pulls from several producers times the
    ranks) was lost and came a step later in the workers' report. The
    thread blocks in poll() and takes what came once it has the
    interpreter's lock, which a scheduler thread in a long call that
    keeps it (pickling a large output) can delay past ten messages: the
    loss is made rarer, not impossible. news() takes what the thread has
    not yet, too."""

    def __init__(self, engine_id, dp_rank):
        eps = endpoints(engine_id, dp_rank)
        if eps is None:
            raise ValueError("no engine_id")
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, _HWM)
            self._pub.bind(eps[0])
            self._news = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except (zmq.ZMQError, OSError):
            self._ctx.destroy(linger=0)
            raise
        try:
            try:
                os.unlink(eps[1])
            except FileNotFoundError:
                pass
            self._news.bind(eps[1])
            self._news.setblocking(False)
        except OSError:
            self._news.close()
            self._ctx.destroy(linger=0)
            raise
        self._paths = [eps[0][len("ipc://"):], eps[1]]
        self._raw = collections.deque()  # messages taken, not yet parsed
        self._cv = threading.Condition(threading.Lock())
        self._stop_r, self._stop_w = os.pipe()
        self._closed = False
        self._pid = os.getpid()
        self._drainer = threading.Thread(target=self._drain, daemon=True,
                                         name="ecx-news")
        self._drainer.start()

    def _take(self):
        """Moves every message waiting on the socket to _raw (with _cv's
        lock held); True when one was."""
        took = False
        while True:
            try:
                self._raw.append(self._news.recv(_NEWS_MAX))
                took = True
            except (BlockingIOError, InterruptedError):
                return took
            except OSError as e:  # the socket closed under us, or worse
                logger.debug("ECXConnector: news socket: %s", e)
                return took

    def _drain(self):
        # poll, not select: descriptors above 1024 (vLLM raises its
        # limit) are out of select's range.
        p = select.poll()
        p.register(self._news, select.POLLIN)
        p.register(self._stop_r, select.POLLIN)
        while True:
            try:
                ready = {fd for fd, _ in p.poll()}
            except InterruptedError:
                continue
            except (OSError, ValueError) as e:
                logger.warning("ECXConnector: the news reader stopped "
                               "(%s): news waits on the socket for the "
                               "scheduler's hooks again", e)
                return
            if self._stop_r in ready:
                return
            with self._cv:
                if self._closed:
                    return
                if self._take():
                    self._cv.notify_all()

    def send_starts(self, specs) -> None:
        """Tells every worker to start these pulls now (never blocks)."""
        try:
            self._pub.send(json.dumps(
                {"starts": [spec_to_wire(s) for s in specs]}).encode(),
                zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("ECXConnector: starts not sent: %s", e)

    def news(self, timeout_s=0.0):
        """The workers' news received so far, as (rank, held, failed)
        triples: held a list of (id, attempt), failed of (id, attempt,
        why). With timeout_s, waits that long for the first if none has
        come."""
        with self._cv:
            self._take()
            if not self._raw and timeout_s > 0:
                self._cv.wait_for(lambda: self._take() or self._raw,
                                  timeout_s)
            raws, self._raw = list(self._raw), collections.deque()
        out = []
        for raw in raws:
            try:
                out.append(parse_news(raw))
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("ECXConnector: dropping malformed worker "
                               "news: %s", e)
        return out

    def close(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child's copy: the parent's to close
        with self._cv:
            if self._closed:
                return
            self._closed = True
        os.write(self._stop_w, b"x")
        self._drainer.join(5.0)
        if not self._drainer.is_alive():  # else it may still poll them
            os.close(self._stop_r)
            os.close(self._stop_w)
        self._ctx.destroy(linger=0)
        self._news.close()
        for p in self._paths:
            try:
                os.unlink(p)
            except OSError:
                pass


class WorkerChannel:
    """A worker's end: connects the starts socket and hands each start
    message to on_starts from a thread of its own; its news socket is
    connected at the first pull (the scheduler binds it after the workers
    start) and given to libecx, which sends each pull's news itself."""

    def __init__(self, engine_id, dp_rank, rank, on_starts, spec_cls):
        eps = endpoints(engine_id, dp_rank)
        if eps is None:
            raise ValueError("no engine_id")
        self._rank = rank
        self._on_starts = on_starts
        self._spec_cls = spec_cls
        self._ctx = zmq.Context()
        # vLLM makes its workers before its scheduler: they connect first
        # and retry every 20 ms (ZeroMQ's default is 100) until it binds.
        self._ctx.setsockopt(zmq.RECONNECT_IVL, 20)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, _HWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(eps[0])
        self._news_path = eps[1]
        self._news = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._news.setblocking(False)
        # A datagram not yet read counts against its sender's buffer:
        # with the default (208 KiB) a pull in five pieces lost its last
        # piece's news until the scheduler read (the kernel doubles what
        # is asked, up to net.core.wmem_max). The scheduler's socket also
        # queues at most net.unix.max_dgram_qlen unread datagrams, which
        # its channel's thread takes off as they come (SchedulerChannel).
        try:
            self._news.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                  _NEWS_SNDBUF)
        except OSError as e:
            logger.debug("ECXConnector: news socket's buffer: %s", e)
        self._connected = False
        self._news_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ecx-starts")
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                if not self._sub.poll(100):
                    continue
                raw = self._sub.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop:
                    return
                continue
            try:
                specs = [spec_from_wire(d, self._spec_cls)
                         for d in json.loads(raw)["starts"]]
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("ECXConnector: dropping a malformed start "
                               "message: %s", e)
                continue
            try:
                self._on_starts(specs)
            except Exception:  # noqa: BLE001 - the metadata starts them
                logger.exception("ECXConnector: starting pulls failed")

    def pieces(self, pairs):
        """pairs cut into the pieces a pull each (news_pieces): one
        pull's news is one message, and a message is bounded."""
        return news_pieces(self._rank, pairs)

    def notify(self, pairs):
        """(socket, tag) for a pull of these (id, attempt) pairs (at most
        a piece of pieces()): libecx sends the tag and the statuses on
        the socket when the pull ends; (None, b"") while the scheduler's
        socket cannot be reached."""
        with self._news_lock:
            if not self._connected:
                try:
                    self._news.connect(self._news_path)
                    self._connected = True
                except OSError as e:
                    logger.debug("ECXConnector: no news socket yet: %s", e)
                    return None, b""
        return self._news, news_tag(self._rank, pairs)

    def send_failed(self, failed) -> None:
        """Tells the scheduler of pulls that could not start ({(id,
        attempt): ecx status}); never blocks."""
        if not failed:
            return
        for piece in self.pieces(list(failed)):
            sock, tag = self.notify(piece)
            if sock is None:
                return
            st = array.array("i", [failed[p] for p in piece])
            try:
                sock.send(tag + st.tobytes())
            except OSError as e:
                logger.debug("ECXConnector: news not sent: %s", e)

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self._ctx.destroy(linger=0)
        self._news.close()  # libecx sends on duplicates of its own
