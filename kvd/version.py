"""Runs in every kvd process: the package version and the wire protocol version."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+src"
