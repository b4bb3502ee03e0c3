"""Runs in the operator's shell and in tests: a soak of the daemon under faults (SPEC section 10).

`run_soak(SoakConfig(seconds=...))` starts a daemon, four scheduler actors
and one TP=2 engine that verifies every loaded block, kills and restarts
them (and the daemon once) at random, and returns a `SoakResult`: operations,
faults, violations (must be 0) and the daemon's RSS after warm-up and at the
end. `kvd bench soak --seconds N` prints it as one row.
"""

from kvd_tools.soak.harness import SoakConfig, SoakResult, run_soak

__all__ = ["SoakConfig", "SoakResult", "run_soak"]
