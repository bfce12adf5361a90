#!/usr/bin/python3
"""Producer.put of a CPU tensor (bfloat16, a new id each round) at 64 KiB,
256 KiB and 1 MiB, with integrity off and on (on: commit hashes the arena
copy, XXH3, right after the copy), beside a one-thread torch copy of the
same bytes into a ring of cold destinations touched before (96 MiB, more
than the last-level cache), as the arena's places are. Medians of ROUNDS
rounds (default 2000) after 100 untimed; the two producers in turn, each
in a fresh arena of 256 MiB.

    PYTHONPATH=python ECX_LIBRARY=build/libecx.so \\
        .venv/bin/python bench/put_latency.py

What it shows (docs/bench.md, "Small saves"): where the copy into the
arena uses non-temporal stores (src/producer/items.c, STREAM_MIN and
STREAM_MIN_HASHED), and what the hash adds."""
import os
import statistics
import time

import torch

import ecx

ROUNDS = int(os.environ.get("ROUNDS", "2000"))
SIZES = {"64KiB": (32, 1024), "256KiB": (128, 1024), "1MiB": (512, 1024)}
RING_BYTES = 96 << 20


def main():
    if ROUNDS < 1:
        raise SystemExit("put_latency: ROUNDS must be 1 or more")
    torch.set_num_threads(1)  # the baseline copies on one thread, as put
    print(f"Producer.put of a CPU tensor (new id each round), integrity "
          f"off and on, beside a one-thread torch copy into cold memory; "
          f"medians of {ROUNDS} rounds, us")
    print(f"{'item':>7} | {'put':>7} {'put+hash':>9} | {'cold copy':>9} "
          f"{'put/cold':>8} {'put+hash/cold':>13}")
    for name, shape in SIZES.items():
        src = torch.randn(shape).to(torch.bfloat16)
        ring = [torch.empty_like(src)
                for _ in range(RING_BYTES // src.nbytes)]
        for x in ring:
            x.fill_(0)
        prods = [ecx.Producer(capacity_bytes=256 << 20,
                              bind_host="127.0.0.1", registry_port=0,
                              integrity=integ) for integ in (False, True)]
        t = [[], [], []]
        try:
            for r in range(ROUNDS + 100):
                for k, p in enumerate(prods):
                    t0 = time.perf_counter()
                    p.put(f"{name}-{r}", src)
                    t[k].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ring[r % len(ring)].copy_(src)
                t[2].append(time.perf_counter() - t0)
        finally:
            for p in prods:
                p.close()
        put, hashed, cold = (statistics.median(v[100:]) * 1e6 for v in t)
        print(f"{name:>7} | {put:>7.1f} {hashed:>9.1f} | {cold:>9.1f} "
              f"{put / cold:>8.2f} {hashed / cold:>13.2f}")


if __name__ == "__main__":
    main()
