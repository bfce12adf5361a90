"""Pushes over Mooncake's TCP wire against raw TCP, same run.

For each size (64 KiB, 1 MiB, 7 MiB; SIZES=bytes,bytes,... for others):
an ecx Producer in this process holds the item; an ecx Consumer's receive
arena behind a ControlShard (ArenaPool), in a process of its own (the
consumer side, as a prefill is), gives a reservation. Per size, a line of
baselines:
  tcp    raw TCP to the same consumer process: n bytes sent, received in
         full into a preallocated buffer, one byte back (Python sockets),
         median of N;
  write  Producer.push into a reservation of its own, made beforehand
         and abandoned after (untimed): one acknowledged Mooncake WRITE
         from the C writer into the C receiver, into a window not hashed
         (as the connector's default push), median of N;
  8x     eight writes of the item one after another (Producer.push) and
         as one Producer.push_batch (up to four in flight), all into one
         reservation (a window not hashed);
  floor  the write, then one round trip of a complete_batch frame
         (pyzmq REQ, as the Pusher's) to ecx-bench-zmq-echo, a C REP
         server beside the shard that only answers (bench/zmq_echo.c):
         the least a push on upstream's wire can take here with no
         control work at the far end, median of N (skipped, and said,
         where the program is not built: ECX_ZMQ_ECHO, else
         bench/ecx-bench-zmq-echo beside ECX_LIBRARY);
then a line per kind of push, each with two times, medians of N: `push`,
until Pusher.push returns (what the encoder waits for), and `ready`,
until the item's ready event is heard here (what the consumer's
scheduler waits for; a thread of this process that only reads the
shard's event socket and notes the time):
  push    the whole push through ecx.vllm.push.pusher (reserve, write,
          complete_batch) of a fresh transfer_id each time, as the
          connector makes it by default (no hash, as pulls);
  bound   the same push reserved beforehand (untimed): the write and the
          complete_batch, what follows the encoder's output being bound
          (the connector reserves when the step plans the item,
          pushflow/pushes.py);
  bound-i the bound push with the connector's integrity key on: the
          item's XXH3 made at put by a Producer(integrity=True) (untimed,
          as the put is), the reserve asking for a hashed window (the
          consumer's receiver hashes the bytes as they land) and the
          complete carrying the hash, which the consumer checks;
  bound-p the bound push with the hash made at the push (a Producer
          without integrity, Pusher(send_hash=True): the encoder hashes
          the item beside its write), as every push did before the hash
          followed the integrity key.
The write, floor, tcp and push rows are interleaved, one of each in turn, so
drift on a shared machine falls on all of them alike. Ratios are
tcp_time / ecx_time (1.0: as fast as raw TCP).

On loopback:
  PYTHONPATH=python ECX_LIBRARY=build/libecx.so /usr/bin/python3 bench/push_mooncake.py
Across two hosts (bench/two_hosts.sh runs it so with PUSH=1: the consumer
side in namespace B, this process in A):
  bench/push_mooncake.py --consumer-wrap 'CMD' --consumer-host ADDR \
      --producer-host ADDR
where CMD (split on spaces) starts the consumer side where it should run,
and each ADDR is an IP address (v4 or v6) of the side it names.
Environment: SIZES (bytes, comma-separated), N (repetitions, default
40), ECX_LIBRARY (libecx.so), ECX_ZMQ_ECHO (ecx-bench-zmq-echo).
"""
import argparse
import json
import os
import struct
import subprocess
import socket
import statistics
import sys
import threading
import time
import uuid

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))

import pushkit  # noqa: E402,F401  (the vllm stub on sys.path)
import ecx  # noqa: E402
from ecx.vllm.push import ArenaPool, ControlShard  # noqa: E402
from ecx.vllm.push.pusher import PushSpec, Pusher  # noqa: E402
from benchkit import put_random, uptime  # noqa: E402

SIZES = [int(x) for x in os.environ.get(
    "SIZES", f"{64 << 10},{1 << 20},{7 << 20}").split(",")]
N = int(os.environ.get("N", "40"))


def tcp_sink(ls):
    """The raw TCP baseline's receiving end (in the consumer side): per
    connection a header (n, reps), then reps times n bytes received in full
    into one buffer and a byte back."""
    while True:
        try:
            c, _ = ls.accept()
        except OSError:
            return
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        n, reps = struct.unpack("<QQ", c.recv(16, socket.MSG_WAITALL))
        view = memoryview(bytearray(n))
        for _ in range(reps):
            got = 0
            while got < n:
                got += c.recv_into(view[got:], n - got)
            c.sendall(b"k")
        c.close()


def echo_path():
    """ecx-bench-zmq-echo's path, or None where it is not built."""
    path, lib = os.environ.get("ECX_ZMQ_ECHO"), os.environ.get("ECX_LIBRARY")
    if not path and lib:
        path = os.path.join(os.path.dirname(os.path.realpath(lib)), "bench",
                            "ecx-bench-zmq-echo")
    return path if path and os.access(path, os.X_OK) else None


