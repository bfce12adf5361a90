"""Entries in the reference's shape, as the binding, the command and a
consumer see them: their items' epoch is ecx.EPOCH_REFERENCE, a leased
lookup finds them unleased, `ecx info` says where they come from, and the
mooncake setting is checked. (Loads from a reference producer are
tests/unit/test_mooncake_ref.c and tests/interop/.)"""
import json
import subprocess
import urllib.request

import pytest

import ecx
from conftest import ecx_bin


def ref_item(i):
    # No ecx epoch: published in the reference's shape.
    return ecx.Item(f"ref-{i}", "float16", (4, 8), 64, "tcp://127.0.0.1:1",
                    epoch=ecx.EPOCH_REFERENCE)


def test_reference_entry(registry):
    r = registry()
    with ecx.Client(r.url) as c:
        c.publish(ref_item(0))
        body = json.load(urllib.request.urlopen(r.url + "/ec/info/ref-0"))
        assert "ecx_epoch" not in body
        assert body["producer_zmq"] == "tcp://127.0.0.1:1"
        found = c.lookup(["ref-0"])
        assert found[0].epoch == ecx.EPOCH_REFERENCE
        assert "ecx_epoch" not in found[0].to_json()
    # A leased lookup asks its producer for no lease (it has none): found,
    # unleased, with no wait on the address that answers nothing.
    cons = ecx.Consumer(r.url, timeout_ms=2000)
    try:
        got = cons.lookup(["ref-0"], lease_ms=5000)
        assert got[0] is not None and got[0].lease == 0
    finally:
        cons.close()
    out = subprocess.run([ecx_bin(), "info", r.url, "ref-0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "a reference producer" in out.stdout


def test_mooncake_setting(registry):
    r = registry()
    with pytest.raises(ecx.EcxError) as e:
        ecx.Consumer(r.url, mooncake="sometimes")
    assert "mooncake=sometimes" in str(e.value)
    with ecx.Client(r.url) as c:
        c.publish(ref_item(1))
    cons = ecx.Consumer(r.url, timeout_ms=2000, recv_capacity=1 << 20,
                        mooncake="off")
    try:
        found = cons.lookup(["ref-1"])
        with pytest.raises(ecx.EcxError) as e:
            cons.load([found[0]])
        assert "reference's protocol" in str(e.value)
        assert "off" in str(e.value)
    finally:
        cons.close()
