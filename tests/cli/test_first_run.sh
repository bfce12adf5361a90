#!/bin/bash
# What a new user hits first, with real processes on 127.0.0.1: `ecx get`
# writes its file whole or not at all; a URL that names no registry is said
# to be one, not a miss; an embedded registry is healthy only once its items
# are published; a registry open to all says so, and entries removed from
# under a producer come back. Usage: test_first_run.sh PATH/TO/ecx
set -u
ECX=${1:?usage: test_first_run.sh PATH/TO/ecx}
PY=/usr/bin/python3
. "$(dirname "$0")/lib.sh"
scale=${ECX_TEST_TIME_SCALE:-1}

free_port() {
	$PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# --- 1. ecx get: the file is written whole, or the old one stays ---
"$ECX" serve --bind 127.0.0.1 --port 0 --capacity 300MiB --synthetic 1 \
	--prefix big --shape 134217728 --dtype bfloat16 >"$work/big.out" \
	2>"$work/big.err" &
pids+=("$!")
wait_for "$work/big.out" "^serving" || bad "serve of a 256 MiB item did not start"
bigreg=$(sed -n 's/.*registry //p' "$work/big.out")
mkdir "$work/out"
$PY -c "import numpy as np; np.save('$work/out/good.npy', np.arange(10))"
sum0=$(md5sum <"$work/out/good.npy")
leftovers() { ls -A "$work/out" | grep -v '^good\.npy$'; }

# A write that fails (a file size limit: before, SIGXFSZ ended the process
# halfway through the file).
(
	ulimit -f 1024
	exec "$ECX" get --timeout 60s --transport tcp "$bigreg" big-0 -o "$work/out/good.npy"
) >/dev/null 2>"$work/err"
rc=$?
check "a write that fails exits 1 (got $rc)" test "$rc" = 1
check "and says the file was left as it was" grep -q "left as it was" "$work/err"
check "the old file is intact" test "$(md5sum <"$work/out/good.npy")" = "$sum0"
check "no partial file is left" test -z "$(leftovers)"

# A signal while the file is written: SIGTERM (and SIGINT, from a parent
# that does not ignore it) as soon as anything changes in the folder.
for sig in TERM INT; do
	$PY - "$ECX" "$bigreg" "$work/out" "$sig" >"$work/sig.out" 2>&1 <<'PY'
import hashlib, os, signal, subprocess, sys, time
ecx, reg, out, name = sys.argv[1:]
good = os.path.join(out, "good.npy")
orig = open(good, "rb").read()
before = hashlib.md5(orig).hexdigest()
interrupted = False
for attempt in range(5):
    st0 = os.stat(good)
    p = subprocess.Popen([ecx, "get", "--timeout", "60s", "--transport", "tcp", reg, "big-0",
                          "-o", good], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    sent = False
    while p.poll() is None:
        names = set(os.listdir(out))
        st = os.stat(good) if "good.npy" in names else None
        if names != {"good.npy"} or st is None or \
                st.st_size != st0.st_size or st.st_ino != st0.st_ino:
            p.send_signal(getattr(signal, "SIG" + name))
            sent = True
            break
        time.sleep(0.0005)
    rc = p.wait()
    if sent and rc == -getattr(signal, "SIG" + name):
        interrupted = True
        break
    # It finished before the signal came: the small file back, again.
    print("attempt", attempt, "not interrupted in time, rc", rc)
    with open(good + ".tmp", "wb") as f:
        f.write(orig)
    os.rename(good + ".tmp", good)
if not interrupted:
    sys.exit(2)
after = hashlib.md5(open(good, "rb").read()).hexdigest()
left = sorted(set(os.listdir(out)) - {"good.npy"})
print("rc", rc, "same", after == before, "left", left)
sys.exit(0 if after == before and not left else 1)
PY
	rc=$?
	if [ "$rc" = 2 ]; then
		echo "# SIG$sig: the write ended before the signal came: $(cat "$work/sig.out")"
		bad "SIG$sig during the write could not be timed"
	else
		check "SIG$sig during the write: the old file stays, no partial file ($(tail -1 "$work/sig.out"))" \
			test "$rc" = 0
	fi
done
"$ECX" get --timeout 60s "$bigreg" big-0 -o "$work/out/good.npy" >/dev/null 2>"$work/err"
check "a get that completes replaces the file" \
	$PY -c "import numpy as np,sys; a=np.load('$work/out/good.npy'); sys.exit(a.shape != (134217728,))"
check "and leaves nothing else" test -z "$(leftovers)"
chmod 640 "$work/out/good.npy"
"$ECX" get --timeout 60s "$bigreg" big-0 -o "$work/out/good.npy" >/dev/null 2>"$work/err"
check "a file replaced keeps its mode" test "$(stat -c %a "$work/out/good.npy")" = 640
"$ECX" get --timeout 60s "$bigreg" big-0 -o /dev/null >/dev/null 2>"$work/err"
rc=$?
check "-o /dev/null still works ($(cat "$work/err"))" test "$rc" = 0
check "and /dev/null is still a device" test -c /dev/null
# -o naming a symbolic link: the file it names is replaced, the link stays.
rm -f "$work/out/good.npy"
$PY -c "import numpy as np; np.save('$work/out/good.npy', np.arange(10))"
ln -s good.npy "$work/out/link.npy"
"$ECX" get --timeout 60s "$bigreg" big-0 -o "$work/out/link.npy" >/dev/null 2>"$work/err"
rc=$?
check "-o through a symbolic link works ($(cat "$work/err"))" test "$rc" = 0
check "and the link is still a link" test -L "$work/out/link.npy"
check "and the file it names holds the item" \
	$PY -c "import numpy as np,sys; a=np.load('$work/out/good.npy'); sys.exit(a.shape != (134217728,))"
kill -TERM "${pids[-1]}"
rm -rf "$work/out"

# --- 2. a URL that names no registry is an error, not a miss ---
"$ECX" serve --bind 127.0.0.1 --port 0 --synthetic 1 --shape 64 \
	--dtype uint8 >"$work/s.out" 2>"$work/s.err" &
pids+=("$!")
wait_for "$work/s.out" "^serving" || bad "serve did not start"
reg=$(sed -n 's/.*registry //p' "$work/s.out")
mkdir "$work/www"
(cd "$work/www" && exec $PY -m http.server 0 --bind 127.0.0.1) >"$work/www.out" 2>&1 &
pids+=("$!")
wait_for "$work/www.out" "port [0-9]" || bad "python3 -m http.server did not start"
www="http://127.0.0.1:$(grep -o 'port [0-9]*' "$work/www.out" | head -1 | cut -d' ' -f2)"
for url in "$www" "$reg/foo" "$reg/ec"; do
	for cmd in "get $url synthetic-0 -o $work/x.npy" "info $url synthetic-0" \
		"ls $url"; do
		# shellcheck disable=SC2086
		"$ECX" $cmd >/dev/null 2>"$work/err"
		rc=$?
		if [ "$rc" = 1 ] && grep -q "$url is not an ecx or reference registry" "$work/err" &&
			[ "$(wc -l <"$work/err")" = 1 ]; then
			ok "ecx ${cmd%% *} at $url: exit 1, says it is no registry"
		else
			bad "ecx ${cmd%% *} at $url: rc=$rc: $(cat "$work/err")"
		fi
	done
done
"$ECX" get "$reg" nosuchid -o "$work/x.npy" >/dev/null 2>"$work/err"
check "a real miss still exits 3" test $? = 3
"$ECX" info "$reg" nosuchid >/dev/null 2>"$work/err"
check "for info too" test $? = 3
"$ECX" info "$reg/" synthetic-0 >/dev/null 2>"$work/err"
check "a trailing slash is still the registry" test $? = 0

kill -TERM "${pids[-1]}" "${pids[-2]}"

# --- 3. an embedded registry is healthy once its items are published ---
# /healthz polled from the moment serve starts: each time it says ok,
# every id asked for must already be found. Before, it said ok from the
# registry's start, while the arena was mapped and the items put.
for try in 1 2 3; do
	hport=$(free_port)
	$PY - "$ECX" "$hport" >"$work/health.out" 2>&1 <<'PY'
import json, subprocess, sys, time, urllib.error, urllib.request
ecx, port = sys.argv[1], sys.argv[2]
n = 4000
base = f"http://127.0.0.1:{port}"
p = subprocess.Popen([ecx, "serve", "--bind", "127.0.0.1", "--port", port,
                      "--capacity", "300MiB", "--synthetic", str(n),
                      "--shape", "16384", "--dtype", "float32", "--json"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
ids = [f"synthetic-{i}" for i in range(n)]
starting = oks = 0
bad = None
deadline = time.monotonic() + 30
try:
    while time.monotonic() < deadline and oks < 3 and p.poll() is None:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
                code, body = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            code, body = e.code, json.loads(e.read())
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.001)
            continue
        if code == 503:
            assert body.get("starting") is True and not body["ok"], body
            assert body["detail"].startswith("starting"), body
            starting += 1
            continue
        assert code == 200 and body["ok"], (code, body)
        oks += 1
        req = urllib.request.Request(base + "/ec/lookup",
                                     data=json.dumps({"ids": ids}).encode(),
                                     headers={"Content-Type":
                                              "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            missing = json.loads(r.read())["missing"]
        if missing:
            bad = f"/healthz ok with {len(missing)} of {n} ids missing"
            break
finally:
    p.terminate()
    err = p.communicate(timeout=10)[1].decode()
if "already in use" in err:
    print("port taken")
    sys.exit(2)
print(f"{starting} answers 'starting', then {oks} ok" if bad is None else bad)
sys.exit(0 if bad is None and oks >= 1 else 1)
PY
	rc=$?
	[ "$rc" = 2 ] || break
done
check "/healthz ok only once every item is found ($(tail -1 "$work/health.out"))" \
	test "$rc" = 0

# --- 4a. open to all without a token: one clear line at start ---
# In a network namespace of its own (only its loopback), so that binding
# every interface exposes nothing.
if unshare -n true 2>/dev/null; then
	$PY - "$ECX" >"$work/open.out" 2>&1 <<'PY'
import subprocess, sys, threading
ecx = sys.argv[1]
cmds = {"registry": ["registry", "--port", "0"],
        "serve": ["serve", "--port", "0", "--advertise", "127.0.0.1",
                  "--synthetic", "1", "--shape", "4", "--dtype", "uint8"]}
cases = [(c, b, t) for c in ("registry", "serve")
         for b in ("0.0.0.0", "::", "127.0.0.1", "::1", "localhost")
         for t in (None, "secret")]
for c, bind, tok in cases:
    argv = [ecx] + cmds[c] + ["--bind", bind] + (["--token", tok] if tok
                                                 else [])
    p = subprocess.Popen(["unshare", "-n", "sh", "-c",
                          'ip link set lo up 2>/dev/null; exec "$@"', "sh"]
                         + argv, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(30, p.kill)  # never a hung test
    watchdog.start()
    line = p.stdout.readline()  # the ready line: past where it warns
    watchdog.cancel()
    p.terminate()
    err = p.communicate(timeout=30)[1]
    n = sum("warning: listening on" in x and "with no token" in x
            for x in err.splitlines())
    want = int(bind in ("0.0.0.0", "::") and tok is None)
    ready = line.startswith(("listening on", "serving"))
    print("ok" if n == want and ready else "bad",
          f"ecx {c} --bind {bind}{' --token' if tok else ''}: {want} "
          f"warning line(s) (got {n}{'' if ready else ', not started: ' + err.strip()})")
PY
	while read -r verdict line; do
		if [ "$verdict" = ok ]; then ok "$line"; else bad "$line"; fi
	done <"$work/open.out"
else
	echo "# skip: no unshare -n here (not root): the open-bind warning is untested"
fi

# --- 4b. an entry removed from under its producer comes back ---
# DELETE it by HTTP, then time until a lookup finds it again: within one
# renew period (2 s; the embedded registry checks as often).
came_back() { # came_back NAME REGISTRY-URL HTTP-URL ID
	local t0 ms
	curl -s -o /dev/null -X DELETE "$3/ec/info/$4"
	if "$ECX" info "$2" "$4" >/dev/null 2>&1; then
		bad "$1: DELETE did not remove $4"
		return
	fi
	t0=$(date +%s%N)
	for _ in $(seq $((60 * scale))); do
		"$ECX" info "$2" "$4" >/dev/null 2>&1 && break
		sleep 0.1
	done
	ms=$((($(date +%s%N) - t0) / 1000000))
	if "$ECX" info "$2" "$4" >/dev/null 2>&1 && [ "$ms" -le $((2000 * scale + 1000)) ]; then
		ok "$1: $4 is published again $ms ms after its DELETE"
	else
		bad "$1: $4 not back within $ms ms of its DELETE"
	fi
}
"$ECX" serve --bind 127.0.0.1 --port 0 --synthetic 3 --shape 4 \
	--dtype uint8 >"$work/e.out" 2>"$work/e.err" &
pids+=("$!")
wait_for "$work/e.out" "^serving" || bad "serve (embedded) did not start"
ereg=$(sed -n 's/.*registry //p' "$work/e.out")
came_back "embedded registry" "$ereg" "$ereg" synthetic-1
came_back "embedded registry, again" "$ereg" "$ereg" synthetic-1
"$ECX" ls "$ereg" >"$work/ls"
check "and nothing else changed (3 entries)" grep -q "^3 entries" "$work/ls"
kill -TERM "${pids[-1]}"

"$ECX" registry --bind 127.0.0.1 --port 0 >"$work/r.out" 2>"$work/r.err" &
pids+=("$!")
wait_for "$work/r.out" "listening on" || bad "registry did not start"
sreg=$(sed -n 's/^listening on //p' "$work/r.out")
"$ECX" serve --bind 127.0.0.1 --registry "$sreg" --synthetic 3 --shape 4 \
	--dtype uint8 >"$work/p.out" 2>"$work/p.err" &
pids+=("$!")
wait_for "$work/p.out" "^serving" || bad "serve --registry did not start"
came_back "ecx registry" "$sreg" "$sreg" synthetic-2
kill -TERM "${pids[-1]}" "${pids[-2]}"

if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
	rport=$(free_port)
	redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no \
		--dir "$work" --logfile "$work/redis.log" &
	pids+=("$!")
	for _ in $(seq 100); do
		redis-cli -p "$rport" ping 2>/dev/null | grep -q PONG && break
		sleep 0.1
	done
	"$ECX" registry --bind 127.0.0.1 --port 0 --store "redis://127.0.0.1:$rport" \
		>"$work/rr.out" 2>"$work/rr.err" &
	pids+=("$!")
	wait_for "$work/rr.out" "listening on" || bad "registry on Redis did not start"
	rreg=$(sed -n 's/^listening on //p' "$work/rr.out")
	"$ECX" serve --bind 127.0.0.1 --registry "redis://127.0.0.1:$rport" \
		--synthetic 3 --shape 4 --dtype uint8 >"$work/rp.out" 2>"$work/rp.err" &
	pids+=("$!")
	wait_for "$work/rp.out" "^serving" || bad "serve --registry redis:// did not start"
	came_back "Redis" "redis://127.0.0.1:$rport" "$rreg" synthetic-0
	kill -TERM "${pids[-1]}"
	# No TTL: nothing is renewed, but what is removed is still put back.
	"$ECX" serve --bind 127.0.0.1 --registry "redis://127.0.0.1:$rport" \
		--registry-ttl 0 --synthetic 3 --prefix nottl --shape 4 \
		--dtype uint8 >"$work/rq.out" 2>"$work/rq.err" &
	pids+=("$!")
	wait_for "$work/rq.out" "^serving" || bad "serve --registry-ttl 0 did not start"
	came_back "Redis, --registry-ttl 0" "redis://127.0.0.1:$rport" "$rreg" nottl-1
	check "and its entry has no TTL" \
		test "$(redis-cli -p "$rport" ttl ecx:nottl-1)" = -1
	kill -TERM "${pids[-1]}" "${pids[-2]}" "${pids[-3]}"
else
	echo "# skip: no redis-server: the Redis re-publish is untested"
fi
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
