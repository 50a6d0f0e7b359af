"""The small symbolic evaluation the rotary rule reads a rotation with: each expression of a
candidate rotation (a ``rotate_half``/``rotate_every_two`` body, or the statements of an inline
rotation) is evaluated to a *symbol* for what it holds relative to the rotated tensor ``x`` — ``x``
itself, its last dimension ``d`` and half of it ``h``, the halves ``x1``/``x2`` (or even/odd
positions), their negations, the rotation ``rot`` — or the evaluation stops with
:class:`NotTheRotation` and why. Names are read from an environment (``name -> symbol``) the caller
fills from the rotation's assignments. Nothing else is evaluated: an expression that is not one of
these pieces is not the rotation.

Rotary's own reader, not a general one: the symbols are the ones these two layouts need."""

from __future__ import annotations

import ast

from adopter.core.rules.rotary_embedding.literals import (
    arg,
    einops_last_dim,
    int_const,
    is_ellipsis,
    last_dim_arg,
    splits_last,
    unflattens_last,
    whole_slice,
)
from adopter.core.rules.rotary_embedding.scope import TorchNames
from adopter.core.rules.rotary_embedding.site import Facts

Env = dict  # name -> the symbol it holds (a str, or a tuple of them)


class NotTheRotation(Exception):
    """The rotation's source is not (provably) the rotation; the message says why."""


