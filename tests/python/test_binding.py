"""The Python binding: round trips of every dtype, errors, statistics."""
import pickle
import time

import numpy as np
import pytest
import torch

import ecx

# Every dtype ecx carries that this torch has (float8 came in torch 2.1).
TORCH_DTYPES = [getattr(torch, n) for n in ecx.DTYPES if hasattr(torch, n)]


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape,
                         generator=g, dtype=torch.int64).to(dtype)


@pytest.fixture(scope="module")
def pair():
    p = ecx.Producer(capacity_bytes=64 << 20, bind_host="127.0.0.1",
                     registry_port=0)
    c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}")
    yield p, c
    c.close()
    p.close()


def test_every_torch_dtype_round_trips(pair):
    p, c = pair
    sent = {}
    for i, dt in enumerate(TORCH_DTYPES):
        name = str(dt).split(".")[-1]
        t = random_tensor(dt, (7, 33, 2), i)
        p.put(f"t-{name}", t)
        sent[f"t-{name}"] = t
    items = c.lookup(list(sent))
    assert all(it is not None for it in items)
    got = c.load(items)
    for it, g in zip(items, got):
        t = sent[it.id]
        assert g.dtype == t.dtype and g.shape == t.shape
        # byte-equal, NaNs and all
        assert torch.equal(g.view(torch.uint8), t.view(torch.uint8)), it.id


def test_numpy_arrays_round_trip(pair):
    p, c = pair
    rng = np.random.default_rng(3)
    arrays = {"n-f32": rng.standard_normal((5, 6)).astype(np.float32),
              "n-i16": rng.integers(-99, 99, (9,)).astype(np.int16),
              "n-u8": rng.integers(0, 255, (2, 2, 2), dtype=np.uint8),
              "n-bool": rng.integers(0, 2, (4,)).astype(bool),
              "n-f64-strided": rng.standard_normal((6, 6))[:, ::2]}
    for k, a in arrays.items():
        p.put(k, a)
    items = c.lookup(list(arrays))
    outs = [np.empty(it.shape, dtype=it.dtype) for it in items]
    assert c.load_into(zip(items, outs)) == [None] * len(outs)
    for it, o in zip(items, outs):
        assert np.array_equal(o, np.ascontiguousarray(arrays[it.id]))


def test_descs_are_remembered_per_dtype_and_shape():
    """put makes a tensor's descriptor once per dtype and shape (the
    library only reads it): the same shape given as a list or a tuple
    gets the same one, another shape its own, and the store stays
    bounded."""
    from ecx.dtypes import _DESCS, _DESCS_MAX, desc
    a = desc("bfloat16", (32, 1024))
    assert desc("bfloat16", [32, 1024]) is a and a.nbytes == 65536
    b = desc("bfloat16", (32, 1025))
    assert b is not a and b.nbytes == 65600 and a.nbytes == 65536
    for n in range(_DESCS_MAX + 10):
        assert desc("uint8", (n,)).nbytes == n
    assert len(_DESCS) <= _DESCS_MAX
    with pytest.raises(ValueError, match="unknown dtype"):
        desc("complex64", (1,))


def test_scalar_and_empty(pair):
    p, c = pair
    p.put("scalar", torch.tensor(3.5))
    p.put("empty", torch.zeros((0, 4)))
    a, b = c.lookup(["scalar", "empty"])
    assert a.shape == () and b.shape == (0, 4)
    x, y = c.load([a, b])
    assert x.item() == 3.5 and y.shape == (0, 4)


def test_errors_carry_the_c_name_and_detail(pair):
    p, c = pair
    with pytest.raises(ecx.EcxError) as e:
        p.put("bad/id", torch.zeros(2))
    assert e.value.name == "EID" and "'/'" in e.value.detail
    with pytest.raises(ecx.EcxError) as e:
        p.put("huge", torch.zeros(65 << 20, dtype=torch.uint8))
    assert e.value.name == "ETOOBIG"
    with pytest.raises(ecx.NotFound):
        p.remove("never-put")
    assert c.lookup(["nope"]) == [None]
    with pytest.raises(ValueError):
        p.put("x", np.zeros(3, dtype=np.complex64))
    # An item that vanished between lookup and load fails alone.
    p.put("gone-soon", torch.ones(4))
    p.put("stays", torch.ones(4))
    items = c.lookup(["gone-soon", "stays"])
    p.remove("gone-soon")
    errs = c.load_into([(it, it.empty()) for it in items])
    assert isinstance(errs[0], ecx.NotFound) and errs[1] is None
    assert "gone-soon" in str(errs[0])


def test_items_pickle(pair):
    p, c = pair
    p.put("pk", torch.arange(6))
    it = pickle.loads(pickle.dumps(c.lookup(["pk"])[0]))
    assert torch.equal(c.load([it])[0], torch.arange(6))


def test_consumer_without_a_registry_cannot_look_up():
    # A push-only consumer (no registry): created, but its lookups and
    # loads by id fail, naming why.
    for reg in ("", None):
        c = ecx.Consumer(reg)
        try:
            with pytest.raises(ecx.EcxError) as e:
                c.lookup(["x"])
            assert e.value.name == "EINVAL" and "no registry" in str(e.value)
        finally:
            c.close()
    with pytest.raises(ecx.EcxError) as e:
        ecx.Consumer("ftp://nowhere")
    assert e.value.name == "EINVAL"


