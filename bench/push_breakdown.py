"""Where the time of an ecx push over shared memory goes: one ecx_fetch
timed at each stage, on one clock (time.perf_counter is CLOCK_MONOTONIC,
the same in both processes on this host).

The consumer (a child process) runs a ControlShard over an ArenaPool of
its Consumer's receive arena, with its stages timed where they happen
(the methods wrapped in the child only; nothing of the library is
changed); this process holds the items in an ecx Producer, reserves
beforehand (as the connector does when a request arrives), then sends one
ecx_fetch for K items of a size and waits for every ready event. Times
are from the send of the op, medians of N (after 3 dropped), ms, in the
order of their medians (the reply comes while the bytes move, so it may
come before or after landed):

  op_in    the shard's loop has the op (ZeroMQ, the JSON made here)
  checked  the entries are checked and marked fetching (the table)
  start    the fetch's load about to start (the entries' items and views
           made, Fetches._go entered)
  started  load_notify returned: the C items made, the pull sent, the
           load's thread made
  reply    the op's answer is here (while the bytes move)
  landed   the shard hears the load's end (libecx's datagram)
  settled  every reservation settled READY and its event queued
  sent     the events handed to the PUSH socket
  event    the last ready event is here

Run: PYTHONPATH=python ECX_LIBRARY=build/libecx.so /usr/bin/python3 \\
         bench/push_breakdown.py [--k K] [--nbytes N] [--n N]
"""
import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))

from benchkit import put_random, uptime  # noqa: E402

STAGES = ["op_in", "checked", "start", "started", "reply", "landed",
          "settled", "sent", "event"]

