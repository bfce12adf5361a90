#!/bin/bash
# A simulated cluster of eight hosts: network namespaces joined by a bridge
# (in a namespace of its own; 198.51.100.0/24, a documentation range, on
# links that exist only inside these namespaces), every process on its own
# host's address:
#   d1 d2 d3  directory hosts: redis-server (d1 the master, d2 and d3 its
#             replicas), redis-sentinel (quorum 2, down-after 1000 ms) and
#             an 'ecx registry --store redis+sentinel://...' front
#   p1 p2 p3  producers (ecx-test-peer): p1 and p2 publish to the sentinel
#             URL, p3 through d2's front; entries live 3 s, renewed every 1 s
#   c1 c2     consumers (ecx-cluster-load) that look up and load without
#             pause, checking every byte: c1 through the sentinel URL, c2
#             through the three fronts
# Then, in turn: the Redis master killed; a producer stopped (SIGSTOP) and
# resumed; a producer killed and started again; a producer's link cut and
# restored; a sentinel restarted; a front killed and started again; all
# three directory hosts cut off and back. Per phase it prints a table
# (loads verified, loads failed with a typed error, lookups that missed,
# the longest call against its bound, the time from the fault until every
# call succeeds again, bytes wrong) and fails on a wrong byte, a call past
# its bound, a phase that does not recover, an ecx process that exited, or
# a master failover slower than its target. Everything is removed at the
# end. Needs root and 'ip netns' (CI runs as root); otherwise it reports a
# skip to ctest (exit 77).
#
# Usage: test_cluster.sh ECX ECX_TEST_PEER ECX_CLUSTER_LOAD [--long]
#   (--long: 64 items per producer, 20 s per phase; the default, for CI,
#   16 items and 5 s)
set -u
ECX=$(readlink -f "${1:?usage: test_cluster.sh ECX PEER LOAD [--long]}")
PEER=$(readlink -f "${2:?usage}")
LOAD=$(readlink -f "${3:?usage}")
LONG=${4:-}
PY=/usr/bin/python3
SCALE=${ECX_TEST_TIME_SCALE:-1}
if [ "$LONG" = --long ]; then ITEMS=64 DWELL=20; else ITEMS=16 DWELL=5; fi
BYTES=$((256 << 10))
TIMEOUT=2000 # every consumer call's timeout (ms)
PW=clusterpw
pass=0
fail=0
ok() { echo "ok - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1"; fail=$((fail + 1)); }

if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null ||
	! ip netns add "ecx-probe-$$" 2>/dev/null; then
	echo "SKIP - needs root and network namespaces ('ip netns')"
	echo "0 passed, 0 failed, 1 skipped"
	exit 77
fi
ip netns del "ecx-probe-$$"
for b in redis-server redis-sentinel redis-cli; do
	if ! command -v $b >/dev/null; then
		echo "SKIP - needs $b (scripts/install-deps.sh)"
		echo "0 passed, 0 failed, 1 skipped"
		exit 77
	fi
done

work=$(mktemp -d)
BR=ecx-br-$$
HOSTS="d1 d2 d3 p1 p2 p3 c1 c2"
declare -A IP=([d1]=198.51.100.11 [d2]=198.51.100.12 [d3]=198.51.100.13
	[p1]=198.51.100.21 [p2]=198.51.100.22 [p3]=198.51.100.23
	[c1]=198.51.100.31 [c2]=198.51.100.32)
declare -A PID PFD
ns() { echo "ecx-$1-$$"; }
cleanup() {
	for k in "${!PID[@]}"; do
		kill -CONT "${PID[$k]}" 2>/dev/null
		kill -9 "${PID[$k]}" 2>/dev/null
	done
	wait 2>/dev/null
	for h in $HOSTS; do ip netns del "$(ns "$h")" 2>/dev/null; done
	ip netns del "$BR" 2>/dev/null
	rm -rf "$work"
}
trap cleanup EXIT
now_ms() { date +%s%3N; }

