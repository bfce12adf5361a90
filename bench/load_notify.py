#!/usr/bin/python3
"""Loads said on a socket (Consumer.load_notify, ecx_consumer_load_notify)
against loads waited for (Consumer.load_into), same run.

An ecx Producer in this process holds one item per size (64 KiB, 1 MiB,
7 MiB); a Consumer in a child process (so the producer is another
process, as in a deployment) loads it into the same touched range of its
receive arena, N times each way, the two ways alternating in blocks:
  wait    load_into: the calling thread waits for the load (and drives
          it);
  notify  load_notify, then the calling thread blocks in select() on the
          datagram socket until libecx says the end (as the vLLM
          connector's worker and scheduler hear of their pulls), then
          Load.wait() (at once).
Medians of N per block, then min/median/max over the blocks, and the
ratio notify/wait of adjacent blocks (1.0: the same). The transport is
the consumer's default for one host (shared memory); TRANSPORT=tcp in
the environment loads over TCP on loopback instead.

  PYTHONPATH=python ECX_LIBRARY=build/libecx.so /usr/bin/python3 \\
      bench/load_notify.py [--rounds N] [--blocks K]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from benchkit import put_random, uptime

SIZES = [64 << 10, 1 << 20, 7 << 20]

CHILD = r"""
import json, os, select, socket, statistics, sys, time
import ecx
n, addr, mm, rounds, blocks = (int(sys.argv[1]), sys.argv[2], sys.argv[3],
                               int(sys.argv[4]), int(sys.argv[5]))
tr = os.environ.get("TRANSPORT") or None
with ecx.Consumer(None, recv_capacity=96 << 20, transport=tr) as cons:
    it = ecx.Item(mm, "uint8", [n], n, addr, 0)
    dst = cons.arena_tensor(ecx.Item("d", "uint8", [n], n, "", 0))
    dst.fill_(1)  # touched
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)

    def wait():
        t = time.perf_counter()
        assert cons.load_into([(it, dst)]) == [None]
        return time.perf_counter() - t

    def notify():
        t = time.perf_counter()
        ld = cons.load_notify([(it, dst)], w, b"x")
        assert select.select([r], [], [], 10)[0], "no end said in 10 s"
        r.recv(64)
        d = time.perf_counter() - t
        assert ld.wait() == [None]
        return d

    for f in (wait, notify):  # the connection made, the code warm
        [f() for _ in range(5)]
    out = {"wait": [], "notify": []}
    for _ in range(blocks):
        for name, f in (("wait", wait), ("notify", notify)):
            out[name].append(statistics.median(f() for _ in range(rounds)))
    print(json.dumps(out), flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=5)
    a = ap.parse_args()
    import ecx
    prod = ecx.Producer(capacity_bytes=64 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    print(f"# {uptime()}; transport "
          f"{os.environ.get('TRANSPORT') or 'auto'}; {a.blocks} blocks of "
          f"{a.rounds} each way, alternating")
    print("size       wait us min/med/max     notify us min/med/max   "
          "notify/wait min/med/max")
    for n in SIZES:
        mm = put_random(prod, f"notify{n}", n)
        got = subprocess.run(
            [sys.executable, "-c", CHILD, str(n), prod.address, mm,
             str(a.rounds), str(a.blocks)],
            capture_output=True, text=True, timeout=300)
        if got.returncode != 0:
            sys.exit(f"load_notify.py: the consumer failed: "
                     f"{got.stderr[-2000:]}")
        r = json.loads(got.stdout.splitlines()[-1])
        w = [x * 1e6 for x in r["wait"]]
        nt = [x * 1e6 for x in r["notify"]]
        q = [b / a_ for a_, b in zip(w, nt)]

        def three(v, f="%7.1f"):
            return " ".join(f % x for x in (min(v), statistics.median(v),
                                             max(v)))
        print(f"{n >> 10:>5} KiB  {three(w)}   {three(nt)}   "
              f"{three(q, '%5.2f')}")
    prod.close()


if __name__ == "__main__":
    main()
