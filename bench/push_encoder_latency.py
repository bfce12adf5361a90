"""Push mode through ECXConnector on both sides: an encoder connector
(ec_producer, reserving before the encoder runs) pushes into a prefill
connector (ec_consumer, TP 1) over Mooncake's TCP wire on loopback. Per
size: save_caches's own time (what the encoder's step pays), and the time
from save_caches (the output bound) to the prefill scheduler holding the
item ready (its events drained in a loop of steps); beside, in the same
run, upstream's encoder stand-in (tests/interop/upstream_encoder.py, a
Python writer on the same wire, no hash) pushing the same bytes into the
same prefill, its reservations also made beforehand. Both run in this
process: the prefill's step loop pauses 0.1 ms between steps so that the
encoder's push threads get the GIL (in vLLM the encoder is another
process). Then the parts alone, per size: one write of the item into an
ArenaPool reservation by Producer.push (ecx's C writer) and by the
stand-in's writer, and one XXH3 pass over it (ecx.xxh3: what the encoder
pays where its producer has integrity off, and the consumer's check).
Medians over --rounds.

  ECX_LIBRARY=build/libecx.so PYTHONPATH=python \\
      /usr/bin/python3 bench/push_encoder_latency.py --rounds 50
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import pushkit  # noqa: E402,F401 - the vllm stub and tests/interop
from test_push_connector import (Prefill, Request, mc_writer,  # noqa: E402
                                 push_item)
from test_push_encoder import EncRequest, Encoder, tensor_of  # noqa: E402
from upstream_encoder import Item, UpstreamEncoder  # noqa: E402
from upstream_proxy import Proxy  # noqa: E402

import ecx  # noqa: E402
from ecx.vllm.push import ArenaPool  # noqa: E402

SIZES = {"64KiB": 64, "1MiB": 1024, "7.3MiB": 7475}  # tokens x 512 bf16
STEP_PAUSE_S = 0.0001


def med_us(xs):
    return statistics.median(xs) * 1e6


def ready_after(p, mm_hash, t0, timeout_s=10.0):
    """Seconds from t0 until the prefill scheduler holds mm_hash ready."""
    sched, (worker, cache) = p.sched, p.engine.workers[0]
    while not sched.has_cache_item(mm_hash):
        worker.bind_connector_metadata(sched.build_connector_meta(object()))
        worker.start_load_caches(cache)
        worker.clear_connector_metadata()
        # A step's pause: here the encoder's push threads share this
        # process's GIL, which in vLLM they do not (other processes).
        time.sleep(STEP_PAUSE_S)
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"{mm_hash} never became ready")
    return time.perf_counter() - t0


def consume(p, item):
    """Takes the item and frees it, so the pool has room for the next."""
    req = Request(f"c-{item.transfer_id}", [item])
    eng = p.engine
    eng.add(req)
    eng.step()
    assert req.request_id in eng.scheduled
    eng.finish(req)
    eng.step()


def ecx_round(p, enc, proxy, k, tokens):
    h = f"e{k}-{tokens}".ljust(64, "e")
    params, _ = proxy.encoder_body([{"uuid": h}])
    req = EncRequest(f"e{k}", [(h, tokens)], params)
    enc.plan(req)
    tid = params["ec_items"][0]["transfer_id"]
    push = enc.pushes()._live[tid]
    push.reserved.result(timeout=10)  # reserved before the encoder ran
    t, data = tensor_of(h, tokens)
    enc.cache[h] = t
    t0 = time.perf_counter()
    enc.worker.save_caches(enc.cache, h)
    saved = time.perf_counter() - t0
    ready = ready_after(p, h, t0)
    enc.end_step()
    enc.finish(req)
    enc.drain()
    enc.cache.pop(h)
    consume(p, Item(tid, h, data, [tokens, 512], "bfloat16"))
    return saved, ready


def upstream_round(p, enc, k, tokens):
    it = push_item(f"u{k}-{tokens}", tokens)
    assert enc.reserve(p.base, [it]) == [it]
    t0 = time.perf_counter()
    assert enc.push(p.base, [it]) == []
    ready = ready_after(p, it.mm_hash, t0)
    consume(p, it)
    return ready


class _Window:
    """What ArenaPool.open_write reads of a reservation."""

    def __init__(self, addr, nbytes):
        self.dst_ptr, self.nbytes = addr, nbytes
        self.reservation_id = f"bench-{addr:x}"
        self.expires_at = time.monotonic() + 600


def parts(rounds):
    """{size: (C push, stand-in write, xxh3)} medians, in seconds."""
    cons = ecx.Consumer("http://127.0.0.1:1", recv_capacity=32 << 20)
    prod = ecx.Producer(capacity_bytes=64 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    write = mc_writer()
    pool = ArenaPool(cons)
    out = {}
    try:
        for name, tokens in SIZES.items():
            t, data = tensor_of(f"part-{name}", tokens)
            prod.put(f"part-{name}", t)
            n = len(data)
            w = _Window(pool.allocate(n), n)
            session, _ = pool.open_write(w)
            buf = ctypes.create_string_buffer(data, n)
            c, py, hx = [], [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                prod.push(f"part-{name}", session, w.dst_ptr, n, 10)
                t1 = time.perf_counter()
                write(session, w.dst_ptr, data)
                t2 = time.perf_counter()
                ecx.xxh3(ctypes.addressof(buf), n)
                t3 = time.perf_counter()
                c.append(t1 - t0)
                py.append(t2 - t1)
                hx.append(t3 - t2)
            pool.close_write(w)
            pool.free(w.dst_ptr)
            out[name] = tuple(statistics.median(x) for x in (c, py, hx))
    finally:
        prod.close()
        cons.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    p = Prefill(tp=1)
    enc = Encoder(control_timeout_s=5)
    up = UpstreamEncoder(control_timeout_s=5, writer=mc_writer())
    proxy = Proxy([p.base])
    try:
        print(f"load average {os.getloadavg()[0]:.1f}, rounds "
              f"{args.rounds}, medians")
        print(f"{'size':>8} {'ecx save_caches':>16} {'ecx bound->ready':>17}"
              f" {'upstream push->ready':>21}")
        for name, tokens in SIZES.items():
            saves, ecx_ready, up_ready = [], [], []
            for k in range(args.rounds):
                s, r = ecx_round(p, enc, proxy, k, tokens)
                saves.append(s)
                ecx_ready.append(r)
                up_ready.append(upstream_round(p, up, k, tokens))
            print(f"{name:>8} {med_us(saves):>13.0f} us "
                  f"{med_us(ecx_ready):>14.0f} us "
                  f"{med_us(up_ready):>18.0f} us")
        print(f"{'size':>8} {'C push alone':>16} {'stand-in write':>17}"
              f" {'xxh3':>21}")
        for name, (c, py, hx) in parts(args.rounds).items():
            print(f"{name:>8} {c * 1e6:>13.0f} us {py * 1e6:>14.0f} us "
                  f"{hx * 1e6:>18.0f} us")
    finally:
        up.close()
        enc.close()
        p.close()


if __name__ == "__main__":
    main()