# The hosts, each with one veth into the bridge's namespace.
ip netns add "$BR" && ip -n "$BR" link add br0 type bridge &&
	ip -n "$BR" link set br0 up && ip -n "$BR" link set lo up ||
	{ bad "bridge"; exit 1; }
for h in $HOSTS; do
	n=$(ns "$h")
	ip netns add "$n" &&
		ip link add "e$h$$" type veth peer name "i$h$$" &&
		ip link set "e$h$$" netns "$BR" &&
		ip -n "$BR" link set "e$h$$" master br0 &&
		ip -n "$BR" link set "e$h$$" up &&
		ip link set "i$h$$" netns "$n" &&
		ip -n "$n" link set "i$h$$" name eth0 &&
		ip -n "$n" addr add "${IP[$h]}/24" dev eth0 &&
		ip -n "$n" link set eth0 up && ip -n "$n" link set lo up ||
		{ bad "host $h"; exit 1; }
done
ok "8 hosts on a bridge"
on() { local h=$1; shift; ip netns exec "$(ns "$h")" "$@"; }
# The same for a command put in the background (cmd &): the subshell
# becomes the command, so $! is its pid.
bg() { local h=$1; shift; exec ip netns exec "$(ns "$h")" "$@"; }

SURL="redis+sentinel://:$PW@${IP[d1]}:26379,${IP[d2]}:26379,${IP[d3]}:26379/ecx"
FRONTS="http://${IP[d1]}:9018,http://${IP[d2]}:9018,http://${IP[d3]}:9018"
rcli() { local h=$1; shift; on "$h" redis-cli -h "${IP[$h]}" "$@" 2>/dev/null; }

start_redis() {
	local h=$1
	mkdir -p "$work/$h"
	local of=()
	[ "$h" != d1 ] && of=(--replicaof "${IP[d1]}" 6379)
	# A restarted master comes back as a replica of the current one.
	[ -n "${2:-}" ] && of=(--replicaof "$2" 6379)
	bg "$h" redis-server --port 6379 --bind "${IP[$h]}" --save "" \
		--appendonly no --dir "$work/$h" --requirepass $PW \
		--masterauth $PW --logfile "$work/$h/redis.log" "${of[@]}" &
	PID[redis_$h]=$!
}
start_sentinel() {
	local h=$1
	[ -f "$work/$h/sentinel.conf" ] || cat >"$work/$h/sentinel.conf" <<EOF
port 26379
bind ${IP[$h]}
dir $work/$h
logfile $work/$h/sentinel.log
sentinel monitor ecx ${IP[d1]} 6379 2
sentinel auth-pass ecx $PW
sentinel down-after-milliseconds ecx 1000
sentinel failover-timeout ecx 3000
EOF
	bg "$h" redis-sentinel "$work/$h/sentinel.conf" &
	PID[sentinel_$h]=$!
}
start_front() {
	local h=$1
	bg "$h" "$ECX" registry --bind "${IP[$h]}" --port 9018 --store "$SURL" \
		>"$work/$h/front.out" 2>"$work/$h/front.err" &
	PID[front_$h]=$!
}
for h in d1 d2 d3; do start_redis $h; done
sleep 0.5
for h in d1 d2 d3; do start_sentinel $h; done
# Ready when each sentinel knows the master, both replicas and the other
# two sentinels.
ready=0
for _ in $(seq 200); do
	ready=0
	for h in d1 d2 d3; do
		m=$(rcli $h -p 26379 SENTINEL master ecx | paste -sd' ')
		case "$m" in *"num-slaves 2 "*"num-other-sentinels 2 "*) ready=$((ready + 1)) ;; esac
	done
	[ $ready = 3 ] && break
	sleep 0.2
done
[ $ready = 3 ] && ok "3 Redis (1 master, 2 replicas) and 3 sentinels" ||
	{ bad "sentinels not ready"; exit 1; }
for h in d1 d2 d3; do start_front $h; done

