"""Runs at install time: builds kvd_client's optional native parts.

The CPU backend's block copier (`kvd_client/_blockcopy.c`; streaming stores,
see its header) and the ready table's probe loop (`kvd_client/_readytable.c`,
with zlib's CRC-32). Both optional: without a C compiler (or zlib's headers)
the package still installs; the CPU backend then copies with torch alone
(`kvd_client.backends.native`) and lookups read the table in Python
(`kvd_client.ready_table`). Everything else about the package is in
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
    ]
)
