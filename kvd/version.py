"""Runs in every kvd process: the package version and the wire protocol version."""

from importlib.metadata import PackageNotFoundError, version

# The distribution's name: `kvd` on the public index is an unrelated project.
DISTRIBUTION = "kvd-daemon"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+src"
