#!/bin/bash
# tests/wheel/test_wheel.sh - ecx installed as a vLLM user installs it: the
# wheel that `pip wheel .` builds from this checkout, installed with torch
# 2.13.0 into a fresh venv, then used from a folder outside the repository
# with no PYTHONPATH, ECX_LIBRARY or LD_LIBRARY_PATH (check_installed.py
# says what it checks). The wheel's file list is checked first: one libecx,
# every module of python/ecx, the command.
#
# vLLM itself (3.5 GB) is not installed a second time: the fresh venv then
# sees the project venv's packages through a .pth file, after its own, so
# ecx is still the wheel's while ecx.vllm's modules import the real vLLM.
#
# Usage: test_wheel.sh PYTHON (the project venv's interpreter, ECX_PYTHON)
set -u
PY=${1:?usage: test_wheel.sh PATH/TO/venv/bin/python}
root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/wheel
work=$(mktemp -d /tmp/ecx-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH ECX_LIBRARY LD_LIBRARY_PATH ECX_BIN
fail() { echo "FAIL - $*"; exit 1; }

# The interpreter the project venv was made from makes the fresh one.
base=$("$PY" -c 'import sys; print(sys._base_executable)')
t0=$(date +%s)
"$PY" -m pip wheel -q --no-deps -w "$work/dist" "$root" >"$work/build.log" 2>&1 ||
	fail "pip wheel $root: $(tail -20 "$work/build.log")"
wheel=$(ls "$work"/dist/ecx-*.whl)
echo "ok - built $(basename "$wheel") in $(($(date +%s) - t0)) s"
left=$(git -C "$root" status --porcelain --ignored --untracked-files=all -- \
	python include src tools pyproject.toml | grep -E '^(\?\?|!!)' |
	grep -v __pycache__)
[ -z "$left" ] || fail "pip wheel left files in the tree: $left"
echo "ok - nothing left in the source tree"

"$PY" "$here/wheel_files.py" "$wheel" "$root/python" || fail "the wheel's files"

t0=$(date +%s)
"$base" -m venv "$work/venv" || fail "$base -m venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check \
	torch==2.13.0 "$wheel" >"$work/install.log" 2>&1 ||
	fail "pip install torch==2.13.0 $wheel: $(tail -20 "$work/install.log")"
echo "ok - installed into a fresh venv with torch 2.13.0 in $(($(date +%s) - t0)) s"

cd "$work" || exit 1
want=$(sed -n 's/^#define ECX_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' \
	"$root/include/ecx/ecx.h" | paste -sd.)
got=$("$work/venv/bin/ecx" --version 2>&1) || fail "ecx --version: $got"
case "$got" in
*"$want"*) echo "ok - the venv's ecx --version: $got" ;;
*) fail "the venv's ecx --version says '$got', ecx.h says $want" ;;
esac

cp "$here/check_installed.py" "$work/"
"$work/venv/bin/python" "$work/check_installed.py" --no-vllm "$want" ||
	fail "the installed package, without vLLM"
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mine=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" >"$mine/zz-project-venv.pth"
"$work/venv/bin/python" "$work/check_installed.py" "$want" ||
	fail "the installed package, beside vLLM"
echo "ok - the wheel, installed, works"
