"""The site a rotary form is read at: the function holding the expression, where that function
binds and reads each name (:class:`Facts`), the class of a method, the file's torch names, the
statement holding the expression (:class:`Site`); and what the rewrite may do there: delete the
statements only the rotation read (:func:`removable_run`), evaluate an operand once instead of
twice (:func:`pure`)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from adopter.core.rules.rotary_embedding.scope import TorchNames, class_def, torch_names
from adopter.core.syntax import per_node, walk


class Facts:
    """Where one function binds and reads each name (nested scopes counted with it: conservative),
    and the block (statement list) holding each statement."""

    def __init__(self, fn: ast.AST | None):
        self.fn = fn
        self.params: set[str] = set()
        self.bindings: dict[str, int] = {}  # name -> how many times bound (2 for a def/import/global: never once)
        self.single: dict[str, tuple[ast.stmt, ast.expr, int | None]] = {}  # name -> (stmt, value, tuple index)
        self.loads: dict[str, list[ast.Name]] = {}
        self.blocks: dict[int, tuple[list[ast.stmt], int]] = {}  # id(stmt) -> (block, index)
        if fn is None:
            return
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = fn.args
            self.params = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
            self.params |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
        for name in self.params:
            self.bindings[name] = 1
        for n in walk(fn):
            if isinstance(n, ast.Name):
                if isinstance(n.ctx, ast.Load):
                    self.loads.setdefault(n.id, []).append(n)
                else:
                    self._bind(n.id, 1)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
                self._bind(n.name, 2)
            elif isinstance(n, (ast.Global, ast.Nonlocal)):
                for name in n.names:
                    self._bind(name, 2)
            elif isinstance(n, ast.alias):
                self._bind((n.asname or n.name).split(".")[0], 2)
            for block in ("body", "orelse", "finalbody"):
                stmts = getattr(n, block, None)
                if isinstance(stmts, list):
                    for i, s in enumerate(stmts):
                        if isinstance(s, ast.stmt):
                            self.blocks[id(s)] = (stmts, i)
            for handler in getattr(n, "handlers", []) or []:
                for i, s in enumerate(handler.body):
                    self.blocks[id(s)] = (handler.body, i)
        for stmt in (s for s in walk(fn) if isinstance(s, ast.Assign) and len(s.targets) == 1):
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                self.single[target.id] = (stmt, stmt.value, None)
            elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
                for i, t in enumerate(target.elts):
                    if isinstance(stmt.value, ast.Tuple) and len(stmt.value.elts) == len(target.elts):
                        self.single[t.id] = (stmt, stmt.value.elts[i], None)
                    else:
                        self.single[t.id] = (stmt, stmt.value, i)
        self.single = {k: v for k, v in self.single.items() if self.bindings.get(k) == 1 and k not in self.params}

    def _bind(self, name: str, times: int) -> None:
        self.bindings[name] = self.bindings.get(name, 0) + times

    def bound_once(self, name: str) -> bool:
        """A parameter never rebound, or a name assigned once (every read sees that value)."""
        return self.bindings.get(name) == 1 and (name in self.params or name in self.single)

    def block_of(self, stmt: ast.stmt) -> tuple[list[ast.stmt], int] | None:
        return self.blocks.get(id(stmt))

    def assigned_value(self, e: ast.expr) -> tuple[ast.stmt, ast.expr] | None:
        """(statement, value) of a name assigned once by a plain assignment (not a tuple unpacking
        of a call), else None."""
        if isinstance(e, ast.Name) and e.id in self.single:
            stmt, value, index = self.single[e.id]
            if index is None:
                return stmt, value
        return None


# every candidate in a function reads the same facts (a rotary-heavy file built them per candidate)
facts_of = per_node(256)(Facts)


def inside(node: ast.AST, outer: ast.AST) -> bool:
    return any(n is node for n in walk(outer))


def statement_names(stmt: ast.stmt) -> set[str] | None:
    """The names a plain assignment binds (a name or a tuple of names), else None."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target = stmt.targets[0]
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
        return {t.id for t in target.elts}
    return None


def removable_run(facts: Facts, anchor: ast.stmt, names: set[str], replaced: ast.expr,
                  passable: Callable[[ast.stmt], bool] = lambda stmt: False) -> list[ast.stmt]:
    """The statements right before ``anchor`` (same block, walking back) that only bind some of
    ``names`` read nowhere but in those statements and in ``replaced`` (the expression the rewrite
    replaces): what the rewrite may delete with the guard for TorchScript still one region. A
    statement ``passable`` (another rotation's, rewritten with it) is stepped over, not deleted."""
    where = facts.block_of(anchor)
    if where is None:
        return []
    block, i = where
    run: list[ast.stmt] = []
    for stmt in reversed(block[:i]):
        bound = statement_names(stmt)
        if bound and bound <= names:
            keep = run + [stmt]
            if all(inside(load, replaced) or any(inside(load, s) for s in keep)
                   for name in bound for load in facts.loads.get(name, ())):
                run.append(stmt)
                continue
        if passable(stmt):
            continue
        break
    return run


# compound statements: the expression's statement is a simple one inside them
_COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
             ast.AsyncFor, ast.AsyncWith)


@dataclass
class Site:
    """The sum (or stack, or complex product) being read, with what its reading needs."""

    tree: ast.Module
    fn: ast.AST | None  # the function holding it (None: module level)
    cls: ast.ClassDef | None  # the class whose method that is
    names: TorchNames
    facts: Facts
    stmt: ast.stmt | None  # the statement holding it

    @classmethod
    def of(cls_, tree: ast.Module, fn: ast.AST | None, qualname: str, expr: ast.AST) -> Site:
        owner = class_def(tree, qualname.rsplit(".", 1)[0]) if qualname and "." in qualname else None
        facts = facts_of(fn)
        stmt = None
        if fn is not None:
            stmt = next((s for s in walk(fn) if isinstance(s, ast.stmt) and s is not fn
                         and not isinstance(s, _COMPOUND) and inside(expr, s)), None)
        return cls_(tree, fn, owner, torch_names(tree), facts, stmt)

    @property
    def first_param(self) -> str | None:
        """The function's first parameter (``self`` of a method), None at module level or when none."""
        fn = self.fn
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        first = (fn.args.posonlyargs + fn.args.args)[:1]
        return first[0].arg if first else None


# Methods whose result depends only on the tensor (and the constant arguments): an ``x`` written
# with them (``q.float()``) is the same tensor at both of its places and may be evaluated once.
_PURE_METHODS = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous"}


def pure(e: ast.expr) -> bool:
    """``e`` reads names, attributes and items only (plus pure casts): evaluating it once instead
    of twice changes nothing."""
    for n in walk(e):
        if isinstance(n, ast.Call):
            if not (isinstance(n.func, ast.Attribute) and n.func.attr in _PURE_METHODS):
                return False
            if any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg is None for k in n.keywords):
                return False
        elif isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda)) or \
                isinstance(n, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return False
    return True


def unsafe_operand(e: ast.expr) -> bool:
    """``e`` assigns (``:=``) or yields: the rewrite cannot move it into a call."""
    return any(isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)) for n in walk(e))
