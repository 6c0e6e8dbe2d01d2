"""vLLM's real source, read without importing it: the wheel the `vllm` extra pins, parsed with `ast`.

vLLM needs CUDA to import, but its wheel is plain Python we can read. `vllm_tree()` downloads the pinned wheel once
(``pip download --no-deps``, cached under ``~/.cache/specrl/wheels``), extracts ``vllm/**/*.py`` once
(``~/.cache/specrl/vllm-src/<version>``), and `Source` answers the questions a contract check asks: does this class
exist, which parameters does this method take (following base classes through imports), which fields does this
dataclass/config have, which values does this ``Literal`` alias allow.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SPECRL_CACHE", Path.home() / ".cache" / "specrl"))


class SourceUnavailable(RuntimeError):
    """The pinned wheel could not be fetched (no network, no index): the caller skips with this message."""


def pinned_version(pyproject: Path = REPO / "pyproject.toml") -> str:
    """The exact version of the `vllm` extra (``vllm==X``): the check must read what GPU images install."""
    text = pyproject.read_text()
    m = re.search(r'^vllm\s*=\s*\[\s*"vllm==([0-9][0-9A-Za-z.]*)"\s*\]', text, re.MULTILINE)
    if m is None:
        raise AssertionError("pyproject.toml: the `vllm` extra must pin one version (vllm = [\"vllm==X.Y.Z\"]) so "
                             "the contract check reads the source GPU images run")
    return m.group(1)


def wheel(version: str, timeout_s: float = 600) -> Path:
    folder = CACHE / "wheels"
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={version}",
           "-d", str(folder), "--quiet", "--disable-pip-version-check"]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailable(f"cannot fetch vllm=={version} ({exc})") from None
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SourceUnavailable(f"cannot fetch vllm=={version}: `{' '.join(cmd[2:])}` failed: {tail[0]}")
    return found[0]


def vllm_tree(version: str | None = None) -> Path:
    """The folder holding the pinned wheel's ``vllm/`` Python sources (downloaded and extracted once)."""
    version = version or pinned_version()
    root = CACHE / "vllm-src" / version
    done = root / ".complete"
    if not done.exists():
        whl = wheel(version)
        tmp = root.with_name(f"{version}.tmp{os.getpid()}")
        with zipfile.ZipFile(whl) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, tmp)
        if root.exists():  # another process finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(root)
        done.touch()
    return root


