"""Runs in the test process: classes, bases and method signatures of Python sources, read with `ast`.

kvd's plug-in and a vLLM release are read without importing either (a
release may be a CUDA build that does not import here). `Sources` finds a
module's file under the root of its top-level package, resolves a class's
bases through the modules' imports (re-exports too) and linearizes them as
Python does (C3); `Method` is what a `def` line says a method accepts, and
`incompatibilities` what an override refuses of the calls its base allows.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

POSITIONAL = ("posonly", "pos")


class MissingSource(LookupError):
    """A module of a package under check is not in the sources (widen what is unpacked)."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "posonly", "pos", "args", "kwonly", "kwargs"
    default: bool


@dataclass(frozen=True)
class Method:
    owner: str  # "module.Class"
    name: str
    kind: str  # "method", "classmethod", "staticmethod", "property"
    params: tuple[Param, ...]  # without self / cls
    abstract: bool
    line: int

    def named(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name and p.kind != "posonly"), None)

    def has(self, kind: str) -> bool:
        return any(p.kind == kind for p in self.params)


@dataclass(frozen=True)
class Class:
    module: str
    name: str
    node: ast.ClassDef

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def methods(self) -> dict[str, Method]:
        found: dict[str, Method] = {}
        for stmt in self.node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                method = method_of(self.qualname, stmt)
                if method is not None and stmt.name not in found:
                    found[stmt.name] = method
        return found

    def attributes(self) -> set[str]:
        """Names bound in the class body other than by `def` (they satisfy an abstract one)."""
        names: set[str] = set()
        for stmt in self.node.body:
            if isinstance(stmt, ast.Assign):
                names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names.update([stmt.target.id] if stmt.value is not None else [])
        return names

    def is_dataclass(self) -> bool:
        return any(_name_of(d.func if isinstance(d, ast.Call) else d) == "dataclass"
                   for d in self.node.decorator_list)  # fmt: skip

    def fields(self) -> list[str]:
        """This class's own dataclass fields, in order (no ClassVar)."""
        return [
            s.target.id
            for s in self.node.body
            if isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and "ClassVar" not in ast.unparse(s.annotation)
        ]


