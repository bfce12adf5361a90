#!/bin/bash
# ecx over TCP between two "hosts" on one machine, RUNS times (default 5):
# network namespaces A and B joined by a veth pair (192.0.2.1 and
# 192.0.2.2, a documentation range on links that exist only inside the two
# namespaces), each with its own IPC namespace and /dev/shm, so nothing can
# take a shared-memory shortcut. Each run is `ecx bench transfer --via tcp`
# in B with its producer and its raw TCP sender in A (--peer-wrap), so ecx
# and its baseline are measured in the same run, interleaved; then UCX's
# own ucx_perftest across the same pair, with the segment sizes ecx sets:
# ucp_put_bw and ucp_am_bw at 7 MiB and 64 KiB, ucp_am_bw at 1 MiB, and
# ucp_am_lat (eager and by rendezvous) at 1 MiB, 64 KiB and 256 B; then
# raw TCP with 1, 2 and 4 streams (would more lanes help on this link?).
# Prints per row the min/median/max over the runs of ecx's GB/s, raw
# TCP's and their ratio, and each run's ratio; then, per run, the floor
# of a load carried by UCX against raw TCP's and ecx's: at 64 KiB and 1
# MiB x1 UCX's two messages (a pull of about 300 bytes and the data, one
# way each, the data the faster of eager and rendezvous), at 7 MiB UCX's
# own stream (the faster of ucp_put_bw and ucp_am_bw); and ecx's 7 MiB
# rows against ucp_put_bw of the same run. It also sets ecx's warm
# batches of 64 KiB and 1 MiB against ucp_am_bw at their item's size, per
# run, the tail of single loads (p99 over p50, per run), and the price of
# integrity (ecx bench's hash rows: loads checking each item's XXH3
# against the same loads unchecked, same run). Each
# run's load average is printed as it starts (the machine may be shared).
# Needs root, ip, unshare, sysctl, timeout, ucx_perftest and
# /usr/bin/python3.
#
# VIA (default tcp) is the rows' --via: VIA=tcp,mooncake adds the rows over
# Mooncake's wire (the reference's pull) beside them, same run. PUSH=1 adds
# pushes over Mooncake's wire (bench/push_mooncake.py) after them, PUSH=only
# runs those alone. LEAD=1 adds the rendezvous lead's paired comparison
# (bench/rndv_lead.py: 1 MiB single loads from a producer that pads and
# one that does not) after them, LEAD=only runs that alone.
#
# CC names the TCP congestion control both namespaces use: cubic (Linux's
# own default) unless set, regardless of the machine's default; the
# header prints it. A namespace may only take one that
# net.ipv4.tcp_allowed_congestion_control lists: the script adds CC to
# that list for the run and puts the list back when it exits (a SIGKILL
# leaves CC on the list; two runs at once may leave it there too, or
# take it off under the other). CC=bbr (this
# machine kind's default) paces every flow across the veth: ecx's and raw
# TCP's 7 MiB loads at about 2.2 GB/s instead of 6-9, and loads of 512
# KiB at 1.4-5.7 GB/s from one run to the next (docs/deploy.md,
# "The congestion control decides these figures").
#
# Usage: bench/two_hosts.sh PATH/TO/ecx [RUNS]
set -u
ECX=$(readlink -f "${1:?usage: two_hosts.sh PATH/TO/ecx [RUNS]}")
RUNS=${2:-5}
VIA=${VIA:-tcp}
CC=${CC:-cubic}
PY=/usr/bin/python3
case "$RUNS" in '' | *[!0-9]* | 0)
	echo "two_hosts.sh: RUNS must be a positive number" >&2
	exit 2
	;;
esac
if [ "${PUSH:-0}" = only ] && [ "${LEAD:-0}" = only ]; then
	echo "two_hosts.sh: PUSH=only and LEAD=only: choose one" >&2
	exit 2
fi
perftest=ucx_perftest
[ "${PUSH:-0}" = only ] || [ "${LEAD:-0}" = only ] && perftest=
missing=
for c in $perftest unshare ip sysctl timeout "$PY"; do
	command -v "$c" >/dev/null || missing="$missing $c"