def consumer_side(host):
    """Runs a ControlShard over a Consumer's receive arena, the raw TCP
    sink and ecx-bench-zmq-echo (where built), all on host; prints their
    addresses as one JSON line; serves until stdin closes."""
    import random
    cons = ecx.Consumer(None, recv_capacity=32 << 20, mooncake_host=host)
    pool = ArenaPool(cons)
    for _ in range(50):
        try:
            shard = ControlShard(pool, ec_ip=host,
                                 ec_port=random.randint(20000, 60000))
            shard.start()
            break
        except RuntimeError as e:
            if "in use" not in str(e):  # not a port taken: the host
                sys.exit(f"push_mooncake.py: the consumer side: {e}")
    else:
        sys.exit("push_mooncake.py: the consumer side: no free control "
                 "port in 50 tries")
    ls = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    ls.bind((host, 0))
    ls.listen(1)
    threading.Thread(target=tcp_sink, args=(ls,), daemon=True).start()
    echo, echo_port = None, None
    if echo_path():
        echo = subprocess.Popen([echo_path(), host], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        line = echo.stdout.readline().strip()
        if not line.isdigit():
            sys.exit(f"push_mooncake.py: {echo_path()} could not bind "
                     f"{host}")
        echo_port = int(line)
    print(json.dumps({"endpoint": shard.endpoint,
                      "tcp": [host, ls.getsockname()[1]],
                      "echo": echo_port}), flush=True)
    sys.stdin.read()
    if echo is not None:
        echo.stdin.close()
        echo.wait(10)
    ls.close()
    shard.stop(0)
    cons.close()


class TcpBaseline:
    """A connection to tcp_sink for reps round trips of n bytes, taken one
    at a time (one()), so they interleave with the rows they judge."""

    def __init__(self, addr, n, reps):
        self.s = socket.create_connection(tuple(addr))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.s.sendall(struct.pack("<QQ", n, reps))
        self.data = os.urandom(n)

    def one(self):
        t0 = time.perf_counter()
        self.s.sendall(self.data)
        self.s.recv(1)
        return time.perf_counter() - t0

    def close(self):
        self.s.close()


class ReadyEvents:
    """A thread that reads the shards' event sockets (PULL, as a consumer
    scheduler does) and notes when each ready event came
    (time.perf_counter); wait(transfer_id) returns that time."""

    def __init__(self, endpoint, shards):
        host = endpoint.rsplit(":", 1)[0]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.linger = 0
        self.sock.rcvtimeo = 100
        for _, port in shards:
            self.sock.connect(f"{host}:{port}")
        self.at = {}
        self.cv = threading.Condition()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            try:
                raw = self.sock.recv()
            except zmq.Again:
                continue
            t = time.perf_counter()
            ev = json.loads(raw)
            if ev.get("ready") is True:
                with self.cv:
                    self.at[ev["transfer_id"]] = t
                    self.cv.notify_all()

    def wait(self, tid, timeout_s=10.0):
        with self.cv:
            assert self.cv.wait_for(lambda: tid in self.at, timeout_s), \
                f"{tid}: no ready event within {timeout_s} s"
            return self.at.pop(tid)

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Environment: SIZES=bytes,bytes,... (default 64 KiB, 1 MiB "
        "and 7 MiB), N=repetitions (40), ECX_LIBRARY=libecx.so's path, "
        "ECX_ZMQ_ECHO=ecx-bench-zmq-echo's path (default: bench/ beside "
        "the library). Runs on loopback unless told the hosts.")
    ap.add_argument("--consumer-wrap", default="",
                    help="command (split on spaces) that starts the "
                    "consumer side where it runs (default: none)")
    ap.add_argument("--consumer-host", default="127.0.0.1",
                    help="IP address the consumer side binds (default "
                    "127.0.0.1)")
    ap.add_argument("--producer-host", default="127.0.0.1",
                    help="IP address the producer binds (default "
                    "127.0.0.1)")
    ap.add_argument("--consumer-side", action="store_true",
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.consumer_side:
        return consumer_side(a.consumer_host)
    child = subprocess.Popen(
        a.consumer_wrap.split() + [sys.executable, os.path.abspath(__file__),
                                   "--consumer-side", "--consumer-host",
                                   a.consumer_host],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if not line:  # it said why on its stderr
        sys.exit(f"push_mooncake.py: the consumer side on "
                 f"{a.consumer_host} did not start (exit status "
                 f"{child.wait()})")
    side = json.loads(line)
    endpoint = side["endpoint"]
    prod = ecx.Producer(capacity_bytes=64 << 20, bind_host=a.producer_host,
                        registry_port=0, mooncake=True)
    # Mooncake's wire, not ecx's fetch (bench/push_shm.py)
    prod_i = ecx.Producer(capacity_bytes=64 << 20, bind_host=a.producer_host,
                          registry_port=0, mooncake=True, integrity=True)
    plain = Pusher(prod, control_timeout_s=5.0, fetch=False,
                   send_hash=False)
    kinds = {  # name -> (Pusher, reserved beforehand)
        "push": (plain, False), "bound": (plain, True),
        "bound-i": (Pusher(prod_i, control_timeout_s=5.0, fetch=False),
                    True),
        "bound-p": (Pusher(prod, control_timeout_s=5.0, fetch=False), True)}
    pusher = plain
    events = ReadyEvents(endpoint, pusher.shards(endpoint))
    zctx = zmq.Context()
    echo = None
    if side["echo"] is not None:
        echo = zctx.socket(zmq.REQ)
        echo.linger = 0
        echo.rcvtimeo = echo.sndtimeo = 5000
        echo.setsockopt(zmq.IPV6, 1)
        echo.connect(f"{endpoint.rsplit(':', 1)[0]}:{side['echo']}")
    print(f"# {uptime()}; producer "
          f"{a.producer_host}, consumer {a.consumer_host}")
    if echo is None:
        print("# floor: skipped, ecx-bench-zmq-echo is not built (make "
              "build; or ECX_ZMQ_ECHO=its path)")
    for n in SIZES:
        mm = put_random(prod, f"bench{n}", n)
        put_random(prod_i, f"bench{n}", n)  # the same id, in prod_i
        spec = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
        assert pusher.reserve(endpoint, [spec]) == [spec]
        r = next(iter(spec.shards.values()))
        seq, par = [], []
        eight = [(mm, r["dst_session"], r["dst_ptr"], n)] * 8
        for _ in range(max(5, N // 4)):
            t0 = time.perf_counter()
            for e in eight:
                prod.push(*e)
            seq.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert prod.push_batch(eight) == [0] * 8
            par.append(time.perf_counter() - t0)
        pusher.abandon(endpoint, [spec])

        def timed_push(via, reserved):
            """One push of a fresh transfer_id (reserved beforehand,
            untimed, or not), abandoned after its ready event; its
            seconds until push returned and until that event."""
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            if reserved:
                assert via.reserve(endpoint, [s]) == [s], s.error
            t0 = time.perf_counter()
            assert via.push(endpoint, [s]) == [], s.error
            took = time.perf_counter() - t0
            ready = events.wait(s.transfer_id) - t0
            via.abandon(endpoint, [s])
            return took, ready

        def timed_write():
            """One Producer.push into a fresh reservation (made before and
            abandoned after, untimed); its seconds."""
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            assert pusher.reserve(endpoint, [s]) == [s], s.error
            d = next(iter(s.shards.values()))
            t0 = time.perf_counter()
            prod.push(mm, d["dst_session"], d["dst_ptr"], n)
            took = time.perf_counter() - t0
            pusher.abandon(endpoint, [s])
            return took

        def timed_floor():
            """One write into a fresh reservation (made before and
            abandoned after, untimed), then one complete_batch frame's
            round trip to the echo; its seconds."""
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            assert pusher.reserve(endpoint, [s]) == [s], s.error
            d = next(iter(s.shards.values()))
            frame = json.dumps({"op": "complete_batch", "items": [{
                "transfer_id": s.transfer_id,
                "reservation_id": d["reservation_id"]}]},
                separators=(",", ":")).encode()
            t0 = time.perf_counter()
            prod.push(mm, d["dst_session"], d["dst_ptr"], n)
            echo.send(frame)
            echo.recv()
            took = time.perf_counter() - t0
            pusher.abandon(endpoint, [s])
            return took

        base = TcpBaseline(side["tcp"], n, N)
        w, f, t = [], [], []
        got = {k: [] for k in kinds}
        for _ in range(N):  # interleaved
            w.append(timed_write())
            if echo is not None:
                f.append(timed_floor())
            for k, kind in kinds.items():
                got[k].append(timed_push(*kind))
            t.append(base.one())
        base.close()
        tcp, wm = statistics.median(t), statistics.median(w)
        floor = ""
        if f:
            fm = statistics.median(f)
            floor = f", floor {fm * 1e3:.3f} ms (tcp/floor {tcp / fm:.2f}x)"
        print(f"{n >> 10} KiB: tcp {tcp * 1e3:.3f} ms, write "
              f"{wm * 1e3:.3f} ms (tcp/write {tcp / wm:.2f}x){floor}, 8x "
              f"{statistics.median(seq) * 1e3:.3f} ms one by one, "
              f"{statistics.median(par) * 1e3:.3f} ms as a batch")
        print("  kind     push_ms  ready_ms  tcp/push  tcp/ready")
        for k, rows in got.items():
            pm = statistics.median(x for x, _ in rows)
            rm = statistics.median(y for _, y in rows)
            print(f"  {k:<7} {pm * 1e3:8.3f} {rm * 1e3:9.3f} "
                  f"{tcp / pm:8.2f}x {tcp / rm:9.2f}x", flush=True)
    events.close()
    if echo is not None:
        echo.close(0)
    zctx.term()
    for via in {id(v): v for v, _ in kinds.values()}.values():
        via.close()
    prod_i.close()
    prod.close()
    child.stdin.close()
    child.wait(30)


if __name__ == "__main__":
    main()