def _name_of(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def method_of(owner: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> Method | None:
    """The method a `def` in a class body defines; None for a setter or an overload."""
    decorators = {_name_of(d) for d in node.decorator_list}
    if any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
           for d in node.decorator_list) or "overload" in decorators:  # fmt: skip
        return None
    kind = "method"
    for candidate in ("staticmethod", "classmethod"):
        if candidate in decorators:
            kind = candidate
    if decorators & {"property", "cached_property", "abstractproperty"}:
        kind = "property"
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    params = [
        Param(p.arg, "posonly" if i < len(a.posonlyargs) else "pos", i >= first_default)
        for i, p in enumerate(positional)
    ]
    if kind != "staticmethod":
        params = params[1:]  # self / cls
    if a.vararg is not None:
        params.append(Param(a.vararg.arg, "args", True))
    params += [
        Param(p.arg, "kwonly", d is not None)
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg is not None:
        params.append(Param(a.kwarg.arg, "kwargs", True))
    abstract = bool(decorators & {"abstractmethod", "abstractproperty"})
    return Method(owner, node.name, kind, tuple(params), abstract, node.lineno)


def incompatibilities(base: Method, over: Method) -> list[str]:
    """What calls `base`'s signature allows that `over` refuses (empty: none)."""
    if base.kind != over.kind:
        return [f"a {base.kind} in vLLM, a {over.kind} in kvd"]
    if base.kind == "property":
        return []
    problems = []
    b_pos = [p for p in base.params if p.kind in POSITIONAL]
    o_pos = [p for p in over.params if p.kind in POSITIONAL]
    takes_any = over.has("kwargs")
    for i, b in enumerate(b_pos):
        o = o_pos[i] if i < len(o_pos) else None
        if o is None and not over.has("args"):
            problems.append(f"vLLM may pass {b.name!r} as argument {i + 1}; kvd takes no such")
        elif o is not None and b.default and not o.default:
            problems.append(f"{b.name!r} is optional in vLLM, kvd's {o.name!r} is required")
        if (
            b.kind == "pos"
            and not takes_any
            and (o is None or o.name != b.name or o.kind == "posonly")
        ):
            named = over.named(b.name)
            if named is None or named is not o:
                problems.append(f"vLLM may pass {b.name!r} by name; kvd has no such parameter "
                                f"at position {i + 1}")  # fmt: skip
    for o in o_pos[len(b_pos) :]:
        if not o.default:
            problems.append(f"kvd requires {o.name!r}, which no call of vLLM's signature passes")
    for b in (p for p in base.params if p.kind == "kwonly"):
        o = over.named(b.name)
        if o is None and not takes_any:
            problems.append(f"vLLM may pass {b.name!r} by name; kvd has no such parameter")
        elif o is not None and b.default and not o.default:
            problems.append(f"{b.name!r} is optional in vLLM, required in kvd")
    for o in (p for p in over.params if p.kind == "kwonly"):
        if not o.default and base.named(o.name) is None and not base.has("kwargs"):
            problems.append(f"kvd requires {o.name!r}, which no call of vLLM's signature passes")
    for kind, what in (("args", "*args"), ("kwargs", "**kwargs")):
        if base.has(kind) and not over.has(kind):
            problems.append(f"vLLM takes {what}, kvd does not")
    return problems


class Sources:
    """The modules of the top-level packages in `roots` (package name -> the directory
    holding it); names of other packages (the standard library) are external."""

    def __init__(self, roots: dict[str, Path]) -> None:
        self.roots = roots
        self._modules: dict[str, ast.Module | None] = {}
        self._mros: dict[str, list[Class]] = {}

    def checked(self, module: str) -> bool:
        return module.split(".", maxsplit=1)[0] in self.roots

    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            parts = name.split(".")
            root = self.roots.get(parts[0])
            tree = None
            if root is not None:
                base = root.joinpath(*parts)
                for path in (base.with_suffix(".py"), base / "__init__.py"):
                    if path.is_file():
                        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
                        break
            self._modules[name] = tree
        return self._modules[name]

    def absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        """The module a `from ... import` of `module` imports from."""
        if not stmt.level:
            return stmt.module or ""
        parts = module.split(".")
        root = self.roots.get(parts[0])
        is_package = root is not None and root.joinpath(*parts, "__init__.py").is_file()
        base = parts[: len(parts) - stmt.level + (1 if is_package else 0)]
        return ".".join([*base, stmt.module] if stmt.module else base)

    def statements(self, module: str) -> list[ast.stmt]:
        """A module's top-level statements, those under `if` and `try` included."""
        tree = self.module(module)
        if tree is None:
            raise MissingSource(module)
        out: list[ast.stmt] = []
        todo = list(tree.body)
        while todo:
            stmt = todo.pop(0)
            out.append(stmt)
            if isinstance(stmt, ast.If | ast.Try):
                todo[:0] = [*stmt.body, *stmt.orelse, *getattr(stmt, "finalbody", [])]
        return out

    def find(self, module: str, name: str, depth: int = 0) -> Class | None:
        """The class `name` is in `module`, through its imports; None if it is external."""
        if not self.checked(module) or depth > 20:
            return None
        for stmt in reversed(self.statements(module)):  # the last binding wins
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Class(module, name, stmt)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = self.absolute(module, stmt)
                        if self.checked(source) and self.module(f"{source}.{alias.name}"):
                            return None  # a submodule, not a class
                        return self.find(source, alias.name, depth + 1)
            if (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Name | ast.Attribute)
                and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
            ):
                return self.resolve(module, stmt.value, depth + 1)
        return None

    def resolve(self, module: str, expr: ast.expr, depth: int = 0) -> Class | None:
        """The class an expression of `module` names (a base: `X`, `a.X`, `X[T]`)."""
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        if isinstance(expr, ast.Name):
            return self.find(module, expr.id, depth)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            for stmt in self.statements(module):
                if isinstance(stmt, ast.Import):
                    for alias in stmt.names:
                        if (alias.asname or alias.name) == expr.value.id:
                            return self.find(alias.name, expr.attr, depth + 1)
        return None

    def bases(self, cls: Class) -> list[Class]:
        return [b for e in cls.node.bases if (b := self.resolve(cls.module, e)) is not None]

    def mro(self, cls: Class) -> list[Class]:
        """Python's method resolution order of `cls`, external bases left out."""
        if cls.qualname not in self._mros:
            bases = self.bases(cls)
            self._mros[cls.qualname] = [cls, *_merge([*(self.mro(b) for b in bases), bases])]
        return self._mros[cls.qualname]

    def classes(self, module: str) -> list[Class]:
        return [Class(module, s.name, s) for s in self.statements(module)
                if isinstance(s, ast.ClassDef)]  # fmt: skip


def _merge(seqs: list[list[Class]]) -> list[Class]:
    """C3 linearization's merge."""
    seqs = [list(s) for s in seqs if s]
    out: list[Class] = []
    while seqs:
        for seq in seqs:
            head = seq[0]
            if not any(head.qualname in (c.qualname for c in s[1:]) for s in seqs):
                break
        else:
            raise TypeError("no consistent method resolution order")
        out.append(head)
        seqs = [[c for c in s if c.qualname != head.qualname] for s in seqs]
        seqs = [s for s in seqs if s]
    return out