done
if [ -n "$missing" ]; then
	echo "two_hosts.sh: missing:$missing" >&2
	exit 2
fi
if [ "$(id -u)" != 0 ]; then
	echo "two_hosts.sh: needs root (network namespaces)" >&2
	exit 2
fi
case " $(sysctl -n net.ipv4.tcp_available_congestion_control) " in
*" $CC "*) ;;
*)
	echo "two_hosts.sh: CC=$CC: not a congestion control this kernel has" \
		"loaded (net.ipv4.tcp_available_congestion_control:" \
		"$(sysctl -n net.ipv4.tcp_available_congestion_control);" \
		"modprobe tcp_$CC may add it)" >&2
	exit 2
	;;
esac
# Every server and client runs under `timeout`, so a failed connect
# cannot hang the script; each step runs in the background and is waited
# for, so INT and TERM reach their traps at once.
T=(timeout -k 5 120)
allowed=$(sysctl -n net.ipv4.tcp_allowed_congestion_control)
A=ecxb-a-$$
B=ecxb-b-$$
VA=ecxba$$
VB=ecxbb$$
work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
	# What they started lives on in the namespaces (a killed `timeout`
	# leaves its command): the consumer in B, its producer and raw TCP
	# sender in A, any ucx_perftest or streams.py.
	for ns in "$A" "$B"; do
		ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
	done
	wait 2>/dev/null
	ip link del "$VA" 2>/dev/null # if setup stopped before moving it
	ip netns del "$A" 2>/dev/null
	ip netns del "$B" 2>/dev/null
	[ "$(sysctl -n net.ipv4.tcp_allowed_congestion_control)" = "$allowed" ] ||
		sysctl -q -w net.ipv4.tcp_allowed_congestion_control="$allowed"
	rm -rf "$work"
}
# `bg_wait CMD...`: CMD in the background, waited for; its status.
bg_wait() {
	"$@" &
	pids+=($!)
	wait "$!"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$A" && ip netns add "$B" &&
	ip link add "$VA" type veth peer name "$VB" &&
	ip link set "$VA" netns "$A" && ip link set "$VB" netns "$B" &&
	ip -n "$A" addr add 192.0.2.1/24 dev "$VA" &&
	ip -n "$B" addr add 192.0.2.2/24 dev "$VB" &&
	ip -n "$A" link set lo up && ip -n "$B" link set lo up &&
	ip -n "$A" link set "$VA" up && ip -n "$B" link set "$VB" up ||
	{
		echo "two_hosts.sh: could not set up the namespaces" >&2
		exit 1
	}
case " $allowed " in
*" $CC "*) ;;
*)
	sysctl -q -w net.ipv4.tcp_allowed_congestion_control="$allowed $CC" || {
		echo "two_hosts.sh: CC=$CC: could not be added to" \
			"net.ipv4.tcp_allowed_congestion_control ($allowed)" >&2
		exit 1
	}
	;;
esac
for ns in "$A" "$B"; do
	ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_congestion_control="$CC" || {
		echo "two_hosts.sh: CC=$CC: could not be set in the namespaces" >&2
		exit 1
	}
done

# `in_ns NS CMD...`: CMD in NS with its own IPC namespace and /dev/shm.
cat >"$work/in_ns" <<'SH'
#!/bin/sh
ns=$1
shift
exec ip netns exec "$ns" unshare --ipc --mount --propagation private \
	sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$@"' sh "$@"
SH
# The benchmark's peer wrapper: its producer and raw TCP sender run in A.
printf '#!/bin/sh\nexec %s %s "$@"\n' "$work/in_ns" "$A" >"$work/peer"
chmod +x "$work/in_ns" "$work/peer"