start_producer() {
	local h=$1 reg=$2
	rm -f "$work/$h.in"
	mkfifo "$work/$h.in"
	bg "$h" "$PEER" producer --registry "$reg" --bind "${IP[$h]}" \
		--transport tcp --registry-ttl 3 --timeout 2000 \
		--capacity $((64 << 20)) <"$work/$h.in" >"$work/$h.out" \
		2>>"$work/$h.err" &
	PID[$h]=$!
	local fd
	exec {fd}>"$work/$h.in"
	PFD[$h]=$fd
	for _ in $(seq 100); do grep -q ready "$work/$h.out" && break; sleep 0.1; done
	for i in $(seq 0 $((ITEMS - 1))); do
		echo "put $h-$i uint8 $BYTES" >&"$fd"
	done
	for _ in $(seq 100); do
		[ "$(grep -c '^ok' "$work/$h.out")" -ge "$ITEMS" ] && return 0
		sleep 0.1
	done
	return 1
}
stop_producer() {
	kill -9 "${PID[$1]}" 2>/dev/null
	wait "${PID[$1]}" 2>/dev/null
	unset "PID[$1]"
	local fd=${PFD[$1]}
	exec {fd}>&-
}
for _ in $(seq 50); do
	on p3 curl -sf "http://${IP[d2]}:9018/healthz" >/dev/null 2>&1 && break
	sleep 0.1
done
start_producer p1 "$SURL" && start_producer p2 "$SURL" &&
	start_producer p3 "http://${IP[d2]}:9018" &&
	ok "3 producers put and published $ITEMS items of $BYTES bytes each" ||
	{ bad "producers: $(cat "$work"/p?.err | head -5)"; exit 1; }

IDS="p1:$ITEMS,p2:$ITEMS,p3:$ITEMS"
bg c1 "$LOAD" --registry "$SURL" --ids "$IDS" --bytes $BYTES \
	--timeout $TIMEOUT --log "$work/c1.log" >"$work/c1.out" 2>"$work/c1.err" &
PID[c1]=$!
bg c2 "$LOAD" --registry "$FRONTS" --ids "$IDS" --bytes $BYTES \
	--timeout $TIMEOUT --log "$work/c2.log" >"$work/c2.out" 2>"$work/c2.err" &
PID[c2]=$!
sleep 1

# Each phase: "NAME FAULT_MS FAULT_END_MS END_MS" in phases.txt (the
# fault ends when what was done is undone: SIGCONT, a restart, link up).
phase() {
	echo "$1 $2 ${3:-$2} $(now_ms)" >>"$work/phases.txt"
	echo "# phase $1 done"
}
master_host() {
	local a s
	for s in d1 d2 d3; do
		a=$(rcli $s -p 26379 SENTINEL get-master-addr-by-name ecx | head -1)
		[ -n "$a" ] && break
	done
	for h in d1 d2 d3; do [ "${IP[$h]}" = "$a" ] && echo $h; done
}
# How many of the producers' ids the master lists.
listed() {
	local m
	m=$(master_host)
	[ -n "$m" ] || { echo 0; return; }
	rcli "$m" -a $PW --no-auth-warning --scan --pattern 'ecx:p*' | wc -l
}

# After a fault is undone: until the master lists every id again (at
# most 15 s: a phase that has not recovered by then fails), and 2 s more.
settle() {
	for _ in $(seq 75); do
		[ "$(listed)" -ge $((3 * ITEMS)) ] && break
		sleep 0.2
	done
	sleep 2
}

t=$(now_ms)
sleep "$DWELL"
phase steady "$t" "$t"

# 1. The Redis master killed (SIGKILL); started again afterwards (as a
# replica of the new master).
old=$(master_host)
t=$(now_ms)
kill -9 "${PID[redis_$old]}"
wait "${PID[redis_$old]}" 2>/dev/null
new=""
for _ in $(seq 300); do
	new=$(master_host)
	[ -n "$new" ] && [ "$new" != "$old" ] && break
	sleep 0.05