# -- signatures -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """A function's parameters as the source declares them (``self``/``cls`` dropped)."""

    qualname: str
    positional: tuple[str, ...]  # positional-or-keyword and positional-only, in order
    positional_only: tuple[str, ...]
    required_positional: tuple[str, ...]
    keyword_only: tuple[str, ...]
    required_keyword_only: tuple[str, ...]
    var_positional: bool
    var_keyword: bool

    @classmethod
    def of(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str, method: bool) -> Signature:
        a = fn.args
        pos = [p.arg for p in a.posonlyargs + a.args]
        posonly = [p.arg for p in a.posonlyargs]
        n_default = len(a.defaults)
        required = pos[: len(pos) - n_default]
        if method and pos and not _is_static(fn):
            pos, required = pos[1:], required[1:]
            posonly = posonly[1:]
        kwonly = [p.arg for p in a.kwonlyargs]
        req_kw = [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
        return cls(qualname, tuple(pos), tuple(posonly), tuple(required), tuple(kwonly), tuple(req_kw),
                   a.vararg is not None, a.kwarg is not None)

    @property
    def names(self) -> set[str]:
        return set(self.positional) | set(self.keyword_only)

    def bind(self, n_positional: int, keywords: Iterable[str]) -> list[str]:
        """Why a call with `n_positional` arguments and these keyword names would fail (empty = it binds)."""
        problems: list[str] = []
        keywords = set(keywords)
        if n_positional > len(self.positional) and not self.var_positional:
            problems.append(f"{self.qualname} takes {len(self.positional)} positional arguments, "
                            f"called with {n_positional}")
        by_position = set(self.positional[:n_positional])
        for name in sorted(keywords):
            if name in by_position:
                problems.append(f"{self.qualname}: {name!r} given twice")
            elif name in self.positional_only or (name not in self.names and not self.var_keyword):
                problems.append(f"{self.qualname} has no keyword {name!r}")
        given = by_position | keywords
        for name in self.required_positional + self.required_keyword_only:
            if name not in given:
                problems.append(f"{self.qualname}: required argument {name!r} missing")
        return problems


def _is_static(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


# -- classes and modules ---------------------------------------------------------------------------------------


@dataclass
class ClassInfo:
    module: str
    node: ast.ClassDef
    bases: list[ClassInfo] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.node.name}"

    def mro(self) -> list[ClassInfo]:
        seen: list[ClassInfo] = []
        stack = [self]
        while stack:
            c = stack.pop(0)
            if all(c.name != s.name for s in seen):
                seen.append(c)
                stack.extend(c.bases)
        return seen

    def method(self, name: str) -> Signature | None:
        for c in self.mro():
            for item in c.node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return Signature.of(item, f"{c.name}.{name}", method=True)
        return None

    def fields(self) -> dict[str, bool]:
        """Annotated class-level fields (dataclass, pydantic, msgspec) -> whether each has a default; bases first."""
        out: dict[str, bool] = {}
        for c in reversed(self.mro()):
            for item in c.node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if "ClassVar" in ast.unparse(item.annotation):
                        continue
                    out[item.target.id] = item.value is not None
        return out

    def attributes(self) -> set[str]:
        """Fields, methods/properties, and ``self.x = ...`` assignments in ``__init__``."""
        names = set(self.fields())
        for c in self.mro():
            for item in c.node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                    if item.name == "__init__":
                        for node in ast.walk(item):
                            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                                for t in targets:
                                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                                            t.value.id == "self":
                                        names.add(t.attr)
        return names

    def constructor(self) -> Signature:
        """How the class is called: ``__init__`` if written, else the generated one of its fields."""
        init = self.method("__init__")
        if init is not None:
            return init
        fields = self.fields()
        kw_only = _is_kw_only_dataclass(self.node)
        pos = () if kw_only else tuple(fields)
        return Signature(f"{self.name}()", pos, (), tuple(n for n in pos if not fields[n]),
                         tuple(fields) if kw_only else (),
                         tuple(n for n, d in fields.items() if not d) if kw_only else (), False, False)


def _is_kw_only_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        if isinstance(d, ast.Call) and any(k.arg == "kw_only" and isinstance(k.value, ast.Constant) and
                                           k.value.value is True for k in d.keywords):
            return True
    return False


class Source:
    """Lookups in one extracted ``vllm/`` tree (never imported)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @cache  # noqa: B019 - one Source per test session
    def module(self, dotted: str) -> ast.Module:
        path = self.root / Path(*dotted.split("."))
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not file.exists():
            raise LookupError(f"vLLM source has no module {dotted}")
        return ast.parse(file.read_text(), filename=str(file))

    def has_module(self, dotted: str) -> bool:
        try:
            self.module(dotted)
        except LookupError:
            return False
        return True

    def text(self, dotted: str) -> str:
        return ast.unparse(self.module(dotted))

    def _imported(self, module: str, name: str) -> tuple[str, str] | None:
        """Where `name` seen in `module` comes from: (module, name) through ``from X import name``."""
        package = module if (self.root / Path(*module.split("."))).is_dir() else module.rpartition(".")[0]
        for node in self.module(module).body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        base = node.module or ""
                        if node.level:
                            parts = package.split(".")
                            parts = parts[: len(parts) - (node.level - 1)]
                            base = ".".join(parts + ([node.module] if node.module else []))
                        return base, alias.name
        return None

    def _lazy_attr(self, module: str, name: str) -> tuple[str, str] | None:
        """``MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}``-style lazy exports of a package ``__init__``."""
        for node in ast.walk(self.module(module)):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant) and \
                            isinstance(v.value, str) and ":" in v.value:
                        target, _, attr = v.value.partition(":")
                        return (module + target if target.startswith(".") else target), attr
        return None

    def find(self, module: str, name: str, _depth: int = 0) -> tuple[str, ast.AST]:
        """The top-level definition (class, function, assignment) of `name` as reachable from `module`."""
        if _depth > 10:
            raise LookupError(f"{module}.{name}: import chain too deep")
        for node in self.module(module).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return module, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return module, node
        origin = self._imported(module, name) or self._lazy_attr(module, name)
        if origin is None:
            raise LookupError(f"vLLM {module} defines no {name}")
        return self.find(origin[0], origin[1], _depth + 1)

    def cls(self, module: str, name: str) -> ClassInfo:
        where, node = self.find(module, name)
        if not isinstance(node, ast.ClassDef):
            raise TypeError(f"vLLM {where}.{name} is not a class")
        info = ClassInfo(where, node)
        for base in node.bases:
            base_name = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(base_name, ast.Name):
                try:
                    info.bases.append(self.cls(where, base_name.id))
                except LookupError:
                    pass  # outside vLLM (ABC, Generic, msgspec.Struct, ...): contributes nothing we check
        return info

    def function(self, module: str, name: str) -> Signature:
        where, node = self.find(module, name)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise TypeError(f"vLLM {where}.{name} is not a function")
        return Signature.of(node, f"{where}.{name}", method=False)

    def literal_values(self, module: str, name: str) -> set[str]:
        """The strings a ``Name = Literal[...]`` alias allows, following nested aliases."""
        where, node = self.find(module, name)
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None:
            raise LookupError(f"vLLM {where}.{name} is not a Literal alias")
        return self._literal(where, value)

    def _literal(self, module: str, expr: ast.expr) -> set[str]:
        out: set[str] = set()
        if isinstance(expr, ast.Subscript) and ast.unparse(expr.value).endswith("Literal"):
            items = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            for item in items:
                out |= self._literal(module, item)
        elif isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            out.add(expr.value)
        elif isinstance(expr, ast.Name):
            out |= self.literal_values(module, expr.id)
        elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            out |= self._literal(module, expr.left) | self._literal(module, expr.right)
        return out

    def field_literal(self, cls: ClassInfo, field_name: str) -> set[str]:
        """The Literal values a class field's annotation allows (empty when it allows any string)."""
        for c in cls.mro():
            for item in c.node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                        item.target.id == field_name:
                    return self._literal(c.module, item.annotation)
        raise LookupError(f"{cls.name} has no field {field_name}")