# ucx_perftest with the segment sizes ecx sets (or those in the environment).
seg="UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-256k} UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-1m}"
# `perftest_client TEST SIZE PORT N RUN LABEL`: the client side in B, its
# last result line appended to perftest$RUN.txt under LABEL; fails if
# ucx_perftest did.
perftest_client() {
	set -o pipefail
	# shellcheck disable=SC2086
	"${T[@]}" env UCX_TLS=tcp $seg ${lat:-} UCX_NET_DEVICES=$VB "$work/in_ns" "$B" \
		ucx_perftest 192.0.2.1 -p "$3" -t "$1" -s "$2" -n "$4" -w 20 \
		-f 2>/dev/null |
		awk -v t="$6" -v sz="$2" 'NF > 0 && $1 ~ /^[0-9]/ {
			last = $0 } END { print t, sz, last }' \
			>>"$work/perftest$5.txt"
}
# `py_runs WHAT NS SCRIPT ARGS...`: bench/SCRIPT RUNS times under
# /usr/bin/python3 in namespace NS, with this build's library, each run
# headed "## WHAT run N"; the first that fails ends the script.
py_runs() {
	what=$1 ns=$2 script=$3
	shift 3
	lib=${ECX_LIBRARY:-$(dirname "$ECX")/../libecx.so}
	here=$(dirname "$(readlink -f "$0")")
	for r in $(seq "$RUNS"); do
		echo "## $what run $r, load average $(cut -d' ' -f1-3 /proc/loadavg)"
		bg_wait timeout -k 5 300 env ECX_LIBRARY="$(readlink -f "$lib")" \
			PYTHONPATH="$here/../python" "$work/in_ns" "$ns" "$PY" \
			"$here/$script" "$@" || {
			echo "two_hosts.sh: $what run $r failed" >&2
			exit 1
		}
	done
}
# PUSH=1 (or only): pushes over Mooncake's wire across the same pair,
# bench/push_mooncake.py RUNS times, its consumer side in B, its producer
# and raw TCP sender in A (PUSH=only: nothing else).
push_runs() {
	py_runs push "$A" push_mooncake.py --consumer-wrap "$work/in_ns $B" \
		--consumer-host 192.0.2.2 --producer-host 192.0.2.1
}
# LEAD=1 (or only): bench/rndv_lead.py RUNS times, its consumer in B,
# its two producers in A.
lead_runs() {
	py_runs "rendezvous lead" "$B" rndv_lead.py \
		--producer-wrap "$work/in_ns $A" --producer-host 192.0.2.1
}
if [ "${LEAD:-0}" = only ]; then
	echo "# the rendezvous lead across two hosts: namespaces joined by a" \
		"veth, $(nproc) cores, $RUNS runs, TCP congestion control $CC"
	lead_runs
	exit 0
fi
if [ "${PUSH:-0}" = only ]; then
	echo "# pushes across two hosts: namespaces joined by a veth," \
		"$(nproc) cores, $RUNS runs, TCP congestion control $CC"
	push_runs
	exit 0
fi
echo "# two hosts: namespaces joined by a veth, $(nproc) cores, $RUNS runs," \
	"TCP congestion control $CC, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$RUNS"); do
	echo "## run $r, load average $(cut -d' ' -f1-3 /proc/loadavg)"
	bg_wait timeout -k 5 900 "$work/in_ns" "$B" "$ECX" bench transfer \
		--via "$VIA" --json --peer-wrap "$work/peer" --peer-addr 192.0.2.1 \
		>"$work/run$r.json" 2>"$work/run$r.err" || {
		echo "two_hosts.sh: run $r failed: $(tail -3 "$work/run$r.err")" >&2
		exit 1
	}
	for t in ucp_put_bw:7340032 ucp_put_bw:65536 ucp_am_bw:7340032 \
		ucp_am_bw:65536 ucp_am_bw:1048576 ucp_am_lat:1048576:rndv ucp_am_lat:1048576 \
		ucp_am_lat:65536:rndv ucp_am_lat:65536 ucp_am_lat:256; do
		IFS=: read -r test sz mode <<<"$t"
		# Latency: one message at a time each way, both sides polling,
		# eagerly (as a pull of about 300 bytes goes) or by rendezvous
		# (as ecx sends data of 64 KiB and more); a load's floor takes
		# the faster of the two.
		lat= label=$test
		case $test:$mode in
		*_lat:rndv) lat=UCX_RNDV_THRESH=1k label=${test}_rndv ;;
		*_lat:) lat=UCX_RNDV_THRESH=inf ;;
		*_bw:) ;;
		*)
			echo "two_hosts.sh: $t: no such test" >&2
			exit 2
			;;
		esac
		port=$((20000 + RANDOM % 20000))
		"${T[@]}" env UCX_TLS=tcp $seg $lat UCX_NET_DEVICES=$VA "$work/in_ns" "$A" \
			ucx_perftest -p "$port" >/dev/null 2>&1 &
		pids+=($!)
		srv=$!
		sleep 0.5
		n=$((sz > 1000000 ? 200 : 4000))
		bg_wait perftest_client "$test" "$sz" "$port" "$n" "$r" \
			"$label" ||
			{
				echo "two_hosts.sh: run $r: ucx_perftest $label" \
					"$sz failed; its row is left out" >&2
				kill "$srv" 2>/dev/null
			}
		wait "$srv" 2>/dev/null
	done
