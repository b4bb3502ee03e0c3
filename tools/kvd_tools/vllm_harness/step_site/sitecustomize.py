"""Runs in every Python process of a bench engine started with step times: `step_times.install`.

On `PYTHONPATH` only where `kvd bench peers --step-times` puts it; it does
nothing unless `KVD_STEP_TIMES` is set.
"""

import os
import sys

if os.environ.get("KVD_STEP_TIMES"):
    try:
        from kvd_tools.vllm_harness import step_times

        step_times.install()
    except Exception as exc:  # the engine runs, untimed, and the bench says why
        print(f"kvd step times: not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
