#!/bin/bash
# Shell-level tests of the ecx command: real processes on real ports on
# 127.0.0.1. Usage: test_cli.sh PATH/TO/ecx
# Prints one line per check and "N passed, N failed" at the end.
set -u
ECX=${1:?usage: test_cli.sh PATH/TO/ecx}
PY=/usr/bin/python3
. "$(dirname "$0")/lib.sh"

# --- usage errors exit 2 with a usage message ---
for args in "" "frobnicate" "serve --port notaport" "get" "info onlyone" \
	"registry --threads 0" "serve --synthetic 3" "bench nothing" \
	"bench --via tcp,udp transfer" "bench --via , transfer" \
	"bench --peer-addr ::1 transfer" "bench --peer-wrap /nonexistent transfer" \
	"bench --peer-wrap /bin/true transfer" \
	"bench --peer-wrap /bin/true --via tcp transfer" \
	"bench --peer-wrap /bin/true --peer-addr 127.0.0.1 transfer" \
	"ls a b" "serve --capacity lots"; do
	# shellcheck disable=SC2086
	"$ECX" $args >"$work/out" 2>"$work/err"
	rc=$?
	if [ "$rc" = 2 ] && [ -s "$work/err" ]; then
		ok "usage error exits 2: ecx $args"
	else
		bad "usage error exits 2: ecx $args (got $rc)"
	fi
done
for c in registry serve info ls get bench demo consume; do
	"$ECX" "$c" --help >"$work/help" 2>&1
	check "ecx $c --help exits 0 and starts with usage" \
		grep -q "^usage: ecx $c" "$work/help"
done
check "ecx version" bash -c "'$ECX' version | grep -q '^ecx [0-9]'"

# --- an unreachable registry: one line, non-zero, within the timeout ---
port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
start=$(date +%s%N)
"$ECX" info --timeout 500ms "http://127.0.0.1:$port" someid >"$work/out" 2>"$work/err"
rc=$?
ms=$((($(date +%s%N) - start) / 1000000))
lines=$(wc -l <"$work/err")
if [ "$rc" = 1 ] && [ "$lines" = 1 ] && [ "$ms" -lt 3000 ]; then
	ok "unreachable registry: exit 1, one line, ${ms} ms"
else
	bad "unreachable registry: rc=$rc lines=$lines ms=$ms: $(cat "$work/err")"
fi
"$ECX" get --timeout 500ms "http://127.0.0.1:$port" someid -o "$work/x.npy" 2>"$work/err"
check "get from an unreachable registry fails" test $? = 1

# --- a standalone registry: starts, refuses a taken port, stops on TERM ---
# A port below the ephemeral range: it is restarted on the same port later,
# and no other process's outgoing connection may take it meanwhile.
for _ in $(seq 20); do
	port=$((20000 + RANDOM % 10000))
	"$ECX" registry --bind 127.0.0.1 --port "$port" >"$work/reg.out" 2>&1 &
	regpid=$!
	wait_for "$work/reg.out" "listening on\|cannot start" &&
		grep -q "listening on" "$work/reg.out" && break
	wait "$regpid"
