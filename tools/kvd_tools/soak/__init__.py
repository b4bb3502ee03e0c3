"""Runs in the operator's shell and in tests: a soak of the daemon under faults (SPEC section 10).

`run_soak(SoakConfig(seconds=...))` starts a daemon, four scheduler actors,
one TP=2 engine that verifies every loaded block, the engine's twin on a
second pool (verifying its own) and a short-timeout scheduler of the
engine; it kills and restarts them (and the daemon once), stalls the
daemon, makes a rank reconnect during a store and the twin's workers leave,
and returns a `SoakResult`: operations, faults by kind, violations (must be
0), the daemon's RSS after warm-up and at the end, and the failure paths
the daemon's log shows reached. `kvd bench soak --seconds N` prints it as
one row.
"""

from kvd_tools.soak.harness import SoakConfig, SoakResult, run_soak

__all__ = ["SoakConfig", "SoakResult", "run_soak"]
