"""The pure core imports no I/O (STYLE rule 1, SPEC sections 2 and 4).

The pure core is a folder, `kvd/core/` (index, policies, ownership, the job
state machine): every module found in it is checked, so a new one is checked
without being listed. The client's copy planner (`kvd_client.copy_plan`, which
a TP worker runs) is pure too and is checked with it.

Two checks. A static one parses every module of the pure core with `ast` and
follows its imports through the `kvd` and `kvd_client` packages (parent
packages included, since importing `a.b` runs `a/__init__.py`), so an import
inside a function or a rarely taken branch is caught too. A dynamic one imports
the pure core in a fresh interpreter with a spy on `__import__` that records
every forbidden import made by a `kvd` or `kvd_client` module meanwhile.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvd": ROOT / "kvd", "kvd_client": ROOT / "client" / "kvd_client"}
CORE = ROOT / "kvd" / "core"
# STYLE rule 1: the daemon's core folder, and the worker's copy planner.
PURE = ["kvd.core", "kvd_client.copy_plan"]
# What the core may take from the client package: types that know no wire.
WIRE_FREE = frozenset({"kvd_client", "kvd_client.errors", "kvd_client.types"})
# No sockets, files, clocks, threads, processes, event loops or GPU.
FORBIDDEN = frozenset(
    {
        "zmq",
        "asyncio",
        "torch",
        "mmap",
        "os",
        "socket",
        "threading",
        "selectors",
        "subprocess",
        "posix_ipc",
        "uvloop",
        "multiprocessing",
        "time",
    }
)
# Not even the standard library may pull these in when the pure core is imported.
NEVER_LOADED = frozenset(
    {"zmq", "torch", "asyncio", "mmap", "posix_ipc", "uvloop", "subprocess", "multiprocessing"}
)


def module_file(name: str, packages: Mapping[str, Path] = PACKAGES) -> Path | None:
    """The source file of module `name` when it lives in one of `packages`."""
    top, *rest = name.split(".")
    root = packages.get(top)
    if root is None:
        return None
    path = root.joinpath(*rest)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def submodules(name: str, packages: Mapping[str, Path] = PACKAGES) -> list[str]:
    """`name` and, for a package, every module under it; [] when it does not exist."""
    path = module_file(name, packages)
    if path is None:
        return []
    if path.name != "__init__.py":
        return [name]
    found = []
    for file in sorted(path.parent.rglob("*.py")):
        parts = list(file.relative_to(path.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append(".".join([name, *parts]))
    return found


def is_pure(name: str, pure: Iterable[str] = PURE) -> bool:
    return any(name == core or name.startswith(core + ".") for core in pure)


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes that run when a module is imported: not function bodies, not
    `if TYPE_CHECKING:` blocks."""
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from stmt.decorator_list
            continue
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            yield from _import_time_nodes(stmt.orelse)
            continue
        children = [
            child for child in ast.iter_child_nodes(stmt) if not isinstance(child, ast.stmt)
        ]
        yield stmt
        for child in children:
            yield from ast.walk(child)
        for field in ("body", "orelse", "finalbody", "handlers"):
            nested = getattr(stmt, field, None)
            if isinstance(nested, list):
                blocks = [h.body for h in nested] if field == "handlers" else [nested]
                for block in blocks:
                    yield from _import_time_nodes(block)


