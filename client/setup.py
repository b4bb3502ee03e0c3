"""Runs at install time: builds kvd_client's optional native block copier.

The CPU backend's block copier (`kvd_client/_blockcopy.c`; streaming stores,
see its header). Optional: without a C compiler the package still installs,
and the CPU backend copies with torch alone (`kvd_client.backends.native`).
Everything else about the package is in pyproject.toml.
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
        )
    ]
)
