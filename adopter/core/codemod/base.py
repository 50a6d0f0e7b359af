"""Shared analysis for the per-rule codemods.

A codemod is ``analyze(match, ctx) -> Edit`` (or raises :class:`Skip` with the reason).
Most rules have the same shape — a chain of matched calls whose *last* call becomes the
kernel call and whose earlier calls disappear — so :class:`ChainPlan` does the checks
they share: every matched call is a whole assignment right-hand side or nested in the
anchor call, intermediates are not read anywhere else, moved argument expressions mean
the same at their new place, attributes the kernel takes over are not used elsewhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from adopter.core.codemod.context import (
    FileContext,
    Skip,
    has_call,
    is_self_attr,
    loads,
    simple_assign_target,
    stores,
)
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, Pos
from adopter.core.structures import InitBinding, Match
from adopter.core.syntax import walk


class Codemod:
    """One rule's edit synthesis. Subclasses set ``rule`` (the name used in messages) and
    implement :meth:`analyze`; the rule module declares an instance as ``Rule.codemod``."""

    rule: ClassVar[str] = ""

    def analyze(self, match: Match, ctx: FileContext) -> Edit:  # pragma: no cover - abstract
        raise NotImplementedError


# ---------------------------------------------------------------- small helpers


def pos(ctx: FileContext, node: ast.AST) -> Pos:
    return (node.lineno, ctx.char_col(node.lineno, node.col_offset))


def arg_text(ctx: FileContext, node: ast.expr) -> str:
    """Source text of an argument, single-line (multi-line expressions are unparsed)."""
    text = ctx.segment(node)
    if "\n" in text:
        text = ast.unparse(node)
    return text


def module_handle(ctx: FileContext, call: ast.Call, what: str) -> str:
    """Source text of the module a call calls (``self.dropout`` of ``self.dropout(x)``), handed to
    a guarded kernel in its place. Only references (names, attributes, items without calls):
    the text is evaluated again at the kernel call."""
    func = call.func
    node = func
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    if not isinstance(node, ast.Name) or has_call(func):
        raise Skip(f"the {what} {ctx.segment(func)!r} is not a module reference (name, attribute or item)")
    return arg_text(ctx, func)


def separate_calls(*calls: ast.expr) -> None:
    """Guarded kernels take each matched layer as a module: two matched layers run by one call
    (members of an ``nn.Sequential`` called as a whole) cannot be handed over separately."""
    if len({id(c) for c in calls}) != len(calls):
        raise Skip("the matched layers run inside one call (an nn.Sequential): no separate modules to hand over")


def matched_exprs(match: Match, ctx: FileContext, single_function: bool = True) -> list[tuple[object, ast.expr]]:
    """``[(dsl node, ast expression), ...]`` in match order; all in one function unless
    ``single_function`` is False."""
    out = []
    functions = set()
    for mn in match.nodes:
        span = mn.node.span
        if span is None:
            raise Skip("matched node has no source position")
        functions.add(span.function or match.function)
        out.append((mn.node, ctx.expr_at(span)))
    if len(functions) > 1 and single_function:
        raise Skip(f"matched nodes lie in several functions ({', '.join(sorted(functions))})")
    return out


def match_function(match: Match, ctx: FileContext, exprs) -> ast.FunctionDef:
    fn = ctx.enclosing_function(exprs[0][1])
    if fn is None:
        raise Skip("matched code is not inside a function")
    return fn


def init_statement(ctx: FileContext, match: Match, attr: str) -> tuple[ast.stmt, ast.Call, InitBinding | None]:
    """The ``self.<attr> = Layer(...)`` statement in ``__init__`` (exactly one, a plain call)."""
    binding = next((ib for ib in match.init_nodes if ib.attr in (attr, f"self.{attr}")), None)
    if binding is not None and binding.container:
        raise Skip(f"self.{attr} is built inside a container ({binding.container})")
    owner = binding.span.function.split(".")[0] if binding and binding.span and binding.span.function else None
    class_name = owner or match.class_name
    if class_name is None:
        raise Skip(f"no class for self.{attr}")
    if match.class_name and class_name != match.class_name:
        raise Skip(f"self.{attr} is built in base class {class_name}; rewriting it would change every subclass")
    stmts = [s for s in ctx.class_attr_stores(class_name, attr)]
    if len(stmts) != 1:
        where = ", ".join(str(s.lineno) for s in stmts) or "nowhere"
        raise Skip(f"self.{attr} is assigned {len(stmts)} times in {class_name} (lines {where})")
    stmt = stmts[0]
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and is_self_attr(stmt.targets[0]) == attr
        and isinstance(stmt.value, ast.Call)
    ):
        raise Skip(f"self.{attr} is not assigned a plain layer constructor call (line {stmt.lineno})")
    fn = ctx.enclosing_function(stmt)
    if fn is None or fn.name != "__init__":
        raise Skip(f"self.{attr} is not constructed in __init__")
    return stmt, stmt.value, binding


def attr_used_elsewhere(
    ctx: FileContext, class_name: str, attr: str, allowed: Iterable[ast.AST]
) -> tuple[int, int, str] | None:
    """A read of ``self.<attr>`` outside the ``allowed`` expressions, or None."""
    allowed_positions = set()
    for node in allowed:
        for sub in walk(node):
            if isinstance(sub, ast.Attribute):
                allowed_positions.add((sub.lineno, sub.col_offset))
    for owner in [class_name] + ctx.subclasses(class_name):
        for use in ctx.class_attr_uses(owner, attr):
            if (use[0], use[1]) not in allowed_positions:
                return use if owner == class_name else (use[0], use[1], f"{owner}.{use[2]}")
    return None


def fresh_local(ctx: FileContext, fn: ast.AST, base: str, taken: set[str]) -> str:
    used = ctx.names_in_function(fn) | taken
    name, n = base, 2
    while name in used:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def fresh_attr(ctx: FileContext, class_name: str, base: str) -> str:
    cls = ctx.classes.get(class_name)
    used = set()
    for node in walk(cls) if cls is not None else ():
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            used.add(node.attr)
    name, n = base, 2
    while name in used:
        name, n = f"{base}_{n}", n + 1
    return name


def format_call(callee: str, positional: list[str], keywords: list[tuple[str, str]]) -> str:
    parts = list(positional) + [f"{k}={v}" for k, v in keywords]
    return f"{callee}({', '.join(parts)})"


# ---------------------------------------------------------------- init placement


def place_construction(
    ctx: FileContext,
    kept: ast.stmt,
    absorbed: list[ast.stmt],
    construct_reads: set[str],
) -> tuple[ast.stmt, list[str]]:
    """Where the kernel construction goes: the kept layer's statement when every name
    the construction reads already has its value there, else the last absorbed one.
    Returns (statement to replace, if-condition chain of that statement relative to
    the kept one, as ``["test/body", ...]``). Conditional placement is only allowed
    *below* the kept statement (the DPT ``if self.use_batch_norm:`` case)."""
    init_fn = ctx.enclosing_function(kept)
    chain_kept = ctx.enclosing_ifs(kept, init_fn)
    later = [s for s in absorbed if (s.lineno, s.col_offset) > (kept.lineno, kept.col_offset)]
    # Names the construction reads that are (re)bound between the kept statement and later absorbed ones.
    if later:
        last = max(later, key=lambda s: (s.lineno, s.col_offset))
        rebound = set()
        for node in walk(init_fn):
            if isinstance(node, ast.stmt) and kept.end_lineno < node.lineno <= last.lineno:
                rebound |= stores(node) if not isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)) else set()
        needs_later = bool(rebound & construct_reads)
    else:
        needs_later = False
    conditional = [s for s in absorbed if ctx.enclosing_ifs(s, init_fn) != chain_kept]
    if conditional:
        if len(conditional) > 1 or len(absorbed) > 1:
            raise Skip("absorbed layers are constructed under different conditions")
        target = conditional[0]
        chain_target = ctx.enclosing_ifs(target, init_fn)
        if chain_target[: len(chain_kept)] != chain_kept or (target.lineno < kept.lineno):
            raise Skip("the absorbed layer is constructed under a condition not nested below the kept one")
        return target, [f"{t}/{b}" for t, b in chain_target[len(chain_kept):]]
    if needs_later:
        return max(later, key=lambda s: (s.lineno, s.col_offset)), []
    return kept, []


def forward_condition_chain(ctx: FileContext, kept_expr: ast.AST, absorbed_expr: ast.AST) -> list[str]:
    """if-chain of the absorbed call's statement below the common block with the kept call."""
    fn = ctx.enclosing_function(kept_expr)
    kept_stmt = ctx.statement_of(kept_expr)
    abs_stmt = ctx.statement_of(absorbed_expr)
    chain_kept = ctx.enclosing_ifs(kept_stmt, fn)
    chain_abs = ctx.enclosing_ifs(abs_stmt, fn)
    if chain_abs[: len(chain_kept)] != chain_kept:
        return ["<different branch>"]
    return [f"{t}/{b}" for t, b in chain_abs[len(chain_kept):]]


