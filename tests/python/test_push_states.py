"""Push mode, the reservation state machine of PUSH.md section 4, row by
row, through a real shard's REP socket with a clock the test moves."""
import threading
import time

import pytest

from pushkit import Ctl, item, pull, recv_events, start_shards, wait_for
from ecx.vllm.push import wire
from ecx.vllm.push import (CANCEL_PENDING, CANCELLED, EXPIRE_PENDING,
                           EXPIRED, READY, WRITING)

CANCELLED_REPLY = {"reservation_id": "", "dst_session": "", "dst_ptr": 0,
                   "nbytes": 64, "write": False, "ready": False,
                   "cancelled": True}


class Env:
    def __init__(self, **kw):
        (self.s,), self.clock = start_shards(**kw)
        self.c = Ctl(self.s.endpoint)
        self.events = pull(self.s.event_endpoint)

    def reserve(self, tid, **kw):
        return self.c.result("reserve", **item(tid, **kw))

    def complete(self, tid, rid):
        r = self.c.result("complete", transfer_id=tid, reservation_id=rid)
        return r["completed"], r["became_ready"]

    def cancel(self, tid, rid="", **kw):
        return self.c.result("cancel", transfer_id=tid, reservation_id=rid,
                             **kw)["cancelled"]

    def state(self, tid):
        return self.s.table.state(tid)

    def used(self):
        return self.s.pool.used_bytes()

    def later(self, seconds):
        self.clock.advance(seconds)
        self.s.run_reaper()

    def got(self, n=1, timeout_s=2.0):
        return [e["transfer_id"] for e in recv_events(self.events, n,
                                                      timeout_s)]

    def close(self):
        self.events.close(0)
        self.c.close()
        self.s.stop(0)


@pytest.fixture
def env():
    e = Env()
    yield e
    e.close()


# ---- reserve ----

def test_fresh_reserve_is_a_writer_with_an_open_window(env):
    r = env.reserve("t1")
    assert r["write"] is True and env.state("t1") == WRITING
    assert env.s.pool.is_open(r["reservation_id"])
    assert env.used() == 256


def test_repeat_of_writing_renews_ttl(env):
    r = env.reserve("t1")
    env.later(200)
    assert env.reserve("t1") == dict(r, write=False)
    env.later(200)  # 400 s after creation, 200 after the repeat
    assert env.state("t1") == WRITING
    env.later(101)
    assert env.state("t1") == EXPIRE_PENDING


def test_repeat_of_ready_sends_an_event_again(env):
    r = env.reserve("t1")
    assert env.complete("t1", r["reservation_id"]) == (True, True)
    assert env.got() == ["t1"]
    again = env.reserve("t1")
    assert again == dict(r, write=False, ready=True)
    assert env.got() == ["t1"]


def test_reserve_of_cancelled_and_cancel_pending(env):
    assert env.cancel("t1") is True  # unknown: a tombstone
    assert env.reserve("t1") == CANCELLED_REPLY
    env.reserve("t2")
    assert env.cancel("t2") is True
    assert env.state("t2") == CANCEL_PENDING
    assert env.reserve("t2") == CANCELLED_REPLY


def test_reserve_of_expired_allocates_afresh(env):
    r = env.reserve("t1")
    assert env.cancel("t1", r["reservation_id"], abandon=True,
                      refresh=True)
    assert env.state("t1") == EXPIRED and env.used() == 0
    again = env.reserve("t1")
    assert again["write"] is True
    assert again["reservation_id"] != r["reservation_id"]


def test_reserve_of_expire_pending_is_refused(env):
    env.reserve("t1")
    env.later(301)
    assert env.state("t1") == EXPIRE_PENDING
    reply = env.c.call("reserve", **item("t1"))
    assert reply["ok"] is False and "still has an active writer" in \
        reply["error"]


@pytest.mark.parametrize("change", [{"mm": "other"}, {"tokens": 8},
                                    {"dtype": "float16"}])
