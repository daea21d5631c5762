"""Store credentials: a password in a storage URL is never printed (report, output, error messages carry
the redacted URL), and a wrong or missing one is a one-line error at start-up. Real redis-server with
``requirepass`` on 127.0.0.1."""

import subprocess
import sys

import pytest

from kvtier.app.devservers import RedisServer
from kvtier.errors import StorageError
from kvtier.l3 import open_backend
from kvtier.l3.base import redact_url


@pytest.fixture
def redis_with_password(tmp_path):
    server = RedisServer(tmp_path / "redis-auth", extra=("--requirepass", "s3cret-pw")).start()
    yield server
    server.stop()


SMALL_RUN = ["run", "--no-progress", "--workload-sessions", "2", "--workload-turns", "2", "--workload-system-tokens", "64",
             "--workload-user-tokens", "20", "--workload-reply-tokens", "10", "--tiers-device-pages", "16", "--tiers-host-pages", "20"]


@pytest.mark.integration
def test_password_is_never_in_the_report_or_output(redis_with_password, tmp_path):
    url = f"redis://:s3cret-pw@127.0.0.1:{redis_with_password.port}/0?timeout=2"
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", *SMALL_RUN, "--storage-url", url, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "s3cret-pw" not in text + r.stdout + r.stderr
    assert f"redis://:***@127.0.0.1:{redis_with_password.port}/0" in text  # the URL is still reported, redacted
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0" and redact_url("file:///x") == "file:///x"
    with pytest.raises(StorageError) as err:  # error messages carry the redacted form too
        open_backend("file://:s3cret-pw@somehost/x")
    assert "s3cret-pw" not in str(err.value) and ":***@" in str(err.value)


@pytest.mark.integration
def test_wrong_password_is_a_clear_error_at_start_up(redis_with_password):
    for url, expect in ((f"redis://:wrong-pw@127.0.0.1:{redis_with_password.port}/0", "refused the credentials"),
                        (f"redis://127.0.0.1:{redis_with_password.port}/0", "needs a password")):
        with pytest.raises(StorageError, match=expect):
            open_backend(url)
        r = subprocess.run(
            [sys.executable, "-m", "kvtier.app.cli", *SMALL_RUN, "--storage-url", url], capture_output=True, text=True, timeout=120
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and expect in lines[0] and "wrong-pw" not in r.stderr, r.stderr
