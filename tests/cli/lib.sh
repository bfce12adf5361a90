# tests/cli/lib.sh - what the shell tests here share. Sourced after ECX is
# set: a work folder ($work) and the processes started ($pids), both gone
# on exit; one line per check (ok, bad, check) and their counts ($pass,
# $fail); waiting for a line in a file (wait_for).
work=$(mktemp -d)
pids=()
pass=0
fail=0
cleanup() {
	for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
	rm -rf "$work"
}
trap cleanup EXIT

ok() { echo "ok - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1"; fail=$((fail + 1)); }
check() { # check NAME COMMAND...
	local name=$1
	shift
	if "$@"; then ok "$name"; else bad "$name"; fi
}
wait_for() { # wait_for FILE REGEX [TENTHS]: up to 30 s unless told
	for _ in $(seq "${3:-300}"); do
		grep -q "$2" "$1" 2>/dev/null && return 0
		sleep 0.1
	done
	return 1
}
