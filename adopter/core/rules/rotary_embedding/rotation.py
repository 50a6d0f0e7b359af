"""The rotation function's source: whether a ``rotate_half``-like function of the file is the
half-split rotation (HF Llama's ``cat((-x2, x1), dim=-1)``), the interleaved one (GPT-J's
``rotate_every_two``), another rotation (a flipped sign: worth a reason), or none; read from its
body, whatever it is named.

Extraction inlines ``rotate_half(x)`` into the calling function (its ``-x2`` and ``torch.cat``,
not the slicing). ``Rule.inlined_functions`` (:func:`rotation_functions`) folds that run back into
one call at the call site: module-level functions whose source is the half-split rotation become
``ROTATE_HALF``, the interleaved one ``ROTATE_EVERY_TWO``, other one-argument functions that negate
and concatenate/stack (a flipped sign) ``OTHER_ROTATION``, turned down by the precondition with the
reason. The rotation call is not a pattern node: the trace attributes its ops to the lines of the
rotation function, not to the call site, so confirmation would not find it; the precondition
checks that one product reads a rotation (a folded call, a ``torch.cat`` inlined from a method or
written inline, a ``Cls.rotate_half(x)`` call left as it is) and reads the rest from the source."""

from __future__ import annotations

import ast

from adopter.core.match.source import parse_file
from adopter.core.rules.rotary_embedding.literals import called_name
from adopter.core.rules.rotary_embedding.scope import module_statements, torch_names
from adopter.core.rules.rotary_embedding.values import HalfSplitValues, InterleavedValues, read_rotation
from adopter.core.syntax import walk

ROTATE_HALF = "adopter.rotary.rotate_half"
ROTATE_EVERY_TWO = "adopter.rotary.rotate_every_two"
OTHER_ROTATION = "adopter.rotary.other_rotation"
FOLDED = (ROTATE_HALF, ROTATE_EVERY_TWO, OTHER_ROTATION)  # the node types of a folded rotation call
HALF_SPLIT, INTERLEAVED = "half-split", "interleaved"


def rotation_param(fn: ast.FunctionDef, kind: str) -> str | None:
    """The rotated tensor's parameter of ``fn`` called as ``kind`` (``function``: a plain
    one-argument function; ``static``: a ``@staticmethod`` or a one-argument function read off a
    class; ``method``: ``def rotate_half(self, x)`` not reading ``self``), or None."""
    a = fn.args
    params = a.posonlyargs + a.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.defaults:
        return None
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    if kind == "function" and not decorators and len(params) == 1:
        return params[0].arg
    if kind == "static" and decorators in ([], ["staticmethod"]) and len(params) == 1:
        return params[0].arg
    if kind == "method" and decorators == ["staticmethod"] and len(params) == 1:
        return params[0].arg
    if kind == "method" and not decorators and len(params) == 2:
        this = params[0].arg
        if any(isinstance(n, ast.Name) and n.id == this for s in fn.body for n in walk(s)):
            return None
        return params[1].arg
    return None


def half_split_rotation(fn: ast.FunctionDef, tree: ast.Module, kind: str = "function") -> str:
    """"" when ``fn(x)`` computes ``cat((-x[..., h:], x[..., :h]), dim=-1)`` with
    ``h = x.shape[-1] // 2``; otherwise why not."""
    param = rotation_param(fn, kind)
    if param is None:
        if fn.decorator_list and kind == "function":
            return f"{fn.name} is decorated"
        return f"{fn.name} does not take exactly one argument x"
    why = read_rotation(fn, HalfSplitValues(torch_names(tree)), param, "rot", "cat((-x2, x1), dim=-1)")
    return f"{fn.name} is not the half-split rotate_half: {why}" if why else ""


def interleaved_rotation(fn: ast.FunctionDef, tree: ast.Module, kind: str = "function") -> str:
    """"" when ``fn(x)`` computes ``stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)``
    (GPT-J's ``rotate_every_two``); otherwise why not."""
    param = rotation_param(fn, kind)
    if param is None:
        return f"{fn.name} does not take exactly one argument x"
    why = read_rotation(fn, InterleavedValues(torch_names(tree)), param, "rot", "stack((-x2, x1), dim=-1).flatten(-2)")
    return f"{fn.name} is not the interleaved rotate_every_two: {why}" if why else ""


def _builds_pairs(fn: ast.FunctionDef) -> bool:
    """The source pairs even/odd positions (a step slice, a stack, an unbind, a (-1, 2) reshape)."""
    for n in walk(fn):
        if isinstance(n, ast.Slice) and n.step is not None:
            return True
        if isinstance(n, ast.Call) and called_name(n.func) in ("stack", "unbind", "unflatten"):
            return True
    return False


def rotation_layout(fn: ast.FunctionDef, tree: ast.Module, kind: str = "function") -> tuple[str, str]:
    """(``HALF_SPLIT`` or ``INTERLEAVED``, "") when ``fn``'s source is that rotation, else ("", why)."""
    why_half = half_split_rotation(fn, tree, kind)
    if not why_half:
        return HALF_SPLIT, ""
    why_pairs = interleaved_rotation(fn, tree, kind)
    if not why_pairs:
        return INTERLEAVED, ""
    return "", why_pairs if _builds_pairs(fn) and "takes every other element" in why_half else why_half


def rotation_like(fn: ast.FunctionDef, method: bool = False) -> bool:
    """A one-argument function (a method: of ``self`` and one argument, or a @staticmethod) that
    negates something and concatenates or stacks: a rotation of some kind (worth a reason when it
    is not the rotation)."""
    a = fn.args
    wanted = {1, 2} if method else {1}
    if len(a.posonlyargs + a.args) not in wanted or a.vararg or a.kwarg or a.kwonlyargs:
        return False
    negates = any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) for n in walk(fn))
    joins = any(isinstance(n, ast.Call) and called_name(n.func) in ("cat", "stack", "concat") for n in walk(fn))
    return negates and joins


def rotation_functions(structures, source: str | None) -> dict[str, str]:
    """``Rule.inlined_functions``: module-level functions of the file whose inlined body is one
    rotation call — ``ROTATE_HALF`` for the half-split rotation, ``ROTATE_EVERY_TWO`` for the
    interleaved one, ``OTHER_ROTATION`` for other rotations (turned down by the precondition, with
    the reason)."""
    if not source or "def " not in source:
        return {}
    tree = parse_file(source)
    if tree is None:
        return {}
    out: dict[str, str] = {}
    for stmt in module_statements(tree):
        if isinstance(stmt, ast.FunctionDef):
            layout, _ = rotation_layout(stmt, tree)
            if layout:
                out[stmt.name] = ROTATE_HALF if layout == HALF_SPLIT else ROTATE_EVERY_TWO
            elif rotation_like(stmt):
                out[stmt.name] = OTHER_ROTATION
    return out
