#!/usr/bin/python3
"""The first loads after a reconnect, through the Python binding.

A producer that closes idle connections after 300 ms and one consumer that
loads a 1 MiB item twice, waits 0.8 s (so its connection is closed), and
again, eight times: each line's pairs are the first load after the
reconnect and the one after it, in ms. Over shared memory each connection
has a UCX worker of its own on both ends (docs/protocol.md, "a peer that
leaves is forgotten"); this shows what that costs a reconnect.

Usage: PYTHONPATH=python ECX_LIBRARY=build/libecx.so.0 \\
       /usr/bin/python3 bench/reconnect_latency.py [shm|tcp]
"""
import sys
import time

import numpy as np

import ecx


def main():
    transport = sys.argv[1] if len(sys.argv) > 1 else "shm"
    if transport not in ("shm", "tcp"):
        sys.exit("usage: reconnect_latency.py [shm|tcp]")
    p = ecx.Producer(capacity_bytes=64 << 20, bind_host="127.0.0.1",
                     registry_port=0, idle_ms=300)
    c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}",
                     transport=transport)
    try:
        p.put("a", np.ones(1 << 20, dtype=np.uint8))
        item = c.lookup(["a"])[0]
        out = np.zeros(1 << 20, dtype=np.uint8)
        pairs = []
        for _ in range(8):
            t = time.perf_counter()
            c.load_into([(item, out)])
            first = time.perf_counter() - t
            t = time.perf_counter()
            c.load_into([(item, out)])
            second = time.perf_counter() - t
            pairs.append("%.1f/%.2f" % (first * 1e3, second * 1e3))
            time.sleep(0.8)
        print("%s, first/second load after each reconnect, ms: %s "
              "(%d connections)" % (transport, " ".join(pairs),
                                     c.stats()["connections"]))
    finally:
        c.close()
        p.close()


if __name__ == "__main__":
    main()