class HalfSplitValues:
    """Symbolic evaluation of a candidate ``rotate_half(x)`` body: each name holds one of
    ``x``, ``d`` (``x.shape[-1]``), ``h`` (``d // 2``), ``x1``/``x2`` (first/second half),
    ``-x1``/``-x2``, ``rot`` (``cat((-x2, x1), dim=-1)``), or a tuple of them (``x.chunk(2, -1)``)."""

    def __init__(self, names: TorchNames, chunks: bool = True):
        self.names = names
        self.chunks = chunks  # halves from x.chunk(2, dim=-1) or a (2, d/2) view accepted (else sliced only)

    def value(self, e: ast.expr, env: Env) -> object:
        if isinstance(e, ast.Name) and e.id in env:
            return env[e.id]
        if isinstance(e, ast.Name):
            return self.unknown_name(e, env)
        if isinstance(e, ast.Tuple):
            return tuple(self.value(elt, env) for elt in e.elts)
        if isinstance(e, ast.Subscript) and self._is_x(e.value, env):
            return self._slice(e.slice, env)
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "shape" \
                and self._is_x(e.value.value, env) and int_const(e.slice) == -1:
            return "d"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "size" \
                and self._is_x(e.func.value, env) and len(e.args) == 1 and int_const(e.args[0]) == -1:
            return "d"
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.FloorDiv) and int_const(e.right) == 2 \
                and self.value(e.left, env) == "d":
            return "h"
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            inner = self.value(e.operand, env)
            if inner in ("x1", "x2"):
                return "-" + inner
        if isinstance(e, ast.Call) and self.names.is_(e.func, "cat"):
            return self._cat(e, env)
        halves = ("x1", "x2") if isinstance(e, ast.Call) and self._is_chunk(e, env) else self._halves_view(e, env)
        if halves is not None:
            if not self.chunks:
                raise NotTheRotation(f"the halves come from {ast.unparse(e)}: rewritten inline only when sliced")
            return halves
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("stack", "flatten",
                                                                                            "unbind", "view"):
            raise NotTheRotation(f"it builds pairs ({ast.unparse(e)}): an interleaved rotation, not rotate_half")
        raise NotTheRotation(f"{ast.unparse(e)} is not part of the half-split rotation")

    def unknown_name(self, e: ast.Name, env: Env) -> object:
        raise NotTheRotation(f"{e.id} is not part of the half-split rotation")

    def _halves_view(self, e: ast.expr, env: Env) -> object:
        """The halves read through a ``(2, d/2)`` view of the last dimension (x-transformers):
        ``x.shape`` -> ``shape``, ``x.shape[:-1]`` -> ``lead``, ``x.reshape(*x.shape[:-1], 2, -1)``
        (``.view``, ``x.shape[:-1] + (2, -1)``, ``x.unflatten(-1, (2, -1))``) -> ``halves``, its
        ``.unbind(-2)`` -> ``(x1, x2)``, ``halves[..., i, :]`` -> the half ``i``; None for anything
        else. A ``(-1, 2)`` view pairs neighbours instead (the interleaved layout): not read here."""
        if isinstance(e, ast.Attribute) and e.attr == "shape" and self._is_x(e.value, env):
            return "shape"
        if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Slice) and e.slice.lower is None \
                and e.slice.step is None and int_const(e.slice.upper) == -1 and self._value_is(e.value, env, "shape"):
            return "lead"
        if isinstance(e, ast.Subscript) and self._value_is(e.value, env, "halves"):
            parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
            if len(parts) == 3 and is_ellipsis(parts[0]) and int_const(parts[1]) in (0, 1) and whole_slice(parts[2]):
                return ("x1", "x2")[int_const(parts[1])]
            return None
        if isinstance(e, ast.Call) and self.names.is_rearrange(e.func) and e.args and self._is_x(e.args[0], env):
            # ``rearrange(x, '... (r d) -> ... r d', r=2)``
            return "halves" if einops_last_dim(e) == "halves" else None
        if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute)):
            return None
        if e.keywords and e.func.attr != "unbind":  # unbind(dim=-2) only
            return None
        method, receiver, args = e.func.attr, e.func.value, list(e.args)
        if method in ("reshape", "view") and self._is_x(receiver, env):
            return "halves" if splits_last(args, lambda lead: self._value_is(lead, env, "lead"), [2, -1]) else None
        if method == "unflatten" and self._is_x(receiver, env) and unflattens_last(args, [2, -1]):
            return "halves"
        if method == "unbind" and self._value_is(receiver, env, "halves"):
            dim = arg(e, 0, "dim")
            if dim is not None and int_const(dim) == -2 and len(args) + len(e.keywords) == 1:
                return ("x1", "x2")
        return None

    def _value_is(self, e: ast.expr, env: Env, want: str) -> bool:
        try:
            return self.value(e, env) == want
        except NotTheRotation:
            return False

    def _is_x(self, e: ast.expr, env: Env) -> bool:
        return isinstance(e, ast.Name) and self._value_is(e, env, "x")

    def _is_chunk(self, call: ast.Call, env: Env) -> bool:
        """``x.chunk(2, dim=-1)`` or ``torch.chunk(x, 2, dim=-1)``."""
        if not isinstance(call.func, ast.Attribute) or call.func.attr != "chunk":
            return False
        if isinstance(call.func.value, ast.Name) and call.func.value.id in self.names.modules:
            if not call.args or not self._is_x(call.args[0], env):
                return False
            rest = ast.Call(func=call.func, args=call.args[1:], keywords=call.keywords)
        elif self._is_x(call.func.value, env):
            rest = call
        else:
            return False
        chunks = arg(rest, 0, "chunks")
        return chunks is not None and int_const(chunks) == 2 and last_dim_arg(rest, 1)

    def _slice(self, s: ast.expr, env: Env) -> str:
        parts = s.elts if isinstance(s, ast.Tuple) else [s]
        text = ", ".join(ast.unparse(p) for p in parts)
        if any(isinstance(p, ast.Slice) and p.step is not None for p in parts):
            raise NotTheRotation(f"x[{text}] takes every other element: an interleaved rotation "
                                 "(GPT-J/GLM style), not rotate_half")
        if len(parts) != 2 or not is_ellipsis(parts[0]) or not isinstance(parts[1], ast.Slice):
            raise NotTheRotation(f"x[{text}] is not a slice of the last dimension written x[..., a:b]")
        sl = parts[1]
        lower = None if sl.lower is None or int_const(sl.lower) == 0 else self.value(sl.lower, env)
        upper = None if sl.upper is None else self.value(sl.upper, env)
        if lower is None and upper == "h":
            return "x1"
        if lower == "h" and upper is None:
            return "x2"
        raise NotTheRotation(f"x[{text}] is not the first or second half of the last dimension")

    def _last_dim(self, call: ast.Call, env: Env) -> bool:
        """The call's ``dim`` is -1, or ``t.ndim - 1`` / ``t.dim() - 1`` of the rotated tensor or a
        half of it (wav2vec2-conformer)."""
        if last_dim_arg(call, 1):
            return True
        dim = arg(call, 1, "dim")
        if not (isinstance(dim, ast.BinOp) and isinstance(dim.op, ast.Sub) and int_const(dim.right) == 1):
            return False
        rank = dim.left
        if isinstance(rank, ast.Attribute) and rank.attr == "ndim":
            tensor = rank.value
        elif isinstance(rank, ast.Call) and isinstance(rank.func, ast.Attribute) and rank.func.attr == "dim" \
                and not rank.args and not rank.keywords:
            tensor = rank.func.value
        else:
            return False
        try:
            return self.value(tensor, env) in ("x", "x1", "x2", "-x1", "-x2")
        except NotTheRotation:
            return False

    def _cat(self, call: ast.Call, env: Env) -> str:
        seq = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "tensors"), None)
        if not isinstance(seq, (ast.Tuple, ast.List)):
            raise NotTheRotation(f"{ast.unparse(call)} is not a concatenation of two halves along dim=-1")
        got = [self.value(e, env) for e in seq.elts]
        if got != ["-x2", "x1"]:
            raise NotTheRotation(f"it returns cat(({_shown(got)}), dim=-1), not cat((-x2, x1), dim=-1)")
        if not self._last_dim(call, env):
            raise NotTheRotation(f"{ast.unparse(call)} is not a concatenation of two halves along dim=-1")
        return "rot"


