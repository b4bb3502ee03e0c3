"""Runs in every kvd process: the package version.

The one place the daemon's version is written: `pyproject.toml` reads it from
here (`[tool.setuptools.dynamic]`), so the installed distribution's metadata
says the same (a test checks it) and no process start pays for
`importlib.metadata`.
"""

# The distribution's name: `kvd` on the public index is an unrelated project.
DISTRIBUTION = "kvd-daemon"

__version__ = "0.1.0"
