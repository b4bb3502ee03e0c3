"""Runs at install time: builds kvd_client's optional native parts.

The CPU backend's block copier (`kvd_client/_blockcopy.c`; streaming stores,
see its header), the ready table's probe loop (`kvd_client/_readytable.c`,
with zlib's CRC-32) and a warm restart's slot-table scan and ready-table
fill (`kvd_client/_warmstart.c`), and the remote tier's checksum, CRC-32C
(`kvd_client/_crc32c.c`). All optional: without a C compiler (or
zlib's headers) the package still installs; the CPU backend then copies with
torch alone (`kvd_client.backends.native`), lookups read the table in Python
(`kvd_client.ready_table`) and the daemon adopts a warm pool in Python
(`kvd.io.region`, `kvd.io.ready_table`) and checksums remote values in
Python, slowly (`kvd.io.remote_value`). Everything else about the package is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvd_client._blockcopy",
            sources=["kvd_client/_blockcopy.c"],
            optional=True,
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "kvd_client._readytable",
            sources=["kvd_client/_readytable.c"],
            optional=True,
            libraries=["z"],
            extra_compile_args=["-O3"],
        ),
        Extension(
            "kvd_client._crc32c",
            sources=["kvd_client/_crc32c.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension(
            "kvd_client._warmstart",
            sources=["kvd_client/_warmstart.c", "kvd_client/_warmscan.c"],
            depends=["kvd_client/_warmstart.h"],
            optional=True,
            libraries=["z"],
            extra_compile_args=["-O3"],
        ),
    ]
)