done
pids+=("$regpid")
grep -q "listening on" "$work/reg.out" || bad "registry did not start"
regurl=$(sed -n 's/^listening on //p' "$work/reg.out")
regport=${regurl##*:}
"$ECX" registry --bind 127.0.0.1 --port "$regport" >/dev/null 2>"$work/err"
rc=$?
check "second registry on a taken port exits 1" test "$rc" = 1
check "and says the port is in use" grep -q "already in use" "$work/err"
"$ECX" registry --bind 256.1.1.1 --port 0 >/dev/null 2>"$work/err"
check "a bad bind address exits 1 with a reason" \
	bash -c "test $? = 1 && grep -q 'cannot use bind address' '$work/err'"

# --- serve publishing to it: .npy, raw and synthetic items ---
$PY - "$work" <<'PY'
import sys, numpy as np
w = sys.argv[1]
rng = np.random.default_rng(7)
np.save(w + "/emb-f32.npy", rng.standard_normal((37, 64)).astype(np.float32))
np.save(w + "/emb-i64.npy", rng.integers(-9, 9, size=(5, 3, 2)))
np.save(w + "/emb-u8.npy", rng.integers(1, 255, size=(4096,), dtype=np.uint8))
raw = rng.integers(1, 65535, size=(16, 32), dtype=np.uint16)
raw.tofile(w + "/raw.bin")
np.save(w + "/raw-as-u16.npy", raw)
PY
"$ECX" serve --bind 127.0.0.1 --registry "$regurl" --capacity 64MiB \
	--synthetic 3 --shape 16x3584 --dtype bfloat16 \
	"$work/emb-f32.npy" "$work/emb-i64.npy" "$work/emb-u8.npy" \
	>"$work/serve.out" 2>"$work/serve.err" &
servepid=$!
pids+=("$servepid")
check "serve starts" wait_for "$work/serve.out" "^serving 6 items"
# Raw bytes need --dtype and --shape: bfloat16 raw from a uint16 file.
"$ECX" serve --bind 127.0.0.1 --port 0 "rawid=$work/raw.bin" >/dev/null 2>"$work/err"
check "raw file without --dtype is a usage error" test $? = 2

"$ECX" info "$regurl" emb-f32 >"$work/info" 2>&1
check "info prints dtype" grep -q "dtype: *float32" "$work/info"
check "info prints shape" grep -q "shape: *37x64" "$work/info"
"$ECX" info --json "$regurl" emb-f32 >"$work/info.json"
check "info --json is the registry's entry" \
	$PY -c "import json,sys; e=json.load(open('$work/info.json')); sys.exit(not (e['nbytes']==37*64*4 and e['shape']==[37,64] and e['dtype']=='float32' and e['producer_zmq'].startswith('tcp://')))"
"$ECX" info "$regurl" nosuchid >/dev/null 2>"$work/err"
check "info on a missing id exits 3" test $? = 3
"$ECX" ls "$regurl" >"$work/ls"
check "ls lists every item" grep -q "^6 entries" "$work/ls"
check "ls shows a synthetic item" grep -q "^synthetic-2 .*bfloat16 *16x3584" "$work/ls"
"$ECX" ls --json --limit 2 "$regurl" >"$work/ls.json"
check "ls --json is one JSON document: an array of every entry, paged through" \
	$PY -c "import json,sys; r=json.load(open('$work/ls.json')); sys.exit(not (isinstance(r, list) and len(r)==6 and len({e['id'] for e in r})==6))"

# get: numpy reads back what was served
for id in emb-f32 emb-i64 emb-u8; do
	"$ECX" get "$regurl" "$id" -o "$work/got-$id.npy" >/dev/null 2>"$work/err"
	check "get $id" test $? = 0
	check "numpy reads $id back equal" $PY -c "import numpy as np,sys; a=np.load('$work/$id.npy'); b=np.load('$work/got-$id.npy'); sys.exit(not (a.dtype==b.dtype and a.shape==b.shape and np.array_equal(a,b)))"
done
"$ECX" get --verify "$regurl" synthetic-1 -o "$work/syn.npy" >/dev/null 2>"$work/err"
check "get --verify a synthetic bfloat16 item" test $? = 0
check "bfloat16 .npy opens in numpy as documented" $PY -c "
import numpy as np, sys
a = np.load('$work/syn.npy')
bits = a['bfloat16']
sys.exit(not (a.shape == (16, 3584) and bits.dtype == np.uint16))"
# torch from the test venv (ctest gives ECX_PYTHON; Debian's python3 has none)
TPY=${ECX_PYTHON:-$PY}
if $TPY -c "import torch" 2>/dev/null; then
	check "and converts to a torch bfloat16 tensor" $TPY -c "
import numpy as np, torch, sys
bits = np.load('$work/syn.npy')['bfloat16']
t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
sys.exit(not (t.dtype == torch.bfloat16 and tuple(t.shape) == (16, 3584)))"
elif [ -n "${ECX_PYTHON:-}" ]; then
	bad "ECX_PYTHON ($ECX_PYTHON) has no torch: the bfloat16 conversion cannot be checked"
else
	echo "skip - no torch in $TPY: the .npy's conversion to torch not checked (set ECX_PYTHON)"
fi
"$ECX" get "$regurl" nosuchid -o "$work/none.npy" 2>"$work/err"
check "get of a missing id exits 3" test $? = 3

# a serve with an embedded registry on a taken port fails at once
"$ECX" serve --bind 127.0.0.1 --port "$regport" --synthetic 1 --shape 4 --dtype uint8 >/dev/null 2>"$work/err"
check "serve on a taken registry port exits 1" test $? = 1
check "and says why" grep -q "already in use" "$work/err"

# The registry goes down: a clear error, bounded; it comes back (empty):
# the producer notices and publishes its items again.
kill -TERM "$regpid"
wait "$regpid"
start=$(date +%s%N)
"$ECX" info --timeout 1s "$regurl" emb-f32 >/dev/null 2>"$work/err"
rc=$?
ms=$((($(date +%s%N) - start) / 1000000))
check "registry down: info exits 1 within its timeout (${ms} ms)" \
	bash -c "test $rc = 1 && test $ms -lt 3000"
for _ in $(seq 20); do
	"$ECX" registry --bind 127.0.0.1 --port "$regport" >"$work/reg2.out" 2>&1 &
	regpid=$!
	wait_for "$work/reg2.out" "listening on\|cannot start" &&
		grep -q "listening on" "$work/reg2.out" && break
	wait "$regpid"
	sleep 0.2
done
pids+=("$regpid")
grep -q "listening on" "$work/reg2.out" || bad "registry did not restart"
back=1
for _ in $(seq 100); do
	"$ECX" info "$regurl" emb-f32 >/dev/null 2>&1 && { back=0; break; }
	sleep 0.1
done
check "registry back: the producer published its items again" test "$back" = 0
"$ECX" ls "$regurl" >"$work/ls-back"
check "all six of them" grep -q "^6 entries" "$work/ls-back"

# SIGTERM on serve unpublishes its items
kill -TERM "$servepid"
for _ in $(seq 100); do kill -0 "$servepid" 2>/dev/null || break; sleep 0.1; done
wait "$servepid"
check "serve exits 143 on SIGTERM" test $? = 143
"$ECX" ls "$regurl" >"$work/ls2"
check "its items are unpublished" grep -q "^0 entries" "$work/ls2"

kill -TERM "$regpid"
wait "$regpid"
check "registry exits 0 on SIGTERM" test $? = 0

# A token: pulls without it are refused, and it never reaches the logs.
secret=hunter2-$$-not-in-logs
ECX_LOG=debug "$ECX" serve --bind 127.0.0.1 --port 0 --token "$secret" \
	--synthetic 1 --shape 64 --dtype uint8 >"$work/tok.out" 2>"$work/tok.err" &
tokpid=$!
pids+=("$tokpid")
wait_for "$work/tok.out" "^serving" || bad "serve with a token did not start"
tokurl=$(sed -n 's/.*registry //p' "$work/tok.out")
ECX_LOG=debug "$ECX" get --token wrong "$tokurl" synthetic-0 -o "$work/t.npy" \
	>/dev/null 2>"$work/tok-get.err"
check "a pull with the wrong token is refused" \
	bash -c "test $? = 1 && grep -q 'token' '$work/tok-get.err'"
ECX_TOKEN="$secret" ECX_LOG=debug "$ECX" get --verify "$tokurl" synthetic-0 \
	-o "$work/t.npy" >/dev/null 2>>"$work/tok-get.err"
check "with the token (from ECX_TOKEN) it is served" test $? = 0
kill -TERM "$tokpid"
wait "$tokpid"
check "the token appears in no log" \
	bash -c "! grep -q '$secret' '$work/tok.err' '$work/tok-get.err' '$work/tok.out'"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
