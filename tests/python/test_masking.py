"""Registry passwords never reach what the binding and the connector say:
EcxError's message, the connector's config errors and its log lines carry
the URL with its password masked (libecx's ecx_url_mask), as the ecx
command prints it."""
import logging
import shutil
import socket
import subprocess
import threading
import time

import pytest

import ecx
from ecx.errors import mask_urls

PW = "s3kret-pw"


def test_mask_urls_hides_every_password():
    text = (f"a redis://:{PW}@h:1, redis+sentinel://u:{PW}@s:2,s:3/m and "
            "http://h:9018")
    got = mask_urls(text)
    assert PW not in got
    assert got == ("a redis://:***@h:1, redis+sentinel://u:***@s:2,s:3/m "
                   "and http://h:9018")


@pytest.mark.parametrize("url", [f"redis://:{PW}@::1:6379",
                                 f"ftp://:{PW}@h:1"])
def test_a_library_error_quoting_the_url_is_masked(url):
    with pytest.raises(ecx.EcxError) as e:
        ecx.Client(url, timeout_ms=300).lookup(["x"])
    assert PW not in str(e.value) and PW not in e.value.detail
    assert ":***@" in str(e.value)


def test_the_connector_s_config_error_is_masked():
    from ecx.vllm.config import Config
    with pytest.raises(ValueError) as e:
        Config({"remote_registry_url": f"rediss://:{PW}@h:1"})
    assert PW not in str(e.value) and ":***@" in str(e.value)


@pytest.fixture
def redis_with_password(tmp_path):
    """A real redis-server on a free port of 127.0.0.1, requirepass PW,
    stopped at the end."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("no redis-server (scripts/install-deps.sh installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1",
                          "--requirepass", PW, "--save", "",
                          "--appendonly", "no", "--dir", str(tmp_path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://:{PW}@127.0.0.1:{port}"
    p.terminate()
    p.wait(10)


def test_the_connector_s_producer_log_is_masked(caplog, redis_with_password):
    """The worker's "producer at ..., registry ..." line names its Redis
    registry, password masked."""
    from ecx.vllm.config import Config
    from ecx.vllm.worker import Worker
    w = Worker.__new__(Worker)  # the producer's part alone, no vLLM
    w._cfg = Config({"registry": redis_with_password,
                     "bind_host": "127.0.0.1", "capacity_bytes": "16MiB"})
    w._lock, w._producer = threading.Lock(), None
    caplog.set_level(logging.INFO, logger="ecx.vllm")
    try:
        w._ensure_producer()
    finally:
        if w._producer is not None:
            w._producer.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any("registry redis://:***@127.0.0.1:" in m for m in lines), lines
    assert all(PW not in m for m in lines), lines
