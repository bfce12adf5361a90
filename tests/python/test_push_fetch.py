"""ecx's fetch in push mode (docs/protocol.md, "Push mode: fetches over
UCX (ecx)"): an ecx encoder told "ecx_fetch": true by an ecx shard sends
ecx_fetch and the shard pulls the bytes from its producer over UCX into
the reservation; upstream's encoder still writes over Mooncake's wire.
Real sockets on 127.0.0.1, producers in other processes where a fault is
made (SIGKILL, SIGSTOP); bytes, states, pool memory and time checked."""
import contextlib
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import ecx
import pushkit  # noqa: F401  (the vllm stub and tests/interop on sys.path)
from ecx.vllm.push import ArenaPool
from ecx.vllm.push.pusher import PushSpec, Pusher
from pushkit import (Ctl, FakeClock, item, pull, recv_events,
                     start_pool_shards, start_shards)
from upstream_encoder import EventSubscriber, Item, UpstreamEncoder

HIDDEN = 512
TOKEN = "f3tch"


def payload(seed, n):
    return random.Random(seed).randbytes(n)


class Prefill:
    """tp ecx shards over ArenaPools of consumers with no registry."""

    def __init__(self, tp=1, token=None, timeout_ms=2000, clock=None):
        self.consumers = [ecx.Consumer(None, recv_capacity=24 << 20,
                                       timeout_ms=timeout_ms, token=token)
                          for _ in range(tp)]
        kw = {} if clock is None else {"clock": clock}
        self.pools = [ArenaPool(c, **kw) for c in self.consumers]
        self.shards = start_pool_shards(self.pools, token=token, **kw)
        self.base = self.shards[0].endpoint

    def close(self):
        for s in self.shards:
            s.stop(0)
        for c in self.consumers:
            c.close()


