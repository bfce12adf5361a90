"""Pushes ecx encoder -> ecx consumer over shared memory (ecx's fetch: the
consumer's shard pulls over UCX) against memcpy, same run, two processes
on this host.

The consumer (a child process) runs a ControlShard over an ArenaPool of
its Consumer's receive arena; this process holds the items in an ecx
Producer and pushes with ecx.vllm.push.pusher (which the shard tells
"ecx_fetch": true). For each size (64 KiB, 1 MiB, 7 MiB), medians of N:
  memcpy  in the consumer: the item's bytes copied from a buffer of that
          process into the arena, both already touched (ctypes.memmove),
          the same bytes each time (so, up to several MiB, in the CPU's
          caches);
  cold    the same copy from and into memory last touched 96 MiB of
          copies before (out of the caches), as a push's bytes are: the
          encoder's output was written a while before, the reservation's
          range is not the last one used; the baseline of the ratios;
  load    in the consumer: Consumer.load_into of the item from this
          process's Producer into one arena range, already touched: the
          pull the shard starts for an ecx_fetch (UCX; cross-memory
          attach on one host);
  fetch   here: ecx_fetch sent for a reserved item until its ready event
          is heard (the op, the pull, the shard's settling, the event);
  push    here: Pusher.push (reserve, ecx_fetch with the item's XXH3,
          which this process makes and the shard checks) until the ready
          event;
  push-h  the same without the hash (Pusher(send_hash=False));
  mc-h    the same push over Mooncake's TCP wire on loopback instead
          (Pusher(fetch=False, send_hash=False): a write, a complete).
  8x      here: eight items of the size, reserved beforehand (as the
          connector reserves when a request arrives, before the encoder
          runs), pushed as one Pusher.push without the hash (one
          ecx_fetch of eight entries: one load) until the last ready
          event; against eight cold memcpys (and eight memcpys).
Each item is cancelled after its event (freeing its range). Ratios are
the baseline's time over the row's (1.0: as fast).
Run: PYTHONPATH=python ECX_LIBRARY=build/libecx.so /usr/bin/python3 bench/push_shm.py
"""
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))

from benchkit import put_random, uptime  # noqa: E402

SIZES = [64 << 10, 1 << 20, 7 << 20]
N = int(os.environ.get("N", "40"))

CHILD = r"""
import ctypes, json, os, random, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import pushkit
import ecx
from ecx.vllm.push import ArenaPool, ControlShard
cons = ecx.Consumer(None, recv_capacity=96 << 20)
pool = ArenaPool(cons)
for _ in range(50):
    try:
        shard = ControlShard(pool, ec_port=random.randint(20000, 60000))
        shard.start()
        break
    except RuntimeError:
        pass
print(json.dumps({"base": shard.endpoint, "event": shard.event_port}),
      flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    n, reps = cmd["nbytes"], cmd["n"]
    dst = cons.arena_tensor(ecx.Item("d", "uint8", [n], n, "", 0))
    ctypes.memset(dst.data_ptr(), 1, n)  # touched
    src = bytearray(os.urandom(n))
    sp = ctypes.addressof((ctypes.c_char * n).from_buffer(src))
    cp = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), sp, n)
        cp.append(time.perf_counter() - t0)
    # cold: each copy from and into memory last touched 96 MiB of copies
    # ago (more than the CPU's caches), as a push's bytes are
    k = max(2, (96 << 20) // n)
    csrc, cdst = bytearray(b"\x5a" * (k * n)), bytearray(k * n)
    cs = ctypes.addressof((ctypes.c_char * (k * n)).from_buffer(csrc))
    cd = ctypes.addressof((ctypes.c_char * (k * n)).from_buffer(cdst))
    for i in range(k):  # both resident
        ctypes.memmove(cd + i * n, cs + i * n, n)
    cold = []
    for i in range(reps):
        j = i % k * n
        t0 = time.perf_counter()
        ctypes.memmove(cd + j, cs + j, n)
        cold.append(time.perf_counter() - t0)
    del csrc, cdst
    it = ecx.Item(cmd["mm"], "uint8", [n], n, cmd["producer"], 0)
    ld = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        errs = cons.load_into([(it, dst)])
        ld.append(time.perf_counter() - t0)
        assert errs == [None], errs
    assert ecx.xxh3(dst.data_ptr(), n) == cmd["xxh3"]  # the bytes landed
    del dst
    print(json.dumps({"memcpy": statistics.median(cp),
                      "cold": statistics.median(cold),
                      "load": statistics.median(ld[2:])}), flush=True)
shard.stop(0)
cons.close()
"""


