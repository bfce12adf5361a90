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

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
