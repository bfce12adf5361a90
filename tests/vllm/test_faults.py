"""Faults inside real vLLM: an ecx encoder stopped (SIGSTOP: it answers
nothing, its sockets stay open) or killed (SIGKILL, the whole process
group) while a prefill has requests for its items in flight; the
registry killed mid-flight and started again; in push mode (through the
router), the prefill killed mid-push and a new one started while the
encoder runs, and an encoder that answers but never pushes.

What must hold (docs/vllm.md, "When an encoder fails"): the prefill
engine never dies; each affected request either completes with the
aggregated instance's tokens (its items encoded locally) or fails with an
HTTP error, and does so within the bound (`load_timeout_s` plus the
prefill's own time); every later request succeeds with equal tokens.
"""

import concurrent.futures
import os
import signal
import threading
import time
import urllib.request

import pytest

import harness
from conftest import group

TIMEOUT_MS = 2000  # the connector's bound on each registry call and pull
LOAD_TIMEOUT_S = 10  # its bound on a request's wait for its items
SLACK_S = 20  # the prefill's own work on a loaded 2-core machine
BOUND_S = LOAD_TIMEOUT_S + SLACK_S


@pytest.fixture(scope="module")
def prefill(workdir, logs):
    good = str(workdir / "good")
    reg = harness.free_port()
    pre = harness.Instance("faults-prefill", good, logs, core=1, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_consumer", "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {
            "remote_registry_url": "http://127.0.0.1:%d" % reg,
            "recv_capacity_bytes": "256MiB", "timeout_ms": TIMEOUT_MS,
            "load_timeout_s": LOAD_TIMEOUT_S, "log_interval_s": 1}})
    try:
        yield pre, reg
    finally:
        pre.stop()


def encoder(workdir, logs, reg, name):
    return harness.Instance(name, str(workdir / "good"), logs, core=0, ec={
        "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
        "ec_role": "ec_producer", "ec_connector_extra_config": {
            "registry_http_port": reg, "bind_host": "127.0.0.1",
            "capacity_bytes": "256MiB", "log_interval_s": 1}},
        extra_args=["--mm-encoder-only"])


def timed(url, body):
    t0 = time.monotonic()
    status, out = harness.post(url, body, timeout=BOUND_S + 60)
    return status, out, time.monotonic() - t0


def in_flight(url, bodies, want, what, act):
    """Sends bodies to url all at once and calls act() 50 ms later (the
    fault); each answer must be want's tokens or an HTTP error, within
    BOUND_S. Returns (status, equal, seconds) of each, and prints them."""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futs = [pool.submit(timed, url, b) for b in bodies]
        time.sleep(0.05)
        act()
        got = [f.result() for f in futs]
    out = []
    for (status, body, secs), w in zip(got, want):
        equal = status == 200 and body["choices"][0]["token_ids"] == w
        out.append((status, equal, round(secs, 2)))
        assert secs <= BOUND_S and (equal or status >= 400), \
            (what, status, secs, body)
    print(what + ":", out)
    return out


def fault(workdir, logs, aggregated, prefill, name, sig, seed):
    """Items published by an encoder, then the prefill asked for them and
    the encoder's process group sent sig 50 ms later. Returns what each
    request got: (status, equal to the aggregated tokens, seconds)."""
    pre, reg = prefill
    enc = encoder(workdir, logs, reg, name)
    try:
        group([enc, pre])
        bodies = harness.requests_set(seed)
        want = aggregated.tokens(bodies)
        for b in bodies:  # the encoder's step: encode and publish
            status, out = harness.post(enc.url, dict(b, max_tokens=1))
            assert status == 200, (status, out)
        before = harness.fresh_counters(pre)
        out = in_flight(pre.url, bodies, want, name,
                        lambda: os.killpg(enc.proc.pid, sig))
        assert pre.alive() and pre.healthy(), pre.tail()
        after = harness.fresh_counters(pre)
        # every request asked for its items (looked up); nothing passed
        # as remote that did not land or fail
        assert after.get("lookups", 0) > before.get("lookups", 0)
        return out, bodies, want, enc
    except BaseException:
        enc.stop()
        raise


def pulled_again(enc, pre, aggregated, seed):
    """A new set of requests encoded (and published) by enc, then sent to
    pre: tokens equal, and every item pulled from enc (items_remote grows
    by their count). Returns pre's counters after."""
    bodies = harness.requests_set(seed)
    before = harness.fresh_counters(pre)
    for b in bodies:
        status, o = harness.post(enc.url, dict(b, max_tokens=1))
        assert status == 200, (status, o)
    assert harness.tokens_many(pre.url, bodies) == aggregated.tokens(bodies)
    after = harness.fresh_counters(pre)
    n = sum(len(b["messages"][0]["content"]) - 1 for b in bodies)
    assert after["items_remote"] - before.get("items_remote", 0) == n, \
        (before, after)
    return after


def later_requests_succeed(pre, aggregated, seed):
    bodies = harness.requests_set(seed)
    assert harness.tokens_many(pre.url, bodies) == aggregated.tokens(bodies)


