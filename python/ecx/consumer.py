"""Consumer (looks items up and loads them) and Load (a load in flight)."""
import array
import ctypes
import os
import threading
import weakref

from . import _cdefs as C
from ._args import b, size, token as _token
from .client import lookup as _lookup, release as _release
from .dtypes import cuda_register, cuda_unregister, describe
from .errors import EFORK, check_fork, closed, error, strerror
from .item import Found, check_items, fill


def _ms(seconds):
    """Whole milliseconds, rounded up, never below 0."""
    return max(0, int(-(-float(seconds) * 1000 // 1)))


class Consumer:
    """Looks items up and loads them (ecx_consumer).

    registry: one URL or several (a list, or comma-separated); None for a
    consumer that only receives pushes (its lookups raise). token: None
    reads ECX_TOKEN. recv_capacity: the receive arena (arena_tensor, and
    load/load_start when given Items); 0 (the default here) for none.
    integrity: check every loaded item against its producer's hash (a
    mismatch is Corrupt; a producer without integrity fails the item).
    mooncake: "auto" (None: ECX_MOONCAKE, else auto), "off" or "force":
    how items of producers that speak only the reference's protocol load
    (over Mooncake's TCP wire into this consumer's receiver), and whether
    every item does; mooncake_host: the host in the receiver's session.
    """

    def __init__(self, registry, token=None, timeout_ms=5000,
                 recv_capacity=0, transport=None, bind_host=None,
                 integrity=False, mooncake=None, mooncake_host=None):
        if registry and not isinstance(registry, str):
            registry = ",".join(registry)
        F = C.ConsumerParam
        p = C.ecx_consumer_params()
        m = F.TIMEOUT | F.RECV_CAPACITY
        if registry:
            p.registry, m = b(registry), m | F.REGISTRY
        p.timeout_ms = int(timeout_ms)
        p.recv_capacity = recv_capacity = size("recv_capacity",
                                                recv_capacity)
        token = _token(token)
        if token:
            p.token, m = b(token), m | F.TOKEN
        if transport is not None:
            p.transport, m = b(transport), m | F.TRANSPORT
        if bind_host is not None:
            p.bind_host, m = b(bind_host), m | F.BIND_HOST
        if integrity:
            p.integrity, m = 1, m | F.INTEGRITY
        if mooncake is not None:
            p.mooncake, m = b(mooncake), m | F.MOONCAKE
        if mooncake_host is not None:
            p.mooncake_host, m = b(mooncake_host), m | F.MOONCAKE_HOST
        p.field_mask = m
        self._keep = p
        self._pid = os.getpid()
        self._arena = recv_capacity > 0
        self._live = 0          # arena tensors alive
        self._closing = False
        self._h = None
        self._cuda_pinned = None  # an ecx.cuda.Pin; False: refused
        self._loads = weakref.WeakSet()  # loads in flight
        h = C.P()
        why = ctypes.create_string_buffer(256)
        rc = C.ecx_consumer_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise error(rc, why.value.decode())
        self._h = h

    def lookup(self, ids, lease_ms=None):
        """Looks ids up in one round trip per registry: a list with an Item
        for each id found and None for each missing. Raises EcxError when
        a registry could not be asked (its .found holds what the
        others answered).

        With lease_ms (0: the default, 30 s), each item found is also
        leased: its producer pins it for that long (or its own maximum), so
        the load that follows cannot miss it to eviction ("a hit will
        load"; taken in the lookup itself by a producer's embedded
        registry, else one round trip per producer). An item whose lease is
        refused (the producer's lease share is taken, it no longer holds
        the item, it does not answer) is None, as a miss. Item.lease holds
        the lease; a load of the item ends it, release() ends it sooner."""
        return _lookup(self._handle, C.ecx_consumer_lookup,
                       C.ecx_consumer_lookup_lease, ids, lease_ms)

    def release(self, items):
        """Ends the leases of items (Items from lookup with lease_ms; None
        and Items without a lease are skipped), one round trip per
        producer, and sets their lease to 0. A lease that has ended already
        is no error. Raises EcxError when a producer could not be told (its
        leases then end at their expiry)."""
        _release(self._handle, C.ecx_consumer_release, items)

    def _pairs_array(self, pairs):
        """The C item array for (Item, tensor) pairs, and what must stay
        alive while a load uses it."""
        items = [it for it, _ in pairs]
        check_items(items, getattr(pairs, "ids", None))
        arr = (C.ecx_item * len(pairs))()
        keep = []
        for a, (item, t) in zip(arr, pairs):
            name, shape, nbytes, ptr, k = describe(t)
            if nbytes != item.nbytes:
                raise ValueError(f"{item.id}: the tensor has {nbytes} "
                                 f"bytes, the item {item.nbytes}")
            if k is not t:
                raise ValueError(f"{item.id}: load into a contiguous "
                                 f"tensor or array (this one would be "
                                 f"copied, and the copy loaded)")
            if getattr(getattr(t, "flags", None), "writeable", True) \
                    is False:
                raise ValueError(f"{item.id}: the array is read-only")
            keep.append(k)
            idb = b(item.id)
            keep.append(idb)
            fill(a, item, idb)
            a.dst = ptr
        return arr, keep

    @staticmethod
    def _errors(arr, items, detail=""):
        """Per item: None, or its error; detail (the load's own words,
        which name the first failed item) is added to that item's."""
        for a, item in zip(arr, items):
            if a.status == 0 and getattr(item, "lease", 0):
                item.lease = 0  # its pull ended it
        out = []
        for a, item in zip(arr, items):
            if a.status == 0:
                out.append(None)
                continue
            msg = f"{item.id} from {item.producer}: {strerror(a.status)}"
            if detail and f"first: {item.id}" in detail:
                msg += " (" + detail.split("first: ", 1)[1] + ")"
                detail = ""
            out.append(error(a.status, msg))
        return out

    def load_into(self, pairs):
        """Loads each (Item, tensor) pair in one batched call (one pull per
        producer). Returns a list with None for each item that loaded and an
        EcxError for each that did not. A None in place of an Item (an id
        lookup did not find) raises NotFound naming it."""
        pairs = list(pairs)
        if not pairs:
            return []
        arr, keep = self._pairs_array(pairs)
        rc = C.ecx_consumer_load(self._handle(), arr, len(pairs))
        if rc == EFORK:
            raise error(rc)
        del keep
        detail = C.ecx_last_error().decode() if rc != 0 else ""
        return self._errors(arr, [it for it, _ in pairs], detail)

    def load_start(self, items):
        """Starts loading, without waiting: items are Items (from lookup;
        each gets a new tensor, in the receive arena while it has room) or
        (Item, tensor) pairs. Returns a Load; its .test() says whether it
        has ended, .wait() waits for it (bounded by the consumer's
        timeout_ms from the start). The Load keeps the items and tensors
        alive until it ends. A None in place of an Item raises NotFound
        naming the id."""
        items = list(items) if not isinstance(items, Found) else items
        if all(isinstance(x, tuple) for x in items) and items:
            pairs = [(it, t) for it, t in items]
        else:
            check_items(items)
            pairs = [(it, self._new_tensor(it)) for it in items]
        return Load(self, pairs)

    def load_notify(self, pairs, sock=None, msg=b""):
        """Starts loading (Item, tensor) pairs without waiting for a
        handshake (ecx_consumer_load_notify): returns a Load at once, and
        no Python thread has to run for it to end. Once it has ended, libecx sends
        on sock (a socket, or its descriptor; None: nothing is sent), in
        one message and without blocking, msg followed by each item's
        status as a native int32 (0: loaded; see notify_statuses). The Load
        keeps the items and tensors alive until it ends."""
        fd = -1 if sock is None else (sock if isinstance(sock, int)
                                      else sock.fileno())
        return Load(self, [(it, t) for it, t in pairs], notify=(fd,
                                                                bytes(msg)))

    def _new_tensor(self, it):
        t = self.arena_tensor(it) if self._arena else None
        return t if t is not None else it.empty("cpu")

    def arena_tensor(self, item):
        """A torch tensor for item inside the receive arena (registered
        once, shared-memory mapped: the fastest place to load into), or
        None when the arena has no room. Its space returns to the arena
        when the tensor is freed."""
        import torch
        n = max(int(item.nbytes), 1)
        ptr = C.ecx_consumer_alloc(self._handle(), n)
        if not ptr:
            return None
        self._live += 1
        buf = (ctypes.c_char * n).from_address(ptr)
        # The arena outlives its tensors: each holds the consumer alive.
        weakref.finalize(buf, Consumer._arena_free, self, ptr)
        t = torch.frombuffer(buf, dtype=torch.uint8)[:item.nbytes]
        return t.view(getattr(torch, item.dtype)).view(item.shape)

    @staticmethod
    def _arena_free(consumer, ptr):
        if consumer._h is None:
            return
        C.ecx_consumer_free(consumer._h, ptr)
        consumer._live -= 1
        if consumer._closing and consumer._live == 0:
            consumer._destroy()

    def load(self, items, device="cpu"):
        """Loads Items (from lookup) into new torch tensors (in the receive
        arena while it has room); raises the first item's error if any
        failed."""
        check_items(items)
        items = list(items)
        outs = [self._new_tensor(it) for it in items]
        errs = self.load_into(list(zip(items, outs)))
        for e in errs:
            if e is not None:
                raise e
        if device != "cpu":
            outs = [o.to(device) for o in outs]
        return outs

    def stats(self):
        s = C.ecx_consumer_stats()
        C.ecx_consumer_stats_get(self._handle(), ctypes.byref(s))
        return {n: getattr(s, n) for n in C.CONSUMER_STATS}

    def _handle(self):
        if self._h is None:
            raise closed("consumer")
        check_fork(self, "consumer")
        return self._h

    def close(self):
        """Closes the consumer; while arena tensors are alive the arena
        stays mapped, and goes when the last of them is freed. In a forked
        child it only forgets the parent's consumer (which is left as it
        is: its loads, arena and connections are the parent's)."""
        if getattr(self, "_h", None) is None:
            return
        if self._pid != os.getpid():
            self._h = None
            return
        for load in list(getattr(self, "_loads", ())):
            load.wait()  # ecx_consumer_destroy needs none in flight
        if self._live > 0:
            self._closing = True
            return
        self._destroy()

    def _destroy(self):
        if self._cuda_pinned:
            cuda_unregister(self._cuda_pinned)
            self._cuda_pinned = None
        C.ecx_consumer_destroy(self._h)
        self._h = None

    def arena(self):
        """(address, size) of the receive arena; (None, 0) without one."""
        cap = ctypes.c_uint64()
        base = C.ecx_consumer_arena(self._handle(), ctypes.byref(cap))
        return base, cap.value

    def alloc(self, nbytes):
        """The address of nbytes of the receive arena, or None when it has
        no room; give it back with free."""
        return C.ecx_consumer_alloc(self._handle(), max(int(nbytes), 1))

    def free(self, ptr):
        C.ecx_consumer_free(self._handle(), ptr)

    def mooncake_session(self):
        """The session ("host:port") of this consumer's Mooncake receiver,
        which it starts if it is not running (the dst_session a pusher
        writes to)."""
        s = ctypes.c_char_p()
        rc = C.ecx_consumer_mooncake_session(self._handle(), ctypes.byref(s))
        if rc != 0:
            raise error(rc)
        return s.value.decode()

    def push_open(self, ptr, nbytes, timeout_s, hashed=True):
        """Lets writes over Mooncake's wire land in [ptr, ptr + nbytes)
        (inside one alloc) for timeout_s; returns the window's id. hashed:
        the receiver hashes the bytes as they land (push_close_hashed)."""
        wid = ctypes.c_uint64()
        open_ = (C.ecx_consumer_push_open if hashed
                 else C.ecx_consumer_push_open_unhashed)
        rc = open_(self._handle(), ptr, int(nbytes), _ms(timeout_s),
                   ctypes.byref(wid))
        if rc != 0:
            raise error(rc)
        return wid.value

    def push_renew(self, wid, timeout_s):
        """Moves window wid's deadline to timeout_s from now."""
        rc = C.ecx_consumer_push_renew(self._handle(), wid, _ms(timeout_s))
        if rc != 0:
            raise error(rc)

    def push_close(self, wid):
        """Ends window wid: nothing lands through it after this returns.
        Returns the bytes of the writes that landed whole."""
        return self.push_close_hashed(wid)[0]

    def push_close_hashed(self, wid):
        """push_close, returning (bytes landed, XXH3 of the window's range
        or None): the hash the receiver made as the bytes came in, where
        every byte landed exactly once and in order; None otherwise (hash
        the range then, ecx.xxh3)."""
        n, h, whole = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
        rc = C.ecx_consumer_push_close_hashed(
            self._handle(), wid, ctypes.byref(n), ctypes.byref(h),
            ctypes.byref(whole))
        if rc != 0:
            raise error(rc)
        return n.value, (h.value if whole.value else None)

    def pin_for_cuda(self, required=False):
        """Page-locks the receive arena for CUDA (cuMemHostRegister,
        PORTABLE, through the driver API), once, so copies from arena
        tensors to a GPU are DMAs that can run on a side stream
        (t.to("cuda", non_blocking=True)). True when it is page-locked (by
        this call, or already, e.g. by UCX: then never unregistered here);
        False without CUDA or an arena, or when the driver refuses (logged
        with its code), or raises ecx.cuda.CudaError for that (OSError
        where libcuda does not load) when required."""
        if self._cuda_pinned:
            return True
        if self._cuda_pinned is False and not required:
            return False  # tried before (and logged)
        base, size = self.arena()
        if not base:
            return False
        pinned = cuda_register(base, size, "receive arena", required)
        self._cuda_pinned = pinned if pinned is not None else False
        return pinned is not None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def notify_statuses(data, n):
    """The (msg, statuses) of a message of Consumer.load_notify for a load
    of n items: its last 4*n bytes are the statuses (native int32)."""
    k = len(data) - 4 * n
    if k < 0:
        raise ValueError(f"{len(data)} bytes cannot carry {n} statuses")
    st = array.array("i")
    st.frombytes(data[k:])
    return data[:k], list(st)


class Load:
    """A load in flight (Consumer.load_start). .items and .tensors are what
    it loads into; both, and the C items, stay alive here until it ends.
    .test() returns True once it has ended (it does not wait for the
    pulls; but see test() on failover); .wait() blocks
    until it ends, at most the consumer's timeout_ms from the start, and
    returns .errors: None for each item that loaded, an EcxError for each
    that did not (ETIMEDOUT for what was still missing at the deadline)."""

    def __init__(self, consumer, pairs, notify=None):
        self.items = [it for it, _ in pairs]
        self.tensors = [t for _, t in pairs]
        self.errors = None
        self._consumer = consumer
        self._lock = threading.Lock()
        self._h = None
        self._arr, self._keep = consumer._pairs_array(pairs) if pairs \
            else ((C.ecx_item * 0)(), [])
        h = C.P()
        if notify is None:
            rc = C.ecx_consumer_load_start(consumer._handle(), self._arr,
                                           len(pairs), ctypes.byref(h))
        else:
            fd, msg = notify
            rc = C.ecx_consumer_load_notify(
                consumer._handle(), self._arr, len(pairs), fd, msg,
                len(msg), ctypes.byref(h))
        if rc != 0:
            raise error(rc, C.ecx_last_error().decode())
        self._h = h
        consumer._loads.add(self)

    @property
    def done(self):
        return self._h is None

    @property
    def ok(self):
        """True once it ended with every item loaded."""
        return self.done and not any(self.errors or ())

    def test(self):
        """True when the load has ended (its per-item .errors are then
        set), False while it runs. It does not wait for pulls; but when
        the load ended with items whose holder is gone, finishing it tries
        their other holders first (ecx_load_wait's failover), which can
        take up to the rest of the load's deadline."""
        with self._lock:
            if self._h is None:
                return True
            check_fork(self._consumer, "consumer")
            if C.ecx_load_test(self._h) != 0:
                return False
            self._finish()
            return True

    def wait(self):
        """Waits for the end (bounded by the consumer's timeout) and
        returns .errors."""
        with self._lock:
            if self._h is not None:
                check_fork(self._consumer, "consumer")
                self._finish()
            return self.errors

    def _finish(self):
        C.ecx_load_wait(self._h)  # frees the C load; returns at once when done
        self._h = None
        self.errors = Consumer._errors(self._arr, self.items)
        self._keep = None
        self._consumer._loads.discard(self)

    def __del__(self):
        if getattr(self, "_h", None) is not None:
            if self._consumer._pid != os.getpid():
                return  # a forked child's copy: the parent's to end
            self.wait()

    def __repr__(self):
        state = "running" if self._h is not None else (
            f"{sum(e is None for e in self.errors)} of {len(self.items)} "
            f"loaded")
        return f"<ecx.Load of {len(self.items)} items, {state}>"