def test_conflicting_reservation_for_transfer_id(env, change):
    env.reserve("t1")
    reply = env.c.call("reserve", **item("t1", **change))
    assert reply == {"ok": False,
                     "error": "conflicting reservation for transfer_id"}
    assert env.used() == 256


def test_resident_copy_is_reused(env):
    r = env.reserve("t1")
    env.complete("t1", r["reservation_id"])
    env.got()
    addr, nbytes, shape, dtype = env.s.take("t1", "m" * 64)
    assert (addr, nbytes, shape, dtype) == (r["dst_ptr"], 64, (4, 8),
                                            "bfloat16")
    assert env.c.result("status", transfer_id="t1") is None  # deleted
    hit = env.reserve("t2")  # pinned resident
    assert (hit["ready"], hit["cached"], hit["write"]) == (True, True,
                                                           False)
    assert hit["dst_ptr"] == addr and env.state("t2") == READY
    assert env.got() == ["t2"]
    env.s.release("m" * 64)
    hit3 = env.reserve("t3")  # retired, not evicted
    assert hit3["cached"] and hit3["dst_ptr"] == addr
    assert env.got() == ["t3"]
    assert env.used() == 256


def test_a_ready_record_is_no_writer_to_follow(env):
    r = env.reserve("t1")
    env.complete("t1", r["reservation_id"])
    again = env.reserve("t2")  # READY but not resident: a fresh writer
    assert again["write"] is True and again["dst_ptr"] != r["dst_ptr"]


def test_conflicting_cached_tensor(env):
    r = env.reserve("t1")
    env.complete("t1", r["reservation_id"])
    env.s.take("t1", "m" * 64)
    reply = env.c.call("reserve", **item("t2", tokens=8))
    assert reply == {"ok": False,
                     "error": "conflicting cached tensor for mm_hash"}


def test_follower_of_an_inflight_writer(env):
    w = env.reserve("t1")
    f = env.reserve("t2")
    assert (f["write"], f["ready"], f["cached"]) == (False, False, False)
    assert f["dst_ptr"] == w["dst_ptr"] and env.used() == 256
    assert env.complete("t2", f["reservation_id"]) == (False, False)
    assert env.complete("t1", w["reservation_id"]) == (True, True)
    assert env.got(2) == ["t2", "t1"]  # followers first
    assert env.state("t1") == READY and env.state("t2") == READY
    # both are leases on one resident copy (cached, as upstream's reply
    # says of a record holding a lease): repeated, neither is written
    for tid, r in (("t1", w), ("t2", f)):
        again = env.reserve(tid)
        assert (again["write"], again["ready"], again["cached"]) == (
            False, True, True)
        assert again["reservation_id"] == r["reservation_id"]
    assert env.got(2) == ["t1", "t2"]
    # ending both keeps the resident copy, retired
    env.cancel("t1")
    env.cancel("t2")
    assert env.s.table.resident("m" * 64).pins == 0
    assert env.used() == 256


@pytest.mark.parametrize("change", [{"dtype": "float16"},
                                    {"tokens": 2, "hidden": 16}])
def test_conflicting_inflight_tensor(env, change):
    env.reserve("t1")
    reply = env.c.call("reserve", **item("t2", **change))
    assert reply == {"ok": False,
                     "error": "conflicting in-flight tensor for mm_hash"}
    assert env.state("t2") is None


def test_pool_full_without_waiting():
    e = Env(pool_size=512)
    try:
        e.reserve("t1", mm="a", tokens=8, hidden=16)  # 256 B
        e.reserve("t2", mm="b", tokens=8, hidden=16)
        t0 = time.monotonic()
        reply = e.c.call("reserve", **item("t3", mm="c", tokens=8,
                                           hidden=16))
        assert time.monotonic() - t0 < 1.0
        assert reply == {"ok": False,
                         "error": "EC consumer buffer pool is full"}
        assert e.state("t3") is None
    finally:
        e.close()