def test_stats_count_what_happened():
    """A fresh pair: two items served and one that went away after its
    lookup, counted exactly on both sides; the consumer's goodbye closes
    its connection."""
    p = ecx.Producer(capacity_bytes=8 << 20, bind_host="127.0.0.1",
                     registry_port=0)
    c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}")
    try:
        for i in range(3):
            p.put(f"st{i}", torch.full((1000,), i, dtype=torch.int32))
        items = c.lookup(["st0", "st1", "st2"])
        p.remove("st2")
        outs = [torch.zeros(1000, dtype=torch.int32) for _ in items]
        errs = c.load_into(zip(items, outs))
        assert errs[0] is None and errs[1] is None
        assert isinstance(errs[2], ecx.NotFound)
        assert torch.equal(outs[1], torch.full((1000,), 1, dtype=torch.int32))
        s = p.stats()
        assert s["registrations"] == 1 and s["pinned"] == 0
        assert (s["pulls"], s["items_served"], s["items_failed"]) == (1, 2, 1)
        assert s["bytes_served"] == 2 * 4000
        assert (s["items"], s["connections"]) == (2, 1)
        cs = c.stats()
        assert (cs["lookups"], cs["loads"], cs["loaded"], cs["failed"]) \
            == (3, 3, 2, 1)
        assert cs["bytes"] == 2 * 4000 and cs["connections"] == 1
    finally:
        c.close()
    assert p.stats()["connections"] == 0  # the goodbye closed it
    p.close()


def test_idle_connections_are_closed_and_come_back():
    """idle_ms reaches the producer: a consumer that stays quiet loses its
    connection within the bound, and its next load connects again."""
    p = ecx.Producer(capacity_bytes=8 << 20, bind_host="127.0.0.1",
                     registry_port=0, idle_ms=1000)
    c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}")
    try:
        p.put("idle", torch.arange(256, dtype=torch.int32))
        out = torch.zeros(256, dtype=torch.int32)
        assert c.load_into([(c.lookup(["idle"])[0], out)]) == [None]
        assert p.stats()["connections"] == 1
        t0 = time.monotonic()
        while p.stats()["connections"] and time.monotonic() - t0 < 4:
            time.sleep(0.02)
        quiet = time.monotonic() - t0
        assert p.stats()["connections"] == 0
        assert quiet < 1.0 + 1.0, f"closed after {quiet:.2f} s"
        out.zero_()
        assert c.load_into([(c.lookup(["idle"])[0], out)]) == [None]
        assert torch.equal(out, torch.arange(256, dtype=torch.int32))
        assert p.stats()["connections"] == 1
    finally:
        c.close()
        p.close()


def test_arena_tensors_and_their_lifetime(pair):
    p, _ = pair
    p.put("ar1", torch.arange(1000, dtype=torch.int32))
    p.put("ar2", torch.ones(300 << 10, dtype=torch.uint8))  # 300 KiB
    c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}",
                     recv_capacity=256 << 10)
    a, b = c.lookup(["ar1", "ar2"])
    x, y = c.load([a, b])  # x in the arena; y does not fit: a fresh tensor
    assert torch.equal(x, torch.arange(1000, dtype=torch.int32))
    assert torch.equal(y, torch.ones(300 << 10, dtype=torch.uint8))
    assert c.arena_tensor(b) is None
    first = x.data_ptr()
    x1 = c.load([a])[0]  # while x lives, its space is not handed out
    assert x1.data_ptr() != first
    assert torch.equal(x1, torch.arange(1000, dtype=torch.int32))
    del x1
    del x  # its arena space comes back
    x2 = c.load([a])[0]
    assert x2.data_ptr() == first
    # Closing the consumer keeps the arena while a tensor uses it.
    c.close()
    assert torch.equal(x2, torch.arange(1000, dtype=torch.int32))
    del x2
    assert c._h is None


def test_token_comes_from_ECX_TOKEN(monkeypatch):
    monkeypatch.setenv("ECX_TOKEN", "s3cret")
    p = ecx.Producer(capacity_bytes=1 << 20, bind_host="127.0.0.1",
                     registry_port=0)  # token from the environment
    url = f"http://127.0.0.1:{p.registry_port}"
    assert p.put("tok", torch.arange(5))
    with ecx.Consumer(url) as c:  # the same token, from the environment
        assert torch.equal(c.load(c.lookup(["tok"]))[0], torch.arange(5))
    with ecx.Consumer(url, token="") as c:  # "" means none: refused
        it = c.lookup(["tok"])[0]
        err = c.load_into([(it, it.empty())])[0]
        assert isinstance(err, ecx.EcxError) and err.name == "EAUTH"
    monkeypatch.delenv("ECX_TOKEN")
    with ecx.Consumer(url) as c:
        it = c.lookup(["tok"])[0]
        assert c.load_into([(it, it.empty())])[0].name == "EAUTH"
    p.close()