CHILD = r"""
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
import pushkit  # noqa: F401  (the vllm stub)
import ecx
from ecx.vllm.push import ArenaPool, ControlShard
from ecx.vllm.push import events, fetch, shard

import threading
T = []  # (stage, time), the first of each stage kept
# T is written by the shard's thread, read by this one, which sleeps on
# the condition until a mark comes (no polling: a thread that wakes every
# half millisecond takes the interpreter's lock from the shard's)
L = threading.Condition()
pc = time.perf_counter


def mark(name):
    with L:
        T.append((name, pc()))
        L.notify()


def wrap(cls, attr, before=None, after=None, when=None):
    f = getattr(cls, attr)

    def w(self, *a):
        ok = when is None or when(self, *a)
        if ok and before:
            mark(before)
        r = f(self, *a)
        if ok and after:
            mark(after)
        return r
    setattr(cls, attr, w)


wrap(shard.ControlShard, "_op_fetch", before="op_in")
wrap(fetch.Fetches, "start", before="checked")
wrap(fetch.Fetches, "_go", before="start", after="started")
wrap(fetch.Fetches, "_end", before="landed")
wrap(shard.ControlShard, "_settle", after="settled",
     when=lambda self, ended: bool(ended))
wrap(events.EventQueue, "flush", after="sent",
     when=lambda self, ev: bool(self._frames))
cons = ecx.Consumer(None, recv_capacity=int(sys.argv[2]))
pool = ArenaPool(cons)
sh = None
for _ in range(50):
    try:
        sh = ControlShard(pool, ec_port=random.randint(20000, 60000))
        sh.start()
        break
    except RuntimeError:
        sh = None
if sh is None:
    sys.exit("no free control port in 50 tries")
print(json.dumps({"base": sh.endpoint}), flush=True)
# Each line asks for the marks since the last, once the stage it names
# (if any) is among them, or after 5 s: the shard's thread marks "sent"
# after its send returns, which can be after the event is at the encoder.
for line in sys.stdin:
    want = line.strip()
    with L:
        if want:
            L.wait_for(lambda: any(n == want for n, _ in T), timeout=5)
        out = list(T)
        T.clear()
    print(json.dumps(out), flush=True)
sh.stop(0)
cons.close()
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8, help="items per push")
    ap.add_argument("--nbytes", type=int, default=7 << 20)
    ap.add_argument("--n", type=int, default=20, help="pushes timed")
    a = ap.parse_args()
    if a.k < 1 or a.nbytes < 1 or a.n < 1:
        ap.error("--k, --nbytes and --n must be positive")
    import pushkit  # noqa: F401
    import ecx
    from ecx.vllm.push.pusher import PushSpec, Pusher
    from upstream_encoder import EventSubscriber

    cap = a.k * a.nbytes + (32 << 20)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, os.path.join(HERE, "..", "tests",
                                                   "python"), str(cap)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prod = pusher = sub = None
    try:
        # The child's next line, within 90 s: its first, after importing
        # torch and vLLM's classes, took over 30 s under ASan on a loaded
        # machine (CI's sanitized pass).
        def said(what):
            if not select.select([child.stdout], [], [], 90)[0]:
                raise RuntimeError(f"the shard's process gave no {what} "
                                   "in 90 s")
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"the shard's process ended before "
                                   f"its {what} (status {child.poll()})")
            return json.loads(line)

        base = said("endpoint")["base"]
        prod = ecx.Producer(capacity_bytes=cap, bind_host="127.0.0.1",
                            registry_port=0)
        pusher = Pusher(prod, control_timeout_s=5.0, send_hash=False)
        sub = EventSubscriber(pusher.shards(base))
        mms = [put_random(prod, f"bd{i}", a.nbytes) for i in range(a.k)]

        def marks(want=""):
            child.stdin.write(want + "\n")
            child.stdin.flush()
            return said("marks")

        def failed(specs):  # a failure event for one of specs, if any
            ids = {s.transfer_id for s in specs}
            for raw in sub.frames:
                ev = json.loads(raw)
                if ev.get("transfer_id") in ids and ev.get("ready") is False:
                    return ev
            return None

        rows = []
        for _ in range(a.n + 3):
            specs = [PushSpec(uuid.uuid4().hex, m, a.nbytes, [a.nbytes],
                              "uint8") for m in mms]
            if pusher.reserve(base, specs) != specs:
                raise RuntimeError(f"the reservations failed: {specs}")
            addr = next(iter(specs[0].shards))
            marks()  # the reserve's, dropped
            t0 = time.perf_counter()
            got = pusher.ctl.call(addr, {
                "op": "ecx_fetch", "ecx_producer": prod.address,
                "items": [{"transfer_id": s.transfer_id,
                           "reservation_id":
                               s.shards[addr]["reservation_id"]}
                          for s in specs]})
            t1 = time.perf_counter()
            if got.get("items") != [{"fetching": True}] * a.k:
                raise RuntimeError(f"ecx_fetch was refused: {got}")
            deadline = time.monotonic() + 10
            while not all(sub.ready(s.transfer_id) for s in specs):
                ev = failed(specs)
                if ev is not None:
                    raise RuntimeError(f"a push failed: {ev}")
                if time.monotonic() > deadline:
                    raise RuntimeError("no ready events within 10 s")
                sub.drain(0.001)
            t2 = time.perf_counter()
            row = {"reply": t1 - t0, "event": t2 - t0}
            for name, t in marks("sent"):
                row.setdefault(name, t - t0)
            missing = [st for st in STAGES if st not in row]
            if missing:
                raise RuntimeError(f"stages not seen in 5 s: {missing}")
            rows.append(row)
            sub.frames.clear()
            for s in specs:
                got = pusher.ctl.call(addr, {
                    "op": "cancel", "transfer_id": s.transfer_id,
                    "reservation_id": s.shards[addr]["reservation_id"]})
                if got.get("ok") is False:
                    raise RuntimeError(f"cancel: {got}")
        print(f"# {uptime()}")
        print(f"# one ecx_fetch of {a.k} x {a.nbytes} B, medians of "
              f"{a.n}, ms from the op's send")
        med = {st: statistics.median(r[st] for r in rows[3:]) * 1e3
               for st in STAGES}
        prev = 0.0
        for st in sorted(STAGES, key=med.get):  # reply runs beside the rest
            print(f"{st:8} {med[st]:8.3f}  (+{med[st] - prev:.3f})")
            prev = med[st]
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for x in (sub, pusher, prod):
            try:
                if x is not None:
                    x.close()
            except Exception as e:  # the others are still closed
                print(f"push_breakdown: closing: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
