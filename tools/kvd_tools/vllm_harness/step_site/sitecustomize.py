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
    except Exception as exc:  # the engine runs, untimed; the bench's report says why
        line = f"not installed: {type(exc).__name__}: {exc}"
        print(f"kvd step times: {line}", file=sys.stderr)
        try:  # the file `step_times.note_error` writes, if that module did not import
            path = os.path.join(os.environ["KVD_STEP_TIMES"], f"steps-{os.getpid()}.error")
            with open(path, "a") as f:
                f.write(f"{os.environ.get('KVD_STEP_TIMES_TAG', '?')}: {line}\n")
        except OSError as err:
            print(f"kvd step times: cannot note it: {err}", file=sys.stderr)