def test_eviction_of_retired_residents_only():
    reclaimed = []
    e = Env(pool_size=512, on_reclaimed=reclaimed.append)
    try:
        for tid, mm in (("t1", "a"), ("t2", "b")):
            r = e.reserve(tid, mm=mm, tokens=8, hidden=16)
            e.complete(tid, r["reservation_id"])
            e.s.take(tid, mm)
        e.s.release("b")  # retired; "a" stays pinned
        r = e.reserve("t3", mm="c", tokens=8, hidden=16)
        assert r["write"] is True and reclaimed == ["b"]
        assert e.s.table.resident("a") is not None
        reply = e.c.call("reserve", **item("t4", mm="d", tokens=8,
                                           hidden=16))
        assert reply["error"] == "EC consumer buffer pool is full"
    finally:
        e.close()


def test_expired_records_reaped_before_reserve():
    e = Env(pool_size=256)
    try:
        r = e.reserve("t1", mm="a", tokens=8, hidden=16)
        e.complete("t1", r["reservation_id"])
        e.clock.advance(301)  # no reaper run yet
        assert e.state("t1") == READY
        again = e.reserve("t1", mm="a", tokens=8, hidden=16)
        assert again["write"] is True  # EXPIRED first, so allocated afresh
        assert again["reservation_id"] != r["reservation_id"]
    finally:
        e.close()


def test_a_full_pool_reaps_before_it_refuses():
    e = Env(pool_size=256)
    try:
        r = e.reserve("t1", mm="a", tokens=8, hidden=16)
        e.complete("t1", r["reservation_id"])
        e.clock.advance(301)
        spec = wire.reserve_spec(item("t2", mm="b", tokens=8, hidden=16),
                                 256)
        assert e.s.table.reserve(spec)["write"] is True  # no op-level reap
        assert e.state("t1") == EXPIRED
    finally:
        e.close()


# ---- complete ----

def test_complete_unknown_or_other_reservation(env):
    assert env.complete("t1", "x" * 32) == (False, False)
    r = env.reserve("t1")
    assert env.complete("t1", "y" * 32) == (False, False)
    assert env.state("t1") == WRITING
    assert env.complete("t1", r["reservation_id"]) == (True, True)
    assert env.complete("t1", r["reservation_id"]) == (True, False)
    assert not env.s.pool.is_open(r["reservation_id"])


def test_ready_gets_a_fresh_ttl(env):
    w = env.reserve("t1")
    env.reserve("t2")  # a follower
    env.later(200)
    assert env.complete("t1", w["reservation_id"]) == (True, True)
    env.later(200)  # 400 s after the reserves, 200 after READY
    assert env.state("t1") == READY and env.state("t2") == READY
    env.later(101)
    assert env.state("t1") == EXPIRED and env.state("t2") == EXPIRED


def test_complete_of_cancel_pending_ends_cancelled(env):
    r = env.reserve("t1")
    env.cancel("t1")
    assert env.used() == 256  # kept for the writer
    assert env.complete("t1", r["reservation_id"]) == (True, False)
    assert env.state("t1") == CANCELLED and env.used() == 0
    assert env.got(1, timeout_s=0.3) == []


def test_complete_of_expire_pending_ends_expired(env):
    r = env.reserve("t1")
    env.later(301)
    assert env.state("t1") == EXPIRE_PENDING and env.used() == 256
    assert not env.s.pool.is_open(r["reservation_id"])
    assert env.complete("t1", r["reservation_id"]) == (True, False)
    assert env.state("t1") == EXPIRED and env.used() == 0


def test_deferred_writer_still_serves_its_followers(env):
    w = env.reserve("t1")
    env.reserve("t2")
    env.cancel("t1")
    assert env.complete("t1", w["reservation_id"]) == (True, False)
    assert env.got() == ["t2"]
    assert env.state("t2") == READY and env.state("t1") == CANCELLED
    assert env.used() == 256  # the follower's lease


