"""The encoder's side of upstream vLLM's push mode, driven by an ecx
Producer: the items are held in the producer's arena (under their mm_hash,
put as usual) and written with Producer.push_batch over Mooncake's TCP
wire into reservations that the consumer's shards hand out
(../../../../docs/protocol.md "Push mode: the producer side";
shared/reference/vllm/PUSH.md sections 1, 2, 5, 6).

Pusher.push(consumer_zmq, specs) does, for one consumer:
  discovery (peers at the base address, every shard at the base's host
  with its port, event_port of each; cached per base address), reserve
  (one item) or reserve_batch (several) on every shard at once, a
  reservation older than TTL/2 that is not ready, cached or cancelled
  cancelled with abandon and refresh and reserved again, the writable
  shards' reservations (not cached, not cancelled, write true or absent;
  nbytes checked) written, one complete_batch per shard (every entry
  completed:true). Any failure cancels every known reservation of the
  failed items with abandon (up to 2 tries each).

ecx's own (upstream's consumer ignores them): with send_hash, every
reserve says "ecx_hashed": true (so an ecx consumer's receiver hashes the
bytes as they land) and each complete_batch entry carries the item's
XXH3 as "ecx_xxh3" (16 hex digits; the hash made at put where the
Producer has integrity on, else made from its bytes on the Pusher's
hashing threads while the write goes), which an ecx consumer checks the
landed bytes against; and a token as "ecx_token" (with the hash always: a
shard with a token checks every push, as a stranger can write on
Mooncake's wire). And ecx's fetch: every reserve asks "ecx_fetch": true;
a shard that answers "ecx_fetch": true in a writable reservation (an ecx
consumer over its receive arena) is sent, instead of a write and a
complete, one ecx_fetch naming this Producer's address: the shard pulls
the items over UCX (cross-memory attach on one host) and completes them
itself when they land (a failure reaches the consumer as a failure event,
and is not in push's return: a spec whose nbytes is not the held item's,
for one, fails at the pull). The push ends here at the shard's
acceptance, so each fetched item is first held for the shard's pull
(Producer.lease, its number sent as the entry's "ecx_lease"; the pull
ends it, else its expiry): later puts cannot evict it before the pull
reads it; an item the producer will not lease is written instead.
Upstream's consumer never answers the field, so it is written over
Mooncake's wire as before.

specs_from_params turns a request's ec_transfer_params into PushSpecs,
finished_map builds the map that request_finished returns to upstream's
proxy; ../pushflow/pushes.py drives them from ECXConnector's encoder.
"""
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait

from .reqs import ControlError, ControlTimeout, Requests
from .wire import FETCH_FIELD, HASH_FIELD, HASHED_FIELD, LEASE_FIELD

TTL_S = 300.0
TIMED_OUT = object()  # what _cancel returns for no reply in time
CANCELS_KEPT = 1024  # Pusher.cancels


class PushSpec:
    """One item to push: its transfer_id, mm_hash (the id it is held under
    in the Producer), nbytes, shape [tokens, hidden] and dtype name."""

    def __init__(self, transfer_id, mm_hash, nbytes, shape, dtype,
                 metadata=None):
        self.transfer_id = transfer_id
        self.mm_hash = mm_hash
        self.nbytes = int(nbytes)
        self.shape = [int(d) for d in shape]
        self.dtype = dtype
        self.metadata = metadata
        self.xxh3 = None       # the item's hash, sent with complete
        self.shards = {}       # shard address -> reservation
        self.reserved_at = {}  # shard address -> clock() of its reserve
        self.error = None

    def request(self):
        return {"transfer_id": self.transfer_id, "mm_hash": self.mm_hash,
                "nbytes": self.nbytes, "shape": self.shape,
                "dtype": self.dtype}


