#!/bin/bash
# A consumer that speaks only the reference's protocol (ref_consumer.py:
# registry GET, ZeroMQ pull naming its own Mooncake session, a Mooncake-wire
# receiver) loads from `ecx serve`, every byte checked. Items are .npy files
# made from a seed (items.py), so ref_consumer checks them with --seed.
# Then the token rule: `ecx serve --token` refuses the reference's pull (it
# carries no token) with an error that says so, and writes nothing.
#
# ref_consumer runs on Mooncake's own engine (--engine mooncake: the
# mooncake-transfer-engine-non-cuda wheel, pinned in tests/requirements.txt
# and installed in the project venv); ECX_INTEROP_ENGINE=mcwire runs it on
# the peers' own writer and receiver instead. ECX_PYTHON: the interpreter
# (ctest gives the venv's).
#
# Skips (exit 77) while ecx answers the pull with "cannot write into a
# Mooncake session" (ecx without the Mooncake writer); ECX_INTEROP_STRICT=1
# makes that a failure.
# Usage: test_ref_consumer_from_ecx.sh PATH/TO/ecx
set -u
ECX=${1:?usage: test_ref_consumer_from_ecx.sh PATH/TO/ecx}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../cli/lib.sh"
# The interpreter with Mooncake's engine: ECX_PYTHON, else the venv's.
PY=${ECX_PYTHON:-$here/../../.venv/bin/python}
[ -x "$PY" ] || {
	echo "FAIL - no $PY: run scripts/venv.sh (or set ECX_PYTHON)"
	exit 1
}
seed=interop-$$
engine=${ECX_INTEROP_ENGINE:-mooncake}

# id dtype shape: 1 byte, 64 KiB, 7 MiB (several 64 KiB chunks), odd sizes.
specs="one:uint8:1 k64:float16:32768 big:float32:512x3584 odd:int16:3x5x7"
INTEROP=$here "$PY" -c '
import os, sys
sys.path.insert(0, os.environ["INTEROP"])
import numpy as np, items
work, seed = sys.argv[1], sys.argv[2]
for spec in sys.argv[3:]:
    mm, dtype, shape = spec.split(":")
    dims = tuple(int(d) for d in shape.split("x"))
    n = items.ITEMSIZE[dtype] * int(np.prod(dims))
    a = np.frombuffer(items.item_bytes(seed, mm, n), dtype=dtype).reshape(dims)
    np.save(os.path.join(work, mm + ".npy"), a)
' "$work" "$seed" $specs || { echo "FAIL - could not make the items"; exit 1; }
ids=$(for s in $specs; do echo "${s%%:*}"; done)
files=$(for i in $ids; do echo "$i=$work/$i.npy"; done)

start_serve() { # start_serve OUT ARGS...: sets url (in this shell, so
	# that the server's pid reaches lib.sh's cleanup)
	local out=$1
	shift
	env -u ECX_TOKEN "$ECX" serve --bind 127.0.0.1 --port 0 "$@" $files \
		>"$out" 2>"$out.err" &
	pids+=($!)
	wait_for "$out" "^serving" 300 || return 1
	url=$(sed -n 's/.*registry \(http:[^ ]*\).*/\1/p' "$out")
}

skip_or_fail() { # the ecx without a Mooncake writer
	if [ "${ECX_INTEROP_STRICT:-0}" = 1 ]; then
		bad "$1 (ECX_INTEROP_STRICT=1)"
		exit 1
	fi
	echo "SKIP - $1"
	exit 77
}

start_serve "$work/serve" || { echo "FAIL - ecx serve did not start: $(cat "$work/serve.err")"; exit 1; }
timeout 120 "$PY" "$here/ref_consumer.py" --registry "$url" --seed "$seed" \
	--timeout 20 --engine "$engine" $ids >"$work/rc.json" 2>"$work/rc.err"
rc=$?
if grep -q "cannot write into a Mooncake session" "$work/rc.json"; then
	skip_or_fail "ecx serve answers the reference pull with 'cannot write into a Mooncake session': ecx has no Mooncake-wire writer yet (issue 23)"
fi
if [ "$rc" = 0 ] && "$PY" -c '
import json, sys
r = json.load(open(sys.argv[1]))
ids = sys.argv[2].split()
assert [i["id"] for i in r["items"]] == ids, r
for i in r["items"]:
    assert i["reply"] == {"ok": True, "mooncake_ret": 0}, i
    assert i["checked"] == "seed" and i["bytes_ok"] is True, i
if r["receiver"]["writes"] is not None:  # None: the engine counts nothing
    assert r["receiver"]["writes"] == len(ids), r["receiver"]
    assert r["receiver"]["rejected"] == 0, r["receiver"]
' "$work/rc.json" "$(echo $ids)"; then
	ok "ref_consumer ($engine) loads $(echo $ids) from ecx serve, bytes checked"
else
	bad "ref_consumer from ecx serve (exit $rc): $(head -c 2000 "$work/rc.json") $(tail -5 "$work/rc.err")"
fi

# The same ids again, each into a new buffer of a consumer that ecx has
# seen before: the writer must follow the consumer's current buffers.
timeout 120 "$PY" "$here/ref_consumer.py" --registry "$url" --seed "$seed" \
	--timeout 20 --engine "$engine" big one big >"$work/rc2.json" 2>"$work/rc2.err"
check "a second consumer, one id twice: loads and checks" \
	"$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))
assert r["ok"] and all(i["bytes_ok"] for i in r["items"]), r' "$work/rc2.json"

# The token rule: the reference's pull carries no token.
start_serve "$work/serve2" --token sesame ||
	{ echo "FAIL - ecx serve --token did not start"; exit 1; }
url2=$url
timeout 60 "$PY" "$here/ref_consumer.py" --registry "$url2" --seed "$seed" \
	--timeout 20 --engine "$engine" k64 >"$work/rc3.json" 2>"$work/rc3.err"
check "ecx serve --token: the pull is refused with an error naming the token, nothing written" \
	"$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))
i = r["items"][0]
assert not r["ok"] and i["found"] and i["reply"]["ok"] is False, r
assert "token" in i["reply"].get("err", "").lower(), i["reply"]
assert r["receiver"]["writes"] in (0, None), r' "$work/rc3.json"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
