"""Runs in the daemon and the CLI: one log line per event, key=value fields, to stderr.

Every line goes through `kvd.config.redact`: no userinfo (`user:password@`)
of any value reaches the log.
"""

from __future__ import annotations

import logging
import sys
import time

from kvd.config import redact


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        msg = record.getMessage()
        if "event=" not in msg:
            msg = f"msg={msg!r}"
        line = (
            f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
            f"logger={record.name} {msg}"
        )
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return redact(line)  # no credential a value carried reaches the log


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
