#!/bin/sh
# Installs the Debian packages that ecx builds, tests and runs with. The
# Python tests' packages (torch 2.x, vLLM, Mooncake) come from the Python
# package index into a venv: scripts/venv.sh.
# Idempotent: when every package is already installed it does nothing.
# Runs apt-get as root, or through sudo when not root.
set -eu

PKGS="build-essential cmake pkg-config clang libclang-rt-dev clang-format
libucx-dev ucx-utils libzmq3-dev libmicrohttpd-dev libcurl4-openssl-dev
libcjson-dev libhiredis-dev libxxhash-dev redis-server redis-sentinel libcmocka-dev
python3 python3-venv python3-numpy python3-zmq iproute2 util-linux valgrind gdb curl"

missing=""
for p in $PKGS; do
	if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
		missing="$missing $p"
	fi
done
[ -z "$missing" ] && exit 0

echo "install-deps: installing:$missing" >&2
SUDO=""
if [ "$(id -u)" != 0 ]; then
	command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install:$missing" >&2; exit 1; }
	SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# shellcheck disable=SC2086
$SUDO apt-get install -y -q --no-install-recommends $missing