@pytest.fixture
def prefill():
    made = []

    def make(**kw):
        p = Prefill(**kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


def hold(producer, k, tokens):
    import torch
    data = payload(k, tokens * HIDDEN * 2)
    mm = f"fmm{k}".ljust(64, "f")
    producer.put(mm, torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
                 .view(tokens, HIDDEN))
    tid = f"f{k}".encode().hex().ljust(32, "0")
    return PushSpec(tid, mm, len(data), [tokens, HIDDEN], "bfloat16"), data


def test_ecx_encoder_fetches_into_two_ranks(prefill):
    p = prefill(tp=2)
    prod = ecx.Producer(capacity_bytes=32 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    enc = Pusher(prod, control_timeout_s=2.0)
    try:
        sub = EventSubscriber(enc.shards(p.base))
        held = [hold(prod, k, t) for k, t in enumerate([4, 64, 1024, 7168])]
        specs = [s for s, _ in held]
        assert enc.push(p.base, specs) == []
        for s in specs:
            assert all(r.get("ecx_fetch") is True for r in s.shards.values())
        assert sub.wait_ready([s.transfer_id for s in specs])
        st = prod.stats()  # each rank's pull ended its own hold
        assert (st["leases"], st["leases_used"]) == (0, 2 * len(specs))
        for shard, pool in zip(p.shards, p.pools):
            for spec, data in held:
                addr, n, _, _ = shard.take(spec.transfer_id, spec.mm_hash)
                assert pool.read(addr, n) == data
            # nothing came over Mooncake's wire: every window closed empty
            assert set(pool.landed.values()) == {0}
        sub.close()
    finally:
        enc.close()
        prod.close()


def test_upstream_encoder_still_writes_over_mooncakes_wire(prefill):
    from test_push_mooncake import mc_writer
    p = prefill(tp=1)
    ctl = Ctl(p.base)
    try:  # a reserve that does not ask is not told
        r = ctl.result("reserve", **item("a" * 32))
        assert "ecx_fetch" not in r and r["write"] is True
        ctl.result("cancel", transfer_id="a" * 32,
                   reservation_id=r["reservation_id"])
    finally:
        ctl.close()
    enc = UpstreamEncoder(control_timeout_s=5, writer=mc_writer())
    try:
        sub = EventSubscriber(enc.shards(p.base))
        its = [Item(f"u{k}".encode().hex().ljust(32, "0"), f"um{k}" * 16,
                    payload(k, n * HIDDEN * 2), [n, HIDDEN], "bfloat16")
               for k, n in enumerate([8, 2048])]
        assert enc.push(p.base, its) == []
        assert sub.wait_ready([i.transfer_id for i in its])
        landed = dict(p.pools[0].landed)
        assert landed.pop(r["reservation_id"]) == 0  # cancelled above
        assert sorted(landed.values()) == sorted(len(i.data) for i in its)
        for i in its:
            addr, n, _, _ = p.shards[0].take(i.transfer_id, i.mm_hash)
            assert p.pools[0].read(addr, n) == i.data
        sub.close()
    finally:
        enc.close()


CHILD = r"""
import sys, torch, ecx, random
n, token = int(sys.argv[1]), sys.argv[2] or None
p = ecx.Producer(capacity_bytes=16 << 20, bind_host="127.0.0.1",
                 registry_port=0, token=token)
data = random.Random(n).randbytes(n * 1024)
p.put("kid".ljust(64, "k"), torch.frombuffer(bytearray(data),
      dtype=torch.bfloat16).view(n, 512))
print(p.address, p.item_xxh3("kid".ljust(64, "k")), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child():
    procs = []

    def start(tokens=16, token=""):
        pr = subprocess.Popen([sys.executable, "-c", CHILD, str(tokens),
                               token], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        procs.append(pr)
        addr, h = pr.stdout.readline().split()
        return pr, addr, int(h), payload(tokens, tokens * 1024)
    yield start
    for pr in procs:
        if pr.poll() is None:
            pr.kill()
        pr.wait()


def reserve_fetchable(ctl, tid, tokens):
    r = ctl.result("reserve", ecx_fetch=True,
                   **item(tid, "kid".ljust(64, "k"), tokens, HIDDEN))
    assert r["write"] is True and r["ecx_fetch"] is True
    return r


def fetch_entry(ctl, tid, tokens):
    """An ecx_fetch entry for a fresh fetchable reservation of tid."""
    r = reserve_fetchable(ctl, tid, tokens)
    return {"transfer_id": tid, "reservation_id": r["reservation_id"]}


@contextlib.contextmanager
def fetch_entry_on(prefill, tid, tokens):
    """(prefill, its control client, fetch_entry of tid) on a fresh
    prefill; the client is closed after."""
    p = prefill()
    ctl = Ctl(p.base)
    try:
        yield p, ctl, fetch_entry(ctl, tid, tokens)
    finally:
        ctl.close()


def test_fetch_from_another_process_checks_bytes(prefill, child):
    p = prefill()
    pr, addr, h, data = child(256)
    ctl = Ctl(p.base)
    ev = pull(p.shards[0].event_endpoint)
    try:
        r = reserve_fetchable(ctl, "b" * 32, 256)
        got = ctl.result("ecx_fetch", ecx_producer=addr, items=[{
            "transfer_id": "b" * 32, "reservation_id": r["reservation_id"],
            "ecx_xxh3": f"{h:016x}"}])
        assert got == {"items": [{"fetching": True}]}
        [e] = recv_events(ev, 1)
        assert e["ready"] is True and e["transfer_id"] == "b" * 32
        a, n, _, _ = p.shards[0].take("b" * 32, "kid".ljust(64, "k"))
        assert p.pools[0].read(a, n) == data
        # a second fetch of the same reservation is refused: not WRITING
        again = ctl.result("ecx_fetch", ecx_producer=addr, items=[{
            "transfer_id": "b" * 32, "reservation_id": r["reservation_id"]}])
        assert again == {"items": [{"fetching": False}]}
    finally:
        ev.close(0)
        ctl.close()


def test_wrong_hash_fails_the_fetch(prefill, child):
    p = prefill()
    pr, addr, h, data = child(16)
    ctl = Ctl(p.base)
    ev = pull(p.shards[0].event_endpoint)
    try:
        r = reserve_fetchable(ctl, "c" * 32, 16)
        ctl.result("ecx_fetch", ecx_producer=addr, items=[{
            "transfer_id": "c" * 32, "reservation_id": r["reservation_id"],
            "ecx_xxh3": f"{h ^ 1:016x}"}])
        [e] = recv_events(ev, 1)
        assert e["ready"] is False and "ecx_xxh3" in e["ecx_failed"]
        assert p.shards[0].table.state("c" * 32) == "CANCELLED"
        assert p.pools[0].used_bytes() == 0
    finally:
        ev.close(0)
        ctl.close()


def test_producer_killed_before_the_fetch(prefill, child):
    p = prefill(timeout_ms=2000)
    pr, addr, h, data = child(16)
    ctl = Ctl(p.base)
    ev = pull(p.shards[0].event_endpoint)
    try:
        r = reserve_fetchable(ctl, "d" * 32, 16)
        pr.send_signal(signal.SIGKILL)
        pr.wait()
        t0 = time.monotonic()
        reply = ctl.result("ecx_fetch", ecx_producer=addr, items=[{
            "transfer_id": "d" * 32, "reservation_id": r["reservation_id"]}])
        assert time.monotonic() - t0 < 0.5  # answered at once
        assert reply == {"items": [{"fetching": True}]}
        [e] = recv_events(ev, 1, timeout_s=5.0)
        took = time.monotonic() - t0
        assert e["ready"] is False and addr in e["ecx_failed"]
        assert took < 2.0 + 1.0  # within the consumer's timeout
        assert p.shards[0].table.state("d" * 32) == "CANCELLED"
        assert p.pools[0].used_bytes() == 0
        # the shard serves on
        assert ctl.result("status", transfer_id="d" * 32) is None
    finally:
        ev.close(0)
        ctl.close()


def test_abandon_while_fetching_keeps_memory_until_the_load_ends(
        prefill, child):
    p = prefill(timeout_ms=1500)
    pr, addr, h, data = child(16)
    ctl = Ctl(p.base)
    ev = pull(p.shards[0].event_endpoint)
    try:
        r = reserve_fetchable(ctl, "e" * 32, 16)
        pr.send_signal(signal.SIGSTOP)
        try:
            ctl.result("ecx_fetch", ecx_producer=addr, items=[{
                "transfer_id": "e" * 32,
                "reservation_id": r["reservation_id"]}])
            # a complete while the fetch runs completes nothing
            done = ctl.result("complete", transfer_id="e" * 32,
                              reservation_id=r["reservation_id"])
            assert done == {"completed": False, "became_ready": False}
            assert ctl.result("cancel", transfer_id="e" * 32,
                              reservation_id=r["reservation_id"],
                              abandon=True) == {"cancelled": True}
            [e] = recv_events(ev, 1)
            assert e["ready"] is False
            assert p.shards[0].table.state("e" * 32) == "CANCELLED"
            assert p.pools[0].used_bytes() > 0  # the load may still write
        finally:
            pr.send_signal(signal.SIGCONT)
        assert pushkit.wait_for(lambda: p.pools[0].used_bytes() == 0, 5.0)
        assert recv_events(ev, 1, timeout_s=0.3) == []  # told once
    finally:
        ev.close(0)
        ctl.close()


def test_token_is_needed_for_fetch(prefill, child):
    p = prefill(token=TOKEN)
    pr, addr, h, data = child(16, TOKEN)
    ctl = Ctl(p.base, extra={"ecx_token": TOKEN})
    bare = Ctl(p.base)
    ev = pull(p.shards[0].event_endpoint, password=TOKEN)
    try:
        entry = fetch_entry(ctl, "f" * 32, 16)
        refused = bare.call("ecx_fetch", ecx_producer=addr, items=[entry])
        assert refused["ok"] is False and "unauthorized" in refused["error"]
        # with a token every entry carries its writer's hash
        unhashed = ctl.call("ecx_fetch", ecx_producer=addr, items=[entry])
        assert unhashed["ok"] is False and "ecx_xxh3" in unhashed["error"]
        time.sleep(0.2)
        assert p.shards[0].table.state("f" * 32) == "WRITING"
        entry["ecx_xxh3"] = f"{h:016x}"
        assert ctl.result("ecx_fetch", ecx_producer=addr,
                          items=[entry]) == {"items": [{"fetching": True}]}
        [e] = recv_events(ev, 1)
        assert e["ready"] is True
        a, n, _, _ = p.shards[0].take("f" * 32, "kid".ljust(64, "k"))
        assert p.pools[0].read(a, n) == data
    finally:
        ev.close(0)
        bare.close()
        ctl.close()


def test_bad_fetch_requests_change_nothing(prefill):
    with fetch_entry_on(prefill, "g" * 32, 4) as (p, ctl, good):
        for fields in ({"items": [good]},
                       {"ecx_producer": 5, "items": [good]},
                       {"ecx_producer": "x" * 300, "items": [good]},
                       {"ecx_producer": "tcp://127.0.0.1:1",
                        "ecx_epoch": -1, "items": [good]},
                       {"ecx_producer": "tcp://127.0.0.1:1",
                        "items": [good, {"transfer_id": "g" * 32}]},
                       {"ecx_producer": "tcp://127.0.0.1:1",
                        "items": [dict(good, ecx_xxh3="zz")]}):
            reply = ctl.call("ecx_fetch", **fields)
            assert reply["ok"] is False and set(reply) == {"ok", "error"}
        wrong = ctl.result("ecx_fetch", ecx_producer="tcp://127.0.0.1:1",
                           items=[dict(good, reservation_id="0" * 32)])
        assert wrong == {"items": [{"fetching": False}]}
        assert p.shards[0].table.state("g" * 32) == "WRITING"
        assert not p.shards[0].table.get("g" * 32).fetching
        # a dtype ecx does not carry is written, not fetched
        half = ctl.result("reserve", ecx_fetch=True,
                          **item("k" * 32, "h" * 64, dtype="half"))
        assert half["write"] is True and "ecx_fetch" not in half
    # a shard over memory with no consumer neither offers nor fetches
    shards, _ = start_shards()
    c = Ctl(shards[0].endpoint)
    try:
        r = c.result("reserve", ecx_fetch=True, **item("h" * 32))
        assert "ecx_fetch" not in r
        reply = c.call("ecx_fetch", ecx_producer="tcp://127.0.0.1:1",
                       items=[{"transfer_id": "h" * 32,
                               "reservation_id": r["reservation_id"]}])
        assert reply["ok"] is False and "does not fetch" in reply["error"]
    finally:
        c.close()
        shards[0].stop(0)


def test_fetch_answer_lists_entries_in_order(prefill, child):
    p = prefill()
    pr, addr, h, data = child(16)
    ctl = Ctl(p.base)
    try:
        r = reserve_fetchable(ctl, "j" * 32, 16)
        got = ctl.result("ecx_fetch", ecx_producer=addr, items=[
            {"transfer_id": "z" * 32, "reservation_id": "0" * 32},
            {"transfer_id": "j" * 32,
             "reservation_id": r["reservation_id"]}])
        assert got == {"items": [{"fetching": False}, {"fetching": True}]}
        assert pushkit.wait_for(
            lambda: p.shards[0].table.state("j" * 32) == "READY")
    finally:
        ctl.close()


def hold_fetches(shard):
    """Holds the loads shard starts (not started) until the returned Event
    is set: a fetch accepted meanwhile reaches the producer only then."""
    gate = threading.Event()
    shard._fetches.pause()

    def go():
        gate.wait(30.0)
        shard._fetches.resume()
    threading.Thread(target=go, daemon=True).start()
    return gate


def fill_arena(producer, first, n, tokens=192):
    """n more items of tokens KiB put after the others (later ids)."""
    for k in range(first, first + n):
        hold(producer, k, tokens)


def test_producer_holds_a_fetched_item_until_the_pull(prefill):
    """Between the shard's acceptance and its pull, later puts fill the
    producer's 1 MiB arena five times over: the item sent in ecx_fetch is
    held (a lease), so the push lands; the pull ends the hold, and the
    item is evictable again."""
    p = prefill()
    prod = ecx.Producer(capacity_bytes=1 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    enc = Pusher(prod, control_timeout_s=2.0)
    ev = pull(p.shards[0].event_endpoint)
    gate = hold_fetches(p.shards[0])
    try:
        spec, data = hold(prod, 0, 192)
        assert enc.push(p.base, [spec]) == []  # accepted: fetching
        assert spec.shards[p.base]["ecx_fetch"] is True
        fill_arena(prod, 1, 25)
        assert prod.stats()["evictions"] >= 20
        leases = prod.stats()["leases"]
        gate.set()
        [e] = recv_events(ev, 1, timeout_s=5.0)
        assert e["ready"] is True and e["transfer_id"] == spec.transfer_id
        assert leases == 1  # what held it
        addr, n, _, _ = p.shards[0].take(spec.transfer_id, spec.mm_hash)
        assert p.pools[0].read(addr, n) == data
        assert set(p.pools[0].landed.values()) == {0}  # fetched, not written
        st = prod.stats()
        assert (st["leases"], st["leases_used"]) == (0, 1)
        fill_arena(prod, 30, 10)  # the pull ended the hold
        with pytest.raises(ecx.NotFound):
            prod.item_xxh3(spec.mm_hash)
    finally:
        gate.set()
        ev.close(0)
        enc.close()
        prod.close()


def test_hold_of_a_fetched_item_ends_at_its_ttl(prefill):
    """A shard that does not pull within the hold's TTL (the producer's
    lease_max_ms, 300 ms here) no longer pins the item: it is evicted, and
    the late pull fails with one failure event, its memory freed."""
    p = prefill()
    prod = ecx.Producer(capacity_bytes=1 << 20, bind_host="127.0.0.1",
                        registry_port=0, lease_max_ms=300)
    enc = Pusher(prod, control_timeout_s=2.0)
    ev = pull(p.shards[0].event_endpoint)
    gate = hold_fetches(p.shards[0])
    try:
        spec, data = hold(prod, 0, 192)
        assert enc.push(p.base, [spec]) == []
        assert prod.stats()["leases_granted"] == 1
        time.sleep(0.5)
        st = prod.stats()
        assert (st["leases"], st["leases_expired"]) == (0, 1)
        fill_arena(prod, 1, 10)
        with pytest.raises(ecx.NotFound):
            prod.item_xxh3(spec.mm_hash)
        gate.set()
        [e] = recv_events(ev, 1, timeout_s=5.0)
        assert e["ready"] is False and prod.address in e["ecx_failed"]
        assert p.shards[0].table.state(spec.transfer_id) == "CANCELLED"
        assert pushkit.wait_for(lambda: p.pools[0].used_bytes() == 0)
        assert recv_events(ev, 1, timeout_s=0.3) == []
    finally:
        gate.set()
        ev.close(0)
        enc.close()
        prod.close()


def test_fetch_without_a_hold_is_written_instead(prefill):
    """A producer that grants no lease (lease_share_pct 0) cannot hold the
    item for a pull: the encoder writes it over Mooncake's wire at once."""
    p = prefill()
    prod = ecx.Producer(capacity_bytes=1 << 20, bind_host="127.0.0.1",
                        registry_port=0, lease_share_pct=0)
    enc = Pusher(prod, control_timeout_s=2.0)
    ev = pull(p.shards[0].event_endpoint)
    try:
        spec, data = hold(prod, 0, 64)
        assert enc.push(p.base, [spec]) == []
        [e] = recv_events(ev, 1)
        assert e["ready"] is True
        rid = spec.shards[p.base]["reservation_id"]
        assert p.pools[0].landed[rid] == len(data)  # over Mooncake's wire
        addr, n, _, _ = p.shards[0].take(spec.transfer_id, spec.mm_hash)
        assert p.pools[0].read(addr, n) == data
    finally:
        ev.close(0)
        enc.close()
        prod.close()


def test_bad_lease_field_is_refused(prefill):
    with fetch_entry_on(prefill, "q" * 32, 4) as (p, ctl, good):
        for bad in ("7", -1, 1 << 53, True):
            reply = ctl.call("ecx_fetch", ecx_producer="tcp://127.0.0.1:1",
                             items=[dict(good, ecx_lease=bad)])
            assert reply["ok"] is False and "ecx_lease" in reply["error"]
        assert not p.shards[0].table.get("q" * 32).fetching


def test_reservation_expiring_while_its_fetch_runs_is_told_once(prefill):
    """The reaper expires a writer whose fetch is held back: a failure
    event at once (it can no longer become ready), EXPIRE_PENDING with its
    range kept while the load may write; the load lands: EXPIRED, the
    range freed, no ready event and no second failure event."""
    clock = FakeClock()
    p = prefill(clock=clock)
    prod = ecx.Producer(capacity_bytes=4 << 20, bind_host="127.0.0.1",
                        registry_port=0)
    ctl = Ctl(p.base)
    ev = pull(p.shards[0].event_endpoint)
    gate = hold_fetches(p.shards[0])
    try:
        for k, fail in ((0, False), (1, True)):
            spec, _ = hold(prod, k, 16)
            r = ctl.result("reserve", ecx_fetch=True, **spec.request())
            assert r["ecx_fetch"] is True
            got = ctl.result("ecx_fetch", ecx_producer=prod.address, items=[{
                "transfer_id": spec.transfer_id,
                "reservation_id": r["reservation_id"],
                "ecx_xxh3": f"{prod.item_xxh3(spec.mm_hash):016x}"}])
            assert got == {"items": [{"fetching": True}]}
            clock.advance(301)
            [e] = recv_events(ev, 1)
            assert e["ready"] is False and e["transfer_id"] == spec.transfer_id
            assert "expired" in e["ecx_failed"]
            table = p.shards[0].table
            assert table.state(spec.transfer_id) == "EXPIRE_PENDING"
            assert p.pools[0].used_bytes() > 0  # the load may still write
            if fail:  # the load then fails: still told once
                prod.remove(spec.mm_hash)
            gate.set()
            assert pushkit.wait_for(lambda: p.pools[0].used_bytes() == 0)
            assert table.state(spec.transfer_id) == (
                "CANCELLED" if fail else "EXPIRED")
            assert recv_events(ev, 1, timeout_s=0.3) == []
            gate = hold_fetches(p.shards[0])
    finally:
        gate.set()
        ev.close(0)
        ctl.close()
        prod.close()


def test_duplicate_fetch_entries_are_answered_each_on_its_own(
        prefill, child):
    pr, addr, h, data = child(16)
    for tid, second in (("s" * 32, "0" * 32), ("t" * 32, None)):
        p = prefill()  # a fresh shard: no resident copy of the item yet
        ctl = Ctl(p.base)
        ev = pull(p.shards[0].event_endpoint)
        try:
            good = fetch_entry(ctl, tid, 16)
            dup = dict(good, reservation_id=second or good["reservation_id"])
            got = ctl.result("ecx_fetch", ecx_producer=addr,
                             items=[good, dup])
            # the second names another reservation, or one already fetching
            assert got == {"items": [{"fetching": True},
                                     {"fetching": False}]}
            [e] = recv_events(ev, 1)
            assert e["ready"] is True and e["transfer_id"] == tid
            a, n, _, _ = p.shards[0].take(tid, "kid".ljust(64, "k"))
            assert p.pools[0].read(a, n) == data
            assert recv_events(ev, 1, timeout_s=0.3) == []
        finally:
            ev.close(0)
            ctl.close()