done

# Would more streams (ecx lanes: several endpoints per producer) move more
# across this link? Raw TCP with 1, 2 and 4 streams, 256 MiB in all, each
# receiver landing its share in 7 MiB destinations in turn.
cat >"$work/streams.py" <<'PY'
import socket, sys, threading, time
n, item, k = 256 << 20, 7 << 20, int(sys.argv[2])
def recv_all(c, share):
    dst = memoryview(bytearray(2 * item)); got = 0
    while got < share:
        off = (got // item % 2) * item + got % item
        r = c.recv_into(dst[off:off + min(item - got % item, share - got)])
        if not r: break
        got += r
    c.send(b"k")
if sys.argv[1] == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("192.0.2.1", 47998)); s.listen(k); print("up", flush=True)
    cs = [s.accept()[0] for _ in range(k)]
    ts = [threading.Thread(target=recv_all, args=(c, n // k)) for c in cs]
    [t.start() for t in ts]; [t.join() for t in ts]
else:
    cs = [socket.create_connection(("192.0.2.1", 47998)) for _ in range(k)]
    for c in cs: c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = b"x" * (1 << 20)
    def send(c):
        for _ in range(n // k >> 20): c.sendall(data)
        c.recv(1)
    ts = [threading.Thread(target=send, args=(c,)) for c in cs]
    t = time.perf_counter()
    [x.start() for x in ts]; [x.join() for x in ts]
    print("%.2f" % (n / (time.perf_counter() - t) / 1e9))
PY
line="raw TCP streams, 256 MiB, GB/s:"
for k in 1 2 4 1 2 4; do
	"${T[@]}" ip netns exec "$A" $PY "$work/streams.py" server "$k" >"$work/st.srv" &
	pids+=($!)
	srv=$!
	for _ in $(seq 50); do grep -q up "$work/st.srv" && break; sleep 0.1; done
	if bg_wait "${T[@]}" ip netns exec "$B" $PY "$work/streams.py" client "$k" \
		>"$work/st.cli" 2>/dev/null; then
		line="$line $k: $(cat "$work/st.cli")"
	else
		line="$line $k: failed"
		kill "$srv" 2>/dev/null
	fi
	wait "$srv" 2>/dev/null
done

$PY - "$work" "$RUNS" <<'PY'
import json, statistics, sys
work, runs = sys.argv[1], int(sys.argv[2])
rows = {}
for r in range(1, runs + 1):
    for line in open(f"{work}/run{r}.json"):
        o = json.loads(line)
        if o.get("bench") == "transfer" and o.get("case") == "integrity":
            o["run"] = r
            rows.setdefault(("hash", o["size"], o["batch"], o["via"]),
                            []).append(o)
            continue
        if o.get("bench") != "transfer" or o.get("case") not in (
                "tcp", "mooncake"):
            continue
        key = (o["size"], o["batch"], o["cache"], o["case"])
        o["run"] = r
        rows.setdefault(key, []).append(o)
    pf = open(f"{work}/perftest{r}.txt").read().split("\n")
    for line in pf:
        f = line.split()
        # ucx_perftest -f: TEST SIZE iterations, latency (us) median,
        # average, overall, bandwidth (MB/s) average, overall, message
        # rate average, overall. A latency test: the median latency, one
        # way; else the overall bandwidth.
        if len(f) >= 7 and "_lat" in f[0]:
            rows.setdefault(("perftestlat", int(f[1]), f[0]), []).append(
                (r, float(f[3])))
        elif len(f) >= 7:
            rows.setdefault(("perftest", int(f[1]), f[0]), []).append(
                (r, float(f[-3]) * 1048576 / 1e9))
print("%-8s %-6s %-5s %-4s  %-23s %-23s %s" % (
    "via", "item", "batch", "", "ecx GB/s min/med/max", "raw TCP GB/s",
    "ecx/raw TCP min/median/max (spread: min vs median); each run's"))
for key in sorted(k for k in rows if not k[0].startswith("perftest") and
                  k[0] != "hash"):
    v = rows[key]
    e = [o["gbps"] for o in v]
    b = [o["baseline_gbps"] for o in v]
    q = [o["ratio"] for o in v]
    med = statistics.median(q)
    print("%-8s %-6s x%-4d %-4s  %5.2f %5.2f %5.2f       %5.2f %5.2f %5.2f"
          "       %.2f %.2f %.2f (min %.0f%% below); %s" % (
              key[3], key[0], key[1], key[2], min(e), statistics.median(e),
              max(e),
              min(b), statistics.median(b), max(b), min(q), med, max(q),
              100 * (1 - min(q) / med), " ".join("%.2f" % x for x in q)))
for key in sorted(k for k in rows if k[0] == "perftest"):
    v = [g for _, g in rows[key]]
    print("ucx_perftest %s %d B over TCP: %.2f %.2f %.2f GB/s "
          "(min/median/max)" % (key[2], key[1], min(v), statistics.median(v),
                                max(v)))
for key in sorted(k for k in rows if k[0] == "perftestlat"):
    v = [u for _, u in rows[key]]
    print("ucx_perftest %s %d B over TCP, %s, one way: %.1f %.1f %.1f us "
          "(min/median/max)" % (
              key[2].replace("_rndv", ""), key[1],
              "rendezvous" if key[2].endswith("_rndv") else "eager", min(v),
              statistics.median(v), max(v)))
# The tail of single loads: ecx's p99 over its p50 per run (--check's
# target on one host: 3x at most), beside raw TCP's.
for key in sorted(k for k in rows if not k[0].startswith("perftest") and
                  k[0] != "hash" and k[1] == 1 and k[2] == "warm"):
    v = rows[key]
    print("%s %s x1 warm tail, p99/p50 per run: ecx %s; raw TCP %s" % (
        key[3], key[0],
        " ".join("%.1f" % (o["p99_us"] / o["p50_us"]) if o["p50_us"] > 0
                 else "-" for o in v),
        " ".join("%.1f" % (o["baseline_p99_us"] / o["baseline_p50_us"])
                 if o["baseline_p50_us"] > 0 else "-" for o in v)))
# The price of integrity: warm loads by a consumer checking each item's
# XXH3 against the same loads by one that does not, alternating (ecx
# bench's hash rows).
for key in sorted(k for k in rows if k[0] == "hash"):
    v = rows[key]
    q = [o["ratio"] for o in v]
    print("%s %s x%d hash (integrity: checking / not), GB/s checking %s, "
          "not %s; ratio %.2f %.2f %.2f (min/median/max); runs: %s" % (
              key[3], key[1], key[2],
              " ".join("%.2f" % o["gbps_checking"] for o in v),
              " ".join("%.2f" % o["gbps_plain"] for o in v), min(q),
              statistics.median(q), max(q), " ".join("%.2f" % x for x in q)))
# A single load carried by UCX is at least two of its messages, the pull
# (about 300 bytes, eager) and the data (the faster of eager and
# rendezvous): their one-way latencies summed, per run, against the whole
# warm load of raw TCP and of ecx in the same run (64 KiB and 1 MiB x1).
l256 = dict(rows.get(("perftestlat", 256, "ucp_am_lat"), []))
for label, size in (("64KiB", 65536), ("1MiB", 1048576)):
    eg = dict(rows.get(("perftestlat", size, "ucp_am_lat"), []))
    rv = dict(rows.get(("perftestlat", size, "ucp_am_lat_rndv"), []))
    ld = {r: min(u for u in (eg.get(r), rv.get(r)) if u is not None)
          for r in set(eg) | set(rv)}
    one = [o for o in rows.get((label, 1, "warm", "tcp"), [])
           if o["run"] in ld and o["run"] in l256]
    if not one:
        continue
    us = lambda gbps: size / (gbps * 1e3) if gbps > 0 else float("inf")
    fl = [ld[o["run"]] + l256[o["run"]] for o in one]
    raw = [us(o["baseline_gbps"]) for o in one]
    ecx = [us(o["gbps"]) for o in one]
    print("%s x1 warm, us per load, runs %s: UCX's two messages (256 B "
          "+ %s one way, the faster way) %s; raw TCP %s; ecx %s; raw TCP / UCX's two: "
          "%s" % (label, " ".join(str(o["run"]) for o in one), label,
                  " ".join("%.0f" % x for x in fl),
                  " ".join("%.0f" % x for x in raw),
                  " ".join("%.0f" % x for x in ecx),
                  " ".join("%.2f" % (b / a) for a, b in zip(fl, raw))))
# A 7 MiB load carried by UCX moves no faster than UCX's own stream of 7
# MiB messages (the faster of ucp_put_bw and ucp_am_bw: many in flight,
# no reply): per run against raw TCP's 7 MiB x1 warm load and ecx's.
bw = {}
for t in ("ucp_put_bw", "ucp_am_bw"):
    for r, g in rows.get(("perftest", 7340032, t), []):
        bw[r] = max(bw.get(r, 0.0), g)
one = [o for o in rows.get(("7MiB", 1, "warm", "tcp"), []) if o["run"] in bw]
if one:
    print("7MiB x1 warm, GB/s, runs %s: UCX's own stream (the faster of "
          "ucp_put_bw and ucp_am_bw) %s; raw TCP %s; ecx %s; UCX's own / "
          "raw TCP: %s" % (" ".join(str(o["run"]) for o in one),
              " ".join("%.2f" % bw[o["run"]] for o in one),
              " ".join("%.2f" % o["baseline_gbps"] for o in one),
              " ".join("%.2f" % o["gbps"] for o in one),
              " ".join("%.2f" % (bw[o["run"]] / o["baseline_gbps"])
                       if o["baseline_gbps"] > 0 else "-" for o in one)))
# The batches against UCX's own stream of messages of their item's size
# (ucp_am_bw: many in flight, no reply), per run: what UCX itself moves
# across this link at that size.
for label, size in (("64KiB", 65536), ("1MiB", 1048576)):
    am = dict(rows.get(("perftest", size, "ucp_am_bw"), []))
    for key in sorted(k for k in rows if k[0] == label and k[1] > 1 and
                      k[2] == "warm"):
        got = [o for o in rows[key] if am.get(o["run"])]
        q = [o["gbps"] / am[o["run"]] for o in got]
        if q:
            print("%s %s x%d warm / ucp_am_bw %s, same run: %.2f %.2f %.2f "
                  "(min/median/max); runs %s: %s" % (
                      key[3], label, key[1], label, min(q),
                      statistics.median(q), max(q),
                      " ".join(str(o["run"]) for o in got),
                      " ".join("%.2f" % x for x in q)))
# ecx's warm 7 MiB loads against UCX's own puts of 7 MiB in the same run.
put = dict(rows.get(("perftest", 7340032, "ucp_put_bw"), []))
for key in sorted(k for k in rows if k[0] == "7MiB" and k[2] == "warm"):
    q = [o["gbps"] / put[o["run"]] for o in rows[key] if put.get(o["run"])]
    if q:
        print("%s 7MiB x%d warm / ucp_put_bw 7 MiB, same run: %.2f %.2f "
              "%.2f (min/median/max); %s" % (
                  key[3], key[1], min(q), statistics.median(q), max(q),
                  " ".join("%.2f" % x for x in q)))
PY
echo "$line (the streams are Python threads: the sending and receiving are system calls that run in parallel)"
if [ "${PUSH:-0}" = 1 ]; then
	push_runs
fi
if [ "${LEAD:-0}" = 1 ]; then
	lead_runs
fi
