#!/bin/bash
# By hand, not a ctest test: the unchanged reference connector
# (run_reference.py) on Mooncake's own engine against ecx both ways, and
# against itself as the baseline, in one run, in a network namespace of its
# own (the reference's registry binds 0.0.0.0:9018). Every byte checked;
# p50 load and lookup times printed. Needs root (unshare -n).
# Usage: ECX=build/tools/ecx ECX_LIBRARY=build/libecx.so \
#   MOONCAKE_PY=DIR_HOLDING_mooncake/engine.*.so MOONCAKE_LIB=DIR_OF_libasio.so \
#   SOURCE=.../ec_mooncake_connector.py.txt [REPEAT=30] [ECX_PYTHON=python] \
#   run_reference_matrix.sh
set -u
I=$(cd "$(dirname "$0")" && pwd)
if [ -z "${IN_NETNS:-}" ]; then
	exec env IN_NETNS=1 unshare -n "$0" "$@"
fi
ip link set lo up
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; cd "$W"
SRC=${SOURCE:?the reference connector page}
E=${ECX:?path to ecx}
R=${REPEAT:-30}
export LD_LIBRARY_PATH=${MOONCAKE_LIB:?} GLOG_minloglevel=2
export PYTHONPATH=${MOONCAKE_PY:?}:${ECX_PYTHON:-$I/../../python} ECX_LIBRARY=${ECX_LIBRARY:?}
SPECS="k64:32768:float16 m1:262144:float32 big:1024x3584:bfloat16"
/usr/bin/python3 -c "
import sys; sys.path.insert(0, '$I'); import items, numpy as np
for s in '$SPECS'.split():
    mm, shape, dt, n = items.parse_spec(s)
    a = np.frombuffer(items.item_bytes('r', mm, n), dtype=np.dtype([('bfloat16','<u2')]) if dt=='bfloat16' else dt).reshape(shape)
    np.save(mm + '.npy', a)
"
$E serve --bind 127.0.0.1 --port 0 k64=k64.npy m1=m1.npy big=big.npy > serve.out 2>serve.err &
SP=$!
/usr/bin/python3 $I/run_reference.py --source $SRC producer --seed r $SPECS > prod.out 2>prod.err &
PP=$!
for i in $(seq 300); do grep -q '^serving' serve.out && grep -q registry prod.out && break; sleep 0.1; done
EURL=$(sed -n 's/.*registry \(http:[^ ]*\).*/\1/p' serve.out)
RURL=http://127.0.0.1:9018
echo "== reference consumer <- ecx serve"
timeout 250 /usr/bin/python3 $I/run_reference.py --source $SRC consumer --registry $EURL --seed r --repeat $R k64 m1 big 2>c1.err; echo "rc=$?"
echo "== reference consumer <- reference producer (baseline)"
timeout 250 /usr/bin/python3 $I/run_reference.py --source $SRC consumer --registry $RURL --seed r --repeat $R k64 m1 big 2>c2.err; echo "rc=$?"
echo "== ecx get <- reference producer"
for s in $SPECS; do id=${s%%:*}; timeout 60 $E get $RURL $id -o $id.out.npy >/dev/null 2>get.err && /usr/bin/python3 -c "
import sys; sys.path.insert(0, '$I'); import items, numpy as np
mm, shape, dt, n = items.parse_spec('$s'); a = np.load('$id.out.npy')
print('ecx get $id:', 'bytes ok' if a.shape == shape and a.tobytes() == items.item_bytes('r', mm, n) else 'BYTES DIFFER')" || { echo "ecx get $id failed: $(cat get.err)"; }; done
$E info $RURL big | head -8
echo "== ecx.Consumer <- reference producer, and <- ecx serve (ecx's own wire), one id per load"
timeout 250 /usr/bin/python3 -c "
import sys, time, statistics, json; sys.path.insert(0, '$I'); import items, ecx, torch
specs = '$SPECS'.split()
for url, what in (('$RURL', 'reference producer'), ('$EURL', 'ecx serve')):
    with ecx.Consumer(url, timeout_ms=10000) as c:
        out = {}
        for s in specs:
            mm, shape, dt, n = items.parse_spec(s)
            ts = []
            for r in range($R):
                t0 = time.perf_counter(); f = c.lookup([mm]); t1 = time.perf_counter(); [t] = c.load(f); t2 = time.perf_counter()
                ts.append((t1 - t0, t2 - t1))
                assert t.contiguous().view(torch.uint8).numpy().tobytes() == items.item_bytes('r', mm, n)
            out[mm] = {'n': len(ts), 'load_p50_ms': round(statistics.median(x[1] for x in ts) * 1e3, 3), 'lookup_p50_ms': round(statistics.median(x[0] for x in ts) * 1e3, 3)}
        f = c.lookup([s.split(':')[0] for s in specs]); t0 = time.perf_counter(); c.load(f); batch = time.perf_counter() - t0
        print(what, 'bytes ok', json.dumps(out), 'batch of 3:', round(batch * 1e3, 3), 'ms')
"; echo "rc=$?"
kill $SP $PP; wait
uptime