# ---------------------------------------------------------------- forward chains


@dataclass
class ChainPlan:
    """A chain of matched calls ``c_1 .. c_n`` in one function; ``c_n`` (the anchor) is
    replaced by ``anchor_text``; every other ``c_i`` must either be nested inside ``c_n``
    or be the whole right-hand side of an assignment statement that is then deleted."""

    ctx: FileContext
    fn: ast.FunctionDef
    calls: list[ast.expr]  # matched expressions in execution order; the last is the anchor
    anchor_text: str = ""
    moved: list[tuple[ast.expr, ast.expr]] = field(default_factory=list)  # (expr, from call)
    absorb_if: bool = False  # `if X is not None: <matched stmt>` may be absorbed whole

    def _inside(self, node: ast.AST, container: ast.AST) -> bool:
        return (node.lineno, node.col_offset) >= (container.lineno, container.col_offset) and (
            node.end_lineno,
            node.end_col_offset,
        ) <= (container.end_lineno, container.end_col_offset)

    def build(self) -> ForwardEdit:
        ctx = self.ctx
        anchor = self.calls[-1]
        anchor_stmt = ctx.statement_of(anchor)
        deleted: list[ast.stmt] = []
        statements: list[ast.stmt] = []
        for call in self.calls[:-1]:
            if self._inside(call, anchor):
                continue
            stmt = ctx.statement_of(call)
            if stmt is anchor_stmt:
                raise Skip(f"line {call.lineno}: a matched call sits beside the anchor call in one statement")
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if not self._targets(stmt) or value is not call:
                raise Skip(f"line {call.lineno}: matched call is part of a larger expression")
            if stmt not in deleted:
                deleted.append(stmt)
        for stmt in deleted:
            statements.append(self._effective(stmt))
        statements.append(anchor_stmt)
        self._check_intermediates(deleted, anchor, anchor_stmt)
        self._check_moves(deleted, anchor_stmt)
        order = sorted(statements, key=lambda s: (s.lineno, s.col_offset))
        if order != statements:
            raise Skip("matched statements are not in source order")
        return ForwardEdit(
            statements=tuple(pos(ctx, s) for s in statements),
            anchor=pos(ctx, anchor_stmt),
            expr_edits=(ExprEdit(ctx.char_span(anchor), self.anchor_text),),
            delete=tuple(pos(ctx, self._effective(s)) for s in deleted),
        )

    def _effective(self, stmt: ast.stmt) -> ast.stmt:
        return stmt

    def _targets(self, stmt: ast.stmt) -> tuple[str, ...]:
        """The names a deleted statement binds (the intermediates only matched code may read)."""
        name = simple_assign_target(stmt)
        return (name,) if name is not None else ()

    def _check_intermediates(self, deleted: list[ast.stmt], anchor: ast.expr, anchor_stmt: ast.stmt) -> None:
        """A deleted statement's targets may be read only by matched code, until rebound by a
        plain assignment in the same block (or by the anchor statement)."""
        ctx = self.ctx
        exempt = [anchor, *deleted]
        for stmt in deleted:
            for name in self._targets(stmt):
                rebinders = [s for s in walk(self.fn) if isinstance(s, (ast.Assign, ast.AnnAssign))
                             and simple_assign_target(s) == name and s not in deleted
                             and (s.lineno, s.col_offset) > (stmt.lineno, stmt.col_offset)]
                for node in walk(self.fn):
                    if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
                        continue
                    if (node.lineno, node.col_offset) <= (stmt.end_lineno, stmt.end_col_offset):
                        continue
                    if any(self._inside(node, e) for e in exempt):
                        continue
                    if not any((r.end_lineno, r.end_col_offset) <= (node.lineno, node.col_offset)
                               and (ctx.block_of(r)[2] is ctx.block_of(stmt)[2] or r is anchor_stmt)
                               for r in rebinders):
                        raise Skip(f"intermediate {name!r} is also read at line {node.lineno}")

    def _check_moves(self, deleted: list[ast.stmt], anchor_stmt: ast.stmt) -> None:
        """Argument expressions taken from deleted statements must evaluate to the same
        value at the anchor: nothing left in between rebinds what they read, and an
        expression with calls is only moved when nothing at all remains in between."""
        ctx = self.ctx
        for expr, origin_call in self.moved:
            if self._inside(origin_call, anchor_stmt):
                continue
            origin = ctx.statement_of(origin_call)
            between = [
                s
                for s in walk(self.fn)
                if isinstance(s, ast.stmt)
                and s not in deleted
                and (s.lineno, s.col_offset) > (origin.end_lineno, origin.end_col_offset)
                and (s.end_lineno, s.end_col_offset) <= (anchor_stmt.lineno, anchor_stmt.col_offset)
                and not any(self._inside(s, d) for d in deleted)
            ]
            # Compound statements that *contain* the anchor evaluate only their test in between.
            containers = [
                s
                for s in walk(self.fn)
                if isinstance(s, ast.If)
                and self._inside(anchor_stmt, s)
                and (s.lineno, s.col_offset) > (origin.lineno, origin.col_offset)
            ]
            rebound = set()
            for s in between:
                rebound |= stores(s)
            for s in containers:
                rebound |= {n.target.id for n in walk(s.test) if isinstance(n, ast.NamedExpr)}
            clash = loads(expr) & rebound
            if clash:
                raise Skip(f"{', '.join(sorted(clash))} changes between line {origin.lineno} and line {anchor_stmt.lineno}")
            if has_call(expr) and (between or containers):
                raise Skip(f"argument {ctx.segment(expr)!r} has calls and would move past other code")


# ---------------------------------------------------------------- kernel names


def kernel_name(ctx: FileContext, name: str) -> tuple[str, str]:
    """``(import spec, local name)`` for ``from adopter.kernels import <spec>``.

    Function kernels (``softmax``, ``attention``) are common identifiers; when the module
    already uses the name for something else we import under ``adopter_<name>``."""
    existing = ctx.kernel_imports()
    if name in existing:
        return (name if existing[name] == name else f"{name} as {existing[name]}"), existing[name]
    if name in ctx.module_names():
        alias = f"adopter_{name}"
        return f"{name} as {alias}", alias
    return name, name