done
t_new=$(now_ms)
n_all=$((3 * ITEMS))
relisted=""
for _ in $(seq 200); do
	[ "$(listed)" -ge "$n_all" ] && { relisted=$(now_ms); break; }
	sleep 0.1
done
sleep "$DWELL"
start_redis "$old" "${IP[$new]}"
phase master_killed "$t" "$t"
echo "# failover: $old -> $new in $((t_new - t)) ms; all $n_all ids listed on the new master $((${relisted:-0} - t_new)) ms after it was named"
echo "failover_ms $((t_new - t)) relisted_ms $((${relisted:-0} - t_new))" >"$work/failover.txt"
[ -n "$relisted" ] && [ "$new" != "$old" ] &&
	ok "the sentinels moved the master ($old -> $new) and every id is listed there again" ||
	bad "after the master was killed: new=$new, listed $(listed) of $n_all"
sleep 2

# 2. A producer stopped (SIGSTOP) and resumed.
t=$(now_ms)
kill -STOP "${PID[p1]}"
sleep "$DWELL"
kill -CONT "${PID[p1]}"
e=$(now_ms)
settle
phase producer_stopped "$t" "$e"

# 3. A producer killed, started again.
t=$(now_ms)
stop_producer p2
sleep "$DWELL"
e=$(now_ms)
start_producer p2 "$SURL" || bad "p2 did not start again"
settle
phase producer_killed "$t" "$e"

# 4. A producer's link cut and restored.
t=$(now_ms)
on p3 ip link set eth0 down
sleep "$DWELL"
on p3 ip link set eth0 up
e=$(now_ms)
settle
phase link_down "$t" "$e"

# 5. A sentinel restarted (the one on the master's host).
m=$(master_host)
t=$(now_ms)
kill -9 "${PID[sentinel_$m]}"
wait "${PID[sentinel_$m]}" 2>/dev/null
sleep 1
e=$(now_ms)
start_sentinel "$m"
sleep "$DWELL"
phase sentinel_restarted "$t" "$e"

# 6. A front killed (c2's first registry), started again.
t=$(now_ms)
kill -9 "${PID[front_d1]}"
wait "${PID[front_d1]}" 2>/dev/null
sleep "$DWELL"
e=$(now_ms)
start_front d1
sleep 2
phase front_killed "$t" "$e"

# 7. All three directory hosts cut off, and back.
t=$(now_ms)
for h in d1 d2 d3; do on $h ip link set eth0 down; done
sleep "$DWELL"
for h in d1 d2 d3; do on $h ip link set eth0 up; done
e=$(now_ms)
settle
phase directory_down "$t" "$e"

# Every ecx process still there.
gone=""
for k in p1 p2 p3 c1 c2 front_d1 front_d2 front_d3; do
	kill -0 "${PID[$k]}" 2>/dev/null || gone="$gone $k"
done
[ -z "$gone" ] && ok "no ecx process exited" || bad "exited:$gone"
kill -TERM "${PID[c1]}" "${PID[c2]}"
wait "${PID[c1]}" "${PID[c2]}" 2>/dev/null
unset "PID[c1]" "PID[c2]"

# The table, and its checks.
$PY - "$work" "$TIMEOUT" "$SCALE" <<'PY'
import sys
work, timeout, scale = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# Bounds: a lookup waits up to the timeout per registry asked; a load the
# timeout + 200 ms (ecx.h).
bounds = {"c1": {"L": timeout, "D": timeout + 200},
          "c2": {"L": 3 * timeout, "D": timeout + 200}}
calls = []
for c in ("c1", "c2"):
    for line in open(f"{work}/{c}.log"):
        f = line.split()
        if len(f) < 5:
            continue
        calls.append((int(f[1]), float(f[2]), f[0], f[3], c,
                      f[4] == "1" if f[0] == "D" else False))
calls.sort()
phases = [l.split() for l in open(f"{work}/phases.txt")]
hdr = ("phase", "loads ok", "held", "failed", "lookup errors", "missed",
       "longest / bound", "recovery", "after the fault", "wrong")
