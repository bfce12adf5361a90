#!/bin/bash
# ecx consume: what it says when there is nothing to load, when a check
# fails, and its usage errors; real registries and producers on 127.0.0.1.
# Usage: test_consume.sh PATH/TO/ecx
set -u
ECX=${1:?usage: test_consume.sh PATH/TO/ecx}
. "$(dirname "$0")/lib.sh"
# expect NAME RC PATTERN COMMAND...: exits RC, stderr matches PATTERN.
expect() {
	local name=$1 want=$2 pat=$3
	shift 3
	timeout 60 "$@" >"$work/out" 2>"$work/err"
	local rc=$?
	if [ "$rc" = "$want" ] && grep -q -- "$pat" "$work/err"; then
		ok "$name"
	else
		bad "$name (exit $rc, stderr: $(head -c 300 "$work/err"))"
	fi
}

# A registry with nothing in it, and one that wants a token on reads.
"$ECX" registry --bind 127.0.0.1 --port 0 >"$work/r1" 2>&1 &
pids+=($!)
"$ECX" registry --bind 127.0.0.1 --port 0 --token sesame --token-reads \
	>"$work/r2" 2>&1 &
pids+=($!)
wait_for "$work/r1" "listening on" && wait_for "$work/r2" "listening on" ||
	{ echo "FAIL - registries did not start"; exit 1; }
empty=$(awk '/listening on/ {print $3}' "$work/r1")
locked=$(awk '/listening on/ {print $3}' "$work/r2")

expect "an empty registry: exit 1, says it lists nothing" 1 \
	"lists no items" "$ECX" consume "$empty"
expect "a registry answering 401: exit 1, says so" 1 "401" \
	env -u ECX_TOKEN "$ECX" consume "$locked"
mkdir "$work/none"
expect "an empty --files folder: exit 1, says it holds nothing" 1 \
	"holds no items" "$ECX" consume --files "$work/none"
expect "--transport foo: usage, exit 2" 2 "--transport" \
	"$ECX" consume --transport foo "$empty"
expect "--memory foo: usage, exit 2" 2 "--memory" \
	"$ECX" consume --memory foo "$empty"
expect "--batch 3x: usage, exit 2" 2 "--batch" \
	"$ECX" consume --batch 3x "$empty"

# --verify on an item that is not synthetic gives the reason.
printf 'abcd' >"$work/plain.bin"
"$ECX" serve --bind 127.0.0.1 --port 0 --dtype uint8 --shape 4 \
	"$work/plain.bin" >"$work/s1" 2>&1 &
pids+=($!)
wait_for "$work/s1" "^serving" || { echo "FAIL - serve did not start"; exit 1; }
plain=$(sed -n 's/.*registry \(http:[^ ]*\).*/\1/p' "$work/s1")
expect "--verify on a non-synthetic item: exit 1 with the reason" 1 \
	"not those of the synthetic item" "$ECX" consume --verify "$plain"

# Synthetic items load and verify, into the arena and into fresh memory.
"$ECX" serve --bind 127.0.0.1 --port 0 --synthetic 5 --shape 64x64 \
	--dtype float32 >"$work/s2" 2>&1 &
pids+=($!)
wait_for "$work/s2" "^serving" || { echo "FAIL - serve did not start"; exit 1; }
synth=$(sed -n 's/.*registry \(http:[^ ]*\).*/\1/p' "$work/s2")
for m in prefaulted fresh; do
	if timeout 60 "$ECX" consume --verify --memory "$m" --json "$synth" \
		>"$work/out" 2>"$work/err" &&
		/usr/bin/python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
assert r["verified"] == 5 and r["failed"] == 0 and r["memory"] == sys.argv[2]
' "$work/out" "$m"; then
		ok "consume --verify --memory $m: 5 verified"
	else
		bad "consume --verify --memory $m: $(cat "$work/out" "$work/err")"
	fi
done

# A list of registries, as ls, get and info take: the first one down,
# the items of the second (and of a third) still load.
down=http://127.0.0.1:$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
if timeout 60 "$ECX" consume --verify --json --timeout 2s "$down,$synth" \
	>"$work/out" 2>"$work/err" &&
	/usr/bin/python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
assert r["verified"] == 5 and r["failed"] == 0
' "$work/out" && grep -q "registry $down .*next registries of the list are still listed" "$work/err"; then
	ok "consume R1,R2 with R1 down: says so, loads and verifies R2's 5 items"
else
	bad "consume R1,R2 with R1 down: $(cat "$work/out" "$work/err")"
fi
if timeout 60 "$ECX" consume --json "$synth, $plain" >"$work/out" 2>"$work/err" &&
	/usr/bin/python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
assert r["items"] == 6 and r["failed"] == 0
' "$work/out"; then
	ok "consume R1,R2 loads the items of both (5 + 1)"
else
	bad "consume R1,R2 loads the items of both: $(cat "$work/out" "$work/err")"
fi
expect "consume R1,R2 with both down: exit 1, says none could be listed" 1 \
	"none of the 2 registries could be listed" \
	"$ECX" consume --timeout 2s "$down,${down%:*}:1"

# An item over the 512 MiB the receive arena had fixed: the arena is
# sized from the items listed (it failed with "invalid argument").
avail=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
if [ "${avail:-0}" -ge 3072 ]; then
	"$ECX" serve --bind 127.0.0.1 --port 0 --synthetic 1 --prefix big \
		--shape 513x1048576 --dtype uint8 --capacity 514MiB \
		>"$work/s3" 2>&1 &
	bigpid=$!
	pids+=($bigpid)
	wait_for "$work/s3" "^serving" || bad "serve of a 513 MiB item: $(cat "$work/s3")"
	big=$(sed -n 's/.*registry \(http:[^ ]*\).*/\1/p' "$work/s3")
	if timeout 120 "$ECX" consume --verify --json "$big" >"$work/out" 2>"$work/err" &&
		/usr/bin/python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
assert r["verified"] == 1 and r["bytes"] == 513 << 20
' "$work/out"; then
		ok "consume of a 513 MiB item into the arena: loaded and verified"
	else
		bad "consume of a 513 MiB item: $(cat "$work/out" "$work/err")"
	fi
	kill -TERM "$bigpid"
	wait "$bigpid"
else
	echo "SKIP - a 513 MiB item: ${avail:-?} MiB available, 3072 needed"
fi

# The demo end to end on a small workload: both tables, every item
# verified both ways in both kinds of memory, a ratio for each.
if timeout 200 "$ECX" demo --count 12 --batch 4 --dir "$work" \
	>"$work/out" 2>"$work/err" &&
	grep -q "^Into pre-faulted memory, reused" "$work/out" &&
	grep -q "^Into fresh memory" "$work/out" &&
	[ "$(grep -c ' 12/12$' "$work/out")" = 4 ] &&
	grep -q "^Into pre-faulted memory: ecx loads .* as fast as the file baseline" "$work/out" &&
	grep -q "^Into fresh memory: ecx loads .* as fast as the file baseline" \
		"$work/out"; then
	ok "demo --count 12: two like-with-like tables, all verified"
else
	bad "demo --count 12: $(cat "$work/out" "$work/err")"
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