def imports_of(
    name: str, path: Path, packages: Mapping[str, Path] = PACKAGES, pure: Iterable[str] = PURE
) -> set[str]:
    """The module names a file imports (relative imports resolved).

    A module of the pure core is read whole: an import inside a function or
    under `TYPE_CHECKING` counts too. A module it pulls in from elsewhere only
    counts for what runs on import (a lazy import in a function does not run).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    nodes = ast.walk(tree) if is_pure(name, pure) else _import_time_nodes(tree.body)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            for alias in node.names:  # `from pkg import submodule`
                if module_file(f"{module}.{alias.name}", packages):
                    found.add(f"{module}.{alias.name}")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("__import__", "import_module"):
                found.add(f"<dynamic import in {name}>")
    return found


def import_graph(
    roots: Iterable[str], packages: Mapping[str, Path] = PACKAGES, pure: Iterable[str] = PURE
) -> dict[str, set[str]]:
    """Module -> what it imports, for every module of `packages` reachable from `roots`."""
    graph: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        path = module_file(name, packages)
        if name in graph or path is None:
            continue  # seen, or outside our packages: a leaf
        graph[name] = imports_of(name, path, packages, pure)
        todo.extend(graph[name])
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
    return graph


def violations(graph: Mapping[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {imported}"
        for module, names in graph.items()
        for imported in names
        if imported.split(".")[0] in FORBIDDEN or imported.startswith("<dynamic")
    )


def test_the_core_folder_is_what_is_checked() -> None:
    found = {
        ".".join(("kvd", *f.relative_to(ROOT / "kvd").with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for f in CORE.rglob("*.py")
    }
    assert set(submodules("kvd.core")) == found
    assert {"kvd.core.jobs", "kvd.core.ownership", "kvd.core.index.block_index"} <= found


def test_the_core_takes_only_wire_free_types_from_the_client() -> None:
    graph = import_graph(submodules("kvd.core"))
    from_client = {
        imported
        for module, names in graph.items()
        if module.startswith("kvd.core")
        for imported in names
        if imported.split(".")[0] == "kvd_client"
    }
    assert from_client  # the walk saw the shared errors and types
    assert from_client <= WIRE_FREE, sorted(from_client - WIRE_FREE)


def test_pure_core_imports_nothing_forbidden_statically() -> None:
    roots = [m for name in PURE for m in submodules(name)]
    assert "kvd.core.index.block_index" in roots and "kvd.core.index.policies.arc" in roots
    assert "kvd.core.jobs" in roots and "kvd.core.ownership" in roots
    graph = import_graph(roots)
    # The walk did follow imports out of the core, into the shared errors.
    assert {"kvd", "kvd.errors", "kvd_client", "kvd_client.errors"} <= set(graph)
    assert violations(graph) == []


FAKE = {
    "__init__.py": "",
    "sub/__init__.py": "from fake.sub import core\n",
    "sub/core.py": "from . import helper\nfrom ..other import thing\n",
    # In the core: even an import inside a function counts.
    "sub/helper.py": "def f():\n    import os.path\n",
    # Outside it: only what runs on import counts.
    "other.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torch\nelse:\n    import fake.shell\n"
        "thing = 1\n"
        "def lazy():\n    import zmq\n"
    ),
    "shell.py": "try:\n    import socket\nexcept ImportError:\n    pass\n",
}


def test_static_check_catches_transitive_imports(tmp_path: Path) -> None:
    for rel, text in FAKE.items():
        (tmp_path / "fake" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / rel).write_text(text)
    packages = {"fake": tmp_path / "fake"}
    graph = import_graph(submodules("fake.sub", packages), packages, pure=["fake.sub"])
    assert set(graph) == {
        "fake",
        "fake.sub",
        "fake.sub.core",
        "fake.sub.helper",
        "fake.other",
        "fake.shell",
    }
    assert violations(graph) == ["fake.shell imports socket", "fake.sub.helper imports os.path"]


SPY = r"""
import builtins, importlib, importlib.util, json, sys

forbidden = set(sys.argv[1].split(","))
ours = ("kvd", "kvd_client")
calls = []
real_import = builtins.__import__


def spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "?")
    if level == 0 and name.split(".")[0] in forbidden and importer.split(".")[0] in ours:
        calls.append(f"{importer} imports {name}")
    return real_import(name, globals, locals, fromlist, level)


before = set(sys.modules)
builtins.__import__ = spy
imported = []
for name in sys.argv[2].split(","):
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)
        imported.append(name)
builtins.__import__ = real_import
new = sorted(set(sys.modules) - before)
print(json.dumps({"imported": imported, "calls": calls, "new": new}))
"""


def test_pure_core_imports_nothing_forbidden_at_runtime() -> None:
    modules = [m for name in PURE for m in submodules(name)]
    proc = subprocess.run(
        [sys.executable, "-c", SPY, ",".join(sorted(FORBIDDEN)), ",".join(modules)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["imported"] == modules
    assert "kvd.core.index.block_index" in report["new"]
    assert report["calls"] == []
    assert sorted(NEVER_LOADED & set(report["new"])) == []
