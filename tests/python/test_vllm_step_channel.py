"""The step at which a pulled item becomes schedulable, as vLLM's engine
core steps (test_vllm_steps.Engine: scheduler hooks, metadata pickled to
each rank, the ranks' reports merged back), with one engine's connectors
sharing one config as vLLM's processes do (its engine_id names the step
channel between them; in one test each rank in a process of its own):
schedulable in the step after its request arrived, or in that step with
pull_wait_ms; every rank must hold it first; a
producer that dies or hangs mid-pull fails the request within its bound
and never holds up a step."""
import functools
import multiprocessing
import os
import pickle
import signal
import time
import uuid

import pytest
import torch

import test_vllm_steps as steps
from conftest import stop_process
from test_vllm_steps import producers  # noqa: F401 - a fixture
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.v1.outputs import ECConnectorOutput

from ecx.vllm import ECXConnector

SCALE = float(os.environ.get("ECX_TEST_TIME_SCALE", "1"))
# Long enough between steps for any pull here to land: the step counts
# below are then the connector's, not the machine's load.
GAP_S = 0.1 * SCALE


def engine(url, ranks=2, rank_ids=None, rank_extra=None, **extra):
    """A scheduler connector and `ranks` worker connectors of one engine
    (workers first, as vLLM makes them), each given the engine's config
    with its own rank. rank_ids: engine_id per rank where one differs;
    rank_extra: extra config keys per rank."""
    eid = str(uuid.uuid4())

    def cfg(rank, eid=eid):
        c = steps.config(url, **{**extra, **(rank_extra or {}).get(rank,
                                                                  {})})
        c.ec_transfer_config.engine_id = eid
        c.parallel_config.tensor_parallel_size = ranks
        c.parallel_config.rank = rank
        return c

    workers = [ECXConnector(cfg(r, (rank_ids or {}).get(r, eid)),
                            ECConnectorRole.WORKER) for r in range(ranks)]
    sched = ECXConnector(cfg(0), ECConnectorRole.SCHEDULER)
    # vLLM loads its model in between: the workers' sockets meet the
    # scheduler's by then.
    time.sleep(0.3 * SCALE)
    return steps.Engine(sched, workers)


def steps_to_schedule(eng, req, limit=8):
    """Adds req before a step and steps (GAP_S apart) until it is
    scheduled: the steps it took, counting the one it arrived in."""
    first = eng.steps + 1
    eng.add(req)
    for _ in range(limit):
        eng.step()
        if req.request_id in eng.scheduled:
            return eng.scheduled[req.request_id] - first + 1
        time.sleep(GAP_S)
    return None


def test_schedulable_in_the_step_after_arrival(registry, producers):  # noqa: F811
    reg = registry()
    hashes = [steps.mm_hash(f"chan-{i}") for i in range(9)]
    assert {steps.shape_of(h) for h in hashes} == set(steps.SHAPES)
    producers(reg.url, hashes)
    eng = engine(reg.url)
    try:
        taken = []
        for k, h in enumerate(hashes):
            req = steps.Request(f"r{k}", [h])
            taken.append(steps_to_schedule(eng, req))
            eng.finish(req)
        # The step it arrived in starts every rank's pull, and every rank
        # says it landed before the next: schedulable there (the Engine
        # checks each rank's encoder_cache, byte-equal). Before the step
        # channel: 3, the report of the arrival step being built before
        # the pull lands. The first pull of each rank makes its handshake
        # with the producer too, which on a loaded machine under ASan can
        # outlast GAP_S: that it is scheduled is all checked of it.
        assert None not in taken, taken
        assert taken[1:] == [2] * (len(hashes) - 1), taken
        assert not eng.unavailable
    finally:
        steps.shutdown(eng.sched, [w for w, _ in eng.workers])


def _rank_main(conn, cfg_blob):
    """A worker connector in a process of its own, stepped over conn."""
    w = ECXConnector(pickle.loads(cfg_blob), ECConnectorRole.WORKER)
    cache = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            w.shutdown()
            conn.send("bye")
            return
        _, blob, need = msg
        w.bind_connector_metadata(pickle.loads(blob))
        w.start_load_caches(cache)
        ok = all(h in cache and torch.equal(
            cache[h].view(torch.uint8),
            steps.expected(h).view(torch.uint8)) for h in need)
        wm = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        conn.send((pickle.dumps(wm), ok))
        for h in need:  # the request ends with its step
            cache.pop(h, None)