def specs_from_params(ec_transfer_params, features):
    """(consumer_zmq, [PushSpec]) of a request: features is the request's
    items in order, (mm_hash, nbytes, shape, dtype, metadata) each; the
    proxy's ec_items are matched to them by position (PUSH.md section 6).
    (None, []) when the request carries no consumer_zmq. An item without a
    transfer_id is not pushed."""
    params = ec_transfer_params or {}
    consumer = params.get("consumer_zmq")
    if not isinstance(consumer, str) or not consumer:
        return None, []
    items = params.get("ec_items") or []
    specs = []
    for k, (mm_hash, nbytes, shape, dtype, meta) in enumerate(features):
        entry = items[k] if k < len(items) else None
        tid = entry.get("transfer_id") if isinstance(entry, dict) else None
        if isinstance(tid, str) and tid:
            specs.append(PushSpec(tid, mm_hash, nbytes, shape, dtype, meta))
    return consumer, specs


def finished_map(specs):
    """What request_finished returns to upstream's proxy for the pushed
    items: {mm_hash: {"metadata": ..., "transfer_id": ...}}."""
    return {s.mm_hash: {"metadata": s.metadata,
                        "transfer_id": s.transfer_id} for s in specs}


def _complete_item(spec, reservation, lease=0):
    e = {"transfer_id": spec.transfer_id,
         "reservation_id": reservation["reservation_id"]}
    if spec.xxh3 is not None:
        e[HASH_FIELD] = f"{spec.xxh3:016x}"
    if lease:
        e[LEASE_FIELD] = lease
    return e


def _shard_addr(base, port):
    return f"{base.rsplit(':', 1)[0]}:{int(port)}"


