#!/bin/sh
# tests/gpu/check.sh - ecx's CUDA path on a real GPU, in one go (under five
# minutes; tests/gpu/check.py says what it checks). Prints a table, exits 0
# when every row passes, 1 when one fails, 77 (ctest: skipped) where this
# host has no GPU. A GPU here that torch cannot use is a failure.
#
# ECX_PYTHON: the interpreter whose torch has CUDA (vLLM's venv), default
# python3. ECX_LIBRARY and PYTHONPATH come from ctest; by hand they default
# to this checkout's build/libecx.so and python/.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${ECX_PYTHON:-python3}

# ECX_GPU_PRESENT=1 says a GPU is here without looking (tests use it to
# reach the failure paths on a machine without one).
present=${ECX_GPU_PRESENT:-}
if [ -z "$present" ]; then
	if [ -e /dev/nvidia0 ]; then
		present=/dev/nvidia0
	elif command -v nvidia-smi >/dev/null 2>&1 &&
		nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
		present=nvidia-smi
	fi
fi
if [ -z "$present" ]; then
	echo "skipped: no GPU here (no /dev/nvidia0, nvidia-smi lists none)"
	exit 77
fi

export PYTHONPATH="${PYTHONPATH:-$root/python}"
if [ -z "${ECX_LIBRARY:-}" ] && [ -e "$root/build/libecx.so" ]; then
	export ECX_LIBRARY="$root/build/libecx.so"
fi
if ! command -v "$py" >/dev/null 2>&1; then
	echo "FAIL: a GPU is here but ECX_PYTHON=$py is not an interpreter"
	exit 1
fi
# Bounded by itself too (by hand, outside ctest): five minutes at most.
if command -v timeout >/dev/null 2>&1; then
	rc=0
	timeout -k 5 290 "$py" "$here/check.py" || rc=$?
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		echo "FAIL: the check ran past 290 s and was stopped"
		exit 1
	fi
	exit "$rc"
fi
exec "$py" "$here/check.py"