rows, bad = [], []
fo = open(f"{work}/failover.txt").read().split()
for name, t0, te, t1 in phases:
    t0, te, t1 = int(t0), int(te), int(t1)
    ph = [x for x in calls if t0 <= x[0] < t1]
    ok = sum(1 for x in ph if x[2] == "D" and x[3] == "ok")
    held = sum(1 for x in ph if x[2] == "D" and x[3] == "ok" and x[5])
    failed = sum(1 for x in ph if x[2] == "D" and x[3] not in ("ok", "wrong"))
    missed = sum(1 for x in ph if x[2] == "L" and x[3] == "miss")
    lerr = sum(1 for x in ph if x[2] == "L" and x[3] not in ("ok", "miss"))
    wrong = sum(1 for x in ph if x[3] == "wrong")
    worst = max(ph, key=lambda x: x[1] / bounds[x[4]][x[2]], default=None)
    longest = (f"{worst[1]:.0f} / {bounds[worst[4]][worst[2]]} ms"
               if worst else "-")
    # Recovery: from the fault to the first success after the last call
    # that failed (a lookup error, a miss, a failed load).
    fails = [x for x in ph if x[3] != "ok"]
    if name == "steady" or not fails:
        rec = "-" if name == "steady" else "0 (none failed)"
        recms = 0
        after_end = "-"
    else:
        last = fails[-1][0]
        after = [x for x in ph if x[0] > last and x[2] == "D" and x[3] == "ok"]
        recms = after[0][0] - t0 if after else None
        rec = f"{recms} ms" if after else "never"
        after_end = (f"{max(0, after[0][0] - te)} ms" if after and te > t0
                     else "-")
        if not after:
            bad.append(f"{name}: did not recover")
    if wrong:
        bad.append(f"{name}: {wrong} wrong")
    if worst and worst[1] > bounds[worst[4]][worst[2]] * 1.0 + 250 * scale:
        bad.append(f"{name}: a call took {worst[1]:.0f} ms")
    if ok == 0:
        bad.append(f"{name}: nothing loaded")
    # The target: lookups work again within the failover (until the
    # sentinels name the new master) plus 1 s.
    if name == "master_killed" and recms is not None and \
            recms > int(fo[1]) + 1000 * scale:
        bad.append(f"master_killed: recovered after {recms} ms (the "
                   f"failover took {fo[1]} ms)")
    rows.append((name, ok, held, failed, lerr, missed, longest, rec,
                 after_end, wrong))
w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
fmt = "| " + " | ".join("%%-%ds" % x for x in w) + " |"
print(fmt % hdr)
print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for r in rows:
    print(fmt % tuple(str(v) for v in r))
fo = open(f"{work}/failover.txt").read().split()
print(f"# failover {fo[1]} ms, ids listed again {fo[3]} ms after. "
      "loads ok: verified byte for byte; held: of them, loads made with "
      "an earlier lookup while lookups failed; failed: loads failed with "
      "a typed error; recovery: from the fault to the first load after "
      "the last failed call; after the fault: the same from when the "
      "fault was undone (SIGCONT, restart, link up)")
for b in bad:
    print("FAIL -", b)
sys.exit(1 if bad else 0)
PY
[ $? = 0 ] && ok "every phase: no wrong byte, every call within its bound, recovered" ||
	bad "the table's checks"
# ECX_CLUSTER_LOGS=DIR keeps the logs (the calls, the phases, stderr).
if [ -n "${ECX_CLUSTER_LOGS:-}" ]; then
	mkdir -p "$ECX_CLUSTER_LOGS"
	cp "$work"/*.log "$work"/*.err "$work"/*.txt "$ECX_CLUSTER_LOGS"/ 2>/dev/null
	for h in d1 d2 d3; do
		for f in front.err redis.log sentinel.log; do
			cp "$work/$h/$f" "$ECX_CLUSTER_LOGS/$h-$f" 2>/dev/null
		done
	done
fi
echo "$pass passed, $fail failed"
[ $fail = 0 ]
