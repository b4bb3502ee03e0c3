"""The repository layout of SPEC section 2: what the daemon package holds and imports.

- no module of the daemon (`kvd/`) is over 400 lines;
- nothing the daemon imports, at import time or in a function, is torch, numpy
  or the operator tools, but for the CLI's one seam to `kvd_tools.commands`;
- `kvd.index` and `kvd.index.policies`, the names SPEC section 4 gives, are the
  core's own objects.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_purity import ROOT, submodules

DAEMON = ROOT / "kvd"
MAX_LINES = 400


def test_no_daemon_module_is_over_400_lines() -> None:
    sizes = {
        str(f.relative_to(ROOT)): len(f.read_text(encoding="utf-8").splitlines())
        for f in DAEMON.rglob("*.py")
    }
    assert len(sizes) > 30
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
    return found


def test_the_daemon_never_imports_torch_numpy_or_the_tools() -> None:
    bad = {}
    for module in submodules("kvd"):
        path = DAEMON.joinpath(*module.split(".")[1:])
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        heavy = {
            name for name in _imports(file) if name.split(".")[0] in ("torch", "numpy", "kvd_tools")
        }
        if module == "kvd.cli":
            heavy.discard("kvd_tools.commands")  # `kvd bench` / `kvd demo`, when installed
        if heavy:
            bad[module] = sorted(heavy)
    assert "kvd.io.server" in submodules("kvd")
    assert bad == {}


def test_the_spec_names_of_the_index_are_the_core() -> None:
    import kvd.core.index as core
    import kvd.core.index.policies as core_policies
    import kvd.index as public
    import kvd.index.policies as public_policies

    assert public.BlockIndex is core.BlockIndex
    assert public.OffloadingEvent is core.OffloadingEvent
    assert public_policies.make_policy is core_policies.make_policy
    assert public_policies.POLICIES is core_policies.POLICIES
    assert public.BlockIndex(8, "arc").num_blocks == 8