def test_an_encoder_stopped_mid_flight(workdir, logs, aggregated, prefill):
    """SIGSTOP: registry calls and pulls to it wait their timeout_ms; no
    request waits past the bound, none is answered wrongly; once it
    continues, its items are pulled again."""
    out, bodies, want, enc = fault(workdir, logs, aggregated, prefill,
                                   "faults-encoder-stopped", signal.SIGSTOP,
                                   seed=41)
    try:
        later_requests_succeed(prefill[0], aggregated, 42)
        os.killpg(enc.proc.pid, signal.SIGCONT)
        pulled_again(enc, prefill[0], aggregated, 43)
    finally:
        os.killpg(enc.proc.pid, signal.SIGCONT)
        enc.stop()


def test_an_encoder_killed_mid_flight(workdir, logs, aggregated, prefill):
    """SIGKILL: its registry refuses at once and its pulls break; each
    request ends within the bound, and the same requests sent again are
    answered, encoded by the prefill itself."""
    out, bodies, want, enc = fault(workdir, logs, aggregated, prefill,
                                   "faults-encoder-killed", signal.SIGKILL,
                                   seed=44)
    try:
        pre = prefill[0]
        assert harness.tokens_many(pre.url, bodies) == want
        later_requests_succeed(pre, aggregated, 45)
    finally:
        enc.stop()


# ---- the registry gone (pull mode) ----

def test_the_registry_killed_mid_flight(workdir, logs, aggregated, prefill):
    """A standalone `ecx registry` (the one the encoder publishes to and
    the prefill looks up in) SIGKILLed with the prefill's requests in
    flight: each request ends within the bound, equal or failed; while it
    is gone the encoder still answers and the prefill encodes everything
    itself, with equal tokens; once a registry is back on its port, new
    items are published and pulled again."""
    pre, reg = prefill

    def registry():
        return harness.Process(
            "faults-registry-%d" % time.monotonic_ns(),
            [os.path.join(os.path.dirname(harness.PYTHON), "ecx"),
             "registry", "--bind", "127.0.0.1", "--port", str(reg)],
            str(workdir), harness.clean_env(), logs)

    def up(proc):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/healthz" %
                                            reg, timeout=2):
                    return
            except OSError:
                assert proc.alive(), proc.tail()
                time.sleep(0.1)
        raise AssertionError("registry not up:\n" + proc.tail())

    reg_proc = registry()
    enc = None
    try:
        enc = encoder_of(workdir, logs, reg)
    finally:
        if enc is None:
            reg_proc.stop()
    try:
        registry_faults(enc, pre, reg_proc, aggregated, registry, up)
    finally:
        enc.stop()


def encoder_of(workdir, logs, reg):
    """An ecx encoder publishing to the registry on port reg."""
    return harness.Instance("faults-encoder-ext-registry", str(workdir / "good"),
                           logs, core=0, ec={
                               "ec_connector": "ECXConnector",
                               "ec_connector_module_path": "ecx.vllm",
                               "ec_role": "ec_producer",
                               "ec_connector_extra_config": {
                                   "registry": "http://127.0.0.1:%d" % reg,
                                   "bind_host": "127.0.0.1",
                                   "timeout_ms": TIMEOUT_MS,
                                   "capacity_bytes": "256MiB",
                                   "log_interval_s": 1}},
                           extra_args=["--mm-encoder-only"])


def registry_faults(enc, pre, reg_proc, aggregated, registry, up):
    """The registry test's steps; every registry it starts is stopped."""
    try:
        up(reg_proc)
        group([enc, pre])
        bodies = harness.requests_set(46)
        want = aggregated.tokens(bodies)
        for b in bodies:
            status, out = harness.post(enc.url, dict(b, max_tokens=1))
            assert status == 200, (status, out)
        before = harness.fresh_counters(pre)
        in_flight(pre.url, bodies, want, "registry killed",
                  reg_proc.proc.kill)
        reg_proc.stop()
        assert pre.alive() and pre.healthy(), pre.tail()
        # Gone: the encoder encodes (its publishes fail), the prefill
        # encodes all itself.
        gone = harness.requests_set(47)
        for b in gone:
            t0 = time.monotonic()
            status, o = harness.post(enc.url, dict(b, max_tokens=1))
            assert status == 200 and time.monotonic() - t0 < BOUND_S, \
                (status, o)
        assert harness.tokens_many(pre.url, gone) == aggregated.tokens(gone)
        # Back (empty): what the encoder publishes now is pulled.
        reg_proc = registry()
        up(reg_proc)
        after = pulled_again(enc, pre, aggregated, 48)
        assert after.get("lookup_errors", 0) > before.get("lookup_errors", 0)
        assert enc.alive() and enc.healthy(), enc.tail()
    finally:
        reg_proc.stop()


# ---- push mode: the consumer gone, restarted; an encoder that never
# sends ----

PUSH_WAIT_S = 5  # the push prefill's push_wait_timeout_s


