"""Runs in SGLang's scheduler processes: where the backend's failures end, in few log lines.

No exception leaves `KvdHiCacheStorage` into SGLang's cache controller
threads: one kills the thread (sglang #38428), and with it every later
prefetch or backup. Each entry point turns what kvd raises into a miss or a
skipped store and says so here, in one line per kind of failure at most
every `LOG_EVERY_S` (a daemon that is down would otherwise log every call);
the next line of that kind counts the ones it kept quiet. The vLLM plug-in
keeps the same rule (`kvd_client.vllm.boundary`, not imported here: that
package imports vLLM).
"""

from __future__ import annotations

import logging
import threading
import time

LOG_EVERY_S = 30.0


class FailureLog:
    def __init__(self, log: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self._log = log
        self._every_s = every_s
        self._lock = threading.Lock()  # the prefetch and backup threads both note
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self.count = 0  # failures noted, logged or not

    def note(self, what: str, why: BaseException | str, outcome: str) -> None:
        """`what` failed because of `why`, and `outcome` is what became of it."""
        now = time.monotonic()
        with self._lock:
            self.count += 1
            last = self._last.get(what)
            if last is not None and now - last < self._every_s:
                self._quiet[what] = self._quiet.get(what, 0) + 1
                return
            self._last[what] = now
            quiet = self._quiet.pop(what, 0)
        more = f" ({quiet} more like it since the last line)" if quiet else ""
        self._log.warning("kvd %s failed, %s: %s%s", what, outcome, why, more)
