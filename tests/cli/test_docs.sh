#!/bin/sh
# The command pages in docs/cli are what the command's --help says.
# Usage: test_docs.sh PATH/TO/ecx
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/gen-cli-docs.sh" "$1" "$tmp"
pass=0
fail=0
for f in "$tmp"/*.md; do
	if diff -u "$root/docs/cli/$(basename "$f")" "$f"; then
		pass=$((pass + 1))
	else
		echo "FAIL - docs/cli/$(basename "$f") is stale: run scripts/gen-cli-docs.sh build/tools/ecx"
		fail=$((fail + 1))
	fi
done
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