def _shown(got: list[object]) -> str:
    """The symbols of a concatenation's or stack's parts as a message shows them."""
    return ", ".join(g if isinstance(g, str) else "?" for g in got)


class InlineHalfSplitValues(HalfSplitValues):
    """:class:`HalfSplitValues` over a function's statements: names assigned once in the calling
    function are read from their assignment (``x1 = x[..., : head_size // 2]``); the tensor rotated
    is the name mapped to ``x``. ``resolved`` collects the names read so. Halves only by slicing."""

    def __init__(self, names: TorchNames, facts: Facts):
        super().__init__(names, chunks=False)
        self.facts = facts
        self.resolved: set[str] = set()
        self._busy: set[str] = set()

    def unknown_name(self, e: ast.Name, env: Env) -> object:
        bound = self.facts.single.get(e.id)
        if bound is None or e.id in self._busy:
            raise NotTheRotation(f"{e.id} is not assigned once in the function")
        stmt, value, index = bound
        self._busy.add(e.id)
        try:
            got = self.value(value, env)
        finally:
            self._busy.discard(e.id)
        if index is not None:
            if not isinstance(got, tuple) or index >= len(got):
                raise NotTheRotation(f"line {stmt.lineno} ({ast.unparse(stmt)}) is not part of the rotation")
            got = got[index]
        env[e.id] = got
        self.resolved.add(e.id)
        return got


