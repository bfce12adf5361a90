#!/bin/sh
# tsan-run.sh DIR TIMEOUT SUPP - make tsan's run: DIR/test_transfer (built
# with ThreadSanitizer; it starts its peers, ecx-test-peer, from DIR) with
# the suppressions in SUPP, its reports and those of its peers written to
# DIR/tsan-report.PID and printed last (tsan-reports.sh), core files on.
#
# A hang fails the run: past TIMEOUT seconds timeout sends SIGABRT to the
# test and its peers (SIGKILL 60 s later if that does not end them), the
# backtraces of their core files are printed (backtraces.sh; one core
# file, the last, where the kernel does not name them by pid), and that it
# hung is said again after the race reports. Exit status: the test's, 66
# for a report, 124 or 137 for a hang, 130 or 143 when stopped by INT or
# TERM.
#
# timeout runs the test in a process group of its own, which a Ctrl-C at
# the terminal does not reach (it went on until TIMEOUT): this shell
# passes INT and TERM on to timeout, which sends them to that group.
set -u
dir=${1:?usage: tsan-run.sh DIR TIMEOUT SUPP}
limit=${2:?usage: tsan-run.sh DIR TIMEOUT SUPP}
supp=${3:?usage: tsan-run.sh DIR TIMEOUT SUPP}
here=$(cd "$(dirname "$0")" && pwd)
cd "$dir" || exit 1
rm -f core core.[0-9]* tsan-report.*
ulimit -c unlimited 2>/dev/null || :
start=$(date +%s)
# Set before the test starts, so no signal falls between the two.
tp= stopped=
trap 'stopped=130; [ -z "$tp" ] || kill -INT "$tp" 2>/dev/null' INT
trap 'stopped=143; [ -z "$tp" ] || kill -INT "$tp" 2>/dev/null' TERM
TSAN_OPTIONS="suppressions=$supp disable_coredump=0 log_path=$PWD/tsan-report" \
	UCX_USE_MT_MUTEX=n ECX_TEST_BIN=$PWD \
	timeout -s ABRT -k 60 "$limit" ./test_transfer &
tp=$!
# (A signal before tp was set: the test is told now.)
[ -z "$stopped" ] || kill -INT "$tp" 2>/dev/null
rc=0
wait "$tp" || rc=$?
# A trapped signal ends the wait early: wait again until timeout is done.
while [ -n "$stopped" ] && kill -0 "$tp" 2>/dev/null; do
	wait "$tp" || :
done
if [ -n "$stopped" ]; then
	echo "make tsan: stopped (INT or TERM); test_transfer and its peers" \
		"were told to stop too" >&2
	exit "$stopped"
fi
[ "$rc" = 0 ] && exec "$here/tsan-reports.sh" "$PWD"
hung=
if [ "$rc" = 124 ] || { [ "$rc" = 137 ] &&
	[ $(($(date +%s) - start)) -ge "$limit" ]; }; then
	hung="make tsan: test_transfer HUNG: not done after $limit s"
	hung="$hung (TSAN_TIMEOUT), killed by timeout (exit $rc)"
	echo "$hung; backtraces of its core files follow"
fi
"$here/backtraces.sh" "$PWD"
"$here/tsan-reports.sh" "$PWD"
[ -z "$hung" ] || echo "$hung"
exit "$rc"