def test_ranks_in_processes_of_their_own(registry, producers):  # noqa: F811
    """As vLLM runs them: the scheduler here, each rank's worker connector
    in a process of its own, the step's metadata and reports pickled
    between them. The first item warms up: its pull is each rank process's
    first, whose handshake with the producer (under ASan on a loaded
    2-core machine) can outlast GAP_S, so only that it is scheduled is
    checked (CI's ASan pass: [3, 2, 2] once, without it)."""
    reg = registry()
    hashes = [steps.mm_hash(f"proc-{i}") for i in range(4)]
    producers(reg.url, hashes)
    cfg = steps.config(reg.url)
    cfg.parallel_config.tensor_parallel_size = 2
    ctx = multiprocessing.get_context("spawn")
    ranks = []
    for r in range(2):
        cfg.parallel_config.rank = r
        a, b = ctx.Pipe()
        p = ctx.Process(target=_rank_main, args=(b, pickle.dumps(cfg)))
        p.start()
        ranks.append((a, p))
    sched = None
    try:
        for a, _ in ranks:
            assert a.poll(60 * SCALE) and a.recv() == "ready"
        cfg.parallel_config.rank = 0
        sched = ECXConnector(cfg, ECConnectorRole.SCHEDULER)
        time.sleep(0.3 * SCALE)
        taken = []
        for k, h in enumerate(hashes):
            req = steps.Request(f"p{k}", [h])
            for n in range(1, 9):
                need = []
                if sched.ensure_cache_available(req, 0):
                    assert sched.has_cache_item(h)
                    sched.update_state_after_alloc(req, 0)
                    need = [h]
                blob = pickle.dumps(sched.build_connector_meta(None))
                for a, _ in ranks:
                    a.send(("step", blob, need))
                out = [a.recv() for a, _ in ranks]
                assert all(ok for _, ok in out), "encoder cache miss"
                sched.update_connector_output(ECConnectorOutput(
                    ec_connector_worker_meta=functools.reduce(
                        lambda x, y: x.aggregate(y),
                        [pickle.loads(m) for m, _ in out])))
                assert not sched.take_unavailable_requests()
                if need:
                    taken.append(n)
                    break
                time.sleep(GAP_S)
            sched.update_state_after_free(req, 0)
            sched.request_finished(req)
        assert len(taken) == len(hashes), taken  # every one scheduled
        assert taken[1:] == [2] * (len(hashes) - 1), taken
    finally:
        for a, p in ranks:
            if p.is_alive():
                a.send(("stop",))
                a.poll(10)
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        if sched is not None:
            sched.shutdown()


def test_pull_wait_ms_schedules_in_the_arrival_step(registry, producers):  # noqa: F811
    reg = registry()
    hashes = [steps.mm_hash(f"wait-{i}") for i in range(6)]
    producers(reg.url, hashes)
    eng = engine(reg.url, pull_wait_ms=1000)
    try:
        taken = []
        for k, h in enumerate(hashes):
            req = steps.Request(f"w{k}", [h])
            t0 = time.monotonic()
            taken.append(steps_to_schedule(eng, req))
            assert time.monotonic() - t0 < 1.5 * SCALE
            eng.finish(req)
        assert taken == [1] * len(hashes), taken
        st = eng.sched.stats()
        assert 0 < st["pull_wait_s"] < len(hashes) * 1.0
    finally:
        steps.shutdown(eng.sched, [w for w, _ in eng.workers])


@pytest.mark.parametrize("wait_ms", [0, 50])
def test_an_idle_engine_waits_for_the_item(registry, producers, wait_ms):  # noqa: F811
    """Steps back to back, as vLLM's engine loop runs while a request
    waits: with idle_wait_ms, a step after one that scheduled nothing
    waits (once) for the item's news instead of returning at once, so the
    request is scheduled within 3 steps and the engine does not spin;
    with 0 (the control) it spins through many more empty steps."""
    reg = registry()
    hashes = [steps.mm_hash(f"idle-{wait_ms}-{i}") for i in range(4)]
    producers(reg.url, hashes)
    eng = engine(reg.url, idle_wait_ms=wait_ms)
    eng.idle_aware = True
    try:
        counts = []
        for k, h in enumerate(hashes):
            req = steps.Request(f"i{k}", [h])
            first = eng.steps + 1
            eng.add(req)
            t0 = time.monotonic()
            while req.request_id not in eng.scheduled and \
                    time.monotonic() - t0 < 3 * SCALE:
                eng.step()
            assert req.request_id in eng.scheduled
            counts.append(eng.scheduled[req.request_id] - first + 1)
            eng.finish(req)
        # The first pull also makes each rank's handshake: not counted.
        if wait_ms:
            assert max(counts[1:]) <= 3, counts
            assert eng.sched.stats()["idle_wait_s"] > 0
        else:
            assert "idle_wait_s" not in eng.sched.stats()
        print("steps to schedule, idle_wait_ms=%d: %s" % (wait_ms, counts))
    finally:
        steps.shutdown(eng.sched, [w for w, _ in eng.workers])