# ---- cancel ----

def test_cancel_rows(env):
    r = env.reserve("t1")
    assert env.cancel("t1", "z" * 32) is False
    assert env.cancel("t1", r["reservation_id"], refresh=True) is False
    assert env.state("t1") == WRITING
    assert env.cancel("t1", r["reservation_id"]) is True
    assert env.state("t1") == CANCEL_PENDING
    assert env.cancel("t1") is True  # deferred, no abandon: unchanged
    assert env.state("t1") == CANCEL_PENDING and env.used() == 256
    assert env.cancel("t1", abandon=True) is True
    assert env.state("t1") == CANCELLED and env.used() == 0


def test_cancel_ready_and_abandon_writing(env):
    a = env.reserve("t1", mm="a")
    env.complete("t1", a["reservation_id"])
    assert env.cancel("t1") is True and env.state("t1") == CANCELLED
    env.reserve("t2", mm="b")
    assert env.cancel("t2", abandon=True) is True
    assert env.state("t2") == CANCELLED and env.used() == 0


def test_cancel_refresh_rows(env):
    r = env.reserve("t1", mm="a")
    env.complete("t1", r["reservation_id"])
    assert env.cancel("t1", abandon=True, refresh=True) is False  # READY
    env.reserve("t2", mm="b")
    env.later(301)
    assert env.state("t2") == EXPIRE_PENDING
    assert env.cancel("t2", abandon=True, refresh=True) is True
    assert env.state("t2") == EXPIRED
    assert env.cancel("t2") is False  # EXPIRED
    assert env.cancel("t2", abandon=True, refresh=True) is False


def test_cancel_follower_and_abandoned_writer_ends_followers(env):
    w = env.reserve("t1")
    env.reserve("t2")
    env.reserve("t3")
    assert env.cancel("t2") is True and env.state("t2") == CANCELLED
    assert env.state("t1") == WRITING
    assert env.cancel("t1", w["reservation_id"], abandon=True) is True
    assert env.state("t3") == CANCELLED and env.used() == 0


def test_tombstone_ttl_refreshed_then_dropped(env):
    assert env.cancel("t1") is True
    env.later(200)
    assert env.cancel("t1") is True  # refreshes the tombstone
    env.later(200)
    assert env.reserve("t1") == CANCELLED_REPLY
    env.later(101)
    assert env.state("t1") is None
    assert env.reserve("t1")["write"] is True


def test_tombstone_limit(env):
    env.s.table.tombstone_limit = 3
    for k in range(5):
        env.cancel(f"t{k}")
    assert [env.state(f"t{k}") for k in range(5)] == [
        None, None, CANCELLED, CANCELLED, CANCELLED]


# ---- the reaper, take, shutdown ----

def test_reaper_rows(env):
    r = env.reserve("t1", mm="a")
    env.complete("t1", r["reservation_id"])
    env.reserve("t2", mm="b")
    env.reserve("t3", mm="b")  # a follower of t2
    env.later(301)
    assert env.state("t1") == EXPIRED
    assert env.state("t2") == EXPIRE_PENDING
    assert env.state("t3") == CANCELLED
    assert env.used() == 256  # t2's, kept for its writer
    env.later(299)  # upstream: EXPIRE_PENDING has no deadline
    assert env.state("t2") == EXPIRE_PENDING and env.used() == 256
    env.later(1)  # tombstones gone; ecx: a deferred writer one TTL more
    assert env.state("t1") is None and env.state("t3") is None
    assert env.state("t2") == EXPIRED and env.used() == 0


