"""Pushes over Mooncake's TCP wire on loopback against raw TCP, same run.

For each size (64 KiB, 1 MiB, 7 MiB): an ecx Producer holds the item; an
ecx Consumer's receive arena behind a ControlShard (ArenaPool) gives a
reservation; rows:
  write  Producer.push into the open reservation (one acknowledged
         Mooncake WRITE from the C writer into the C receiver), median of N;
  push   the whole push through ecx.vllm.push.pusher (reserve, write,
         complete_batch) of a fresh transfer_id each time, median of N;
  8x     eight writes of the item one after another (Producer.push) and
         as one Producer.push_batch (up to four in flight);
  tcp    raw TCP on loopback: n bytes sent, received in full into a
         preallocated buffer, one byte back (Python sockets), median of N.
Ratios are tcp_time / ecx_time (1.0: as fast as raw TCP).
Run: PYTHONPATH=python ECX_LIBRARY=build/libecx.so /usr/bin/python3 bench/push_mooncake.py
"""
import os
import socket
import statistics
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))

import pushkit  # noqa: E402,F401  (the vllm stub on sys.path)
import ecx  # noqa: E402
from ecx.vllm.push import ArenaPool, ControlShard  # noqa: E402
from ecx.vllm.push.pusher import PushSpec, Pusher  # noqa: E402

SIZES = [64 << 10, 1 << 20, 7 << 20]
N = int(os.environ.get("N", "40"))


def tcp_rtt(n, reps):
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    buf = bytearray(n)
    view = memoryview(buf)

    def serve():
        c, _ = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            got = 0
            while got < n:
                got += c.recv_into(view[got:], n - got)
            c.sendall(b"k")
        c.close()
    t = threading.Thread(target=serve)
    t.start()
    s = socket.create_connection(ls.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = os.urandom(n)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        s.sendall(data)
        s.recv(1)
        out.append(time.perf_counter() - t0)
    s.close()
    t.join()
    ls.close()
    return statistics.median(out)


def main():
    import torch
    prod = ecx.Producer(capacity_bytes=64 << 20, bind_host="127.0.0.1",
                        registry_port=0, mooncake=True)
    url = f"http://127.0.0.1:{prod.registry_port}"
    cons = ecx.Consumer(url, recv_capacity=32 << 20)
    pool = ArenaPool(cons)
    shard = ControlShard(pool, ec_port=23000 + os.getpid() % 20000).start()
    # Mooncake's wire, not ecx's fetch (bench/push_shm.py)
    pusher = Pusher(prod, control_timeout_s=5.0, fetch=False)
    print(f"# {os.popen('uptime').read().strip()}")
    print("size      write_ms  push_ms  tcp_ms  tcp/write  tcp/push"
          "  8x_seq_ms  8x_batch_ms")
    for n in SIZES:
        mm = f"bench{n}".ljust(64, "x")
        prod.put(mm, torch.frombuffer(bytearray(os.urandom(n)),
                                      dtype=torch.uint8))
        spec = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
        assert pusher.reserve(shard.endpoint, [spec]) == [spec]
        r = next(iter(spec.shards.values()))
        w = []
        for _ in range(N):
            t0 = time.perf_counter()
            prod.push(mm, r["dst_session"], r["dst_ptr"], n)
            w.append(time.perf_counter() - t0)
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
        pusher.abandon(shard.endpoint, [spec])
        p = []
        for _ in range(N):
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            t0 = time.perf_counter()
            assert pusher.push(shard.endpoint, [s]) == [], s.error
            p.append(time.perf_counter() - t0)
            pusher.abandon(shard.endpoint, [s])
        tcp = tcp_rtt(n, N)
        wm, pm = statistics.median(w), statistics.median(p)
        print(f"{n >> 10:>6} KiB {wm * 1e3:8.3f} {pm * 1e3:8.3f} "
              f"{tcp * 1e3:7.3f} {tcp / wm:9.2f}x {tcp / pm:8.2f}x "
              f"{statistics.median(seq) * 1e3:10.3f} "
              f"{statistics.median(par) * 1e3:12.3f}")
    pusher.close()
    shard.stop(0)
    cons.close()
    prod.close()


if __name__ == "__main__":
    main()