def test_every_rank_must_hold_it(registry, producers):  # noqa: F811
    """Rank 1 has no channel (another engine_id): it starts its pull from
    the step's metadata and reports it in the step's report only. Rank 0's
    news alone must not make the item schedulable."""
    reg = registry()
    hashes = [steps.mm_hash(f"rank1-{i}") for i in range(3)]
    producers(reg.url, hashes)
    eng = engine(reg.url, rank_ids={1: str(uuid.uuid4())}, pull_wait_ms=300)
    try:
        for k, h in enumerate(hashes):
            req = steps.Request(f"q{k}", [h])
            # Rank 0's news comes within pull_wait_ms of the arrival step,
            # which must not schedule it: rank 1 says it holds it only in
            # a step's report, the arrival step's where its pull (started
            # from that step's metadata) has landed by then, else the
            # next step's.
            assert steps_to_schedule(eng, req) in (2, 3)
            eng.finish(req)
        assert not eng.unavailable
    finally:
        steps.shutdown(eng.sched, [w for w, _ in eng.workers])


@pytest.mark.parametrize("idle", [False, True])
def test_one_rank_failing_fails_the_request_at_once(registry, producers,  # noqa: F811
                                                    idle):
    """Rank 1's pulls are refused (a wrong token): its news fails the
    request within the step after, never scheduled. With idle steps
    (idle_wait_ms waits for that news), the request is not taken on
    again after the news gave it up: counted once."""
    reg = registry()
    hashes = [steps.mm_hash(f"auth-{idle}-{i}") for i in range(2)]
    producers(reg.url, hashes)
    eng = engine(reg.url, rank_extra={1: {"token": "wrong"}},
                 idle_wait_ms=50)
    eng.idle_aware = idle
    try:
        eng.add(steps.Request("r", hashes))
        t0 = time.monotonic()
        while "r" not in eng.unavailable and time.monotonic() - t0 < 4:
            eng.step()
            time.sleep(0.005)
        assert "r" in eng.unavailable and "r" not in eng.scheduled
        assert eng.unavailable["r"] < 2 * SCALE
        assert eng.sched.stats()["requests"] == 1
    finally:
        steps.shutdown(eng.sched, [w for w, _ in eng.workers])


@pytest.mark.parametrize("death", ["kill", "hang"])
def test_producer_dying_mid_pull(registry, producers, death):  # noqa: F811
    """The producer is stopped (every thread) after a first pull connected
    the ranks to it, and a request for one of its 3.5 MiB items arrives:
    its pulls start and cannot end. Killed ("kill") or left stopped
    ("hang"), the request must come out of take_unavailable_requests within
    its bound (timeout_ms 2 s, load_timeout_s 4 s), never be scheduled,
    and no step may wait for it."""
    reg = registry()
    warm = steps.mm_hash("mid-warm")
    big = next(steps.mm_hash(f"mid-{i}") for i in range(50) if
               steps.shape_of(steps.mm_hash(f"mid-{i}"))[1] == 1792)
    p = producers(reg.url, [warm, big])
    eng = engine(reg.url, lease_ms=0)
    try:
        req = steps.Request("warm", [warm])
        assert steps_to_schedule(eng, req) is not None
        eng.finish(req)
        stop_process(p.proc.pid)
        req = steps.Request("mid", [big])
        eng.add(req)
        t0 = time.monotonic()
        slowest = 0.0
        killed = False
        while "mid" not in eng.unavailable and time.monotonic() - t0 < 8:
            s0 = time.monotonic()
            eng.step()
            slowest = max(slowest, time.monotonic() - s0)
            if not killed and death == "kill" and \
                    time.monotonic() - t0 > 0.3:
                p.proc.send_signal(signal.SIGKILL)
                p.proc.wait()
                killed = True
            time.sleep(0.005)
        waited = time.monotonic() - t0
        print(f"{death}: unavailable after {waited:.2f} s, slowest step "
              f"{slowest * 1e3:.1f} ms")
        assert "mid" in eng.unavailable and "mid" not in eng.scheduled
        assert waited < 4 + 1 * SCALE, waited
        assert slowest < 0.25 * SCALE, f"a step took {slowest:.3f} s"
    finally:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait()
        steps.shutdown(eng.sched, [w for w, _ in eng.workers])
