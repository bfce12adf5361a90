#!/bin/bash
# No arena outlives its process (issue 22, finding 2). UCX's posix
# allocator names a file in /dev/shm, writes it whole, and only then
# unlinks it: a process killed in between left the file, and its memory,
# until removed by hand. ecx keeps UCX off it (System V segments, which
# are marked for removal once attached, else private memory). Here, in an
# IPC and mount namespace of its own (a private /dev/shm, its own System V
# segments), with the System V limit lowered to 64 MiB so a 512 MiB arena
# cannot be a System V segment (the case that took the posix path), `ecx
# serve` is SIGKILLed as soon as a file shows in /dev/shm, or once it
# serves; then /dev/shm must be empty and no segment left. The same for an
# arena that is a System V segment (16 MiB), and for a consumer's receive
# arena of 512 MiB (the test peer). Needs root (unshare):
# skipped (77) otherwise.
# Usage: test_shm_leak.sh PATH/TO/ecx PATH/TO/ecx-test-peer
set -u
ECX=$(readlink -f "${1:?usage: test_shm_leak.sh PATH/TO/ecx PATH/TO/ecx-test-peer}")
PEER=$(readlink -f "${2:?usage: test_shm_leak.sh PATH/TO/ecx PATH/TO/ecx-test-peer}")
if [ "${ECX_SHM_LEAK_INNER:-}" != 1 ]; then
	if ! unshare --ipc --mount true 2>/dev/null; then
		echo "skipped: cannot make IPC and mount namespaces (needs root)"
		exit 77
	fi
	ECX_SHM_LEAK_INNER=1 exec unshare --ipc --mount "$0" "$ECX" "$PEER"
fi
. "$(dirname "$0")/lib.sh"
mount -t tmpfs -o size=1g ecx-test-shm /dev/shm || {
	echo "skipped: cannot mount a tmpfs on /dev/shm"
	exit 77
}
echo $((64 << 20)) >/proc/sys/kernel/shmmax

segments() { ipcs -m | awk '$1 ~ /^0x/' | wc -l; }

# kill_when PID OUT [REGEX]: SIGKILLs PID as soon as /dev/shm holds a file
# or OUT matches REGEX (default: it serves), at most 30 s; echoes which.
kill_when() {
	local why=timeout
	for _ in $(seq 30000); do
		if [ -n "$(ls -A /dev/shm)" ]; then
			why="a file in /dev/shm: $(ls /dev/shm | head -1)"
			break
		fi
		if grep -q "${3:-^serving}" "$2" 2>/dev/null; then
			why=${3:-^serving}
			break
		fi
		kill -0 "$1" 2>/dev/null || {
			why=exited
			break
		}
		sleep 0.001
	done
	kill -9 "$1" 2>/dev/null
	wait "$1" 2>/dev/null
	echo "$why"
}

for cap in 512MiB 16MiB; do
	rm -f "$work/serve.out"
	"$ECX" serve --bind 127.0.0.1 --port 0 --capacity "$cap" \
		--synthetic 1 --prefix t --shape 1024x3584 --dtype bfloat16 \
		>"$work/serve.out" 2>"$work/serve.err" &
	spid=$!
	how=$(kill_when "$spid" "$work/serve.out")
	echo "# serve --capacity $cap killed at: $how"
	sleep 0.2
	left=$(ls -A /dev/shm)
	echo "# $(head -c 300 "$work/serve.err")"
	check "serve --capacity $cap SIGKILLed ($how): nothing left in /dev/shm${left:+ ($left)}" [ -z "$left" ]
	check "serve --capacity $cap: no System V segment left" [ "$(segments)" = 0 ]
	rm -f /dev/shm/* 2>/dev/null
done

# A consumer's receive arena of 512 MiB (the test peer, loading over
# shared memory from a producer here), killed as soon as a file shows or
# once it is ready; then one that loads before it is killed. (Not the last
# producer's "serving" line: the redirection truncates only once the new
# process runs.)
rm -f "$work/serve.out"
"$ECX" serve --bind 127.0.0.1 --port 0 --capacity 16MiB --transport shm \
	--synthetic 1 --prefix t --shape 1024x3584 --dtype bfloat16 \
	>"$work/serve.out" 2>"$work/serve.err" &
spid=$!
pids+=("$spid")
if wait_for "$work/serve.out" "^serving"; then
	url=$(grep -o 'registry http://[^ ,]*' "$work/serve.out" | cut -d' ' -f2)
	"$PEER" consumer "$url" --transport shm --recv $((512 << 20)) --arena \
		>"$work/peer.out" 2>"$work/peer.err" </dev/null &
	how=$(kill_when $! "$work/peer.out" "^ready")
	echo "# consumer killed at: $how"
	check "consumer (512 MiB arena) SIGKILLed ($how): nothing left in /dev/shm" [ -z "$(ls -A /dev/shm)" ]
	mkfifo "$work/in"
	"$PEER" consumer "$url" --transport shm --recv $((512 << 20)) --arena \
		--timeout 20000 <"$work/in" >"$work/peer.out" 2>"$work/peer.err" &
	cpid=$!
	exec 3>"$work/in"
	echo "load t-0" >&3
	wait_for "$work/peer.out" "^ok" || bad "the consumer loads: $(cat "$work/peer.out" "$work/peer.err")"
	check "the consumer loads over shared memory: $(tail -1 "$work/peer.out") $(head -c 300 "$work/peer.err")" grep -q "^ok ok" "$work/peer.out"
	kill -9 "$cpid" "$spid"
	wait "$cpid" "$spid" 2>/dev/null
	exec 3>&-
	sleep 0.2
	left=$(ls -A /dev/shm)
	check "consumer and producer SIGKILLed: nothing left in /dev/shm${left:+ ($left)}" [ -z "$left" ]
	check "no System V segment left" [ "$(segments)" = 0 ]
else
	bad "serve --transport shm starts: $(cat "$work/serve.err")"
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
