#!/bin/sh
# scripts/venv.sh - makes the Python environment the tests run in, .venv at
# the top of the checkout (ECX_VENV elsewhere), with exactly the versions
# that tests/requirements.txt pins (torch 2.x, pytest, Mooncake's engine,
# vLLM's CPU build, torchvision), and ecx itself installed from its wheel
# (built from this checkout; never from PYTHONPATH), as vLLM's users
# install it. Reused while it is right: it is made anew when the pins, this
# script or the base interpreter change, or when a make of it did not
# finish; ecx's wheel is built and installed again when its sources
# change. Prints the interpreter's path last.
#
# The base interpreter is python3 on PATH (ECX_VENV_PYTHON to choose
# another): 3.11, the version the pinned wheels are built for. On Debian,
# venv needs the python3-venv package (scripts/install-deps.sh).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${ECX_VENV:-$root/.venv}
base=${ECX_VENV_PYTHON:-python3}
reqs=$root/tests/requirements.txt

command -v "$base" >/dev/null 2>&1 ||
	{ echo "venv: no $base on PATH (set ECX_VENV_PYTHON to a Python 3.11)" >&2; exit 1; }
ver=$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$ver" != 3.11 ]; then
	echo "venv: $base is Python $ver; the pinned wheels (torch, Mooncake) are for 3.11: set ECX_VENV_PYTHON to a Python 3.11" >&2
	exit 1
fi
want=$( { cat "$reqs" "$0"; "$base" -c 'import sys; print(sys.executable, sys.version)'; } |
	sha256sum | cut -d' ' -f1)

# ecx_wheel: installs this checkout's ecx into the venv from its wheel
# when the wheel's sources differ from those it was last installed from.
ecx_wheel() {
	if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
		files=$(cd "$root" && git ls-files -co --exclude-standard -- pyproject.toml \
			CMakeLists.txt ecx.pc.in include src python/ecx tools | sort)
	else
		files=$(cd "$root" && find pyproject.toml CMakeLists.txt ecx.pc.in include \
			src python/ecx tools -type f ! -name '*.pyc' | sort)
	fi
	# shellcheck disable=SC2086
	have=$(cd "$root" && cat $files | sha256sum | cut -d' ' -f1)
	[ "$(cat "$venv/.ecx-wheel-stamp" 2>/dev/null)" = "$have" ] && return 0
	echo "venv: installing ecx from its wheel (this checkout)" >&2
	log=$venv/pip.log
	"$venv/bin/python" -m pip --disable-pip-version-check install -q --no-deps \
		--force-reinstall "$root" >>"$log" 2>&1 || {
		tail -n 60 "$log" >&2
		echo "venv: building or installing ecx's wheel failed (log above; $log)" >&2
		exit 1
	}
	echo "$have" >"$venv/.ecx-wheel-stamp"
}

if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.ecx-stamp" 2>/dev/null)" = "$want" ]; then
	ecx_wheel
	echo "$venv/bin/python"
	exit 0
fi

# Only a venv this script made is ever made anew: ECX_VENV pointing at
# another environment (vLLM's, say) is refused, not emptied.
if [ -d "$venv" ] && [ -n "$(ls -A "$venv")" ] && [ ! -e "$venv/.ecx-stamp" ] &&
	[ ! -e "$venv/.ecx-making" ]; then
	echo "venv: $venv holds something this script did not make: not touching it (set ECX_VENV to another folder, or remove it)" >&2
	exit 1
fi
echo "venv: making $venv (Python $ver, tests/requirements.txt)" >&2
start=$(date +%s)
rm -rf "$venv"
mkdir -p "$venv"
: >"$venv/.ecx-making"
"$base" -m venv "$venv" ||
	{ echo "venv: '$base -m venv' failed (on Debian: apt-get install python3-venv)" >&2; exit 1; }
log=$venv/pip.log
# pip_install ARGS: quiet when it works, its whole log when it does not.
pip_install() {
	"$venv/bin/python" -m pip --disable-pip-version-check install -q "$@" \
		>>"$log" 2>&1 || {
		cat "$log" >&2
		echo "venv: pip install $* failed (log above; $log)" >&2
		exit 1
	}
}
pip_install -r "$reqs"
# "# no-deps: NAME==VERSION" lines: packages whose own pins cannot be met
# here (vLLM's CPU build), installed alone; the file pins what they need.
nodeps=$(sed -n 's/^# no-deps: *//p' "$reqs")
# shellcheck disable=SC2086
[ -z "$nodeps" ] || pip_install --no-deps $nodeps
# torchvision 0.28.0 is the release made for torch 2.13.0, and Qwen2-VL's
# processors in transformers need it; but PyPI's build is CUDA's: its
# _C.so (the detection ops: nms, roi_align, ...) wants libtorch_cuda and
# does not load beside the CPU torch. torchvision then goes on without its
# ops, as it is written to, except for two fake (meta) registrations of
# nms and qnms that it makes unconditionally, which raise "operator
# torchvision::nms does not exist". The fix made here puts those two
# behind the same check torchvision's own register_meta makes for every
# other op (extension._has_ops()); nothing that vLLM or transformers calls
# uses those ops. The one change is checked by importing torchvision.
tv=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torchvision/_meta_registrations.py
if [ -f "$tv" ]; then
	sed -i 's/^@torch\.library\.register_fake(\(.*\))$/@(torch.library.register_fake if torchvision.extension._has_ops() else lambda name: lambda fn: fn)(\1)/' "$tv"
	"$venv/bin/python" -c 'import torchvision.transforms.v2' >>"$log" 2>&1 || {
		tail -n 20 "$log" >&2
		echo "venv: torchvision does not import after the fix to $tv (log above)" >&2
		exit 1
	}
fi
echo "$want" >"$venv/.ecx-stamp"
rm -f "$venv/.ecx-making"
ecx_wheel
echo "venv: made in $(($(date +%s) - start)) s" >&2
echo "$venv/bin/python"