def push_prefill(workdir, logs, port, ec_port):
    return harness.Instance(
        "faults-push-prefill-%d" % time.monotonic_ns(), str(workdir / "good"),
        logs, core=1, port=port, ec={
            "ec_connector": "ECXConnector",
            "ec_connector_module_path": "ecx.vllm",
            "ec_role": "ec_consumer", "ec_buffer_device": "cpu",
            "ec_ip": "127.0.0.1", "ec_port": ec_port,
            "ec_connector_extra_config": {
                "push": True, "push_wait_timeout_s": PUSH_WAIT_S,
                "control_timeout_s": 2, "recv_capacity_bytes": "256MiB",
                "log_interval_s": 1}})


@pytest.fixture(scope="module")
def push(workdir, logs):
    """An ecx encoder, an ecx push prefill and the router (push mode,
    --overlap) in front; the prefill may be replaced (same ports)."""
    port, ec_port, reg = harness.free_ports(3)
    enc = encoder(workdir, logs, reg, "faults-push-encoder")
    state = {"enc": enc, "pre": None, "ec_port": ec_port, "port": port}
    router = None
    try:
        state["pre"] = push_prefill(workdir, logs, port, ec_port)
        group([enc, state["pre"]])
        router = harness.Router(
            "faults-router-push", logs, str(workdir / "good"), "push",
            [enc.url], [state["pre"].url], ["tcp://127.0.0.1:%d" % ec_port],
            ["--overlap"])
        state["router"] = router
        yield state
    finally:
        if router is not None:
            router.stop()
        if state["pre"] is not None:
            state["pre"].stop()
        enc.stop()


def test_a_push_whose_consumer_is_killed_then_restarted(
        workdir, logs, aggregated, push):
    """The push prefill SIGKILLed with 7 requests in flight through the
    router: each ends within the bound (equal tokens, or an error), the
    encoder lives and answers. A new prefill on the same ports, started
    while the encoder keeps running, is pushed into: tokens equal, every
    item pushed."""
    enc, pre, router = push["enc"], push["pre"], push["router"]
    bodies = harness.requests_set(51)
    want = aggregated.tokens(bodies)
    in_flight(router.url, bodies, want, "push consumer killed",
              lambda: os.killpg(pre.proc.pid, signal.SIGKILL))
    pre.stop()
    assert enc.alive() and enc.healthy(), enc.tail()
    # The encoder still encodes (its pushes to the dead consumer fail).
    t0 = time.monotonic()
    status, o = harness.post(enc.url, dict(harness.requests_set(52)[0],
                                           max_tokens=1))
    assert status == 200 and time.monotonic() - t0 < BOUND_S, (status, o)
    # Restarted while the encoder runs: same HTTP and control ports.
    new = push["pre"] = push_prefill(workdir, logs, push["port"],
                                     push["ec_port"])
    group([new])
    again = harness.requests_set(53)
    before = harness.fresh_counters(new)
    assert harness.tokens_many(router.url, again) == aggregated.tokens(again)
    after = harness.fresh_counters(new)
    n = sum(len(b["messages"][0]["content"]) - 1 for b in again)
    # Taken, not ready: pushes the encoder still had in flight for the
    # killed consumer's requests (within its control_timeout_s) may land
    # in the new one too, ready and asked for by nobody (they expire).
    assert after.get("push_items_taken", 0) - \
        before.get("push_items_taken", 0) == n, after
    assert enc.alive()


class SilentEncoder:
    """An encoder that answers as a pushing encoder does (200, the
    item's ec_transfer_params entry) and never pushes anything."""

    def __init__(self):
        import http.server
        import json as _json

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = _json.loads(self.rfile.read(
                    int(self.headers["Content-Length"])))
                tid = body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
                out = _json.dumps({
                    "id": "x", "object": "chat.completion", "choices": [],
                    "ec_transfer_params": {"f" * 64: {
                        "metadata": {}, "transfer_id": tid}}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_an_encoder_that_answers_but_never_sends(workdir, logs, aggregated,
                                                 push):
    """Through a router whose encoder answers 200 with a push's
    ec_transfer_params and never pushes: every request fails (500) within
    push_wait_timeout_s plus slack, the prefill lives, and requests
    through the real encoder right after are answered with equal
    tokens."""
    pre = push["pre"]
    silent = SilentEncoder()
    router = None
    try:
        router = harness.Router(
            "faults-router-silent", logs, str(workdir / "good"), "push",
            [silent.url], [pre.url], ["tcp://127.0.0.1:%d" % push["ec_port"]],
            ["--overlap"])
        bodies = harness.requests_set(54, pairs=False)
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: timed(router.url, b), bodies))
        print("silent encoder:", [(s, round(t, 2)) for s, _, t in got])
        for status, body, secs in got:
            assert status >= 500 and secs <= PUSH_WAIT_S + SLACK_S, \
                (status, secs, body)
            assert secs >= PUSH_WAIT_S - 0.5, (status, secs, body)
        assert pre.alive() and pre.healthy(), pre.tail()
        later = harness.requests_set(55)
        assert harness.tokens_many(push["router"].url, later) == \
            aggregated.tokens(later)
    finally:
        if router is not None:
            router.stop()
        silent.stop()