def test_loading_what_lookup_did_not_find_names_it(pair):
    p, c = pair
    p.put("here", torch.ones(2))
    found = c.lookup(["here", "missing-one"])
    assert found.missing() == ["missing-one"]
    with pytest.raises(ecx.NotFound, match="missing-one"):
        c.load(found)
    with pytest.raises(ecx.NotFound, match="missing-one"):
        c.load_start(found)
    with pytest.raises(ecx.NotFound, match="position 0"):
        c.load([None])


def test_put_of_an_id_already_held_keeps_the_first_bytes(pair):
    p, c = pair
    assert p.put("same-id", torch.zeros(4)) is True
    assert p.put("same-id", torch.ones(4)) is False  # kept as it was
    assert torch.equal(c.load(c.lookup(["same-id"]))[0], torch.zeros(4))
    p.remove("same-id")
    assert p.put("same-id", torch.ones(4)) is True  # replaced
    assert torch.equal(c.load(c.lookup(["same-id"]))[0], torch.ones(4))
    with pytest.raises(ecx.EcxError) as e:  # another shape: refused
        p.put("same-id", torch.ones(5))
    assert e.value.name == "EINVAL"


def test_load_start_runs_in_the_background(pair):
    p, _ = pair
    sent = {f"bg-{i}": random_tensor(torch.float16, (64, 512), 40 + i)
            for i in range(6)}
    for k, t in sent.items():
        p.put(k, t)
    c = ecx.Consumer(f"http://127.0.0.1:{p.registry_port}",
                     recv_capacity=1 << 20)
    found = c.lookup(list(sent) + ["bg-gone"])
    p.put("bg-gone", torch.ones(3))
    found[-1] = c.lookup(["bg-gone"])[0]
    p.remove("bg-gone")  # vanishes between lookup and load
    load = c.load_start(found)
    assert isinstance(load, ecx.Load)
    deadline = time.monotonic() + 5
    while not load.test():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert load.done and not load.ok
    errs = load.wait()  # returns at once now, the same answer
    assert errs[:6] == [None] * 6 and isinstance(errs[6], ecx.NotFound)
    for it, t in zip(load.items[:6], load.tensors[:6]):
        assert torch.equal(t.view(torch.uint8), sent[it.id].view(torch.uint8))
    # Pairs: into tensors of the caller's.
    outs = [it.empty() for it in found[:6]]
    load2 = c.load_start(list(zip(found[:6], outs)))
    assert load2.wait() == [None] * 6 and load2.ok
    assert all(torch.equal(o, sent[it.id]) for it, o in zip(found, outs))
    # close waits for a load still in flight
    load3 = c.load_start(found[:2])
    c.close()
    assert load3.done and load3.ok


def test_integrity_checks_against_the_producers_hash(pair):
    plain, _ = pair
    sent = random_tensor(torch.bfloat16, (256, 3584), 77)
    with ecx.Producer(capacity_bytes=16 << 20, bind_host="127.0.0.1",
                      registry_port=0, integrity=True) as p:
        p.put("int-a", sent)
        url = f"http://127.0.0.1:{p.registry_port}"
        with ecx.Consumer(url, integrity=True) as c:
            (got,) = c.load(c.lookup(["int-a"]))
            assert torch.equal(got, sent)
    # A checking consumer refuses bytes that come with no hash.
    plain.put("int-plain", torch.ones(16))
    with ecx.Consumer(f"http://127.0.0.1:{plain.registry_port}",
                      integrity=True) as c:
        items = c.lookup(["int-plain"])
        errs = c.load_into([(it, it.empty()) for it in items])
        assert isinstance(errs[0], ecx.EcxError)
        assert errs[0].name == "EUNSUPPORTED"


def test_reserve_fill_commit(pair):
    p, c = pair
    want = random_tensor(torch.float16, (64, 128), 91)
    dst = p.reserve("rsv-a", "float16", (64, 128))
    assert dst is not None and dst.dtype == torch.float16
    base, size = p.arena()
    assert base <= dst.data_ptr() < base + size  # in the arena itself
    assert c.lookup(["rsv-a"]) == [None]  # invisible until committed
    dst.copy_(want)
    p.commit("rsv-a")
    (got,) = c.load(c.lookup(["rsv-a"]))
    assert torch.equal(got, want)
    # Held already: nothing to fill, and put says it kept the first.
    assert p.reserve("rsv-a", "float16", (64, 128)) is None
    assert p.put("rsv-a", torch.zeros(64, 128, dtype=torch.float16)) is False
    # A cancelled reservation leaves nothing behind.
    assert p.reserve("rsv-b", "int32", (10,)) is not None
    p.cancel("rsv-b")
    with pytest.raises(ecx.NotFound):
        p.commit("rsv-b")
    assert c.lookup(["rsv-b"]) == [None]
    # put of a non-contiguous tensor goes through the same copy.
    t = random_tensor(torch.float32, (32, 16), 92).t()
    assert p.put("rsv-t", t) is True
    (got,) = c.load(c.lookup(["rsv-t"]))
    assert torch.equal(got, t)
