"""One parser of sizes: the connector's parse_size reads strings through
libecx's ecx_size_parse, the parser of `ecx serve --capacity` too, so both
take the units docs/vllm.md promises (KB, MB, GB, TB: powers of 1000;
KiB ... TiB and K ... T: powers of 1024) and say the same of a bad one."""
import ctypes
import os
import subprocess
import sys

import pytest

try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "vllm_stub"))

from ecx import _cdefs  # noqa: E402
from ecx.vllm.config import Config, parse_size  # noqa: E402

GOOD = {"100MB": 10 ** 8, "1KB": 1000, "2GB": 2 * 10 ** 9, "3TB": 3 * 10 ** 12,
        "512MiB": 512 << 20, "64K": 64 << 10, "2TiB": 2 << 40,
        "1.5 GB": 1500 * 10 ** 6, "8gib": 8 << 30, "2e9": 2 * 10 ** 9,
        # exact where floats are not: 4.35 * 1000 is 4349.999... as a float,
        # which the connector's own parser truncated to 4349
        "4.35KB": 4350, "1.1MB": 1100000}
BAD = ["8 parsecs", "-1", "", "GiB", "1PiB", "1.5.5", "0x10", "nan",
       "9007199254740992", "8GiB\0junk"]


def c_parse(text):
    out = ctypes.c_uint64(7)
    why = ctypes.create_string_buffer(256)
    rc = _cdefs.ecx_size_parse(text.encode(), ctypes.byref(out), why,
                               len(why))
    return rc, out.value, why.value.decode()


@pytest.mark.parametrize("text,want", sorted(GOOD.items()))
def test_the_connector_and_the_library_read_the_same_size(text, want):
    assert c_parse(text) == (0, want, "")
    assert parse_size(text, "capacity_bytes") == want


@pytest.mark.parametrize("text", BAD)
def test_a_bad_size_names_the_key_and_the_units(text):
    with pytest.raises(ValueError) as e:
        parse_size(text, "capacity_bytes")
    msg = str(e.value)
    assert msg.startswith("capacity_bytes: ")
    if "\0" in text:
        assert "NUL" in msg
        return
    rc, _, why = c_parse(text)
    assert rc != 0 and msg == "capacity_bytes: " + why
    if "too large" not in msg:
        assert "KiB, MiB, GiB, TiB" in msg and "KB, MB, GB, TB" in msg


def test_numbers_stay_numbers():
    assert parse_size(7, "k") == 7 and parse_size(1e9, "k") == 10 ** 9
    for bad in (True, -5, float("nan"), float("inf"), [1], None):
        with pytest.raises(ValueError, match="^k: "):
            parse_size(bad, "k")


def test_config_reads_decimal_units():
    c = Config({"capacity_bytes": "100MB", "recv_capacity_bytes": "1.5GiB"})
    assert c.capacity_bytes == 10 ** 8
    assert c.recv_capacity_bytes == 3 << 29


@pytest.mark.skipif(not os.environ.get("ECX_BIN"), reason="needs ECX_BIN")
def test_the_command_reads_the_same_sizes():
    """ecx serve --capacity takes what the connector takes, and refuses
    what it refuses with the same reason."""
    rc = subprocess.run(
        [os.environ["ECX_BIN"], "serve", "--bind", "127.0.0.1", "--port",
         "0", "--capacity", "8 parsecs"], capture_output=True, text=True,
        timeout=60)
    assert rc.returncode == 2
    assert rc.stderr.strip() == (
        "ecx serve: --capacity: " + c_parse("8 parsecs")[2])
