#!/bin/sh
# run-fuzz.sh DIR SECONDS: runs every fuzz_* target in DIR for SECONDS each,
# starting from the committed corpus in fuzz/corpus/NAME. New inputs go to a
# scratch folder so the committed corpus changes only by hand. Exits non-zero
# on the first finding (the crashing input is left in the current folder).
set -eu
dir=$1
secs=$2
root=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "$dir"/fuzz_*; do
	[ -x "$t" ] || continue
	name=$(basename "$t" | sed 's/^fuzz_//')
	mkdir -p "$scratch/$name"
	echo "fuzz: $name for ${secs}s"
	"$t" -max_total_time="$secs" -max_len=65536 -print_final_stats=1 \
		"$scratch/$name" "$root/fuzz/corpus/$name" 2>"$scratch/$name.log" || {
		tail -40 "$scratch/$name.log"
		echo "fuzz: $name FAILED"
		exit 1
	}
	grep -E '^stat::number_of_executed_units' "$scratch/$name.log" || true
done
echo "fuzz: no findings"
