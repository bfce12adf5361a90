#!/bin/bash
# ecx loads from a producer that speaks only the reference's protocol
# (ref_producer.py: its own registry in the reference's shape, a REP socket
# answering the reference's pull, a Mooncake-wire writer): `ecx get` one id
# at a time, `ecx info`, then the Python ecx.Consumer, one batch of every id
# (parallel pulls to one REP socket), every byte checked against the seed.
#
# ref_producer runs on Mooncake's own engine (--engine mooncake: the
# mooncake-transfer-engine-non-cuda wheel, pinned in tests/requirements.txt
# and installed in the project venv); ECX_INTEROP_ENGINE=mcwire runs it on
# the peers' own writer and receiver instead. ECX_PYTHON: the interpreter
# (ctest gives the venv's).
#
# Skips (exit 77) while ecx sends the producer its own ops (ref_producer
# logs 'answered unknown op') instead of the reference pull: an ecx without
# the reference-pull consumer. ECX_INTEROP_STRICT=1 makes that a failure.
# Usage: test_ecx_from_ref_producer.sh PATH/TO/ecx
# (the Python part needs ECX_LIBRARY and PYTHONPATH, as ctest sets them)
set -u
ECX=${1:?usage: test_ecx_from_ref_producer.sh PATH/TO/ecx}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../cli/lib.sh"
# The interpreter with Mooncake's engine: ECX_PYTHON, else the venv's.
PY=${ECX_PYTHON:-$here/../../.venv/bin/python}
[ -x "$PY" ] || {
	echo "FAIL - no $PY: run scripts/venv.sh (or set ECX_PYTHON)"
	exit 1
}
seed=interop-$$
specs="a:64x64:float32 big:1024x3584:bfloat16 one:1:uint8 odd:3x5x7:int16"
ids=$(for s in $specs; do echo "${s%%:*}"; done)

"$PY" "$here/ref_producer.py" --bind 127.0.0.1 --seed "$seed" --max-seconds 250 \
	--engine "${ECX_INTEROP_ENGINE:-mooncake}" \
	--ready-file "$work/ready.json" $specs >/dev/null 2>"$work/producer.log" &
pids+=($!)
wait_for "$work/ready.json" "registry" 300 ||
	{ echo "FAIL - ref_producer did not start: $(cat "$work/producer.log")"; exit 1; }
url=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["registry"])' \
	"$work/ready.json")

# check_npy FILE ID SPEC: the .npy holds the item's shape and bytes.
check_npy() {
	INTEROP=$here "$PY" -c '
import os, sys
sys.path.insert(0, os.environ["INTEROP"])
import numpy as np, items
f, spec, seed = sys.argv[1:]
mm, shape, dtype, n = items.parse_spec(spec)
a = np.load(f)
assert a.shape == shape, (a.shape, shape)
assert a.tobytes() == items.item_bytes(seed, mm, n), "bytes differ"
' "$1" "$2" "$seed"
}

for s in $specs; do
	id=${s%%:*}
	timeout 60 env -u ECX_TOKEN "$ECX" get --timeout 10s "$url" "$id" \
		-o "$work/$id.npy" >"$work/get.out" 2>"$work/get.err"
	rc=$?
	if [ "$rc" != 0 ] && grep -q "answered unknown op" "$work/producer.log"; then
		why="ecx get sends the reference producer ecx's own ops ($(grep -m1 'answered unknown op' "$work/producer.log")): ecx has no reference-pull consumer yet (issue 23); ecx get said: $(head -c 300 "$work/get.err")"
		if [ "${ECX_INTEROP_STRICT:-0}" = 1 ]; then
			bad "$why (ECX_INTEROP_STRICT=1)"
			exit 1
		fi
		echo "SKIP - $why"
		exit 77
	fi
	if [ "$rc" = 0 ] && check_npy "$work/$id.npy" "$s"; then
		ok "ecx get $id from ref_producer, bytes checked"
	else
		bad "ecx get $id (exit $rc): $(head -c 500 "$work/get.err") $(tail -3 "$work/producer.log")"
	fi
done

timeout 30 env -u ECX_TOKEN "$ECX" info "$url" big >"$work/info.out" 2>&1
check "ecx info shows the entry as a reference producer's" \
	grep -qi "reference" "$work/info.out"

# The Python consumer: one load of every id.
if timeout 120 env -u ECX_TOKEN INTEROP="$here" "$PY" -c '
import os, sys
sys.path.insert(0, os.environ["INTEROP"])
import items, ecx, torch
url, seed, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
with ecx.Consumer(url, timeout_ms=10000) as c:
    found = c.lookup([s.split(":")[0] for s in specs])
    assert all(found), found
    tensors = c.load(found)
    for spec, t in zip(specs, tensors):
        mm, shape, dtype, n = items.parse_spec(spec)
        assert tuple(t.shape) == shape and str(t.dtype) == "torch." + dtype
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        assert raw == items.item_bytes(seed, mm, n), mm + ": bytes differ"
' "$url" "$seed" $specs >"$work/py.out" 2>&1; then
	ok "ecx.Consumer loads $(echo $ids) in one batch, bytes checked"
else
	bad "ecx.Consumer from ref_producer: $(tail -c 1500 "$work/py.out") $(tail -3 "$work/producer.log")"
fi

# The reference producer stopped (SIGSTOP) after the lookup: the load ends
# within its timeout (1 s, + 0.5 s of slack), with a typed error, and a
# load after SIGCONT works; killed (SIGKILL) after a lookup: the load fails
# at once (its connection went), well before the timeout.
# The timed-out pull's late answer and write (after SIGCONT) land nowhere
# the caller sees: the second load's bytes are checked.
if timeout 120 env -u ECX_TOKEN INTEROP="$here" "$PY" -c '
import os, signal, sys, time
sys.path.insert(0, os.environ["INTEROP"])
import items, ecx, torch
url, seed, pid, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mm, shape, dtype, n = items.parse_spec(spec)
def check(t):
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert raw == items.item_bytes(seed, mm, n), "bytes differ"
with ecx.Consumer(url, timeout_ms=1000) as c:
    found = c.lookup([mm])
    assert all(found), found
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        c.load(found)
        raise SystemExit("a load from a stopped producer succeeded")
    except ecx.EcxError as e:
        took = time.monotonic() - t0
        print("stopped:", type(e).__name__, e, f"{took:.3f} s")
        assert took < 1.5, f"took {took:.3f} s against a 1 s timeout"
    os.kill(pid, signal.SIGCONT)
    time.sleep(0.3)
    check(c.load(c.lookup([mm]))[0])
    found = c.lookup([mm])
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        c.load(found)
        raise SystemExit("a load from a killed producer succeeded")
    except ecx.EcxError as e:
        took = time.monotonic() - t0
        print("killed:", type(e).__name__, e, f"{took:.3f} s")
        # Its connection goes with it: said at once, not at the timeout.
        assert took < 0.5, f"took {took:.3f} s: not said at once"
        assert "ECONNECT" in str(e), e
' "$url" "$seed" "${pids[0]}" "big:1024x3584:bfloat16" >"$work/stop.out" 2>&1; then
	ok "a stopped, then killed, reference producer: bounded by its timeout, then said at once ($(tr '\n' ' ' <"$work/stop.out"))"
else
	bad "stopped or killed reference producer: $(tail -c 1500 "$work/stop.out")"
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
