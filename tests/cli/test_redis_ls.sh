#!/bin/bash
# `ecx ls redis://` lists what a producer published to Redis: a real
# redis-server on a free port in a temporary folder, an `ecx serve`
# publishing synthetic items to it, and `ecx ls` (table and --json, in
# pages) against it; everything started and stopped here.
# Usage: test_redis_ls.sh PATH/TO/ecx
set -u
ECX=${1:?usage: test_redis_ls.sh PATH/TO/ecx}
PY=/usr/bin/python3
. "$(dirname "$0")/lib.sh"

port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
	--dir "$work" --logfile "$work/redis.log" &
pids+=("$!")
url="redis://127.0.0.1:$port"
up=0
for _ in $(seq 100); do
	redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && { up=1; break; }
	sleep 0.1
done
[ "$up" = 1 ] || { echo "FAIL - redis-server did not start"; exit 1; }

# Nothing published yet: an empty listing, not an error.
"$ECX" ls "$url" >"$work/empty" 2>"$work/err"
check "ls of an empty Redis succeeds" test $? = 0
check "and says 0 entries" grep -q "^0 entries" "$work/empty"

"$ECX" serve --bind 127.0.0.1 --registry "$url" --capacity 64MiB \
	--synthetic 5 --prefix rls --shape 16x3584 --dtype bfloat16 \
	>"$work/serve.out" 2>"$work/serve.err" &
servepid=$!
pids+=("$servepid")
check "serve publishes to Redis" wait_for "$work/serve.out" "^serving 5 items"

"$ECX" ls "$url" >"$work/ls" 2>"$work/err"
check "ls redis:// exits 0" test $? = 0
check "ls redis:// lists every item" grep -q "^5 entries" "$work/ls"
for i in 0 1 2 3 4; do
	check "ls shows rls-$i with its dtype and shape" \
		grep -q "^rls-$i .*bfloat16 *16x3584 .*tcp://127.0.0.1:" "$work/ls"
done
check "the header comes first" grep -q "^ID " <(head -1 "$work/ls")
"$ECX" ls --json --limit 2 "$url" >"$work/ls.json" 2>"$work/err"
check "ls --json rows are the entries, sorted, with their ids" \
	$PY -c "
import json, sys
rows = json.load(open('$work/ls.json'))  # one document: an array
ids = [r['id'] for r in rows]
ok = ids == ['rls-%d' % i for i in range(5)] and all(
    r['dtype'] == 'bfloat16' and r['shape'] == [16, 3584] and
    r['nbytes'] == 16 * 3584 * 2 and r['producer_zmq'].startswith('tcp://')
    for r in rows)
sys.exit(not ok)"
# The same entries as Redis holds them.
check "Redis holds what ls shows" \
	test "$(redis-cli -p "$port" --scan --pattern 'ecx:rls-*' | wc -l)" = 5
"$ECX" info "$url" rls-3 >"$work/info" 2>&1
check "info redis:// finds an item" grep -q "shape: *16x3584" "$work/info"
# Of a list, each registry is listed; one that fails is said, the exit 1.
"$ECX" ls "$url,http://127.0.0.1:1" >"$work/ls-list" 2>"$work/err"
rc=$?
check "ls of a list lists those that answer, exit 1 for the other" \
	bash -c "test $rc = 1 && grep -q '^5 entries, .* in 1 of 2 registries' '$work/ls-list' && grep -q '127.0.0.1:1' '$work/err'"

# The producer stops: it unpublishes, and ls shows nothing.
kill -TERM "$servepid"
wait "$servepid"
"$ECX" ls "$url" >"$work/ls-after" 2>"$work/err"
check "after the producer stops, ls shows 0 entries" \
	grep -q "^0 entries" "$work/ls-after"

# Redis gone: ls fails in one line, with nothing on stdout.
kill -TERM "${pids[0]}"
wait "${pids[0]}" 2>/dev/null
"$ECX" ls --timeout 1s "$url" >"$work/ls-down" 2>"$work/err"
check "ls of a Redis that is down exits 1" test $? = 1
check "and prints no table" test ! -s "$work/ls-down"
check "and says why" grep -q "ecx ls: .*127.0.0.1:$port" "$work/err"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
