"""Constants and call arguments as the rotary forms read them off the syntax tree: an integer
(``-1`` included), a call's argument by position or keyword, ``dim=-1``, ``...`` and ``:`` in a
subscript, and the shapes that split the last dimension in two (``x.reshape(*x.shape[:-1], 2, -1)``,
``x.unflatten(-1, (-1, 2))``)."""

from __future__ import annotations

import ast
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
