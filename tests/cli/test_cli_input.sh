#!/bin/bash
# What a new user types and reads (issue 15, sections 3 and 4): strict
# numbers, missing arguments, file and dtype messages, signals while
# `ecx serve` loads, the ready line's evictions, a registry that is down at
# start, every --json output parsed by python3 -m json.tool, IPv6 and host
# names, lists of registries, and a Redis store that is down or refuses
# the registry's password. Real processes on 127.0.0.1 / ::1 and free
# ports, stopped here. Usage: test_cli_input.sh PATH/TO/ecx
# Prints one line per check and "N passed, N failed, N skipped".
set -u
ECX=$(readlink -f "${1:?usage: test_cli_input.sh PATH/TO/ecx}")
PY=/usr/bin/python3
work=$(mktemp -d)
pids=()
pass=0
fail=0
skip=0
cleanup() {
	for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
	rm -rf "$work"
}
trap cleanup EXIT
cd "$work" || exit 1

ok() { echo "ok - $1 [$SECONDS s]"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1"; fail=$((fail + 1)); }
skipped() { echo "SKIP - $1"; skip=$((skip + 1)); }
check() { # check NAME COMMAND...
	local name=$1; shift
	if "$@"; then ok "$name"; else bad "$name"; fi
}
wait_for() { # wait_for FILE REGEX [TENTHS]: up to 60 s by default
	for _ in $(seq "${3:-600}"); do
		grep -q "$2" "$1" 2>/dev/null && return 0
		sleep 0.1
	done
	return 1
}
free_port() {
	$PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
json_ok() { # json_ok FILE: every line of FILE is one JSON document
	[ -s "$1" ] || return 1
	while IFS= read -r line; do
		printf '%s' "$line" | $PY -m json.tool >/dev/null || return 1
	done <"$1"
}
# expect RC PATTERN ARGS...: ecx ARGS exits RC and stderr matches PATTERN.
expect() {
	local want=$1 pat=$2
	shift 2
	timeout 60 "$ECX" "$@" >"$work/out" 2>"$work/err"
	local rc=$?
	if [ "$rc" = "$want" ] && grep -q -- "$pat" "$work/err"; then
		ok "ecx $* -> $rc: $(head -c 150 "$work/err" | head -1)"
	else
		bad "ecx $* -> $rc (want $want, /$pat/): $(head -c 300 "$work/err")"
	fi
}

# --- numbers are parsed strictly: a usage error naming the flag ---
syn=(--bind 127.0.0.1 --port 0 --shape 4 --dtype int8)
expect 2 "bad --synthetic '-1'" serve "${syn[@]}" --synthetic -1
expect 2 "bad --synthetic '3abc'" serve "${syn[@]}" --synthetic 3abc
expect 2 "bad --synthetic '0'" serve "${syn[@]}" --synthetic 0
expect 2 "bad --count 'abc'" serve --port 0 --workload qwen --count abc
expect 2 "bad --capacity '1KiB'" serve "${syn[@]}" --synthetic 1 --capacity 1KiB
expect 2 "--capacity: 'abc' is not a size" serve "${syn[@]}" --synthetic 1 --capacity abc
expect 2 "--capacity: 'nan' is not a size" serve "${syn[@]}" --synthetic 1 --capacity nan
expect 2 "bad --port '80x'" serve "${syn[@]}" --synthetic 1 --port 80x
expect 2 "bad --zmq-port '-5'" serve "${syn[@]}" --synthetic 1 --zmq-port -5
expect 2 "bad --registry-ttl '-3'" serve "${syn[@]}" --synthetic 1 --registry-ttl -3
expect 2 "bad --transport 'foo'" serve "${syn[@]}" --synthetic 1 --transport foo
expect 2 "bad --shape '5x'" serve --port 0 --synthetic 1 --dtype int8 --shape 5x
expect 2 "bad --timeout" serve "${syn[@]}" --synthetic 1 --timeout 1e3
expect 2 "bad --threads '2x'" registry --port 0 --threads 2x
expect 2 "bad --limit '10abc'" ls --limit 10abc http://127.0.0.1:1
expect 2 "unknown --dtype 'fp32'" serve --port 0 --synthetic 1 --shape 4 --dtype fp32
expect 2 "bad --advertise 'my\"host'" serve "${syn[@]}" --synthetic 1 --advertise 'my"host'
expect 2 "bad --advertise" serve "${syn[@]}" --synthetic 1 --advertise 'a\b'
expect 2 "bad --bind" serve --bind 'no such host' --port 0 --synthetic 1 --shape 4 --dtype int8

# --- sizes take the units the docs promise, and a refusal names them ---
expect 2 "--capacity: '100XB' is not a size: .*KiB, MiB, GiB, TiB .*KB, MB, GB, TB" \
	serve "${syn[@]}" --synthetic 1 --capacity 100XB
for c in 8MB:8000000 8MiB:8388608 "0.5 MB:500000" 8m:8388608; do
	timeout 60 "$ECX" serve "${syn[@]}" --synthetic 1 --capacity "${c%%:*}" \
		--json >cap.json 2>cap.err &
	cpid=$!
	pids+=("$cpid")
	wait_for cap.json registry 300
	check "serve --capacity '${c%%:*}' makes an arena of ${c##*:} bytes" $PY -c "
import json, sys
sys.exit(json.load(open('cap.json'))['capacity'] != int(sys.argv[1]))" "${c##*:}"
	kill -TERM "$cpid"
	wait "$cpid"
	rm -f cap.json
done

# --- a duration needs its unit: a bare number is no longer 5 ms ---
expect 2 "bad --timeout '5' (a duration with its unit, ms or s, e.g. 500ms, 2s" \
	serve "${syn[@]}" --synthetic 1 --timeout 5
expect 2 "bad --timeout '5' (.*ms or s" ls --timeout 5 http://127.0.0.1:1
expect 2 "bad --timeout '5' (.*ms or s" info --timeout 5 http://127.0.0.1:1 x
expect 2 "bad --timeout '5' (.*ms or s" consume --timeout 5 http://127.0.0.1:1
expect 2 "bad --timeout '5' (.*ms or s" get --timeout 5 http://127.0.0.1:1 x -o x.npy
expect 2 "bad --timeout '0s'" ls --timeout 0s http://127.0.0.1:1
expect 2 "bad --timeout '5m'" ls --timeout 5m http://127.0.0.1:1
timeout 60 "$ECX" ls --timeout 1500ms http://127.0.0.1:1 >/dev/null 2>tmo.err
check "--timeout 1500ms is taken (the registry is down: exit 1, not 2)" test $? = 1

# --- every --help that takes a registry names each kind libecx speaks ---
for c in serve get consume info ls; do
	"$ECX" "$c" --help >help.txt 2>&1
	check "ecx $c --help names http://, redis:// and redis+sentinel:// registries" \
		bash -c "grep -q 'http://HOST' help.txt && grep -q 'redis://\[:PASSWORD@\]HOST' help.txt && grep -q 'redis+sentinel://\[:PASSWORD@\]HOST' help.txt"
done

# --- a missing argument says what is missing ---
expect 2 "missing -o FILE" get http://127.0.0.1:1 someid
expect 2 "missing ID" get http://127.0.0.1:1
expect 2 "missing ID" info http://127.0.0.1:1
expect 2 "missing REGISTRY" ls
expect 2 "missing --dtype" serve --port 0 --synthetic 3 --shape 4
expect 2 "'-' is not allowed" get http://127.0.0.1:1 someid -o -
check "get -o - wrote no file named -" test ! -e "$work/-"
expect 2 "one too many" ls http://127.0.0.1:1 extra
expect 2 "ecx get: unrecognized option '--frob'" get --frob
check "an unknown option gets a pointer to --help, not the whole usage" \
	bash -c "! grep -q '^usage:' '$work/err' && grep -q \"Run 'ecx get --help'\" '$work/err'"
expect 2 "ecx serve: option '--bind' requires an argument" serve --bind
expect 2 "give --registry .* or --port .*, not both" serve --registry http://127.0.0.1:1 --port 5

# --- files: .npy by magic bytes, dtypes, shapes, raw files ---
$PY - <<'PY'
import numpy as np
np.save("a.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
np.save("be.npy", np.arange(6, dtype=">f4"))
np.save("obj.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
np.save("cplx.npy", np.zeros(3, dtype=np.complex64))
np.save("u32.npy", np.zeros(3, dtype=np.uint32))
np.save("upper.npy", np.arange(6, dtype=np.int16))
np.zeros(6, dtype=np.float32).tofile("raw.bin")
PY
mv upper.npy UPPER.NPY
mkdir adir
f=(--bind 127.0.0.1 --port 0)
expect 2 "unknown --dtype 'fp32'" serve "${f[@]}" --dtype fp32 --shape 6 raw.bin
expect 1 "cannot read missing.bin: No such file" serve "${f[@]}" --dtype float32 --shape 6 missing.bin
expect 1 "adir is not a regular file" serve "${f[@]}" --dtype float32 --shape 6 adir
expect 2 "raw.bin holds 24 bytes, but --shape 5 of float32 makes 20" serve "${f[@]}" --dtype float32 --shape 5 raw.bin
expect 2 "raw.bin is not a .npy file: raw bytes need --dtype and --shape" serve "${f[@]}" raw.bin
expect 1 "numpy dtype >f4 is not one ecx carries: big-endian" serve "${f[@]}" be.npy
expect 1 "numpy dtype |O is not one ecx carries" serve "${f[@]}" obj.npy
expect 1 "numpy dtype <c8 is not one ecx carries: complex" serve "${f[@]}" cplx.npy
expect 1 "numpy dtype <u4 is not one ecx carries" serve "${f[@]}" u32.npy
expect 2 "a.npy is 3x4, not --shape 5x5" serve "${f[@]}" --shape 5x5 a.npy
expect 2 "a.npy holds float32, not --dtype int8" serve "${f[@]}" --dtype int8 a.npy
if [ -e /dev/full ] && [ "$(id -u)" != 0 ]; then
	chmod 000 raw.bin
	expect 1 "cannot read raw.bin: Permission denied" serve "${f[@]}" --dtype float32 --shape 6 raw.bin
	chmod 644 raw.bin
fi

# --- a standalone registry for what follows ---
for _ in $(seq 20); do
	regport=$((20000 + RANDOM % 10000))
	"$ECX" registry --bind 127.0.0.1 --port "$regport" >reg.out 2>reg.err &
	regpid=$!
	wait_for reg.out "listening on" 100 && break
	kill "$regpid" 2>/dev/null
	wait "$regpid" 2>/dev/null
done
pids+=("$regpid")
reg=http://127.0.0.1:$regport
check "registry up at $reg" grep -q "^listening on $reg\$" reg.out

# .npy known by its magic bytes, whatever its name
"$ECX" serve --bind 127.0.0.1 --registry "$reg" --capacity 16MiB \
	UPPER.NPY a.npy >npy.out 2>npy.err &
npypid=$!
pids+=("$npypid")
check "serve UPPER.NPY (a .npy file by its first bytes) and a.npy" \
	wait_for npy.out "^serving 2 items"
"$ECX" info "$reg" UPPER >info.out 2>&1
check "UPPER.NPY served as int16 of shape 6" \
	bash -c "grep -q 'dtype: *int16' info.out && grep -q 'shape: *6\$' info.out"

# --- every --json output parses (names with quotes and backslashes) ---
"$ECX" info --json "$reg" a >info.json
check "info --json parses" json_ok info.json
"$ECX" ls --json "$reg" >ls.json
check "ls --json is one JSON document (python -m json.tool reads it): 2 entries" \
	bash -c "$PY -m json.tool ls.json >/dev/null && $PY -c \"import json,sys; sys.exit(len(json.load(open('ls.json'))) != 2)\""
check "and one entry a line" test "$(grep -c '^,\?{"' ls.json)" = 2
odd='we"ird\name.npy'
"$ECX" get --json "$reg" a -o "$odd" >get.json 2>get.err
check "get --json -o 'we\"ird\\name.npy' parses" json_ok get.json
check "and names the file as given" $PY -c "
import json, sys
sys.exit(json.load(open('get.json'))['file'] != sys.argv[1])" "$odd"
check "the file is there, numpy reads it" $PY -c "
import numpy as np, sys
sys.exit(not np.array_equal(np.load(sys.argv[1]), np.arange(12, dtype=np.float32).reshape(3, 4)))" "$odd"
"$ECX" consume --json "$reg" >consume.json 2>consume.err
check "consume --json parses" json_ok consume.json

# --- the ready line counts what is kept and what was evicted ---
"$ECX" serve --bind 127.0.0.1 --port 0 --capacity 1MiB --synthetic 40 \
	--shape 65536 --dtype int8 --json >evict.json 2>evict.err &
epid=$!
pids+=("$epid")
wait_for evict.json registry
check "serve --json parses" json_ok evict.json
check "ready JSON: 16 kept, 24 evicted, 40 put" $PY -c "
import json, sys
j = json.load(open('evict.json'))
sys.exit(not (j['items'] == 16 and j['evicted'] == 24 and j['put'] == 40
              and j['bytes'] == 16 * 65536 and j['put_bytes'] == 40 * 65536))"
kill -TERM "$epid"
wait "$epid"
"$ECX" serve --bind 127.0.0.1 --port 0 --capacity 1MiB --synthetic 40 \
	--shape 65536 --dtype int8 >evict.out 2>evict.err &
epid=$!
pids+=("$epid")
wait_for evict.out serving
check "ready line: 16 items (1.0 MiB; 24 more were evicted" \
	grep -q "^serving 16 items (1.0 MiB; 24 more were evicted for room" evict.out
kill -INT "$epid"
wait "$epid"
check "stopped by SIGINT once serving: exit 130" test $? = 130

# --- SIGTERM and SIGINT while serve is still putting items ---
for sig in TERM INT; do
	want=$([ $sig = TERM ] && echo 143 || echo 130)
	"$ECX" serve --bind 127.0.0.1 --registry "$reg" --capacity 4MiB \
		--prefix "load$sig" --synthetic 100000000 --shape 262144 \
		--dtype int8 >load.out 2>load.err &
	lpid=$!
	pids+=("$lpid")
	# in its put phase once its items are listed (the arena holds 16:
	# the later ones evict the earlier)
	for _ in $(seq 600); do
		"$ECX" ls --json "$reg" 2>/dev/null | grep -q "\"load$sig-[0-9]*[1-9][0-9]\"" && break
		sleep 0.1
	done
	t0=$(now_ms)
	kill -"$sig" "$lpid"
	while kill -0 "$lpid" 2>/dev/null && [ $(($(now_ms) - t0)) -lt 10000 ]; do
		sleep 0.02
	done
	ms=$(($(now_ms) - t0))
	wait "$lpid"
	rc=$?
	check "SIG$sig during the put phase: stopped in ${ms} ms (< 1000)" test "$ms" -lt 1000
	check "and exits $want (got $rc)" test "$rc" = "$want"
	check "and said so" grep -q "stopped on signal .* while putting items" load.err
	check "serving never started" test ! -s load.out
	"$ECX" ls "$reg" >ls.after 2>&1
	check "what it had published is unpublished" bash -c "! grep -q '^load$sig-' ls.after"
done

# --- SIGTERM while serve starts (UCX may take seconds on a busy host) ---
"$ECX" serve --bind 127.0.0.1 --port 0 --synthetic 5 --shape 4 --dtype int8 \
	>start.out 2>start.err &
spid=$!
pids+=("$spid")
sleep 0.1
t0=$(now_ms)
kill -TERM "$spid"
while kill -0 "$spid" 2>/dev/null && [ $(($(now_ms) - t0)) -lt 10000 ]; do
	sleep 0.02
done
ms=$(($(now_ms) - t0))
wait "$spid"
rc=$?
check "SIGTERM while starting: stopped in ${ms} ms (< 1000), exit $rc (143)" \
	bash -c "test $ms -lt 1000 && test $rc = 143"

# --- a remote registry that is down at start: serve waits, then serves ---
port2=$(free_port)
"$ECX" serve --bind 127.0.0.1 --registry "HTTP://127.0.0.1:$port2" \
	--synthetic 3 --shape 4 --dtype int8 >late.out 2>late.err &
latepid=$!
pids+=("$latepid")
check "registry down: serve says it waits for it" \
	wait_for late.err "waiting for the registry"
check "and is not serving yet" test ! -s late.out
"$ECX" registry --bind 127.0.0.1 --port "$port2" >reg2.out 2>&1 &
pids+=("$!")
check "registry up: serve publishes and starts serving" \
	wait_for late.out "^serving 3 items"
check "it said the registry answers" grep -q "answers\$" late.err
"$ECX" ls "HTTP://127.0.0.1:$port2" >late.ls 2>&1
check "HTTP:// (upper case) is taken; the 3 items are listed" grep -q "^3 entries" late.ls
"$ECX" ls "$reg, http://127.0.0.1:$port2" >both.ls 2>&1
check "ls R1,R2 lists both registries" \
	bash -c "grep -q '^synthetic-2 ' both.ls && grep -q '^a ' both.ls && grep -q 'in 2 of 2 registries' both.ls"
"$ECX" ls --json "$reg,http://127.0.0.1:$port2" >both.json 2>&1
check "ls --json R1,R2 parses and names each row's registry" \
	$PY -c "
import json, sys
rows = json.load(open('both.json'))
sys.exit(not (len(rows) == 5 and all('registry' in r for r in rows)))"
kill -TERM "$latepid"
wait "$latepid"
check "serve exits 143 on SIGTERM once serving" test $? = 143
kill -TERM "$npypid"
wait "$npypid"

"$ECX" ls --json "http://127.0.0.1:$(free_port)" >down.json 2>down.err
rc=$?
check "ls --json of a registry that is down: exit $rc (1), still one document" \
	bash -c "test $rc = 1 && $PY -c \"import json,sys; sys.exit(json.load(open('down.json')) != [])\""

# --- host names and IPv6 ---
"$ECX" serve --bind localhost --port 0 --synthetic 2 --shape 64 --dtype int8 \
	--json >lh.json 2>lh.err &
lhpid=$!
pids+=("$lhpid")
wait_for lh.json registry
lhreg=$($PY -c "import json; print(json.load(open('lh.json'))['registry'])" 2>/dev/null)
check "serve --bind localhost starts ($lhreg)" test -n "$lhreg"
"$ECX" get --verify "$lhreg" synthetic-1 -o lh.npy >/dev/null 2>lh.get
check "and serves" test $? = 0
kill -TERM "$lhpid"
wait "$lhpid"

if $PY -c 'import socket; s=socket.socket(socket.AF_INET6); s.bind(("::1",0))' 2>/dev/null; then
	"$ECX" registry --bind ::1 --port 0 >r6.out 2>r6.err &
	pids+=("$!")
	wait_for r6.out "listening on" 100
	check "registry --bind ::1 prints a URL: $(cat r6.out)" \
		grep -q '^listening on http://\[::1\]:[0-9]*$' r6.out
	for tr in auto tcp; do
		# A file per transport: the last one's, still there, would
		# satisfy the wait before this serve has written its own.
		"$ECX" serve --bind ::1 --port 0 --transport "$tr" --synthetic 2 \
			--shape 4096 --dtype bfloat16 --json >"s6-$tr.json" 2>s6.err &
		s6pid=$!
		pids+=("$s6pid")
		wait_for "s6-$tr.json" registry
		r6=$($PY -c "import json; print(json.load(open('s6-$tr.json'))['registry'])" 2>/dev/null)
		p6=$($PY -c "import json; print(json.load(open('s6-$tr.json'))['producer'])" 2>/dev/null)
		check "serve --bind ::1 ($tr): registry $r6, producer $p6" \
			bash -c "[[ '$r6' == http://\[::1\]:* && '$p6' == tcp://\[::1\]:* ]]"
		"$ECX" get --transport "$tr" --verify "$r6" synthetic-1 -o g6.npy \
			>/dev/null 2>g6.err
		check "get $r6 ($tr) loads and verifies" test $? = 0
		kill -TERM "$s6pid"
		wait "$s6pid"
	done
	# :: listens on every address, IPv4 and IPv6
	"$ECX" serve --bind :: --port 0 --synthetic 2 --shape 64 --dtype int8 \
		--json >sa.json 2>sa.err &
	sapid=$!
	pids+=("$sapid")
	wait_for sa.json registry
	ra=$($PY -c "import json; print(json.load(open('sa.json'))['registry'])" 2>/dev/null)
	"$ECX" get --verify "http://[::1]:${ra##*:}" synthetic-1 -o ga.npy >/dev/null 2>ga.err &&
		"$ECX" get --verify "http://127.0.0.1:${ra##*:}" synthetic-0 -o ga.npy >/dev/null 2>>ga.err
	check "serve --bind :: is reached at [::1] and 127.0.0.1 ($ra)" test $? = 0
	kill -TERM "$sapid"
	wait "$sapid"
else
	skipped "IPv6: this host has no ::1"
fi

# --- a Redis store: down, and a wrong password ---
rport=$(free_port)
"$ECX" registry --bind 127.0.0.1 --port 0 --store "redis://127.0.0.1:$rport" \
	>rr.out 2>rr.err &
pids+=("$!")
wait_for rr.out "listening on" 100
rreg=$(sed -n 's/^listening on //p' rr.out)
code=$(curl -s -o hz.json -w '%{http_code}' "$rreg/healthz")
check "Redis down: /healthz answers $code (503), not ok" \
	bash -c "test '$code' = 503 && $PY -c \"import json,sys; sys.exit(json.load(open('hz.json'))['ok'] is not False)\""
check "and the registry said so at start" grep -q "healthz answers 503" rr.err
if command -v redis-server >/dev/null; then
	redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no \
		--dir "$work" --requirepass right-password --logfile "$work/redis.log" &
	pids+=("$!")
	for _ in $(seq 100); do
		redis-cli -p "$rport" -a right-password ping 2>/dev/null | grep -q PONG && break
		sleep 0.1
	done
	"$ECX" registry --bind 127.0.0.1 --port 0 \
		--store "redis://:wrong@127.0.0.1:$rport" >rw.out 2>rw.err &
	pids+=("$!")
	wait_for rw.out "listening on" 100
	rwreg=$(sed -n 's/^listening on //p' rw.out)
	code=$(curl -s -o /dev/null -w '%{http_code}' "$rwreg/ec/info/someid")
	check "wrong Redis password: a lookup gets $code (5xx, not 400)" \
		bash -c "test '$code' -ge 500"
	code=$(curl -s -o /dev/null -w '%{http_code}' "$rwreg/healthz")
	check "and /healthz $code (503)" test "$code" = 503
	"$ECX" registry --bind 127.0.0.1 --port 0 \
		--store "redis://:right-password@127.0.0.1:$rport" >rg.out 2>rg.err &
	pids+=("$!")
	wait_for rg.out "listening on" 100
	code=$(curl -s -o /dev/null -w '%{http_code}' "$(sed -n 's/^listening on //p' rg.out)/healthz")
	check "the right password: /healthz $code (200)" test "$code" = 200

	# --- a registry URL's password is never printed ---
	sport=$(free_port)
	printf 'port %s\nbind 127.0.0.1\nsentinel monitor m1 127.0.0.1 %s 1\nsentinel auth-pass m1 right-password\n' \
		"$sport" "$rport" >sentinel.conf
	redis-sentinel "$work/sentinel.conf" --dir "$work" --logfile "$work/sentinel.log" &
	pids+=("$!")
	for _ in $(seq 100); do
		redis-cli -p "$sport" ping 2>/dev/null | grep -q PONG && break
		sleep 0.1
	done
	surl="redis+sentinel://:right-password@127.0.0.1:$sport/m1"
	shown="redis+sentinel://:\*\*\*@127.0.0.1:$sport/m1"
	"$ECX" serve --bind 127.0.0.1 --registry "$surl" --prefix pw --synthetic 2 \
		--shape 4 --dtype int8 >pw.out 2>pw.err &
	pwpid=$!
	pids+=("$pwpid")
	check "serve --registry redis+sentinel://:PASSWORD@...: ready line masks it" \
		wait_for pw.out "registry $shown\$" 300
	ECX_LOG=info "$ECX" serve --bind 127.0.0.1 --registry "redis://:right-password@127.0.0.1:$rport" \
		--prefix pwj --synthetic 1 --shape 4 --dtype int8 --json >pwj.out 2>pwj.err &
	pwjpid=$!
	pids+=("$pwjpid")
	wait_for pwj.out registry 300
	check "serve --json --registry redis://:PASSWORD@...: \"registry\" masks it" $PY -c "
import json, sys
sys.exit(json.load(open('pwj.out'))['registry'] != 'redis://:***@127.0.0.1:$rport')"
	check "the library's log (ECX_LOG=info) names the registry masked" \
		grep -q "registry redis://:\*\*\*@127.0.0.1:$rport\$" pwj.err
	"$ECX" ls --json "$surl,$reg" >pwls.json 2>pwls.err
	check "ls --json R1,R2: the rows' \"registry\" masks the password" $PY -c "
import json, sys
rows = json.load(open('pwls.json'))
sys.exit(not any(r['registry'] == 'redis+sentinel://:***@127.0.0.1:$sport/m1' for r in rows))"
	"$ECX" ls "redis://user:right-password@127.0.0.1:1,$surl" >pwls.out 2>pwls.err
	"$ECX" info "redis://right-password@127.0.0.1:1x" a >>pwls.out 2>>pwls.err
	# libecx quotes these URLs in its messages: the command masks them
	"$ECX" info "http://u:right-password@127.0.0.1:1" a >>pwls.out 2>>pwls.err
	"$ECX" get "http://u:right-password@127.0.0.1:1" a -o x.npy >>pwls.out 2>>pwls.err
	"$ECX" consume "ftp://u:right-password@127.0.0.1:1" >>pwls.out 2>>pwls.err
	check "a URL the library quotes is shown masked: $(tail -1 pwls.err)" \
		grep -q "^ecx consume: registry URL 'ftp://u:\*\*\*@127.0.0.1:1' is not" pwls.err
	"$ECX" consume --timeout 2s "redis://:right-password@127.0.0.1:1" >>pwls.out 2>>pwls.err
	"$ECX" serve --bind 127.0.0.1 --registry "redis://:right-password@127.0.0.1:$rport/x" \
		--synthetic 1 --shape 4 --dtype int8 >>pwls.out 2>>pwls.err
	check "and no output of serve, ls, info or consume holds the password" \
		bash -c "! grep -q right-password pw.out pw.err pwj.out pwj.err pwls.json pwls.err pwls.out"
	kill -TERM "$pwpid" "$pwjpid"
	wait "$pwpid" "$pwjpid"
else
	skipped "wrong Redis password: no redis-server"
	skipped "a registry URL's password is never printed: no redis-server"
fi

echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
