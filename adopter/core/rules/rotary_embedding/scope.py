"""What a file binds where the rotary forms look names up: the names of ``torch`` and of its
functions, the module-level functions, the classes (nested ones by qualified name) and their
methods, single inheritance among the file's classes followed."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from adopter.core.syntax import per_node, walk


def _run_in(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run in the scope whose ``body`` this is: those of its ``if``/``try``/``with``
    blocks too (``if is_torch_available(): import torch``), in source order."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _run_in(getattr(stmt, block, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _run_in(handler.body)


# Kept for the file being read only (its tree, and the codemod's own parse of it when rewriting):
# a tree kept alive past its file would make every garbage collection of the scan walk it.
@per_node(2)
def module_statements(tree: ast.Module) -> tuple[ast.stmt, ...]:
    """Statements run at module level, in source order (see :func:`_run_in`)."""
    return tuple(_run_in(tree.body))


class TorchNames:
    """Names the file binds to the ``torch`` module and to functions of it, by module-level imports
    (those under ``if``/``try`` included: ``if is_torch_available(): import torch``)."""

    def __init__(self, tree: ast.Module):
        self.modules: set[str] = set()
        self.functions: dict[str, str] = {}  # local name -> torch function name
        self.einops_modules: set[str] = set()  # ``import einops``
        self.rearrange: set[str] = set()  # ``from einops import rearrange``
        for stmt in module_statements(tree):
            if isinstance(stmt, ast.Import):
                self.modules |= {a.asname or a.name for a in stmt.names if a.name == "torch"}
                self.einops_modules |= {a.asname or a.name for a in stmt.names if a.name == "einops"}
            elif isinstance(stmt, ast.ImportFrom) and stmt.module == "torch" and not stmt.level:
                for a in stmt.names:
                    self.functions[a.asname or a.name] = a.name
            elif isinstance(stmt, ast.ImportFrom) and stmt.module == "einops" and not stmt.level:
                self.rearrange |= {a.asname or a.name for a in stmt.names if a.name == "rearrange"}

    def is_(self, func: ast.expr, *names: str) -> bool:
        """``func`` is ``torch.<name>`` or a name imported as it, for one of ``names``."""
        if isinstance(func, ast.Attribute) and func.attr in names:
            return isinstance(func.value, ast.Name) and func.value.id in self.modules
        return isinstance(func, ast.Name) and self.functions.get(func.id) in names

    def is_rearrange(self, func: ast.expr) -> bool:
        """``func`` is ``einops.rearrange`` (however imported)."""
        if isinstance(func, ast.Attribute) and func.attr == "rearrange":
            return isinstance(func.value, ast.Name) and func.value.id in self.einops_modules
        return isinstance(func, ast.Name) and func.id in self.rearrange


# every rotation function and candidate of a file reads the same imports (kept as module_statements)
torch_names = per_node(2)(TorchNames)


def class_def(tree: ast.Module, qualname: str) -> ast.ClassDef | None:
    """The class ``qualname`` (``Outer.Inner``) the file defines, else None."""
    scope, found = module_statements(tree), None
    for part in qualname.split("."):
        found = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if found is None:
            return None
        scope = _run_in(found.body)
    return found


def method_def(tree: ast.Module, cls: ast.ClassDef, name: str, seen: frozenset = frozenset()) -> ast.FunctionDef | str:
    """The ``def name`` of ``cls`` or of a base class defined in the file (first found, as the
    method resolution order of single inheritance), when the class binds the name only there."""
    defs = [s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == name]
    other = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
                for s in cls.body if not isinstance(s, ast.FunctionDef) for n in walk(s))
    if len(defs) > 1 or other or any(isinstance(s, (ast.AsyncFunctionDef, ast.ClassDef)) and s.name == name
                                     for s in cls.body):
        return f"{cls.name}.{name} is bound more than once"
    if defs:
        return defs[0]
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id not in seen:
            parent = class_def(tree, base.id)
            if parent is not None:
                found = method_def(tree, parent, name, seen | {cls.name})
                if not isinstance(found, str) or "bound more than once" in found:
                    return found
    return f"{cls.name}.{name} is not a method defined in this file"


def module_function(tree: ast.Module, name: str) -> ast.FunctionDef | str:
    """The module-level ``def name`` when it is the only module-level binding of ``name``."""
    defs, other = [], False
    for stmt in module_statements(tree):
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            defs.append(stmt)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            other |= any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
        elif isinstance(stmt, (ast.ClassDef, ast.AsyncFunctionDef)) and stmt.name == name:
            other = True
        elif not isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.If, ast.Try, ast.With)):
            other |= any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
                         for n in walk(stmt))
    if not defs:
        return f"{name} is not a function defined in this file"
    if len(defs) > 1 or other:
        return f"{name} is bound more than once at module level"
    return defs[0]