class InterleavedValues:
    """Symbolic evaluation of a candidate ``rotate_every_two(x)`` body: each name holds one of
    ``x``, ``pairs`` (``x.reshape(*x.shape[:-1], -1, 2)``), ``x1``/``x2`` (even/odd positions,
    ``x[..., ::2]``/``x[..., 1::2]``), ``-x1``/``-x2``, ``stacked`` (``stack((-x2, x1), dim=-1)``),
    ``rot`` (``stacked.flatten(-2)``), ``shape`` (``x.shape``), or a tuple of them (``unbind``)."""

    def __init__(self, names: TorchNames):
        self.names = names

    def value(self, e: ast.expr, env: Env) -> object:
        if isinstance(e, ast.Name) and e.id in env:
            return env[e.id]
        if isinstance(e, ast.Tuple):
            return tuple(self.value(elt, env) for elt in e.elts)
        if isinstance(e, ast.Attribute) and e.attr == "shape" and self.value(e.value, env) == "x":
            return "shape"
        if isinstance(e, ast.Subscript):
            return self._subscript(e, env)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            inner = self.value(e.operand, env)
            if inner in ("x1", "x2"):
                return "-" + inner
        if isinstance(e, ast.Call):
            return self._call(e, env)
        raise NotTheRotation(f"{ast.unparse(e)} is not part of the interleaved rotation")

    def _subscript(self, e: ast.Subscript, env: Env) -> str:
        base = self.value(e.value, env)
        parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
        text = ", ".join(ast.unparse(p) for p in parts)
        last = parts[-1]
        leading = parts[:-1]
        all_leading = (len(leading) == 1 and is_ellipsis(leading[0])) or all(whole_slice(p) for p in leading)
        if base == "x" and all_leading and isinstance(last, ast.Slice) and last.upper is None \
                and last.step is not None and int_const(last.step) == 2:
            start = 0 if last.lower is None else int_const(last.lower)
            if start in (0, 1):
                return ("x1", "x2")[start]
        if base == "pairs" and len(parts) == 2 and is_ellipsis(parts[0]) and int_const(last) in (0, 1):
            return ("x1", "x2")[int_const(last)]
        if base == "shape" and isinstance(last, ast.Slice) and last.lower is None and int_const(last.upper) == -1 \
                and last.step is None and len(parts) == 1:
            return "lead"
        raise NotTheRotation(f"{ast.unparse(e.value)}[{text}] is not the even or odd positions of the last dimension")

    def _call(self, call: ast.Call, env: Env) -> object:
        func = call.func
        if self.names.is_rearrange(func) and call.args:
            # x-transformers: ``rearrange(x, '... (d r) -> ... d r', r=2)`` pairs neighbours,
            # ``rearrange(stacked, '... d r -> ... (d r)')`` flattens the stack back
            base, layout = self.value(call.args[0], env), einops_last_dim(call)
            if base == "x" and layout == "pairs":
                return "pairs"
            if base == "stacked" and layout == "merge":
                return "rot"
            raise NotTheRotation(f"{ast.unparse(call)} is not part of the interleaved rotation")
        if self.names.is_(func, "stack"):
            seq = call.args[0] if call.args else None
            if not isinstance(seq, (ast.Tuple, ast.List)) or not last_dim_arg(call, 1):
                raise NotTheRotation(f"{ast.unparse(call)} is not a stack of two parts along dim=-1")
            got = [self.value(elt, env) for elt in seq.elts]
            if got != ["-x2", "x1"]:
                raise NotTheRotation(f"it stacks ({_shown(got)}), not (-x2, x1)")
            return "stacked"
        if self.names.is_(func, "flatten", "unbind") and call.args:  # torch.flatten(t, ...): t the receiver
            receiver, rest = call.args[0], ast.Call(func=func, args=call.args[1:], keywords=call.keywords)
        elif isinstance(func, ast.Attribute):
            receiver, rest = func.value, call
        else:
            raise NotTheRotation(f"{ast.unparse(call)} is not part of the interleaved rotation")
        method = func.attr if isinstance(func, ast.Attribute) else self.names.functions.get(func.id, "")
        base = self.value(receiver, env)
        if base == "stacked" and method == "flatten":
            start = arg(rest, 0, "start_dim")
            if start is not None and int_const(start) == -2 and len(rest.args) + len(rest.keywords) == 1:
                return "rot"
        if base == "stacked" and method in ("reshape", "view") and len(rest.args) == 1 and not rest.keywords \
                and self.value(rest.args[0], env) == "shape":
            return "rot"
        if base == "x" and method in ("reshape", "view") and not rest.keywords \
                and splits_last(list(rest.args), lambda lead: self.value(lead, env) == "lead", [-1, 2]):
            return "pairs"
        if base == "x" and method == "unflatten" and unflattens_last(list(rest.args), [-1, 2]):
            return "pairs"
        if base == "pairs" and method == "unbind" and last_dim_arg(rest, 0):
            return ("x1", "x2")
        raise NotTheRotation(f"{ast.unparse(call)} is not part of the interleaved rotation")


def _assign(values: HalfSplitValues | InterleavedValues, stmt: ast.stmt, env: Env) -> None:
    """Bind the targets of a plain assignment (a name, or a tuple of names unpacking a tuple of
    values: ``x1, x2 = x.chunk(2, dim=-1)``) in ``env``."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        raise NotTheRotation(f"line {stmt.lineno} is not a plain assignment")
    target = stmt.targets[0]
    if isinstance(target, ast.Name):
        env[target.id] = values.value(stmt.value, env)
        return
    if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
        value = values.value(stmt.value, env)
        if isinstance(value, tuple) and len(value) == len(target.elts):
            for t, v in zip(target.elts, value):
                env[t.id] = v
            return
    raise NotTheRotation(f"line {stmt.lineno} ({ast.unparse(stmt)}) is not part of the rotation")


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    return body


def read_rotation(fn: ast.FunctionDef, values: HalfSplitValues | InterleavedValues, param: str, want: str,
                  returns: str) -> str:
    """"" when ``fn``'s body (its rotated tensor ``param``) returns the ``want`` symbol of
    ``values``' evaluation, its statements before the return plain assignments of the rotation's
    pieces; otherwise why not (``returns``: the rotation as the message shows it)."""
    env: Env = {param: "x"}
    body = _body(fn)
    try:
        for stmt in body[:-1]:
            _assign(values, stmt, env)
        if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
            raise NotTheRotation("it does not end with a return of the rotation")
        if values.value(body[-1].value, env) != want:
            raise NotTheRotation(f"it returns {ast.unparse(body[-1].value)}, not {returns}")
    except NotTheRotation as why:
        return str(why)
    return ""
