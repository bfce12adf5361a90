"""Client (registry only, no data plane), and the one lookup and release
path that Consumer and Client share."""
import contextlib
import ctypes
import os
import threading

from . import _cdefs as C
from ._args import b, token as _token
from .errors import closed, check_fork, error
from .item import (Found, fill, found as _found, item_of, lookup_array,
                   need_client, release_array)


def lookup(handle, plain, leased, ids, lease_ms, lock=None):
    """Looks ids up through plain(h, arr, n), or leased(h, arr, n,
    lease_ms) with lease_ms: a Found. When a registry could not be asked it
    raises the EcxError, whose .found holds what the others answered.
    handle() gives the C handle (checked); lock serializes the call."""
    ids = [ids] if isinstance(ids, str) else list(ids)
    if not ids:
        return Found([], [])
    arr, keep = lookup_array(ids)
    with lock if lock is not None else contextlib.nullcontext():
        if lease_ms is None:
            rc = plain(handle(), arr, len(ids))
        else:
            rc = leased(handle(), arr, len(ids), int(lease_ms))
        err = error(rc) if rc != 0 else None
    result = _found(ids, arr)
    del keep
    if err is not None:
        err.found = result
        raise err
    return result


def release(handle, fn, items, lock=None):
    """Ends the leases of items through fn(h, arr, n) and sets their lease
    to 0 (None and Items without a lease are skipped); raises EcxError
    when a producer could not be told."""
    arr, held, keep = release_array(list(items))
    if not held:
        return
    with lock if lock is not None else contextlib.nullcontext():
        rc = fn(handle(), arr, len(held))
        err = error(rc) if rc != 0 else None
    for it in held:
        it.lease = 0
    del keep
    if err is not None:
        raise err


class Client:
    """A registry client (ecx_client): lookups, listings, publishing and
    health of one or several registries, with no data plane (no UCX, no
    threads, nothing connected until the first call). Each registry keeps
    one persistent connection; one that fails is skipped for a back-off
    (500 ms doubling to 10 s) instead of costing its timeout every call.

    registry: one URL or several (a list, or comma-separated), each
    http://HOST:PORT, redis://[:password@]HOST[:PORT][/DB] or
    redis+sentinel://[:password@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]
    (the master the sentinels name, followed through failovers); anything
    else raises EcxError EINVAL now. token: None reads ECX_TOKEN. spin_us: how
    long a request polls its connection for the answer before sleeping
    (None: the library's 200 us; 0 sleeps at once). Safe to share between
    threads (calls are serialized).
    """

    def __init__(self, registry, token=None, timeout_ms=5000,
                 connect_timeout_ms=None, registry_ttl_s=None, spin_us=None):
        self._h = None
        self._pid = os.getpid()
        need_client()
        if not registry:
            raise ValueError("a client needs a registry URL")
        if not isinstance(registry, str):
            registry = ",".join(registry)
        F = C.ClientParam
        p = C.ecx_client_params()
        m = F.REGISTRY | F.TIMEOUT
        p.registry = b(registry)
        p.timeout_ms = int(timeout_ms)
        token = _token(token)
        if token:
            p.token, m = b(token), m | F.TOKEN
        if connect_timeout_ms is not None:
            p.connect_timeout_ms = int(connect_timeout_ms)
            m |= F.CONNECT_TIMEOUT
        if registry_ttl_s is not None:
            p.registry_ttl_s = int(registry_ttl_s)
            m |= F.REGISTRY_TTL
        if spin_us is not None:
            p.spin_us = int(spin_us)
            m |= F.SPIN
        p.field_mask = m
        self._keep = p
        self._lock = threading.Lock()
        self.registry = registry
        self.last_total = None
        h = C.P()
        why = ctypes.create_string_buffer(256)
        rc = C.ecx_client_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise error(rc, why.value.decode())
        self._h = h

    def _handle(self):
        if self._h is None:
            raise closed("client")
        check_fork(self, "client")
        return self._h

    def lookup(self, ids, lease_ms=None):
        """Looks ids up, one round trip per registry (ids missing from one
        are asked of the next): a Found list with an Item for each id found
        and None for each missing. When a registry could not be asked it
        raises EcxError whose .found holds what the others answered.
        lease_ms: as Consumer.lookup (where the registry is not the
        producer's own, the client also talks to the producers' ZeroMQ
        sockets): each Item found is leased, and a
        Consumer in any process that loads it ends the lease."""
        return lookup(self._handle, C.ecx_client_lookup,
                      C.ecx_client_lookup_lease, ids, lease_ms, self._lock)

    def release(self, items):
        """Ends the leases of items, as Consumer.release."""
        release(self._handle, C.ecx_client_release, items, self._lock)

    def publish(self, item):
        """Writes item's entry (id, dtype, shape, producer, epoch) to the
        first registry."""
        idb = b(item.id)
        a = C.ecx_item()
        fill(a, item, idb)
        with self._lock:
            rc = C.ecx_client_publish(self._handle(), ctypes.byref(a))
            if rc != 0:
                raise error(rc)

    def remove(self, id, producer=None):
        """Deletes id's entry from the first registry; with producer, only
        if the entry is that producer's. NotFound when nothing was
        removed."""
        with self._lock:
            rc = C.ecx_client_remove(self._handle(), b(id),
                                     b(producer) if producer else None)
            if rc != 0:
                raise error(rc)

    def list(self, after="", limit=500):
        """Yields every Item of the first registry whose id sorts after
        `after`, in id order, asking `limit` (1 to 1000) at a time.
        .last_total is the registry's count of entries as of the last
        page."""
        limit = int(limit)
        if not 1 <= limit <= 1000:
            raise ValueError("limit is 1 to 1000")
        cursor = after or ""
        while True:
            page, cursor = self._list_page(cursor, limit)
            yield from page
            if not cursor:
                return

    def _list_page(self, after, limit):
        page = []
        failure = []

        def one(arg, item):
            try:
                x = item.contents
                page.append(item_of(x.id.decode(), x))
                return 0
            except BaseException as e:  # noqa: BLE001 - re-raised below
                failure.append(e)
                return 1

        cb = C.ecx_list_fn(one)
        nxt = ctypes.create_string_buffer(256)
        total = ctypes.c_uint64()
        with self._lock:
            rc = C.ecx_client_list(self._handle(), b(after), limit, cb,
                                   None, nxt, 256, ctypes.byref(total))
            err = error(rc) if rc != 0 and not failure else None
        if failure:
            raise failure[0]
        if err is not None:
            raise err
        self.last_total = total.value
        return page, nxt.value.decode()

    def health(self):
        """Asks the first registry whether it serves; returns its epoch
        (it changes at each start of an HTTP registry; 0 for Redis)."""
        epoch = ctypes.c_uint64()
        with self._lock:
            rc = C.ecx_client_health(self._handle(), ctypes.byref(epoch))
            if rc != 0:
                raise error(rc)
        return epoch.value

    @property
    def connections(self):
        """Connections opened so far, over all registries."""
        return C.ecx_client_connections(self._handle())

    def close(self):
        if getattr(self, "_h", None) is not None:
            if self._pid == os.getpid():  # a forked child's: forgotten
                C.ecx_client_destroy(self._h)
            self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
