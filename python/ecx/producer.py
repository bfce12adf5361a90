"""Producer: keeps tensors in a registered arena and serves them."""
import ctypes
import os

from . import _cdefs as C
from ._args import b, size, token as _token
from .dtypes import (copy_into, cuda_register, cuda_unregister, desc,
                     describe, is_cuda, torch_name)
from .errors import check_fork, closed, error


class Producer:
    """Keeps tensors in a registered arena and serves them (ecx_producer).

    registry_port: embedded registry port (default 9018; 0 picks one; None
    for none, with `registry` given). registry: a remote registry URL to
    publish to instead. token: None reads ECX_TOKEN. integrity: hash
    each item at put (XXH3) for consumers that check it. registry_ttl_s:
    the lease of this producer's registry entries (default 30). idle_ms:
    a consumer connection with no pull for this long is closed and its
    memory unmapped (default 15000; a live consumer reconnects by itself).
    mooncake: False refuses the reference's pull op (by default it is
    served by writing into the consumer's Mooncake session).

    The arena (capacity_bytes) is mapped and touched here, so construction
    takes as long as populating it (seconds for GiBs); puts never do.
    """

    def __init__(self, capacity_bytes=None, bind_host=None,
                 advertise_host=None, zmq_port=None, registry_port=9018,
                 registry=None, token=None, transport=None, timeout_ms=None,
                 integrity=False, lease_max_ms=None, lease_share_pct=None,
                 registry_ttl_s=None, idle_ms=None, mooncake=None):
        F = C.ProducerParam
        p = C.ecx_producer_params()
        m = F(0)
        if capacity_bytes is not None:
            p.capacity_bytes = size("capacity_bytes", capacity_bytes)
            m |= F.CAPACITY
        if bind_host is not None:
            p.bind_host, m = b(bind_host), m | F.BIND_HOST
        if advertise_host is not None:
            p.advertise_host, m = b(advertise_host), m | F.ADVERTISE_HOST
        if zmq_port is not None:
            p.zmq_port, m = int(zmq_port), m | F.ZMQ_PORT
        if registry:
            p.registry, m = b(registry), m | F.REGISTRY
        elif registry_port is not None:
            p.registry_port, m = int(registry_port), m | F.REGISTRY_PORT
        token = _token(token)
        if token:
            p.token, m = b(token), m | F.TOKEN
        if transport is not None:
            p.transport, m = b(transport), m | F.TRANSPORT
        if timeout_ms is not None:
            p.timeout_ms, m = int(timeout_ms), m | F.TIMEOUT
        if integrity:
            p.integrity, m = 1, m | F.INTEGRITY
        if lease_max_ms is not None:
            p.lease_max_ms, m = int(lease_max_ms), m | F.LEASE_MAX_MS
        if lease_share_pct is not None:
            p.lease_share_pct, m = int(lease_share_pct), m | F.LEASE_SHARE
        if registry_ttl_s is not None:
            p.registry_ttl_s, m = int(registry_ttl_s), m | F.REGISTRY_TTL
        if idle_ms is not None:
            p.idle_ms, m = int(idle_ms), m | F.IDLE
        if mooncake is not None:
            p.mooncake, m = int(bool(mooncake)), m | F.MOONCAKE
        p.field_mask = m
        self._keep = p
        self._h = None
        self._pid = os.getpid()
        self._cuda_pinned = None  # an ecx.cuda.Pin; False: refused
        h = C.P()
        why = ctypes.create_string_buffer(256)
        rc = C.ecx_producer_create(ctypes.byref(p), ctypes.byref(h), why, 256)
        if rc != 0:
            raise error(rc, why.value.decode())
        self._h = h

    def put(self, id, tensor):
        """Copies the tensor into the arena and publishes it under id.

        Returns True when the item was stored, False when id was already
        held with the same dtype and shape: ids are content hashes, so the
        bytes held are kept as they are and the tensor given is NOT copied
        (put("a", zeros(4)) then put("a", ones(4)) leaves the zeros). To
        replace an item, remove(id) first. The same id with another dtype or
        shape raises EcxError EINVAL.

        A tensor is copied once, straight into its place in the arena: a
        contiguous CPU tensor or array by libecx (one call; large items with
        stores that bypass the cache), any other torch tensor by copy_
        between reserve and commit; the first CUDA one page-locks the arena
        (cuMemHostRegister) so that copy is a DMA.
        """
        is_torch = type(tensor).__module__.startswith("torch")
        if is_torch and (tensor.device.type != "cpu" or
                         not tensor.is_contiguous()):
            if is_cuda(tensor):
                self.pin_for_cuda()
            dst = self.reserve(id, torch_name(tensor.dtype),
                               tuple(tensor.shape))
            if dst is None:
                return False
            try:
                copy_into(dst, tensor)
            except BaseException:
                self.cancel(id)
                raise
            self.commit(id)
            return True
        if is_torch:  # CPU and contiguous (checked above)
            d = desc(torch_name(tensor.dtype), tuple(tensor.shape))
            ptr, keep = tensor.data_ptr(), tensor
        else:
            name, shape, _, ptr, keep = describe(tensor)
            d = desc(name, shape)
        stored = ctypes.c_int()
        rc = C.ecx_producer_put_stored(self._handle(), b(id), ctypes.byref(d),
                                  ptr, ctypes.byref(stored))
        del keep
        if rc != 0:
            raise error(rc)
        return bool(stored.value)

    def reserve(self, id, dtype, shape):
        """Takes room for id and returns a torch tensor over it, in the
        arena, for the caller to fill (t.copy_(src), from any device);
        then commit(id) publishes it, or cancel(id) gives the room back.
        Until then id is invisible to consumers. Returns None when id is
        already held with this dtype and shape (nothing to fill)."""
        import torch
        d = desc(dtype, tuple(shape))
        dst = ctypes.c_void_p()
        rc = C.ecx_producer_reserve(self._handle(), b(id), ctypes.byref(d),
                               ctypes.byref(dst))
        if rc != 0:
            raise error(rc)
        if not dst.value:
            return None
        n = int(d.nbytes)
        if n == 0:
            return torch.empty(tuple(shape), dtype=getattr(torch, dtype))
        buf = (ctypes.c_char * n).from_address(dst.value)
        t = torch.frombuffer(buf, dtype=torch.uint8)
        return t.view(getattr(torch, dtype)).view(tuple(shape))

    def commit(self, id):
        """Publishes a reserved id (see reserve)."""
        rc = C.ecx_producer_commit(self._handle(), b(id))
        if rc != 0:
            raise error(rc)

    def cancel(self, id):
        """Gives a reserved id's room back (see reserve)."""
        rc = C.ecx_producer_cancel(self._handle(), b(id))
        if rc != 0:
            raise error(rc)

    def pin_for_cuda(self, required=False):
        """Page-locks the arena for CUDA (cuMemHostRegister, PORTABLE,
        through the driver API), once; put does it at its first CUDA
        tensor, which for GiBs takes seconds: call it up front. True when
        the arena is page-locked (by this call, or already, e.g. by UCX:
        then it is never unregistered here); False without CUDA, or when
        the driver refuses (logged with its code), or raises
        ecx.cuda.CudaError for that (OSError where libcuda does not
        load) when required."""
        if self._cuda_pinned:
            return True
        if self._cuda_pinned is False and not required:
            return False  # tried before (and logged)
        base, size = self.arena()
        pinned = cuda_register(base, size, "producer's arena", required)
        self._cuda_pinned = pinned if pinned is not None else False
        return pinned is not None

    def arena(self):
        """(address, size) of the arena."""
        cap = ctypes.c_uint64()
        base = C.ecx_producer_arena(self._handle(), ctypes.byref(cap))
        return base, cap.value

    def remove(self, id):
        """Unpublishes id and frees its space once no pull reads it;
        NotFound when it is not held."""
        rc = C.ecx_producer_remove(self._handle(), b(id))
        if rc != 0:
            raise error(rc)

    def push(self, id, dst_session, dst_ptr, nbytes, timeout_s=None):
        """Writes the held item id (all nbytes of it) into Mooncake session
        dst_session ("host:port") at address dst_ptr, over Mooncake's TCP
        wire, and returns once the receiver has acknowledged it; within
        timeout_s (None: the producer's timeout). Raises the ecx error
        (ENOTFOUND, ESIZE, ETIMEDOUT, ECONNECT, EINVAL for a destination
        outside the session's buffers or a write the receiver refused)
        with its detail."""
        ms = 0 if timeout_s is None else max(1, int(timeout_s * 1000))
        rc = C.ecx_producer_push(self._handle(), b(id), b(dst_session),
                                 int(dst_ptr), int(nbytes), ms)
        if rc != 0:
            raise error(rc)

    def push_batch(self, writes, timeout_s=None):
        """push for several writes at once, (id, dst_session, dst_ptr,
        nbytes) each, up to four in flight, all within timeout_s. Returns
        the statuses in order (0, or that write's error code); the detail
        of the first failed one is kept in self.last_push_error ("" when
        all succeeded)."""
        writes = list(writes)
        if not writes:
            return []
        arr = (C.ecx_push_item * len(writes))()
        keep = []
        for e, (id, session, ptr, n) in zip(arr, writes):
            keep += [b(id), b(session)]
            e.id, e.dst_session = keep[-2], keep[-1]
            e.dst_ptr, e.nbytes = int(ptr), int(n)
        ms = 0 if timeout_s is None else max(1, int(timeout_s * 1000))
        rc = C.ecx_producer_push_batch(self._handle(), arr, len(writes), ms)
        self.last_push_error = (C.ecx_last_error().decode() if rc != 0
                                else "")
        return [e.status for e in arr]

    def item_xxh3(self, id):
        """The XXH3 of the held item id (an int): the hash made at put
        with integrity on, else one made now from its bytes. NotFound when
        it is not held (or not committed yet)."""
        out = ctypes.c_uint64()
        rc = C.ecx_producer_item_xxh3(self._handle(), b(id),
                                      ctypes.byref(out))
        if rc != 0:
            raise error(rc)
        return out.value

    def lease(self, id, ms=0):
        """Takes a lease on the held item id for a pull another process
        will make, and returns its number (an int, 1 to 2**53-1): until that pull names it (an
        Item's lease, or a push-mode "ecx_lease"), lease_end(), its
        expiry after ms (0: the producer's lease_max_ms, which also cuts a
        longer ms) or the item's removal, eviction cannot take the item.
        Raises NotFound (not held), or EcxError ENOSPC (the lease share of
        the arena is taken) or EBUSY (65536 leases held): a lease is
        refused, never waited for."""
        out = ctypes.c_uint64()
        rc = C.ecx_producer_lease(self._handle(), b(id), int(ms),
                                  ctypes.byref(out))
        if rc != 0:
            raise error(rc)
        return out.value

    def lease_end(self, lease):
        """Ends lease now; True when it was still held."""
        rc = C.ecx_producer_lease_end(self._handle(), int(lease))
        if rc < 0:
            raise error(rc)
        return rc == 1

    def stats(self):
        s = C.ecx_producer_stats()
        C.ecx_producer_stats_get(self._handle(), ctypes.byref(s))
        return {n: getattr(s, n) for n in C.PRODUCER_STATS}

    @property
    def address(self):
        """The producer_zmq address it publishes."""
        return C.ecx_producer_address(self._handle()).decode()

    @property
    def registry_port(self):
        return C.ecx_producer_registry_port(self._handle())

    def _handle(self):
        if self._h is None:
            raise closed("producer")
        check_fork(self, "producer")
        return self._h

    def close(self):
        """Unpublishes everything and stops serving. In a forked child it
        only forgets the parent's producer (which is left as it is)."""
        if getattr(self, "_h", None) is not None:
            if self._pid != os.getpid():
                self._h = None
                return
            if self._cuda_pinned:
                cuda_unregister(self._cuda_pinned)
                self._cuda_pinned = None
            C.ecx_producer_destroy(self._h)
            self._h = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

