"""What the rendezvous lead costs or saves on this CPU: single warm loads
over TCP of one item (1 MiB unless --nbytes; over 64 KiB and up to 2 MiB,
the sizes that go by rendezvous with a lead) from two producer processes,
one that pads a pull's only rendezvous message (ECX_TEST_RNDV_LEAD=1) and
one that does not (ECX_TEST_RNDV_LEAD=0), into one destination in this
process's consumer. After 150 untimed loads from each: interleaved blocks
of --loads timed loads (each block after one untimed load, the order
alternating), each block followed by one untimed load into the
destination cleared first, whose bytes are checked against the
producer's XXH3. Left to itself a producer pads only where
ecx_copy_offset_slow finds that the CPU copies slowly a few bytes off a
page (its verdict: `ECX_LOG=debug ecx serve`; docs/deploy.md, "The
rendezvous lead, where the CPU needs it"). Prints per producer the
median, min and max of the blocks' medians, and the median of the paired
differences (padded minus not, block by block), us: above 0, the padding
costs here.

On loopback:
  PYTHONPATH=python ECX_LIBRARY=build/libecx.so /usr/bin/python3 bench/rndv_lead.py
Across two hosts (bench/two_hosts.sh runs it so with LEAD=1 or only: this
process in namespace B, the producers in A):
  bench/rndv_lead.py --producer-wrap 'CMD' --producer-host ADDR
"""
import argparse
import ctypes
import json
import os
import select
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchkit import uptime  # noqa: E402

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import ecx
from benchkit import put_random
n = int(sys.argv[3])
prod = ecx.Producer(capacity_bytes=n + (16 << 20), bind_host=sys.argv[2],
                    registry_port=0)
mm = put_random(prod, "rndv-lead-%d" % n, n)
print(json.dumps({"addr": prod.address, "mm": mm,
                  "xxh3": prod.item_xxh3(mm)}), flush=True)
sys.stdin.readline()
prod.close()
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--loads", type=int, default=30)
    ap.add_argument("--producer-wrap", default="",
                    help="command (split on spaces) the producers run in")
    ap.add_argument("--producer-host", default="127.0.0.1")
    a = ap.parse_args()
    if not (64 << 10) < a.nbytes <= (2 << 20):
        ap.error("--nbytes must be over 64 KiB and at most 2 MiB (the "
                 "loads that go by rendezvous with a lead)")
    if a.blocks < 1 or a.loads < 1:
        ap.error("--blocks and --loads must be positive")
    if os.environ.get("ECX_TEST_NO_LEAD") is not None:
        ap.error("ECX_TEST_NO_LEAD is set: the consumer would ask neither "
                 "producer for a lead")
    import ecx

    kids, info = {}, {}
    try:
        for name, lead in (("padded", "1"), ("unpadded", "0")):
            env = dict(os.environ, ECX_TEST_RNDV_LEAD=lead)
            kids[name] = subprocess.Popen(
                a.producer_wrap.split() + [sys.executable, "-c", CHILD, HERE,
                                           a.producer_host, str(a.nbytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=env)
            out = kids[name].stdout
            ready, _, _ = select.select([out], [], [], 60)
            line = out.readline() if ready else ""
            if not line:
                sys.exit(f"rndv_lead.py: the {name} producer did not start "
                         f"within 60 s (exit status {kids[name].poll()})")
            info[name] = json.loads(line)
        cons = ecx.Consumer(None, transport="tcp", recv_capacity=64 << 20)
        n = a.nbytes
        dst = cons.arena_tensor(ecx.Item("d", "uint8", [n], n, "", 0))
        items = {k: ecx.Item(v["mm"], "uint8", [n], n, v["addr"], 0)
                 for k, v in info.items()}

        def load(k):
            errs = cons.load_into([(items[k], dst)])
            if errs != [None]:
                sys.exit(f"rndv_lead.py: {k} load failed: {errs[0]} (its "
                         f"producer's exit status: {kids[k].poll()})")

        for k in items:  # the connection's first loads, untimed
            for _ in range(150):
                load(k)
        res = {k: [] for k in items}
        for b in range(a.blocks):
            order = list(items) if b % 2 == 0 else list(items)[::-1]
            for k in order:
                load(k)
                ts = []
                for _ in range(a.loads):
                    t0 = time.perf_counter()
                    load(k)
                    ts.append(time.perf_counter() - t0)
                ctypes.memset(dst.data_ptr(), 0, n)
                load(k)
                if ecx.xxh3(dst.data_ptr(), n) != info[k]["xxh3"]:
                    sys.exit(f"rndv_lead.py: {k}: bytes differ")
                res[k].append(statistics.median(ts) * 1e6)
        print(f"# {uptime()}; {n} B single warm loads over TCP, "
              f"{a.blocks} blocks of {a.loads} each way, us")
        for k, v in res.items():
            print(f"{k:9s} block medians: median {statistics.median(v):.0f}"
                  f"  min {min(v):.0f}  max {max(v):.0f}")
        diff = [p - u for p, u in zip(res["padded"], res["unpadded"])]
        print(f"padded - unpadded, paired by block: median "
              f"{statistics.median(diff):+.0f} us "
              f"(min {min(diff):+.0f}, max {max(diff):+.0f})")
        dst = None  # the arena tensor freed before the consumer closes
        cons.close()
    finally:
        for p in kids.values():
            try:
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
