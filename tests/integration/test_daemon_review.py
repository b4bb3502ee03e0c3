"""Runs in the test process: issue 24's daemon-side findings, one regression test each.

Against a real daemon (and a real `kvd serve` for the command line). Each
test failed on the main before its fix; the commit that fixed it says how.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from kvd_tools.launcher import DaemonProcess

# -- 8: no credential in what kvd prints or logs ------------------------------------

SECRET = "s3cretPW"


def test_a_credential_in_the_remote_url_is_never_printed_or_logged(tmp_path: Path) -> None:
    for url in (
        f"default:{SECRET}@redis.internal:6379",  # no scheme: redact_url kept it all
        f"redis://default:{SECRET}@redis.internal:6379/x",
        f"redis://default:{SECRET}@redis.internal:99999",
        f"redis+cluster://default:{SECRET}@a:1,b:x",
        f":{SECRET}@redis.internal",
    ):
        out = subprocess.run(
            [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(tmp_path),
             "--remote-url", url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 2, (url, out.stderr)
        assert "remote_url" in out.stderr
        assert SECRET not in out.stdout + out.stderr, out.stderr
        assert "***@" in out.stderr, out.stderr
    # A URL that parses: the daemon runs (the server is not there) and logs.
    d = DaemonProcess(remote_url=f"redis://default:{SECRET}@127.0.0.1:1", remote_timeout_ms="100")
    d.start()
    try:
        time.sleep(1.0)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(timeout=20)
        log = d.log_path.read_text(errors="replace")
        assert "event=remote_tier" in log and SECRET not in log
    finally:
        d.stop()
