"""Item (what a lookup found) and Found (a lookup's answer), and the C item
arrays that lookups, releases and loads pass to libecx."""
import ctypes

from . import _cdefs as C
from . import _lib
from ._args import b
from .dtypes import NAMES, desc
from .errors import ENOTFOUND, EUNSUPPORTED, EcxError, NotFound, error


class Item:
    """What a lookup found: enough to load it anywhere (it pickles).

    lease: the lease a lookup with lease_ms took on it (0: none). A load of
    the item, in this process or another, names it and so ends it; so does
    release(), or its expiry."""
    __slots__ = ("id", "dtype", "shape", "nbytes", "producer", "epoch",
                 "lease")

    def __init__(self, id, dtype, shape, nbytes, producer, epoch=0,
                 lease=0):
        self.id, self.dtype, self.shape = id, dtype, tuple(shape)
        self.nbytes, self.producer, self.epoch = nbytes, producer, epoch
        self.lease = lease

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, s):
        self.lease = 0  # pickled before leases
        for k, v in s.items():
            setattr(self, k, v)

    def __repr__(self):
        return (f"Item({self.id!r}, {self.dtype}, {self.shape}, "
                f"{self.nbytes} bytes, {self.producer})")

    def empty(self, device="cpu"):
        """A torch tensor this item can load into."""
        import torch
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype),
                           device=device)

    def to_json(self):
        """The registry entry of this item, as the registry stores it
        ({"nbytes", "shape", "dtype", "producer_zmq", "ecx_epoch"})."""
        need_client()
        a = C.ecx_item()
        fill(a, self, b(self.id))
        ptr = C.ecx_item_to_json(ctypes.byref(a))
        if not ptr:
            raise ValueError(f"{self.id}: no registry entry for this item "
                             f"(bad descriptor?)")
        try:
            return ctypes.string_at(ptr).decode()
        finally:
            C.ecx_free(ptr)

    @classmethod
    def from_json(cls, id, text):
        """The Item a registry entry (JSON text or bytes) describes."""
        need_client()
        data = b(text)
        a = C.ecx_item()
        why = ctypes.create_string_buffer(256)
        rc = C.ecx_item_from_json(data, len(data), ctypes.byref(a), why, 256)
        if rc != 0:
            raise error(rc, why.value.decode())
        return item_of(id, a)


class Found(list):
    """What lookup returns: a list with an Item, or None, for each id asked,
    in order; .ids are those ids (so a load of a None can name it)."""

    def __init__(self, ids, items):
        super().__init__(items)
        self.ids = list(ids)

    def missing(self):
        """The ids that were not found."""
        return [i for i, it in zip(self.ids, self) if it is None]


def item_of(id, a):
    """The Item of the C item a."""
    d = a.desc
    return Item(id, NAMES[d.dtype],
                tuple(d.shape[k] for k in range(d.ndim)), d.nbytes,
                a.producer.decode(), a.epoch, a.lease)


def fill(a, item, idb):
    """Fills the C item a from an Item (id bytes kept alive by the
    caller)."""
    a.id = idb
    a.desc = desc(item.dtype, item.shape)
    a.producer = b(item.producer)
    a.epoch = item.epoch
    a.lease = getattr(item, "lease", 0)


def lookup_array(ids):
    """A C item array for ids, and the id bytes it points at."""
    arr = (C.ecx_item * len(ids))()
    keep = [b(i) for i in ids]
    for a, i in zip(arr, keep):
        a.id = i
    return arr, keep


def found(ids, arr):
    return Found(ids, [item_of(i, a) if a.status == 0 else None
                       for i, a in zip(ids, arr)])


def release_array(items):
    """The C item array of the Items (None skipped) that hold a lease, and
    those Items, and the id bytes the array points at."""
    held = [it for it in items if it is not None and it.lease]
    arr = (C.ecx_item * len(held))()
    keep = []
    for a, it in zip(arr, held):
        idb = b(it.id)
        keep.append(idb)
        a.id = idb
        a.producer = b(it.producer)
        a.lease = it.lease
    return arr, held, keep


def check_items(items, ids=None):
    """Raises NotFound for a None among items (what lookup gives for an id
    it did not find), naming the id when lookup's answer says it."""
    ids = ids if ids is not None else getattr(items, "ids", None)
    for k, it in enumerate(items):
        if it is None:
            name = repr(ids[k]) if ids is not None and k < len(ids) \
                else f"at position {k}"
            raise NotFound(ENOTFOUND, f"item {name} was not found by lookup "
                           f"(None in place of an Item): nothing to load")


def need_client():
    if not C.HAS_CLIENT:
        raise EcxError(EUNSUPPORTED, f"the libecx at {_lib.LIBRARY_PATH} has "
                       f"no registry client (ecx_client_*): build a newer "
                       f"libecx")