class Pusher:
    """Pushes items an ecx Producer holds into upstream-protocol consumers.

    control_timeout_s: the REQ timeout (upstream's extra config key);
    write_timeout_s: the bound of one batch of writes (default
    control_timeout_s); token: ecx's control token, sent as "ecx_token"
    (None for none, as upstream); send_hash: whether reserves say
    "ecx_hashed": true and complete and ecx_fetch entries carry
    "ecx_xxh3" (true by default here; the connector passes its integrity
    key, false by default; always true with a token, whose shards refuse
    entries without the hash); fetch: whether shards that offer ecx's fetch
    are sent ecx_fetch instead of writes; fetch_hold_ms: how long the producer
    holds an item sent in an ecx_fetch for the shard's pull at most (a
    lease; 0: the producer's lease_max_ms, which also cuts a longer one);
    threads: the pool's threads for control calls to several shards at
    once; hash_threads: the threads that hash items while their writes go
    (an executor of their own, so that a hash never queues behind control
    calls blocked on a consumer that does not answer). Thread-safe."""

    def __init__(self, producer, control_timeout_s=30.0, token=None,
                 write_timeout_s=None, clock=time.monotonic, threads=8,
                 send_hash=True, fetch=True, fetch_hold_ms=0,
                 hash_threads=2):
        self.producer = producer
        self.fetch = fetch
        self.fetch_hold_ms = int(fetch_hold_ms)
        self.send_hash = bool(send_hash or token)
        self.ctl = Requests(control_timeout_s, token)
        self.write_timeout_s = write_timeout_s or control_timeout_s
        self.clock = clock
        self.topologies = {}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="push")
        self.hasher = ThreadPoolExecutor(hash_threads,
                                         thread_name_prefix="push-hash")
        # (shard, cancel request) sent, newest last: the last
        # CANCELS_KEPT only (for tests and debugging)
        self.cancels = deque(maxlen=CANCELS_KEPT)

    def close(self):
        self.pool.shutdown()
        self.hasher.shutdown()
        self.ctl.close()

    def _run_all(self, calls):
        """Runs calls ([(fn, arg, ...)]) at once, all but the last on the
        pool and the last in this thread (one shard's op then costs no
        hand-over between threads: about 0.1 ms each way on two busy
        cores); returns, in order, what each returned or raised."""
        futs = [self.pool.submit(*c) for c in calls[:-1]]
        last = []
        if calls:
            try:
                last.append(calls[-1][0](*calls[-1][1:]))
            except Exception as e:
                last.append(e)
        out = []
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:
                out.append(e)
        return out + last

    # ---- discovery ----

    def shards(self, consumer_zmq):
        """[(shard address, event port)] of the consumer at consumer_zmq,
        asked once per base address."""
        topo = self.topologies.get(consumer_zmq)
        if topo is None:
            got = self.ctl.call(consumer_zmq, {"op": "peers"})
            try:
                addrs = [_shard_addr(consumer_zmq, p) for p in got["ports"]]
                topo = [(a, int(self.ctl.call(a, {"op": "event_port"})))
                        for a in addrs]
            except (KeyError, TypeError, ValueError) as e:
                raise ControlError(
                    f"peers on {consumer_zmq}: not an EC consumer's answer "
                    f"({type(e).__name__}: {e})") from None
            self.topologies[consumer_zmq] = topo
        return topo

    # ---- reserve and cancel ----

    def _reserve_on(self, addr, specs):
        ask = {FETCH_FIELD: True} if self.fetch else {}
        if self.send_hash:
            ask[HASHED_FIELD] = True
        if len(specs) == 1:
            try:
                return [(True, self.ctl.call(
                    addr, dict(op="reserve", **specs[0].request(), **ask)))]
            except ControlTimeout as e:  # kept whole: reserve looks
                return [(False, e)]
            except ControlError as e:
                return [(False, str(e))]
        try:
            got = self.ctl.call(addr, dict(
                {"op": "reserve_batch",
                 "items": [s.request() for s in specs]}, **ask))
            got = got["items"]
            if len(got) != len(specs):
                raise ControlError(f"reserve_batch on {addr}: {len(got)} "
                                   f"answers for {len(specs)} items")
        except ControlTimeout as e:
            return [(False, e)] * len(specs)
        except (ControlError, KeyError, TypeError) as e:
            return [(False, str(e))] * len(specs)
        return [(r.get("ok") is True,
                 r.get("result") if r.get("ok") is True else r.get("error"))
                for r in got]

    def reserve(self, consumer_zmq, specs, addrs=None):
        """Reserves specs on every shard at once (or on addrs); an item
        any shard failed is cancelled with abandon everywhere and gets
        .error. Returns the specs reserved on every shard."""
        try:
            addrs = addrs or [a for a, _ in self.shards(consumer_zmq)]
        except ControlError as e:
            for s in specs:
                s.error = f"no shards at {consumer_zmq}: {e}"
            return []
        got = self._run_all([(self._reserve_on, a, specs) for a in addrs])
        for g in got:
            if isinstance(g, Exception):
                raise g
        answers = dict(zip(addrs, got))
        if any(isinstance(r, ControlTimeout) for g in got for _, r in g):
            # a shard gone or stuck: the consumer may have restarted,
            # with another tp; the next push asks its topology again
            self.topologies.pop(consumer_zmq, None)
        good, failed = [], []
        for k, spec in enumerate(specs):
            for a in addrs:
                okay, r = answers[a][k]
                if okay and isinstance(r, dict):
                    spec.shards[a] = r
                    spec.reserved_at[a] = self.clock()
                elif spec.error is None:
                    spec.error = f"reserve on {a}: {r}"
            (good if spec.error is None else failed).append(spec)
        if failed:  # all at once: a silent shard costs one timeout
            self.abandon(consumer_zmq, failed, addrs)
        return good

    def _cancel(self, addr, req):
        """Up to 2 tries, as upstream's; not a second after no reply
        within control_timeout_s (a peer gone would only take as long
        again). Returns the reply's "cancelled", None where none came,
        TIMED_OUT where the peer did not answer in time."""
        self.cancels.append((addr, req))
        for _ in range(2):
            try:
                return self.ctl.call(addr, req).get("cancelled")
            except ControlTimeout:
                return TIMED_OUT
            except (ControlError, AttributeError):
                continue
        return None

    def _cancel_all(self, addr, reqs):
        """reqs to one shard in turn, until one finds it silent: the rest
        end at its TTL (or with it, where it is gone)."""
        for req in reqs:
            if self._cancel(addr, req) is TIMED_OUT:
                return

    def abandon(self, consumer_zmq, specs, addrs=None):
        """cancel{abandon:true} of every spec on every shard (addrs, else
        the consumer's known shards, else those each spec reserved on),
        with its reservation_id where one came back and "" where none
        did; the shards in parallel (up to the pool's threads), each
        given at most one control_timeout_s without a reply."""
        if addrs is None:
            addrs = [a for a, _ in self.topologies.get(consumer_zmq, [])]
        per = {}  # shard -> its cancels
        for spec in specs:
            for a in addrs or list(spec.shards):
                rid = (spec.shards.get(a) or {}).get("reservation_id", "")
                per.setdefault(a, []).append({
                    "op": "cancel", "transfer_id": spec.transfer_id,
                    "reservation_id": rid or "", "abandon": True})
        for g in self._run_all([(self._cancel_all, a, reqs)
                                for a, reqs in per.items()]):
            if isinstance(g, Exception):
                raise g

    def _refresh(self, consumer_zmq, spec):
        now = self.clock()
        stale = [a for a, r in spec.shards.items()
                 if now - spec.reserved_at[a] >= TTL_S / 2
                 and not r.get("ready") and not r.get("cached")
                 and not r.get("cancelled")]
        for a in stale:
            self._cancel(a, {"op": "cancel", "transfer_id": spec.transfer_id,
                             "reservation_id": spec.shards[a].get(
                                 "reservation_id", ""),
                             "abandon": True, "refresh": True})
            del spec.shards[a]
        if stale and not self.reserve(consumer_zmq, [spec], addrs=stale):
            raise ControlError(spec.error or "refresh failed")

    # ---- the hold of a fetched item ----

    def _hold(self, fetches, writes):
        """A lease on the item of each fetch entry, so that the producer
        cannot evict it between the shard's acceptance and its pull (the
        pull names the lease and the producer ends it once the pull holds
        the item; else it expires). An entry whose lease is refused (the
        lease share taken, leases off) is written over Mooncake's wire
        instead, now, while the item is held. Returns {shard: [lease per
        entry]}."""
        take = getattr(self.producer, "lease", None)
        leases = {}
        for a in list(fetches):
            kept = []
            for spec, r in fetches[a]:
                try:
                    lease = take(spec.mm_hash, self.fetch_hold_ms) \
                        if take is not None else 0
                except Exception:  # noqa: BLE001 - written instead
                    writes.setdefault(a, []).append((spec, r))
                    continue
                kept.append((spec, r, lease))
            if kept:
                fetches[a] = [(spec, r) for spec, r, _ in kept]
                leases[a] = [lease for _, _, lease in kept]
            else:
                del fetches[a]
        return leases

    def _unhold(self, leases):
        end = getattr(self.producer, "lease_end", None)
        for lease in leases:
            if lease and end is not None:
                try:
                    end(lease)
                except Exception:  # noqa: BLE001 - it expires then
                    pass

    # ---- the push ----

    def push(self, consumer_zmq, specs):
        """Reserves (where not yet), writes and completes specs; returns
        the specs that failed (each with .error), their reservations
        cancelled with abandon. Blocks for at most the reserve, the writes
        (write_timeout_s) and the completes, each bounded, and where one
        fails the abandon's cancels (control_timeout_s, the shards in
        parallel)."""
        fresh = [s for s in specs if not s.shards and s.error is None]
        if fresh:
            self.reserve(consumer_zmq, fresh)
        live = [s for s in specs if s.error is None]
        if not live:
            return [s for s in specs if s.error is not None]
        held = {}  # shard -> leases of its fetch entries not yet settled
        try:
            for spec in live:
                self._refresh(consumer_zmq, spec)
            writes = {}  # shard -> [(spec, reservation)]
            fetches = {}  # shard -> [(spec, reservation)], ecx's fetch
            for spec in live:
                for a, r in spec.shards.items():
                    if (r.get("cached") or r.get("cancelled")
                            or not r.get("write", True)):
                        continue
                    if r.get("nbytes") != spec.nbytes:
                        raise ControlError(
                            f"{a} reserved {r.get('nbytes')} bytes for "
                            f"{spec.transfer_id}, the item has "
                            f"{spec.nbytes}")
                    fetch = self.fetch and r.get(FETCH_FIELD) is True
                    (fetches if fetch else writes).setdefault(
                        a, []).append((spec, r))
            held = self._hold(fetches, writes) if fetches else {}
            # Each item's hash made on the hasher while the writes go (both
            # leave the interpreter's lock): a producer without integrity
            # hashes 7 MiB in about 0.6 ms, as long as a write's control.
            # Not on the pool: there a hash could wait behind control calls
            # (another push's) blocked for up to control_timeout_s.
            hashing = []
            if self.send_hash:
                for spec in {id(s): s for e in (*writes.values(),
                                                *fetches.values())
                             for s, _ in e}.values():
                    if spec.xxh3 is None:
                        hashing.append((spec, self.hasher.submit(
                            self.producer.item_xxh3, spec.mm_hash)))
            batch = [(spec.mm_hash, r["dst_session"], r["dst_ptr"],
                      spec.nbytes)
                     for entries in writes.values() for spec, r in entries]
            try:
                status = self.producer.push_batch(batch,
                                                  self.write_timeout_s)
            finally:
                # Every hash ended before anything is raised; the write's
                # error (propagating from here) goes before a hash's.
                wait([fut for _, fut in hashing])
            hash_error = None  # the first, in order
            for spec, fut in hashing:
                if fut.exception() is None:
                    spec.xxh3 = fut.result()
                elif hash_error is None:
                    hash_error = fut.exception()
            bad = [k for k, st in enumerate(status) if st != 0]
            if bad:
                raise ControlError(
                    f"{len(bad)} of {len(batch)} writes failed: "
                    f"{getattr(self.producer, 'last_push_error', '')}")
            if hash_error is not None:  # the writes' errors first
                raise hash_error
            ops = [(a, "completed", len(entries), {
                "op": "complete_batch",
                "items": [_complete_item(s, r) for s, r in entries]})
                for a, entries in writes.items()]
            ops += [(a, "fetching", len(entries), {
                "op": "ecx_fetch", "ecx_producer": self.producer.address,
                "items": [_complete_item(s, r, lease)
                          for (s, r), lease in zip(entries, held[a])]})
                for a, entries in fetches.items()]
            got = self._run_all([(self.ctl.call, a, req)
                                 for a, _, _, req in ops])
            errors = []
            for (a, key, n, _), g in zip(ops, got):
                if isinstance(g, (ControlError, KeyError, TypeError)):
                    errors.append(str(g))
                    continue
                if isinstance(g, Exception):
                    raise g
                try:
                    done = g["items"]
                    ok = [isinstance(d, dict) and d.get(key) is True
                          for d in done]
                except (KeyError, TypeError) as e:
                    errors.append(str(e))
                    continue  # its leases are ended below
                if key == "fetching":  # the shard's pull ends the others
                    leases, held[a] = held[a], []
                    self._unhold(lease for k, lease in enumerate(leases)
                                 if k >= len(ok) or not ok[k])
                if len(done) != n or not all(ok):
                    errors.append(f"{a}: not every entry {key}")
            if errors:
                raise ControlError("; ".join(errors))
        except Exception as e:  # every failure ends in abandon
            self._unhold(x for leases in held.values() for x in leases)
            for spec in live:
                if spec.error is None:
                    spec.error = f"{type(e).__name__}: {e}"
            self.abandon(consumer_zmq, live)
        return [s for s in specs if s.error is not None]
