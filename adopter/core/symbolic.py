"""The symbolic evaluator the rules share: what a small piece of source computes, read from its
``ast`` (nothing is imported or run).

A rule that must know the value of a function body (an activation module's formula, a norm's
``forward``, a helper method it calls) evaluates it here:

* an *environment* (a ``dict``) binds names to values of the rule's choosing: :class:`Sym` terms,
  or plain numbers where a rule evaluates a formula at sample points;
* :class:`Evaluator` walks the ``ast``: expressions by kind, each through a hook a rule overrides
  for what it recognises (``torch.rsqrt``, a GeLU call, ``ctx.saved_tensors``); a body of plain
  assignments ending in a ``return`` (:meth:`Evaluator.run`), with a statement hook for the
  other statements a rule reads; a same-file function or method inlined with its parameters
  bound (:meth:`Evaluator.inline`, nesting bounded);
* :class:`Unknown` is a first-class outcome: what no hook reads makes the value unknown, never
  a guess. A rule may also keep an unknown *value* (``Sym.unknown``) where the rest of an
  expression still says something (a call whose arguments are read on).

Model-structure extraction (:mod:`adopter.core.extract`) does not run on this evaluator: it
enumerates every control-flow path of whole forwards, forking and merging states, writing DSL
nodes in SSA form under path and step budgets tuned for scanning whole libraries; what it shares
with the rules' evaluation is the reading of dotted names (:func:`dotted`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from adopter.core.syntax import dotted_name as dotted  # noqa: F401 (re-exported: the rules read it here)

V = TypeVar("V")


class Unknown(Exception):
    """The evaluator cannot tell what the code computes (outside what the rule reads)."""


@dataclass(frozen=True)
class Sym:
    """A symbolic value: ``kind`` says what it is (each rule names the kinds it builds), ``value``
    its payload (an attribute name, a constant, an operator), ``args``/``kw`` the values it is
    computed from. Equal terms compute the same value: ``node`` (the expression it was read from)
    and ``text`` (a constant as the source writes it) are for messages and rewrites only."""

    kind: str
    value: object = None
    args: tuple = ()
    kw: tuple = ()
    node: ast.AST | None = field(default=None, compare=False, hash=False)
    text: str = field(default="", compare=False, hash=False)

    def kwarg(self, name: str, position: int | None = None):
        """The argument named ``name``, else the one at ``position`` (None when absent)."""
        for k, v in self.kw:
            if k == name:
                return v
        return self.args[position] if position is not None and position < len(self.args) else None

    @staticmethod
    def unknown(node: ast.AST, args: tuple = ()) -> Sym:
        """An expression no hook reads, as a value (its source text); ``args``: the values it is
        computed from, kept visible."""
        return Sym("unknown", ast.unparse(node), args, node=node)


@dataclass(frozen=True)
class Returned(Generic[V]):
    """A statement that leaves the body with ``value``."""

    value: V


# expression type -> the Evaluator hook that reads it
_HOOKS = {
    ast.Name: "name", ast.Constant: "constant", ast.Attribute: "attribute", ast.BinOp: "binop",
    ast.UnaryOp: "unaryop", ast.Subscript: "subscript", ast.Call: "call", ast.IfExp: "ifexp",
    ast.Tuple: "tuple_",
}


class Evaluator(Generic[V]):
    """Evaluates ``ast`` expressions and bodies over an environment ``{name: value}``.

    Every expression hook defaults to :meth:`other`, which raises :class:`Unknown`; a rule
    overrides the hooks for what it reads (and :meth:`other` to keep unknown values instead of
    failing). :meth:`statement` reads a plain ``name = value`` and a ``return``; a rule extends
    it for the other statements it reads. ``max_depth`` bounds the nesting of inlined functions.
    """

    max_depth = 8
    depth = 0  # functions being inlined around the current evaluation

    # -- expressions
    def eval(self, node: ast.expr, env: dict[str, V]) -> V:
        hook = _HOOKS.get(type(node))
        return getattr(self, hook)(node, env) if hook is not None else self.other(node, env)

    def name(self, node: ast.Name, env: dict[str, V]) -> V:
        if node.id in env:
            return env[node.id]
        return self.unbound(node, env)

    def unbound(self, node: ast.Name, env: dict[str, V]) -> V:
        """A name the environment does not bind."""
        return self.other(node, env)

    def constant(self, node: ast.Constant, env: dict[str, V]) -> V:
        return self.other(node, env)

    def attribute(self, node: ast.Attribute, env: dict[str, V]) -> V:
        return self.other(node, env)

    def binop(self, node: ast.BinOp, env: dict[str, V]) -> V:
        return self.other(node, env)

    def unaryop(self, node: ast.UnaryOp, env: dict[str, V]) -> V:
        return self.other(node, env)

    def subscript(self, node: ast.Subscript, env: dict[str, V]) -> V:
        return self.other(node, env)

    def call(self, node: ast.Call, env: dict[str, V]) -> V:
        return self.other(node, env)

    def ifexp(self, node: ast.IfExp, env: dict[str, V]) -> V:
        return self.other(node, env)

    def tuple_(self, node: ast.Tuple, env: dict[str, V]) -> V:
        return self.other(node, env)

    def other(self, node: ast.expr, env: dict[str, V]) -> V:
        """An expression no hook reads."""
        raise Unknown(ast.unparse(node))

    # -- statements
    def run(self, body: list[ast.stmt], env: dict[str, V]) -> V:
        """The value ``body`` returns, its statements run in order on ``env`` (updated in place);
        a leading docstring is skipped. :class:`Unknown` when a statement is not read or the body
        ends without a ``return``."""
        for i, st in enumerate(body):
            if i == 0 and self.is_docstring(st):
                continue
            returned = self.statement(st, env, body[i + 1:])
            if returned is not None:
                return returned.value
        raise Unknown("the body ends without a return")

    @staticmethod
    def is_docstring(st: ast.stmt) -> bool:
        """``st`` (a body's first statement) is its docstring."""
        return is_docstring(st)

    def statement(self, st: ast.stmt, env: dict[str, V], rest: list[ast.stmt]) -> Returned[V] | None:
        """Run ``st`` (``rest``: the statements after it): a plain ``name = value`` binds the name,
        a ``return value`` leaves the body (:class:`Returned`); anything else is unknown."""
        target = assigned_name(st)
        if target is not None:
            env[target] = self.eval(st.value, env)
            return None
        if isinstance(st, ast.Return) and st.value is not None:
            return Returned(self.eval(st.value, env))
        raise Unknown(ast.unparse(st))

    def assignments(self, body: list[ast.stmt], env: dict[str, V]) -> dict[str, V]:
        """A copy of ``env`` after ``body``, a block of plain ``name = value`` assignments;
        :class:`Unknown` for any other statement."""
        env = dict(env)
        for st in body:
            target = assigned_name(st)
            if target is None:
                raise Unknown(ast.unparse(st))
            env[target] = self.eval(st.value, env)
        return env

    # -- inlining
    def inline(self, fn: ast.FunctionDef, env: dict[str, V]) -> V:
        """The value ``fn`` returns with its parameters bound in ``env`` (the callee's own
        environment); :class:`Unknown` past ``max_depth`` nested calls."""
        if self.depth >= self.max_depth:
            raise Unknown(f"{fn.name} is inlined {self.depth} calls deep")
        self.depth += 1
        try:
            return self.run(fn.body, env)
        finally:
            self.depth -= 1


# ---------------------------------------------------------------- reading the ast


def is_docstring(st: ast.stmt) -> bool:
    """``st`` is a string on its own (a docstring when it is a body's first statement)."""
    return isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)


def assigned_name(st: ast.stmt) -> str | None:
    """The name of a plain ``name = value`` assignment; None for any other statement."""
    if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
        return st.targets[0].id
    return None


def positional_parameters(fn: ast.FunctionDef) -> list[str] | None:
    """The parameter names of ``fn`` when it takes plain positional parameters only (no
    ``*args``/``**kwargs``, keyword-only or positional-only parameters, defaults), else None."""
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
        return None
    return [p.arg for p in a.args]
