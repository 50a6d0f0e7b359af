"""Constants and call arguments as the rotary forms read them off the syntax tree: an integer
(``-1`` included), a call's argument by position or keyword, ``dim=-1``, ``...`` and ``:`` in a
subscript, and the shapes that split the last dimension in two (``x.reshape(*x.shape[:-1], 2, -1)``,
``x.unflatten(-1, (-1, 2))``)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable


def int_const(e: ast.expr) -> int | None:
    """The integer ``e`` writes (``2``, ``-1``), else None (a bool is no integer here)."""
    if isinstance(e, ast.Constant) and type(e.value) is int:
        return e.value
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        inner = int_const(e.operand)
        return -inner if inner is not None else None
    return None


def arg(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    """The call's argument at ``position`` or named ``keyword`` (None when absent or both)."""
    found = [k.value for k in call.keywords if k.arg == keyword]
    if len(call.args) > position:
        found.append(call.args[position])
    return found[0] if len(found) == 1 else None


def last_dim_arg(call: ast.Call, position: int) -> bool:
    """The call's ``dim`` (keyword, or positional at ``position``) is the constant -1."""
    dim = arg(call, position, "dim")
    return dim is not None and int_const(dim) == -1


def is_ellipsis(e: ast.expr) -> bool:
    """``...`` (in a subscript: every leading dimension)."""
    return isinstance(e, ast.Constant) and e.value is Ellipsis


def whole_slice(e: ast.expr) -> bool:
    """``:`` (in a subscript: the whole dimension)."""
    return isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None


def ints(elts: list[ast.expr]) -> list[int | None]:
    return [int_const(v) for v in elts]


def splits_last(args: list[ast.expr], is_lead: Callable[[ast.expr], bool], sizes: list[int]) -> bool:
    """``args`` of a ``reshape``/``view`` give the leading dimensions (``is_lead``) and then
    ``sizes`` for the last one: ``(*lead, a, b)`` or ``(lead + (a, b))``. ``is_lead`` is asked
    before the sizes are compared (a reader may raise on what it cannot read)."""
    if len(args) == 1 and isinstance(args[0], ast.BinOp) and isinstance(args[0].op, ast.Add) \
            and isinstance(args[0].right, ast.Tuple):
        return is_lead(args[0].left) and ints(args[0].right.elts) == sizes
    return len(args) == 3 and isinstance(args[0], ast.Starred) and is_lead(args[0].value) \
        and ints(args[1:]) == sizes


def unflattens_last(args: list[ast.expr], sizes: list[int]) -> bool:
    """``args`` of an ``unflatten`` split the last dimension into ``sizes``: ``(-1, (a, b))``."""
    return len(args) == 2 and int_const(args[0]) == -1 and isinstance(args[1], (ast.Tuple, ast.List)) \
        and ints(args[1].elts) == sizes


def called_name(func: ast.expr) -> str:
    """The name a call's function is read by: ``f`` of ``f(...)`` and of ``a.b.f(...)``; "" else."""
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


_EINOPS_TOKEN = re.compile(r"\s*(\(|\)|\.\.\.|[A-Za-z_]\w*)")


def _einops_axes(side: str) -> list | None:
    """One side of an einops pattern as axes: names or ``...``, a parenthesised group as a tuple of
    names; None for anything else (numbers, anonymous axes, nesting)."""
    out: list = []
    group: list | None = None
    pos = 0
    side = side.strip()
    while pos < len(side):
        m = _EINOPS_TOKEN.match(side, pos)
        if m is None:
            return None
        tok, pos = m.group(1), m.end()
        if tok == "(":
            if group is not None:
                return None
            group = []
        elif tok == ")":
            if group is None:
                return None
            out.append(tuple(group))
            group = None
        elif group is not None:
            if tok == "...":
                return None
            group.append(tok)
        else:
            out.append(tok)
    return out if group is None else None


def einops_last_dim(call: ast.Call) -> str | None:
    """What ``rearrange(t, pattern, **sizes)`` does to the last dimension: ``"halves"`` for
    ``'... (r d) -> ... r d'`` with ``r=2`` (two halves: a ``(2, d/2)`` view), ``"pairs"`` for
    ``'... (d r) -> ... d r'`` with ``r=2`` (neighbours paired: a ``(d/2, 2)`` view), ``"merge"``
    for ``'... d r -> ... (d r)'`` (the last two dimensions flattened in order); the leading axes
    the same on both sides (``...`` or named). None for any other pattern (the axis names are the
    user's: only their positions count)."""
    if len(call.args) != 2 or not isinstance(call.args[1], ast.Constant) or not isinstance(call.args[1].value, str):
        return None
    lhs, arrow, rhs = call.args[1].value.partition("->")
    left, right = (_einops_axes(lhs), _einops_axes(rhs)) if arrow else (None, None)
    if not left or not right or left[:-1] != right[:-2] and left[:-2] != right[:-1]:
        return None
    sizes = {k.arg: int_const(k.value) for k in call.keywords}
    if None in sizes:
        return None
    split = isinstance(left[-1], tuple) and len(left[-1]) == 2 and len(right) >= 2 \
        and left[:-1] == right[:-2] and list(left[-1]) == right[-2:]
    if split and not any(isinstance(a, tuple) for a in right) and len(set(left[-1])) == 2 \
            and not set(left[-1]) & set(left[:-1]):
        outer, inner = left[-1]
        if sizes == {outer: 2}:
            return "halves"
        if sizes == {inner: 2}:
            return "pairs"
        return None
    merge = isinstance(right[-1], tuple) and len(right[-1]) == 2 and len(left) >= 2 \
        and right[:-1] == left[:-2] and list(right[-1]) == left[-2:]
    if merge and not sizes and not any(isinstance(a, tuple) for a in left) and len(set(right[-1])) == 2:
        return "merge"
    return None
