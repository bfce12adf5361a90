#!/bin/bash
# An arena that cannot fit is refused before a page is touched (issue 22,
# finding 1): `ecx serve --capacity` twice this host's MemAvailable exits 1
# at once, naming the size asked and what is available, and leaves nothing
# in /dev/shm or among the System V segments. (On the code before, it took
# the machine's memory until the kernel killed it.)
# Usage: test_memory.sh PATH/TO/ecx
set -u
ECX=$(readlink -f "${1:?usage: test_memory.sh PATH/TO/ecx}")
. "$(dirname "$0")/lib.sh"

avail=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
avail=$((avail * 1024))
ask=$((avail * 2))
shm0=$(ls /dev/shm | wc -l)
t0=$(date +%s%N)
"$ECX" serve --bind 127.0.0.1 --port 0 --capacity "$ask" \
	>"$work/serve.out" 2>"$work/serve.err" &
spid=$!
pids+=("$spid")
# A refusal is at once; the old code touched pages until it was killed:
# it is stopped here after 10 s.
for _ in $(seq 100); do
	kill -0 "$spid" 2>/dev/null || break
	sleep 0.1
done
if kill -0 "$spid" 2>/dev/null; then
	kill -9 "$spid"
	bad "serve --capacity $ask (2x MemAvailable) still running after 10 s"
fi
wait "$spid"
rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
check "serve --capacity 2x MemAvailable exits 1 (rc $rc, in $ms ms)" [ "$rc" = 1 ]
check "within 2 s" [ "$ms" -lt 2000 ]
check "the message names the size asked" grep -q "an arena of $ask bytes" "$work/serve.err"
check "and what is available" grep -q "does not fit in memory: [0-9]* bytes .* available (MemAvailable" "$work/serve.err"
check "one line, no UCX" [ "$(wc -l <"$work/serve.err")" = 1 ]
echo "# $(cat "$work/serve.err")"
check "nothing new in /dev/shm" [ "$(ls /dev/shm | wc -l)" -le "$shm0" ]

# Under a control group's memory limit: an arena larger than the room the
# group leaves is refused the same way, naming the group (a container's
# limit is far below the host's MemAvailable). Needs a cgroup this test can
# make: root, with a writable memory controller (v1 or v2).
cg=""
if [ -w /sys/fs/cgroup/memory ]; then
	cg=/sys/fs/cgroup/memory/ecx-test-$$
	mkdir "$cg" 2>/dev/null && echo $((256 << 20)) >"$cg/memory.limit_in_bytes" || cg=""
elif [ -w /sys/fs/cgroup/cgroup.procs ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
	cg=/sys/fs/cgroup/ecx-test-$$
	mkdir "$cg" 2>/dev/null && echo $((256 << 20)) >"$cg/memory.max" || cg=""
fi
if [ -z "$cg" ]; then
	echo "ok - # SKIP no memory cgroup can be made here (not root, or no writable memory controller)"
else
	(
		echo "$BASHPID" >"$cg/cgroup.procs"
		exec timeout 20 "$ECX" serve --bind 127.0.0.1 --port 0 --capacity 1GiB \
			--synthetic 1 --shape 64 --dtype uint8
	) >"$work/cg.out" 2>"$work/cg.err"
	rc=$?
	check "serve --capacity 1GiB under a 256 MiB cgroup limit exits 1 (rc $rc)" [ "$rc" = 1 ]
	check "naming the control group's limit" grep -q "left under the memory limit of this process's control group ($cg)" "$work/cg.err"
	echo "# $(cat "$work/cg.err")"
	(
		echo "$BASHPID" >"$cg/cgroup.procs"
		exec "$ECX" serve --bind 127.0.0.1 --port 0 --capacity 64MiB \
			--synthetic 1 --shape 64 --dtype uint8
	) >"$work/cg2.out" 2>"$work/cg2.err" &
	pids+=("$!")
	wait_for "$work/cg2.out" "^serving" 100
	check "and 64 MiB under the same limit serves ($(head -c 300 "$work/cg2.err"))" grep -q "^serving" "$work/cg2.out"
	kill -9 "${pids[-1]}" 2>/dev/null
	wait "${pids[-1]}" 2>/dev/null
	for _ in $(seq 50); do rmdir "$cg" 2>/dev/null && break; sleep 0.1; done
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
