#!/bin/sh
# gen-cli-docs.sh ECX [DIR]: writes DIR/CMD.md (default docs/cli) for each
# command from its own --help, so the pages always match the code.
# tests/cli/test_docs.sh runs it into a scratch folder and diffs.
set -eu
ecx=$1
dir=${2:-$(dirname "$0")/../docs/cli}
mkdir -p "$dir"
for c in registry serve info ls get consume bench demo; do
	{
		echo "# ecx $c"
		echo
		echo "Generated from \`ecx $c --help\` by scripts/gen-cli-docs.sh."
		echo
		echo '```'
		"$ecx" "$c" --help
		echo '```'
	} >"$dir/$c.md"
done
