#!/bin/bash
# Producer and consumer agree on a transport per connection: every pair of
# --transport settings (auto, tcp, shm) either loads a 7 MiB item byte for
# byte or fails with a message naming both settings, and a consumer running
# as another Unix user (runuser -u nobody) loads over TCP where shared
# memory cannot work. No UCX line reaches the terminal. Real `ecx serve`
# processes on 127.0.0.1, started and stopped here.
# Usage: test_transports.sh PATH/TO/ecx
set -u
ECX=$(readlink -f "${1:?usage: test_transports.sh PATH/TO/ecx}")
. "$(dirname "$0")/lib.sh"
chmod 1777 "$work" # the other user writes its file here too

# get AS_USER TRANSPORT: one `ecx get --verify`, output in $work/get.*
get() {
	local run=()
	[ "$1" != - ] && run=(runuser -u "$1" --)
	rm -f "$work/x.npy"
	"${run[@]}" "$ECX" get "$url" t-0 -o "$work/x.npy" --verify \
		--transport "$2" --timeout 5s >"$work/get.out" 2>"$work/get.err"
}

# What each pair must do: "load", or a phrase the refusal must contain.
expect() { # expect PRODUCER CONSUMER
	case "$1/$2" in
	tcp/shm | shm/tcp) echo "no transport in common: this producer's transport is $1, the consumer's is $2" ;;
	*) echo load ;;
	esac
}

for pt in auto tcp shm; do
	# Not the last producer's "serving" line (the redirection below
	# truncates only once the new process runs).
	rm -f "$work/serve.out"
	"$ECX" serve --bind 127.0.0.1 --port 0 --transport "$pt" \
		--synthetic 1 --prefix t --shape 1024x3584 --dtype bfloat16 \
		>"$work/serve.out" 2>"$work/serve.err" &
	spid=$!
	pids+=("$spid")
	if ! wait_for "$work/serve.out" "^serving"; then
		bad "serve --transport $pt starts"
		continue
	fi
	url=$(grep -o 'registry http://[^ ,]*' "$work/serve.out" | cut -d' ' -f2)
	for ct in auto tcp shm; do
		want=$(expect "$pt" "$ct")
		get - "$ct"
		rc=$?
		if [ "$want" = load ]; then
			if [ $rc = 0 ] && grep -q "(verified)" "$work/get.out"; then
				ok "producer $pt, consumer $ct: loads, bytes verified"
			else
				bad "producer $pt, consumer $ct: rc $rc: $(cat "$work/get.err")"
			fi
		elif [ $rc = 1 ] && grep -qF "$want" "$work/get.err"; then
			ok "producer $pt, consumer $ct: refused, naming both settings"
		else
			bad "producer $pt, consumer $ct: rc $rc, wanted '$want': $(cat "$work/get.err")"
		fi
		if grep -q "UCX" "$work/get.err"; then
			bad "producer $pt, consumer $ct: a UCX line on the terminal: $(grep UCX "$work/get.err")"
		fi
	done

	# Another Unix user on this host: no shared memory with the producer.
	if [ "$(id -u)" != 0 ] || ! command -v runuser >/dev/null ||
		! runuser -u nobody -- test -x "$ECX"; then
		echo "ok - # SKIP another user: needs root, runuser, and $ECX readable by nobody"
	else
		for ct in auto tcp shm; do
			get nobody "$ct"
			rc=$?
			if [ "$ct" = shm ] || [ "$pt" = shm ]; then
				if [ $rc = 1 ] && grep -q "cannot map this producer's memory\|no transport in common" "$work/get.err"; then
					ok "producer $pt, consumer $ct as nobody: refused, saying why"
				else
					bad "producer $pt, consumer $ct as nobody: rc $rc: $(cat "$work/get.err")"
				fi
			elif [ $rc = 0 ] && grep -q "(verified)" "$work/get.out"; then
				ok "producer $pt, consumer $ct as nobody: loads over TCP, bytes verified"
			else
				bad "producer $pt, consumer $ct as nobody: rc $rc: $(cat "$work/get.err")"
			fi
		done
	fi
	kill "$spid"
	wait "$spid" 2>/dev/null
done

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
