"""Runs in the operator's shell: `python -m kvd_tools.demo` (the same as `kvd demo`)."""

import sys

from kvd_tools.demo.runner import cli

if __name__ == "__main__":  # spawned TP workers must not run the demo again
    sys.exit(cli())
