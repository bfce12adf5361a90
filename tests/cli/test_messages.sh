#!/bin/bash
# What the command says when something is wrong, as a new user meets it:
# a registry URL that names a producer's ZeroMQ port, an IPv6 address
# without brackets, a registry or Redis that refuses or does not answer,
# a registry that goes down under `ecx serve` and comes back, a token that
# differs from the producer's. Each message says what is wrong and names
# the URL, the bound or the address once; libcurl's and hiredis's own
# words come only after. The servers (an `ecx serve`, an `ecx registry`, a
# silent listener, a redis-server where there is one) listen on free ports
# of 127.0.0.1 and are stopped here.
# Usage: test_messages.sh PATH/TO/ecx
set -u
ECX=${1:?usage: test_messages.sh PATH/TO/ecx}
PY=/usr/bin/python3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$(dirname "$0")/lib.sh"

free_port() {
	$PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
count() { # count FILE STRING: lines of FILE with STRING
	grep -cF -- "$2" "$1"
}

# A producer with a token, and its embedded registry.
"$ECX" serve --bind 127.0.0.1 --port 0 --capacity 64MiB --token A \
	--synthetic 2 --shape 4x4 --dtype float32 \
	>"$work/serve.out" 2>"$work/serve.err" &
pids+=("$!")
wait_for "$work/serve.out" "^serving 2 items" ||
	{ echo "FAIL - ecx serve did not start"; cat "$work/serve.err"; exit 1; }
zmq=$(grep -o 'tcp://[0-9.]*:[0-9]*' "$work/serve.out" | head -1)
reg=$(grep -o 'registry http://[0-9.]*:[0-9]*' "$work/serve.out" | sed 's/registry //')

# A listener that takes connections and never answers.
silent=$(free_port)
$PY -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
held = []
while True:
    held.append(s.accept()[0])
' "$silent" &
pids+=("$!")
disown "$!" # killed at the end without a word from bash
for _ in $(seq 50); do
	$PY -c "import socket; socket.create_connection(('127.0.0.1', $silent), 1)" 2>/dev/null && break
	sleep 0.1
done
closed=$(free_port)

# 1. The registry's URL names a producer's ZeroMQ port.
"$ECX" get "http://${zmq#tcp://}" synthetic-0 -o "$work/x.npy" 2>"$work/e1"
check "a ZeroMQ port given as a registry exits 1" test $? = 1
check "and asks whether it is a registry, naming the URL" \
	grep -qF "http://${zmq#tcp://} does not answer HTTP: is it a registry?" "$work/e1"
check "and libcurl's 'Unsupported protocol' only follows as detail" \
	grep -qF "(libcurl: Unsupported protocol)" "$work/e1"
"$ECX" get "$zmq" synthetic-0 -o "$work/x.npy" 2>"$work/e1b"
check "a tcp:// registry URL is said to be a producer's port" \
	grep -qF "a tcp:// address is a producer's ZeroMQ port" "$work/e1b"

# An IPv6 address without brackets.
"$ECX" get http://::1:9018 synthetic-0 -o "$work/x.npy" 2>"$work/e2"
check "an IPv6 registry without brackets is a usage error (exit 2)" \
	test $? = 2
check "and says to put it in brackets, written right" \
	grep -qF "put the address in brackets, http://[::1]:9018" "$work/e2"
check "not libcurl's 'bad/illegal format'" \
	bash -c "! grep -q 'bad/illegal' '$work/e2'"
"$ECX" get redis://::1:6379 synthetic-0 -o "$work/x.npy" 2>"$work/e2r"
check "the same for redis://" \
	grep -qF "put the address in brackets, redis://[::1]:6379" "$work/e2r"

# A registry that refuses, or takes the connection and never answers.
"$ECX" get "http://127.0.0.1:$closed" synthetic-0 -o "$work/x.npy" 2>"$work/e3"
check "a closed registry port: refused, with the URL" \
	grep -qF "registry http://127.0.0.1:$closed refused the connection" "$work/e3"
t0=$(date +%s%N)
"$ECX" get --timeout 1s "http://127.0.0.1:$silent" synthetic-0 \
	-o "$work/x.npy" 2>"$work/e4"
t1=$(date +%s%N)
check "a silent registry names the bound that ran out" \
	grep -qF "registry http://127.0.0.1:$silent took the connection but did not answer within the request timeout of 1000 ms" "$work/e4"
check "and ends within it (under 3 s)" test $(((t1 - t0) / 1000000)) -lt 3000

# Redis that refuses, or does not answer.
"$ECX" get "redis://127.0.0.1:$closed" synthetic-0 -o "$work/x.npy" 2>"$work/e5"
check "Redis refused: said so, with its address" \
	grep -qF "Redis at 127.0.0.1:$closed refused the connection" "$work/e5"
t0=$(date +%s%N)
"$ECX" get --timeout 1s "redis://127.0.0.1:$silent" synthetic-0 \
	-o "$work/x.npy" 2>"$work/e6"
t1=$(date +%s%N)
check "Redis silent: 'did not answer within 1000 ms', with its address" \
	grep -qF "Redis at 127.0.0.1:$silent did not answer within 1000 ms" "$work/e6"
check "hiredis's 'Resource temporarily unavailable' only as detail" \
	bash -c "! grep -q ': Resource temporarily unavailable\$' '$work/e6'"
check "and it ends within the bound (under 3 s)" test $(((t1 - t0) / 1000000)) -lt 3000

# docs/vllm.md quotes what `ecx ls` prints where port 9018 is closed.
quote=$(grep -o '`[^`]*` means port 9018 is closed' "$ROOT/docs/vllm.md" |
	sed 's/`\([^`]*\)`.*/\1/')
"$ECX" ls "http://127.0.0.1:$closed" >/dev/null 2>"$work/e7"
check "docs/vllm.md's quote ('$quote') is what ecx ls prints" \
	bash -c "test -n '$quote' && grep -qF '$quote' '$work/e7'"

# 3. A token that is not the producer's: the producer is named once.
"$ECX" get --token B "$reg" synthetic-0 -o "$work/x.npy" 2>"$work/e8"
check "a wrong token exits 1" test $? = 1
check "and says the producer refused it for the token" \
	grep -qF "synthetic-0: producer $zmq refused: bad or missing token" "$work/e8"
check "naming the producer once" test "$(grep -oF "$zmq" "$work/e8" | wc -l)" = 1
"$ECX" get --token B --mooncake force "$reg" synthetic-0 \
	-o "$work/x.npy" 2>"$work/e9"
check "the reference's pull refused for the token: said so" \
	grep -qF "synthetic-0: reference pull from $zmq refused: this producer requires a token" "$work/e9"
check "naming the item and the producer once" \
	bash -c "test \$(grep -oF '$zmq' '$work/e9' | wc -l) = 1 && test \$(grep -oF 'synthetic-0' '$work/e9' | wc -l) = 1"
check "and not as a producer that does not answer" \
	bash -c "! grep -q 'does not answer' '$work/e9'"
"$ECX" consume --token B "$reg" >/dev/null 2>"$work/e10"
check "ecx consume with a wrong token says why and names the producer" \
	grep -qF "producer $zmq refused: bad or missing token" "$work/e10"

# 2. The registry goes down under `ecx serve` and comes back: said once
# each way, not every second.
rport=$(free_port)
"$ECX" registry --bind 127.0.0.1 --port "$rport" >"$work/reg.out" 2>&1 &
regpid=$!
pids+=("$regpid")
wait_for "$work/reg.out" "listening on" ||
	{ echo "FAIL - ecx registry did not start"; exit 1; }
"$ECX" serve --bind 127.0.0.1 --capacity 64MiB --registry-ttl 3 \
	--registry "http://127.0.0.1:$rport" --synthetic 2 --prefix down \
	--shape 4x4 --dtype float32 >"$work/s2.out" 2>"$work/s2.err" &
s2=$!
pids+=("$s2")
wait_for "$work/s2.out" "^serving 2 items" ||
	{ echo "FAIL - ecx serve --registry did not start"; exit 1; }
kill -TERM "$regpid"
wait "$regpid" 2>/dev/null
sleep 6 # renewals every second meanwhile
"$ECX" registry --bind 127.0.0.1 --port "$rport" >"$work/reg2.out" 2>&1 &
pids+=("$!")
check "the registry back: said once" \
	wait_for "$work/s2.err" "the registry answers again" 150
check "the outage was said once, not each second" \
	test "$(count "$work/s2.err" "refused the connection")" = 1
check "it names the registry and why" \
	grep -qF "registry http://127.0.0.1:$rport refused the connection" "$work/s2.err"
check "and the comeback once" \
	test "$(count "$work/s2.err" "the registry answers again")" = 1

# A Redis registry that is not there yet when `ecx serve` starts: the
# command says it waits, once, and nothing says it again each second.
if command -v redis-server >/dev/null; then
	dport=$(free_port)
	"$ECX" serve --bind 127.0.0.1 --capacity 64MiB --registry-ttl 3 \
		--registry "redis://127.0.0.1:$dport" --synthetic 2 \
		--prefix wait --shape 4x4 --dtype float32 \
		>"$work/s3.out" 2>"$work/s3.err" &
	pids+=("$!")
	wait_for "$work/s3.err" "waiting for the registry" 150
	sleep 3.5 # puts tried each second
	redis-server --port "$dport" --bind 127.0.0.1 --save '' \
		--appendonly no --dir "$work" --logfile "$work/redis.log" &
	pids+=("$!")
	check "serve starts once Redis is up" \
		wait_for "$work/s3.out" "^serving 2 items" 150
	check "it said it waits, once, naming Redis and why" \
		test "$(count "$work/s3.err" "Redis at 127.0.0.1:$dport refused the connection")" = 1
	check "no log line repeats it meanwhile (no warning; Redis's port named by that line and the one that says it answers, no other)" \
		bash -c "! grep -q ' warn ' '$work/s3.err' && test \$(grep -c ':$dport' '$work/s3.err') -le 2"
else
	echo "skip - no redis-server: Redis registry down at start not checked"
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
