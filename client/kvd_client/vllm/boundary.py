"""Runs in vLLM's processes: where the plug-in's failures end, one log line a kind at most.

No exception from kvd reaches vLLM (SPEC section 12): each entry point of the
manager and of the worker that calls kvd catches what kvd raises and makes
it a miss, a skipped or failed store, or a load handed back to recompute.
`FailureLog` says so in one line per kind of failure at most every
`LOG_EVERY_S` (a daemon that is down would otherwise log every lookup), and
the next line of that kind counts the ones it kept quiet.
"""

from __future__ import annotations

import logging
import time

LOG_EVERY_S = 30.0


class FailureLog:
    def __init__(self, log: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self._log = log
        self._every_s = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def note(self, what: str, why: BaseException | str, outcome: str) -> None:
        """`what` (a verb, a kind of copy) failed because of `why`, and `outcome`
        is what became of it ("store skipped", "recomputed")."""
        now = time.monotonic()
        last = self._last.get(what)
        if last is not None and now - last < self._every_s:
            self._quiet[what] = self._quiet.get(what, 0) + 1
            return
        self._last[what] = now
        quiet = self._quiet.pop(what, 0)
        more = f" ({quiet} more like it since the last line)" if quiet else ""
        self._log.warning("kvd %s failed, %s: %s%s", what, outcome, why, more)
