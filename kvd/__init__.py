"""kvd: a host-side KV-cache daemon for LLM inference engines.

Runs in the daemon and its command-line tools. The pure core (`kvd.core.index`,
`kvd.core.jobs`) imports no I/O; the server, region, publisher, metrics, config and
CLI are the shell around it. Engines link `kvd_client`, not this package.
"""

from kvd.version import __version__

__all__ = ["__version__"]
