#!/usr/bin/python3
"""The interop peers against Mooncake's own engine, built from its source
(by hand, outside ecx's build: README.md here says how). Not a ctest test:
ecx does not depend on Mooncake.

  check_mooncake.py --bench PATH/transfer_engine_bench [--with-module]

1. mcwire's writer into Mooncake's receiver (transfer_engine_bench
   --mode=target): the descriptor, v2 writes of 1 B, 64 KiB and 7 MiB read
   back with a v2 READ, a v1 write, refusals past the end and outside.
2. Mooncake's writer (--mode=initiator, write and read) into ref_consumer's
   receiver: every request accepted, none rejected.
3. --with-module (mooncake.engine importable, e.g. PYTHONPATH set): the
   reference's whole pull both ways with one side on Mooncake's engine:
   ref_producer (mcwire) -> ref_consumer --engine mooncake, and
   ref_producer --engine mooncake -> ref_consumer (mcwire), bytes checked.
One line per check ('ok - ...' or 'FAIL - ...'); exit 1 on any failure.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import numpy as np  # noqa: E402

import items  # noqa: E402
import mcwire  # noqa: E402
import ref_consumer  # noqa: E402

failed = 0


def check(name, cond, detail=""):
    global failed
    print(("ok - " if cond else "FAIL - ") + name +
          ("" if cond or not detail else f": {detail}"), flush=True)
    failed += 0 if cond else 1


def env():
    e = dict(os.environ, GLOG_logtostderr="1", MC_FORCE_TCP="1")
    return e


def start_target(bench, log):
    p = subprocess.Popen([bench, "--mode=target",
                          "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
                          "--local_server_name=127.0.0.1",
                          "--buffer_size=67108864"],
                         stdout=log, stderr=log, env=env())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = re.search(r"listening on (\S+)", open(log.name).read())
        if m:
            return p, m.group(1)
        time.sleep(0.1)
    p.kill()
    raise SystemExit("transfer_engine_bench --mode=target did not start")


def read_back(host, port, addr, n):
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(mcwire.HEADER.pack(n, addr, mcwire.OP_READ | mcwire.OP_V2))
        (st,) = mcwire.STATUS.unpack(mcwire.recv_exact(s, 8))
        return mcwire.recv_exact(s, n) if st == mcwire.STATUS_OK else None


def writer_into_mooncake(bench, tmp):
    log = open(os.path.join(tmp, "target.log"), "w")
    p, session = start_target(bench, log)
    try:
        desc = mcwire.fetch_segment(
            session, mcwire.encode_segment("127.0.0.1:1", 0, []), 10)
        check("Mooncake's metadata answer decodes: tcp, v2, one buffer",
              desc["protocol"] == "tcp" and desc["tcp_proto_version"] == 2
              and len(desc["buffers"]) == 1, desc)
        host, _ = mcwire.parse_session(desc["name"])
        port = desc["tcp_data_port"]
        base, length = desc["buffers"][0]
        for n, off in ((1, 0), (65536, 4096), (7 << 20, 1 << 20),
                       (210, length - 210)):
            data = items.item_bytes("mc", str(n), n)
            t = time.perf_counter()
            why = mcwire.write(host, port, 2, data, base + off, 10)
            ms = (time.perf_counter() - t) * 1e3
            check(f"v2 write of {n} B at +{off} acknowledged ({ms:.2f} ms) "
                  "and read back", why is None and
                  read_back(host, port, base + off, n) == data, why)
        check("v1 write (no status) lands",
              mcwire.write(host, port, 1, b"abc", base, 10) is None and
              read_back(host, port, base, 3) == b"abc")
        for what, addr, n in (("past the end", base + length - 1, 2),
                              ("outside every buffer", 4096, 1)):
            why = mcwire.write(host, port, 2, b"x" * n, addr, 10)
            check(f"a write {what} is rejected with status 1",
                  why == "write rejected by the receiver, status 1", why)
        for ftype, want in ((mcwire.HS_PROBE, {"status": "success"}),
                            (mcwire.HS_NOTIFY, {"name": "",
                                                "notify_msg": "success"})):
            h, hp = mcwire.parse_session(session)
            with socket.create_connection((h, hp), timeout=10) as s:
                s.sendall(mcwire.encode_frame(ftype, mcwire.json_body({})))
                t, body = mcwire.read_frame(s)
            check(f"handshake type {ftype} answered {want}",
                  t == ftype and json.loads(body) == want, body)
    finally:
        p.terminate()
        p.wait(10)


def mooncake_into_receiver(bench):
    buf = np.full(16 << 20, 0x5A, dtype=np.uint8)
    r = ref_consumer.Receiver("127.0.0.1")
    r.register(buf)
    try:
        for op, block, batch in (("write", 65536, 16), ("read", 65536, 16),
                                 ("write", 1 << 20, 8)):
            before = r.stats()
            p = subprocess.run(
                [bench, "--mode=initiator", "--metadata_server=P2PHANDSHAKE",
                 "--protocol=tcp", "--local_server_name=127.0.0.1",
                 f"--segment_id={r.session}", f"--operation={op}",
                 "--threads=1", f"--batch_size={batch}",
                 f"--block_size={block}", "--duration=2",
                 f"--buffer_size={buf.nbytes}"],
                capture_output=True, text=True, timeout=60, env=env())
            rate = re.findall(r"throughput (\S+ \S+)", p.stderr)
            after = r.stats()
            key = "writes" if op == "write" else "reads"
            n = after[key] - before[key]
            check(f"Mooncake's initiator, {op} {block} B x {batch}: "
                  f"{n} requests served, none rejected "
                  f"({rate[-1] if rate else '?'})",
                  p.returncode == 0 and n > 0 and after["rejected"] == 0 and
                  "FAILED" not in p.stderr, p.stderr[-800:])
        check("the bytes Mooncake's initiator wrote are its (zeroed) buffer's",
              not buf[:8 << 20].any() and (buf[8 << 20:] == 0x5A).all())
    finally:
        r.close()


def pull_both_ways(tmp):
    specs = ["a:64x64:float32", "big:1024x3584:bfloat16", "one:1:uint8"]
    ids = [s.split(":")[0] for s in specs]
    for prod, cons in (("mcwire", "mooncake"), ("mooncake", "mcwire")):
        ready = os.path.join(tmp, f"ready-{prod}.json")
        p = subprocess.Popen([sys.executable, os.path.join(HERE,
                                                           "ref_producer.py"),
                              "--engine", prod, "--seed", "m",
                              "--ready-file", ready, "--max-seconds", "120",
                              *specs], stdout=subprocess.DEVNULL,
                             stderr=open(ready + ".err", "w"), env=env())
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(ready) and time.monotonic() < deadline:
                time.sleep(0.05)
            info = json.load(open(ready))
            r = subprocess.run([sys.executable,
                                os.path.join(HERE, "ref_consumer.py"),
                                "--engine", cons, "--registry",
                                info["registry"], "--seed", "m", *ids],
                               capture_output=True, text=True, timeout=120,
                               env=env())
            out = json.loads(r.stdout) if r.stdout else {}
            check(f"ref_producer --engine {prod} -> ref_consumer --engine "
                  f"{cons}: {' '.join(ids)} pulled, bytes checked",
                  r.returncode == 0 and out.get("ok"),
                  (r.stdout[-1500:], r.stderr[-800:]))
        finally:
            p.terminate()
            p.wait(10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--with-module", action="store_true")
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()
    writer_into_mooncake(args.bench, args.tmp)
    mooncake_into_receiver(args.bench)
    if args.with_module:
        pull_both_ways(args.tmp)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
