"""Runs `kvd` as `python -m kvd`."""

from kvd.cli import main

raise SystemExit(main())