def test_a_writer_that_never_returns_holds_memory_one_ttl(env):
    """ecx's bound on the deferred states (upstream keeps their memory
    until the shard stops): a cancel without abandon, or the TTL, while
    its writer is gone (killed mid-write) frees the memory one TTL later;
    a complete that comes after that finds nothing."""
    r = env.reserve("t1", mm="a")
    env.cancel("t1")
    assert env.state("t1") == CANCEL_PENDING and env.used() == 256
    env.later(299)
    assert env.state("t1") == CANCEL_PENDING and env.used() == 256
    env.later(2)
    assert env.state("t1") == CANCELLED and env.used() == 0
    assert env.complete("t1", r["reservation_id"]) == (False, False)
    r2 = env.reserve("t2", mm="b")
    env.reserve("t3", mm="b")  # a follower, ended with it
    env.later(301)
    assert env.state("t2") == EXPIRE_PENDING and env.used() == 256
    env.later(301)
    assert env.state("t2") == EXPIRED and env.used() == 0
    assert env.complete("t2", r2["reservation_id"]) == (False, False)


def test_loop_runs_the_reaper_by_itself(env):
    env.reserve("t1")
    env.clock.advance(301)
    assert wait_for(lambda: env.state("t1") == EXPIRE_PENDING, 2.0)


def test_take_needs_ready_and_the_mm_hash(env):
    r = env.reserve("t1")
    with pytest.raises(ValueError):
        env.s.take("t1", "m" * 64)
    env.complete("t1", r["reservation_id"])
    with pytest.raises(ValueError):
        env.s.take("t1", "other")
    env.s.take("t1", "m" * 64)
    assert env.state("t1") is None  # no tombstone


def test_stop_drains_writers():
    e = Env()
    try:
        w = e.reserve("t1", mm="a")
        r = e.reserve("t2", mm="b")
        e.complete("t2", r["reservation_id"])
        stopper = threading.Thread(target=e.s.stop, args=(10,))
        t0 = time.monotonic()
        stopper.start()
        assert wait_for(lambda: e.state("t1") == CANCEL_PENDING)
        assert e.state("t2") == CANCELLED
        reply = e.c.call("reserve", **item("t3", mm="c"))
        assert reply == {"ok": False, "error": "EC consumer is shutting down"}
        assert e.complete("t1", w["reservation_id"]) == (True, False)
        stopper.join(5)
        assert not stopper.is_alive() and time.monotonic() - t0 < 5
        assert e.used() == 0
    finally:
        e.events.close(0)
        e.c.close()


@pytest.mark.parametrize("abandon", [False, True])
def test_a_cancel_racing_a_complete(env, abandon):
    """A complete and a cancel of the same writer sent at once from two
    peers (the writer's, the consumer scheduler's), many times: whichever
    the shard serves first, each pair of answers is one the rules allow,
    every record ends CANCELLED, and no memory is left held."""
    n = 40
    rids = [env.reserve(f"r{k}", mm=f"m{k}")["reservation_id"]
            for k in range(n)]
    assert env.used() == 256 * n
    other = Ctl(env.s.endpoint)
    done, cancelled = {}, {}
    go = threading.Barrier(2)

    def completes():
        for k in range(n):
            go.wait()
            r = env.c.result("complete", transfer_id=f"r{k}",
                             reservation_id=rids[k])
            done[k] = (r["completed"], r["became_ready"])

    def cancels():
        for k in range(n):
            go.wait()
            cancelled[k] = other.result(
                "cancel", transfer_id=f"r{k}", reservation_id="",
                abandon=abandon)["cancelled"]
    th = threading.Thread(target=completes)
    th.start()
    cancels()
    th.join()
    other.close()
    # complete first: (true, true), then the cancel ends it (true);
    # cancel first: with abandon CANCELLED at once, the complete finds
    # nothing (false, false); without, CANCEL_PENDING, whose complete
    # ends it (true, false)
    allowed = {((True, True), True),
               (((False, False) if abandon else (True, False)), True)}
    assert {(done[k], cancelled[k]) for k in range(n)} <= allowed
    assert all(env.state(f"r{k}") == CANCELLED for k in range(n))
    assert env.used() == 0