def main():
    import pushkit  # noqa: F401  (the vllm stub on sys.path)
    import ecx
    from ecx.vllm.push.pusher import PushSpec, Pusher
    from upstream_encoder import EventSubscriber

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, os.path.join(HERE, "..", "tests",
                                                   "python")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(child.stdout.readline())
    base = info["base"]
    prod = ecx.Producer(capacity_bytes=160 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    pusher = Pusher(prod, control_timeout_s=5.0)
    bare = Pusher(prod, control_timeout_s=5.0, send_hash=False)
    wire = Pusher(prod, control_timeout_s=5.0, send_hash=False, fetch=False)
    sub = EventSubscriber(pusher.shards(base))
    print(f"# {uptime()}")
    print("size      memcpy_ms  cold_ms  load_ms  fetch_ms  push_ms  "
          "push-h_ms  mc-h_ms  cold/load  cold/fetch  cold/push-h  "
          "cold/mc-h  memcpy/fetch")

    def ready(tid, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not sub.ready(tid):
            assert time.monotonic() < deadline, f"{tid}: no ready event"
            sub.drain(0.001)
        return time.perf_counter()

    def cancel(spec):
        for a, r in spec.shards.items():
            pusher.ctl.call(a, {"op": "cancel",
                                "transfer_id": spec.transfer_id,
                                "reservation_id": r["reservation_id"]})

    batches = []
    for n in SIZES:
        mm = put_random(prod, f"shm{n}", n)
        fetch, push, nohash, mc, eight = [], [], [], [], []
        mms = [put_random(prod, f"shm{n}-{k}", n) for k in range(8)]
        for k in range(N + 2):
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            assert pusher.reserve(base, [s]) == [s], s.error
            [(a, r)] = s.shards.items()
            assert r.get("ecx_fetch") is True, r
            t0 = time.perf_counter()
            got = pusher.ctl.call(a, {
                "op": "ecx_fetch", "ecx_producer": prod.address,
                "items": [{"transfer_id": s.transfer_id,
                           "reservation_id": r["reservation_id"]}]})
            assert got["items"] == [{"fetching": True}], got
            fetch.append(ready(s.transfer_id) - t0)
            cancel(s)
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            t0 = time.perf_counter()
            assert pusher.push(base, [s]) == [], s.error
            push.append(ready(s.transfer_id) - t0)
            cancel(s)
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            t0 = time.perf_counter()
            assert bare.push(base, [s]) == [], s.error
            nohash.append(ready(s.transfer_id) - t0)
            cancel(s)
            s = PushSpec(uuid.uuid4().hex, mm, n, [n], "uint8")
            t0 = time.perf_counter()
            assert wire.push(base, [s]) == [], s.error
            mc.append(ready(s.transfer_id) - t0)
            cancel(s)
            if k % 4 == 0:  # fewer: eight items each
                specs = [PushSpec(uuid.uuid4().hex, m, n, [n], "uint8")
                         for m in mms]
                assert bare.reserve(base, specs) == specs
                t0 = time.perf_counter()
                assert bare.push(base, specs) == [], specs
                for sp in specs:
                    t = ready(sp.transfer_id)
                eight.append(t - t0)
                for sp in specs:
                    cancel(sp)
        child.stdin.write(json.dumps({"nbytes": n, "n": N, "mm": mm,
                                      "producer": prod.address,
                                      "xxh3": prod.item_xxh3(mm)}) + "\n")
        child.stdin.flush()
        side = json.loads(child.stdout.readline())
        cp, cc, ld = side["memcpy"], side["cold"], side["load"]
        fm, pm = statistics.median(fetch[2:]), statistics.median(push[2:])
        hm = statistics.median(nohash[2:])
        wm = statistics.median(mc[2:])
        print(f"{n >> 10:>6} KiB {cp * 1e3:9.3f} {cc * 1e3:8.3f} "
              f"{ld * 1e3:8.3f} {fm * 1e3:9.3f} {pm * 1e3:8.3f} "
              f"{hm * 1e3:10.3f} {wm * 1e3:8.3f} {cc / ld:9.2f}x "
              f"{cc / fm:10.2f}x {cc / hm:11.2f}x {cc / wm:9.2f}x "
              f"{cp / fm:11.2f}x", flush=True)
        em = statistics.median(eight[1:])
        batches.append(f"{n >> 10:>6} KiB {8 * cp * 1e3:12.3f} "
                       f"{8 * cc * 1e3:10.3f} {em * 1e3:10.3f} "
                       f"{8 * cc / em:12.2f}x {8 * cp / em:14.2f}x")
    print("size    8x memcpy_ms   8x cold_ms  8x_push_ms  8x cold/push  "
          "8x memcpy/push")
    print("\n".join(batches))
    child.stdin.close()
    child.wait(30)
    sub.close()
    bare.close()
    wire.close()
    pusher.close()
    prod.close()
    print(f"# {uptime()}")


if __name__ == "__main__":
    main()
