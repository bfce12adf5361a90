#!/bin/sh
# tsan-reports.sh DIR - prints each ThreadSanitizer report file in DIR
# (tsan-report.PID, written where TSAN_OPTIONS has log_path=DIR/tsan-report)
# and exits 66, TSan's own exit code, if one holds a report (a WARNING or a
# DEADLYSIGNAL of ThreadSanitizer); 0 if none does (other output of the
# runtime is printed, and does not fail the run).
# make tsan runs it last, so the race is what a CI log's tail shows,
# whichever process (the test or a peer it started) saw it.
set -u
dir=${1:?usage: tsan-reports.sh DIR}
found=0
for f in "$dir"/tsan-report.*; do
	[ -f "$f" ] || continue
	grep -q 'ThreadSanitizer' "$f" && found=1
	echo "== ThreadSanitizer report $f =="
	cat "$f"
done
[ "$found" = 0 ] && exit 0
echo "tsan-reports.sh: ThreadSanitizer reported (files above)"
exit 66
