#!/bin/sh
# redis_vs_http.sh [ECX]: batched lookups (256 ids) against the HTTP
# registry and against Redis (MGET), in one run. Starts a redis-server on a
# free port in a scratch folder and stops it at the end.
set -eu
ecx=${1:-$(dirname "$0")/../build/tools/ecx}
[ $# -gt 0 ] && shift
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
	--dir "$dir" --logfile '' >/dev/null &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do
	redis-cli -p "$port" ping >/dev/null 2>&1 && break
	sleep 0.1
done
"$ecx" bench registry --redis "redis://127.0.0.1:$port" "$@"
