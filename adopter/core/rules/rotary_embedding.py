"""rotary_embedding: rotary position embeddings (RoPE) in every way models write them, each computed
by one kernel without the rotation's temporaries (the negated half, the concatenation or stack,
every product and the sum; complex tensors).

Forms (each one a DSL variant below), rewritten one expression at a time, nothing else changes but
statements only the rotation used:

* the sum with a rotation function, half-split (HF Llama) or interleaved (GPT-J's
  ``rotate_every_two``, GLM, Cohere), the function module-level, a ``@staticmethod`` or a method
  of the class (``self.rotate_half(x)``, ``Cls.rotate_half(x)``)::

      q_embed = (q * cos) + (rotate_half(q) * sin)
   => q_embed = rotary(q, cos, sin, rotate_half)
      return (tensor * cos) + (rotate_every_two(tensor) * sin)
   => return rotary_interleaved(tensor, cos, sin, rotate_every_two)

* the half rotation written inline (litgpt's ``apply_rope``): its statements go when only the sum
  reads them and they come right before it, else the rotated tensor is handed over::

      x1 = x[..., : head_size // 2]; x2 = x[..., head_size // 2 :]
      rotated = torch.cat((-x2, x1), dim=-1)
      roped = (x * cos) + (rotated * sin)
   => roped = rotary(x, cos, sin)            (or rotary(x, cos, sin, rotated))

* the complex rotation (Meta-llama, torchtitan, mistral-inference)::

      xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
   => xq_out = rotary_complex(xq_, freqs_cis).flatten(3)

* the pairs rotated in real numbers and stacked (llama2.c) or concatenated::

      xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin; xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
      xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
   => xq_out = rotary_pairs(xq_r, xq_i, freqs_cos, freqs_sin).flatten(3)

``adopter.kernels.rotary*`` run the fused kernel when their preconditions hold at run time (dtypes,
shapes, no gradient wanted for cos/sin/freqs_cis, a rotation function still the rotation read here)
and the original expression otherwise. Each form is recognised by what it computes, read from the
source: which elements pair up (halves or even/odd positions), the signs, the order of the parts; a
look-alike that computes something else (a flipped sign, swapped halves, a third of the dimension,
another tensor rotated than the one multiplied by cos) is not a match, whatever it is named.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from adopter.core.codemod.base import Codemod, kernel_name, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit
from adopter.core.dsl import Const, Layer, TensorOp, Var
from adopter.core.match import MatchContext, NotACandidate
from adopter.core.match.source import function_ast, parse_file
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.structures import Match
from adopter.core.syntax import per_node, walk

# Extraction inlines ``rotate_half(x)`` into the calling function (its ``-x2`` and ``torch.cat``,
# not the slicing). ``Rule.inlined_functions`` folds that run back into one call at the call site:
# module-level functions whose source is the half-split rotation become ``ROTATE_HALF``, the
# interleaved one ``ROTATE_EVERY_TWO``, other one-argument functions that negate and
# concatenate/stack (a flipped sign) ``OTHER_ROTATION``, turned down by the precondition with the
# reason. The rotation call is not a pattern node: the trace attributes its ops to the lines of the
# rotation function, not to the call site, so confirmation would not find it; the precondition
# checks that one product reads a rotation (a folded call, a ``torch.cat`` inlined from a method or
# written inline, a ``Cls.rotate_half(x)`` call left as it is) and reads the rest from the source.
ROTATE_HALF = "adopter.rotary.rotate_half"
ROTATE_EVERY_TWO = "adopter.rotary.rotate_every_two"
OTHER_ROTATION = "adopter.rotary.other_rotation"
HALF_SPLIT, INTERLEAVED = "half-split", "interleaved"

DSL = """
rule rotary_embedding
forward:
    $x * $cos -> $a; $r * $sin -> $b; $a + $b -> $out

rule rotary_embedding
forward:
    $z * $freqs -> $p; torch.view_as_real($p) -> $out

rule rotary_embedding
forward:
    torch.stack|torch.cat|torch.concat($parts) -> $out
"""

DOC = """\
Applies a rotary position embedding in one kernel, in each of the ways models write it. (1) The sum
``x * cos + rotate_half(x) * sin`` (``q`` and ``k`` lines of ``apply_rotary_pos_emb``, any operand
order, parentheses or none, inside a larger expression such as ``torch.cat([(q_rot * cos) +
(rotate_half(q_rot) * sin), q_pass], dim=-1)``) becomes ``rotary(x, cos, sin, rotate_half)``, or
``rotary_interleaved(x, cos, sin, rotate_every_two)`` when the rotation pairs even/odd positions
(GPT-J, CodeGen, GLM, Cohere). The same ``x`` must be in both products (a name, attribute or
subscript, optionally cast with ``.float()``/``.to(...)``: it is evaluated once instead of twice).
The rotation is a call of a function of the same file whose *source* is the rotation — a
module-level function (not rebound there, nor a parameter or local of the calling function), a
``@staticmethod`` or a method not reading ``self`` of the calling class or of a class of the file
(``self.rotate_half(x)``, ``Cls.rotate_half(x)``): half-split ``x1 = x[..., : x.shape[-1] // 2]``,
``x2 = x[..., x.shape[-1] // 2 :]`` (``x.size(-1)``, the half in a local, ``x.chunk(2, dim=-1)``, a ``(2, d/2)`` view unbound
``x.reshape(*x.shape[:-1], 2, -1).unbind(-2)`` or indexed ``[..., 0, :]``/``[..., 1, :]``
(x-transformers), ``cat`` imported from torch), ``return torch.cat((-x2, x1), dim=-1)``; interleaved ``x1 = x[...,
::2]``, ``x2 = x[..., 1::2]`` (``x[:, :, :, ::2]``, ``x.reshape(*x.shape[:-1], -1, 2).unbind(-1)``),
``return torch.stack((-x2, x1), dim=-1).flatten(-2)``. Or the half-split rotation written inline in
the function (litgpt): ``rotated = torch.cat((-x2, x1), dim=-1)`` with ``x1``/``x2`` the halves of
``x`` by slicing, or the ``cat`` in the product itself; the rewrite is ``rotary(x, cos, sin)`` and
removes the rotation's statements when only the sum reads them and they come right before it (else
``rotary(x, cos, sin, rotated)``, the rotated tensor handed over). Partial rotary (``q_rot = q[...,
:rotary_dim]``, Phi/GPT-NeoX/StableLM) matches: the kernel rotates whatever it is given. (2) The
complex rotation ``torch.view_as_real(xq_ * freqs_cis)`` (Meta-llama, torchtitan,
mistral-inference) with ``xq_ = torch.view_as_complex(<x>.reshape(..., -1, 2))`` becomes
``rotary_complex(xq_, freqs_cis)`` (the ``.flatten(3)`` and ``.type_as(xq)`` after it stay); not
when the other factor reads a learned parameter of the class (``self.w = nn.Parameter(...)``,
``register_parameter``, through local names: a complex spectral mix, not unit-modulus angles built
from the positions), and a ``freqs_cis`` that is an ``nn.Parameter`` at run time (where the source
did not settle it) runs the original product. (3)
Pairs rotated in real numbers, ``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)``
(llama2.c; the two parts inline or assigned just before, any order of terms and factors) or
``torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)``, becomes ``rotary_pairs(x1, x2,
cos, sin)`` (``join="cat"``); the parts' statements go, so they must be read by nothing else and
come right before the stack (or among another such rotation's, as q and k). Not a match (computes
something else): a flipped sign (``cat((x2, -x1))``, ``x1 * cos + x2 * sin``), swapped parts, a
third of the dimension, a stack on another dimension, a rotation of another tensor than the one
multiplied by cos, a rotation imported from another file or passed in. At run time the kernels
fall back to the original expression unless the tensors are floating (complex) of one dtype and
device, cos/sin (freqs_cis) broadcast to ``x``'s shape (a single KV head ``k`` of shape ``(b, 1, s,
d)`` is never widened) with the last dimension the layout reads, need no gradient, and a rotation
function passed is (still) the rotation read here, probed at ``x``'s rank."""


# ---------------------------------------------------------------- names bound to torch


class _TorchNames:
    """Names the file binds to the ``torch`` module and to functions of it, by module-level imports
    (those under ``if``/``try`` included: ``if is_torch_available(): import torch``)."""

    def __init__(self, tree: ast.Module):
        self.modules: set[str] = set()
        self.functions: dict[str, str] = {}  # local name -> torch function name
        for stmt in _module_level(tree.body):
            if isinstance(stmt, ast.Import):
                self.modules |= {a.asname or a.name for a in stmt.names if a.name == "torch"}
            elif isinstance(stmt, ast.ImportFrom) and stmt.module == "torch" and not stmt.level:
                for a in stmt.names:
                    self.functions[a.asname or a.name] = a.name

    def is_(self, func: ast.expr, *names: str) -> bool:
        """``func`` is ``torch.<name>`` or a name imported as it, for one of ``names``."""
        if isinstance(func, ast.Attribute) and func.attr in names:
            return isinstance(func.value, ast.Name) and func.value.id in self.modules
        return isinstance(func, ast.Name) and self.functions.get(func.id) in names


def _torch_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the ``torch`` module, names bound to ``torch.cat``)."""
    names = _TorchNames(tree)
    return names.modules, {k for k, v in names.functions.items() if v == "cat"}


def _module_level(body: list[ast.stmt]):
    """Statements run at module level: ``body`` and the blocks of its ``if``/``try``/``with``."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, block, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_level(handler.body)


def _int_const(e: ast.expr) -> int | None:
    if isinstance(e, ast.Constant) and type(e.value) is int:
        return e.value
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        inner = _int_const(e.operand)
        return -inner if inner is not None else None
    return None


def _arg(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    """The call's argument at ``position`` or named ``keyword`` (None when absent or both)."""
    found = [k.value for k in call.keywords if k.arg == keyword]
    if len(call.args) > position:
        found.append(call.args[position])
    return found[0] if len(found) == 1 else None


def _last_dim_arg(call: ast.Call, position: int) -> bool:
    """The call's ``dim`` (keyword, or positional at ``position``) is the constant -1."""
    dim = _arg(call, position, "dim")
    return dim is not None and _int_const(dim) == -1


# ---------------------------------------------------------------- the rotation's source


class _NotHalfSplit(Exception):
    """The rotation's source is not (provably) the rotation; the message says why."""


@dataclass
class _Rotation:
    """Symbolic evaluation of a candidate ``rotate_half(x)`` body: each name holds one of
    ``x``, ``d`` (``x.shape[-1]``), ``h`` (``d // 2``), ``x1``/``x2`` (first/second half),
    ``-x1``/``-x2``, ``rot`` (``cat((-x2, x1), dim=-1)``), or a tuple of them (``x.chunk(2, -1)``)."""

    torch_modules: set[str]
    cat_names: set[str]
    chunks: bool = True  # x.chunk(2, dim=-1) accepted for the halves

    def value(self, e: ast.expr, env: dict) -> object:
        if isinstance(e, ast.Name) and e.id in env:
            return env[e.id]
        if isinstance(e, ast.Name):
            return self.unknown_name(e, env)
        if isinstance(e, ast.Tuple):
            return tuple(self.value(elt, env) for elt in e.elts)
        if isinstance(e, ast.Subscript) and self._is_x(e.value, env):
            return self._slice(e.slice, env)
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Attribute) and e.value.attr == "shape" \
                and self._is_x(e.value.value, env) and _int_const(e.slice) == -1:
            return "d"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "size" \
                and self._is_x(e.func.value, env) and len(e.args) == 1 and _int_const(e.args[0]) == -1:
            return "d"
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.FloorDiv) and _int_const(e.right) == 2 \
                and self.value(e.left, env) == "d":
            return "h"
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            inner = self.value(e.operand, env)
            if inner in ("x1", "x2"):
                return "-" + inner
        if isinstance(e, ast.Call) and self._is_cat(e.func):
            return self._cat(e, env)
        if isinstance(e, ast.Call) and self._is_chunk(e, env):
            if not self.chunks:
                raise _NotHalfSplit(f"the halves come from {ast.unparse(e)}: rewritten inline only when sliced")
            return ("x1", "x2")
        halves = self._halves_view(e, env)
        if halves is not None:
            if not self.chunks:
                raise _NotHalfSplit(f"the halves come from {ast.unparse(e)}: rewritten inline only when sliced")
            return halves
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("stack", "flatten",
                                                                                            "unbind", "view"):
            raise _NotHalfSplit(f"it builds pairs ({ast.unparse(e)}): an interleaved rotation, not rotate_half")
        raise _NotHalfSplit(f"{ast.unparse(e)} is not part of the half-split rotation")

    def _halves_view(self, e: ast.expr, env: dict) -> object:
        """The halves read through a ``(2, d/2)`` view of the last dimension (x-transformers):
        ``x.shape`` -> ``shape``, ``x.shape[:-1]`` -> ``lead``, ``x.reshape(*x.shape[:-1], 2, -1)``
        (``.view``, ``x.shape[:-1] + (2, -1)``, ``x.unflatten(-1, (2, -1))``) -> ``halves``, its
        ``.unbind(-2)`` -> ``(x1, x2)``, ``halves[..., i, :]`` -> the half ``i``; None for anything
        else. A ``(-1, 2)`` view pairs neighbours instead (the interleaved layout): not read here."""
        if isinstance(e, ast.Attribute) and e.attr == "shape" and self._is_x(e.value, env):
            return "shape"
        if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Slice) and e.slice.lower is None \
                and e.slice.step is None and _int_const(e.slice.upper) == -1 and self._value_is(e.value, env, "shape"):
            return "lead"
        if isinstance(e, ast.Subscript) and self._value_is(e.value, env, "halves"):
            parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
            whole = lambda p: isinstance(p, ast.Slice) and p.lower is None and p.upper is None and p.step is None
            if len(parts) == 3 and isinstance(parts[0], ast.Constant) and parts[0].value is Ellipsis \
                    and _int_const(parts[1]) in (0, 1) and whole(parts[2]):
                return ("x1", "x2")[_int_const(parts[1])]
            return None
        if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute)) or e.keywords and e.func.attr != "unbind":
            return None
        method, receiver, args = e.func.attr, e.func.value, list(e.args)
        if method in ("reshape", "view") and self._is_x(receiver, env):
            if len(args) == 1 and isinstance(args[0], ast.BinOp) and isinstance(args[0].op, ast.Add) \
                    and isinstance(args[0].right, ast.Tuple) and self._value_is(args[0].left, env, "lead") \
                    and [_int_const(v) for v in args[0].right.elts] == [2, -1]:
                return "halves"
            if len(args) == 3 and isinstance(args[0], ast.Starred) and self._value_is(args[0].value, env, "lead") \
                    and _int_const(args[1]) == 2 and _int_const(args[2]) == -1:
                return "halves"
            return None
        if method == "unflatten" and self._is_x(receiver, env) and len(args) == 2 and _int_const(args[0]) == -1 \
                and isinstance(args[1], (ast.Tuple, ast.List)) and [_int_const(v) for v in args[1].elts] == [2, -1]:
            return "halves"
        if method == "unbind" and self._value_is(receiver, env, "halves"):
            dim = _arg(e, 0, "dim")
            if dim is not None and _int_const(dim) == -2 and len(args) + len(e.keywords) == 1:
                return ("x1", "x2")
        return None

    def _value_is(self, e: ast.expr, env: dict, want: str) -> bool:
        try:
            return self.value(e, env) == want
        except _NotHalfSplit:
            return False

    def unknown_name(self, e: ast.Name, env: dict) -> object:
        raise _NotHalfSplit(f"{e.id} is not part of the half-split rotation")

    def _is_x(self, e: ast.expr, env: dict) -> bool:
        if not isinstance(e, ast.Name):
            return False
        try:
            return self.value(e, env) == "x"
        except _NotHalfSplit:
            return False

    def _is_cat(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Attribute) and func.attr == "cat":
            return isinstance(func.value, ast.Name) and func.value.id in self.torch_modules
        return isinstance(func, ast.Name) and func.id in self.cat_names

    def _is_chunk(self, call: ast.Call, env: dict) -> bool:
        """``x.chunk(2, dim=-1)`` or ``torch.chunk(x, 2, dim=-1)``."""
        if not isinstance(call.func, ast.Attribute) or call.func.attr != "chunk":
            return False
        if isinstance(call.func.value, ast.Name) and call.func.value.id in self.torch_modules:
            if not call.args or not self._is_x(call.args[0], env):
                return False
            rest = ast.Call(func=call.func, args=call.args[1:], keywords=call.keywords)
        elif self._is_x(call.func.value, env):
            rest = call
        else:
            return False
        chunks = _arg(rest, 0, "chunks")
        return chunks is not None and _int_const(chunks) == 2 and _last_dim_arg(rest, 1)

    def _slice(self, s: ast.expr, env: dict) -> str:
        parts = s.elts if isinstance(s, ast.Tuple) else [s]
        text = ", ".join(ast.unparse(p) for p in parts)
        if any(isinstance(p, ast.Slice) and p.step is not None for p in parts):
            raise _NotHalfSplit(f"x[{text}] takes every other element: an interleaved rotation "
                                "(GPT-J/GLM style), not rotate_half")
        if len(parts) != 2 or not (isinstance(parts[0], ast.Constant) and parts[0].value is Ellipsis) \
                or not isinstance(parts[1], ast.Slice):
            raise _NotHalfSplit(f"x[{text}] is not a slice of the last dimension written x[..., a:b]")
        sl = parts[1]
        lower = None if sl.lower is None or _int_const(sl.lower) == 0 else self.value(sl.lower, env)
        upper = None if sl.upper is None else self.value(sl.upper, env)
        if lower is None and upper == "h":
            return "x1"
        if lower == "h" and upper is None:
            return "x2"
        raise _NotHalfSplit(f"x[{text}] is not the first or second half of the last dimension")

    def _last_dim(self, call: ast.Call, env: dict) -> bool:
        """The call's ``dim`` is -1, or ``t.ndim - 1`` / ``t.dim() - 1`` of the rotated tensor or a
        half of it (wav2vec2-conformer)."""
        if _last_dim_arg(call, 1):
            return True
        dim = _arg(call, 1, "dim")
        if not (isinstance(dim, ast.BinOp) and isinstance(dim.op, ast.Sub) and _int_const(dim.right) == 1):
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
        except _NotHalfSplit:
            return False

    def _cat(self, call: ast.Call, env: dict) -> str:
        seq = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "tensors"), None)
        if not isinstance(seq, (ast.Tuple, ast.List)):
            raise _NotHalfSplit(f"{ast.unparse(call)} is not a concatenation of two halves along dim=-1")
        got = [self.value(e, env) for e in seq.elts]
        if got != ["-x2", "x1"]:
            shown = ", ".join(g if isinstance(g, str) else "?" for g in got)
            raise _NotHalfSplit(f"it returns cat(({shown}), dim=-1), not cat((-x2, x1), dim=-1)")
        if not self._last_dim(call, env):
            raise _NotHalfSplit(f"{ast.unparse(call)} is not a concatenation of two halves along dim=-1")
        return "rot"


def _assign(rot, stmt: ast.stmt, env: dict) -> None:
    """Bind the targets of a plain assignment (a name, or a tuple of names unpacking a tuple of
    values: ``x1, x2 = x.chunk(2, dim=-1)``) in ``env``."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        raise _NotHalfSplit(f"line {stmt.lineno} is not a plain assignment")
    target = stmt.targets[0]
    if isinstance(target, ast.Name):
        env[target.id] = rot.value(stmt.value, env)
        return
    if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
        value = rot.value(stmt.value, env)
        if isinstance(value, tuple) and len(value) == len(target.elts):
            for t, v in zip(target.elts, value):
                env[t.id] = v
            return
    raise _NotHalfSplit(f"line {stmt.lineno} ({ast.unparse(stmt)}) is not part of the rotation")


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    return body


def _read_rotation(fn: ast.FunctionDef, rot, param: str, want: str, returns: str) -> str:
    """"" when ``fn``'s body (its rotated tensor ``param``) returns the ``want`` value of ``rot``'s
    symbolic evaluation; otherwise why not (``returns``: the rotation as the message shows it)."""
    env: dict = {param: "x"}
    body = _body(fn)
    try:
        for stmt in body[:-1]:
            _assign(rot, stmt, env)
        if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
            raise _NotHalfSplit("it does not end with a return of the rotation")
        if rot.value(body[-1].value, env) != want:
            raise _NotHalfSplit(f"it returns {ast.unparse(body[-1].value)}, not {returns}")
    except _NotHalfSplit as why:
        return str(why)
    return ""


def _rotation_param(fn: ast.FunctionDef, kind: str) -> str | None:
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
    param = _rotation_param(fn, kind)
    if param is None:
        if fn.decorator_list and kind == "function":
            return f"{fn.name} is decorated"
        return f"{fn.name} does not take exactly one argument x"
    modules, cats = _torch_names(tree)
    why = _read_rotation(fn, _Rotation(modules, cats), param, "rot", "cat((-x2, x1), dim=-1)")
    return f"{fn.name} is not the half-split rotate_half: {why}" if why else ""


@dataclass
class _Interleaved:
    """Symbolic evaluation of a candidate ``rotate_every_two(x)`` body: each name holds one of
    ``x``, ``pairs`` (``x.reshape(*x.shape[:-1], -1, 2)``), ``x1``/``x2`` (even/odd positions,
    ``x[..., ::2]``/``x[..., 1::2]``), ``-x1``/``-x2``, ``stacked`` (``stack((-x2, x1), dim=-1)``),
    ``rot`` (``stacked.flatten(-2)``), ``shape`` (``x.shape``), or a tuple of them (``unbind``)."""

    names: _TorchNames

    def value(self, e: ast.expr, env: dict) -> object:
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
        raise _NotHalfSplit(f"{ast.unparse(e)} is not part of the interleaved rotation")

    def _subscript(self, e: ast.Subscript, env: dict) -> str:
        base = self.value(e.value, env)
        parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
        text = ", ".join(ast.unparse(p) for p in parts)
        last = parts[-1]
        leading = parts[:-1]
        all_leading = (len(leading) == 1 and isinstance(leading[0], ast.Constant) and leading[0].value is Ellipsis) \
            or all(isinstance(p, ast.Slice) and p.lower is None and p.upper is None and p.step is None
                   for p in leading)
        if base == "x" and all_leading and isinstance(last, ast.Slice) and last.upper is None \
                and last.step is not None and _int_const(last.step) == 2:
            start = 0 if last.lower is None else _int_const(last.lower)
            if start in (0, 1):
                return ("x1", "x2")[start]
        if base == "pairs" and len(parts) == 2 and isinstance(parts[0], ast.Constant) and parts[0].value is Ellipsis \
                and _int_const(last) in (0, 1):
            return ("x1", "x2")[_int_const(last)]
        if base == "shape" and isinstance(last, ast.Slice) and last.lower is None and _int_const(last.upper) == -1 \
                and last.step is None and len(parts) == 1:
            return "lead"
        raise _NotHalfSplit(f"{ast.unparse(e.value)}[{text}] is not the even or odd positions of the last dimension")

    def _call(self, call: ast.Call, env: dict) -> object:
        func = call.func
        if self.names.is_(func, "stack"):
            seq = call.args[0] if call.args else None
            if not isinstance(seq, (ast.Tuple, ast.List)) or not _last_dim_arg(call, 1):
                raise _NotHalfSplit(f"{ast.unparse(call)} is not a stack of two parts along dim=-1")
            got = [self.value(elt, env) for elt in seq.elts]
            if got != ["-x2", "x1"]:
                shown = ", ".join(g if isinstance(g, str) else "?" for g in got)
                raise _NotHalfSplit(f"it stacks ({shown}), not (-x2, x1)")
            return "stacked"
        if self.names.is_(func, "flatten") and call.args:
            receiver, rest = call.args[0], ast.Call(func=func, args=call.args[1:], keywords=call.keywords)
        elif self.names.is_(func, "unbind") and call.args:
            receiver, rest = call.args[0], ast.Call(func=func, args=call.args[1:], keywords=call.keywords)
        elif isinstance(func, ast.Attribute):
            receiver, rest = func.value, call
        else:
            raise _NotHalfSplit(f"{ast.unparse(call)} is not part of the interleaved rotation")
        method = func.attr if isinstance(func, ast.Attribute) else self.names.functions.get(func.id, "")
        base = self.value(receiver, env)
        if base == "stacked" and method == "flatten":
            start = _arg(rest, 0, "start_dim")
            if start is not None and _int_const(start) == -2 and len(rest.args) + len(rest.keywords) == 1:
                return "rot"
        if base == "stacked" and method in ("reshape", "view") and len(rest.args) == 1 and not rest.keywords \
                and self.value(rest.args[0], env) == "shape":
            return "rot"
        if base == "x" and method in ("reshape", "view") and self._pairs_shape(rest, env):
            return "pairs"
        if base == "x" and method == "unflatten" and len(rest.args) == 2 and _int_const(rest.args[0]) == -1 \
                and isinstance(rest.args[1], (ast.Tuple, ast.List)) \
                and [_int_const(v) for v in rest.args[1].elts] == [-1, 2]:
            return "pairs"
        if base == "pairs" and method == "unbind" and _last_dim_arg(rest, 0):
            return ("x1", "x2")
        raise _NotHalfSplit(f"{ast.unparse(call)} is not part of the interleaved rotation")

    def _pairs_shape(self, call: ast.Call, env: dict) -> bool:
        """``(*x.shape[:-1], -1, 2)`` or ``(x.shape[:-1] + (-1, 2))``."""
        args = list(call.args)
        if call.keywords:
            return False
        if len(args) == 1 and isinstance(args[0], ast.BinOp) and isinstance(args[0].op, ast.Add) \
                and isinstance(args[0].right, ast.Tuple):
            return self.value(args[0].left, env) == "lead" and [_int_const(v) for v in args[0].right.elts] == [-1, 2]
        return len(args) == 3 and isinstance(args[0], ast.Starred) and self.value(args[0].value, env) == "lead" \
            and _int_const(args[1]) == -1 and _int_const(args[2]) == 2


def interleaved_rotation(fn: ast.FunctionDef, tree: ast.Module, kind: str = "function") -> str:
    """"" when ``fn(x)`` computes ``stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)``
    (GPT-J's ``rotate_every_two``); otherwise why not."""
    param = _rotation_param(fn, kind)
    if param is None:
        return f"{fn.name} does not take exactly one argument x"
    why = _read_rotation(fn, _Interleaved(_TorchNames(tree)), param, "rot",
                         "stack((-x2, x1), dim=-1).flatten(-2)")
    return f"{fn.name} is not the interleaved rotate_every_two: {why}" if why else ""


def _builds_pairs(fn: ast.FunctionDef) -> bool:
    """The source pairs even/odd positions (a step slice, a stack, an unbind, a (-1, 2) reshape)."""
    for n in walk(fn):
        if isinstance(n, ast.Slice) and n.step is not None:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name)):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
            if name in ("stack", "unbind", "unflatten"):
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


def _rotation_like(fn: ast.FunctionDef, method: bool = False) -> bool:
    """A one-argument function (a method: of ``self`` and one argument, or a @staticmethod) that
    negates something and concatenates or stacks: a rotation of some kind (worth a reason when it
    is not the rotation)."""
    a = fn.args
    wanted = {1, 2} if method else {1}
    if len(a.posonlyargs + a.args) not in wanted or a.vararg or a.kwarg or a.kwonlyargs:
        return False
    negates = any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) for n in walk(fn))
    joins = any(isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
                and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in ("cat", "stack", "concat")
                for n in walk(fn))
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
    for stmt in _module_level(tree.body):
        if isinstance(stmt, ast.FunctionDef):
            layout, _ = rotation_layout(stmt, tree)
            if layout:
                out[stmt.name] = ROTATE_HALF if layout == HALF_SPLIT else ROTATE_EVERY_TWO
            elif _rotation_like(stmt):
                out[stmt.name] = OTHER_ROTATION
    return out


# ---------------------------------------------------------------- names in the calling function


class _Facts:
    """Where one function binds and reads each name (nested scopes counted with it: conservative),
    and the block (statement list) holding each statement."""

    def __init__(self, fn: ast.AST | None):
        self.fn = fn
        self.params: set[str] = set()
        self.bindings: dict[str, int] = {}
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
                    self.bindings[n.id] = self.bindings.get(n.id, 0) + 1
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
                self.bindings[n.name] = self.bindings.get(n.name, 0) + 2
            elif isinstance(n, (ast.Global, ast.Nonlocal)):
                for name in n.names:
                    self.bindings[name] = self.bindings.get(name, 0) + 2
            elif isinstance(n, ast.alias):
                name = (n.asname or n.name).split(".")[0]
                self.bindings[name] = self.bindings.get(name, 0) + 2
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
_facts_of = per_node(256)(_Facts)


def _inside(node: ast.AST, outer: ast.AST) -> bool:
    return any(n is node for n in walk(outer))


def _statement_names(stmt: ast.stmt) -> set[str] | None:
    """The names a plain assignment binds (a name or a tuple of names), else None."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target = stmt.targets[0]
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
        return {t.id for t in target.elts}
    return None


def _removable_run(facts: _Facts, anchor: ast.stmt, names: set[str], replaced: ast.expr,
                   passable=lambda stmt: False) -> list[ast.stmt]:
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
        bound = _statement_names(stmt)
        if bound and bound <= names:
            keep = run + [stmt]
            if all(_inside(load, replaced) or any(_inside(load, s) for s in keep)
                   for name in bound for load in facts.loads.get(name, ())):
                run.append(stmt)
                continue
        if passable(stmt):
            continue
        break
    return run


def _class_def(tree: ast.Module, qualname: str) -> ast.ClassDef | None:
    scope, found = list(tree.body), None
    for part in qualname.split("."):
        found = next((n for n in _module_level(scope) if isinstance(n, ast.ClassDef) and n.name == part), None)
        if found is None:
            return None
        scope = list(found.body)
    return found


def _method_def(tree: ast.Module, cls: ast.ClassDef, name: str, seen: frozenset = frozenset()) -> ast.FunctionDef | str:
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
            parent = _class_def(tree, base.id)
            if parent is not None:
                found = _method_def(tree, parent, name, seen | {cls.name})
                if not isinstance(found, str) or "bound more than once" in found:
                    return found
    return f"{cls.name}.{name} is not a method defined in this file"


class _InlineRotation(_Rotation):
    """:class:`_Rotation` over a function's statements: names assigned once in the calling function
    are read from their assignment (``x1 = x[..., : head_size // 2]``); the tensor rotated is the
    name mapped to ``x``. ``resolved`` collects the names read so."""

    def __init__(self, names: _TorchNames, facts: _Facts):
        super().__init__(names.modules, {k for k, v in names.functions.items() if v == "cat"}, chunks=False)
        self.facts = facts
        self.resolved: set[str] = set()
        self._busy: set[str] = set()

    def unknown_name(self, e: ast.Name, env: dict) -> object:
        bound = self.facts.single.get(e.id)
        if bound is None or e.id in self._busy:
            raise _NotHalfSplit(f"{e.id} is not assigned once in the function")
        stmt, value, index = bound
        self._busy.add(e.id)
        try:
            got = self.value(value, env)
        finally:
            self._busy.discard(e.id)
        if index is not None:
            if not isinstance(got, tuple) or index >= len(got):
                raise _NotHalfSplit(f"line {stmt.lineno} ({ast.unparse(stmt)}) is not part of the rotation")
            got = got[index]
        env[e.id] = got
        self.resolved.add(e.id)
        return got


def _sliced_name(e: ast.expr, facts: _Facts, depth: int = 0) -> str | None:
    """The name whose slice ``e`` is, following names assigned once (``x1`` -> ``x[..., :h]`` -> ``x``)."""
    if depth > 8:
        return None
    if isinstance(e, ast.UnaryOp):
        return _sliced_name(e.operand, facts, depth + 1)
    if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name):
        return e.value.id
    if isinstance(e, ast.Name) and e.id in facts.single and facts.single[e.id][2] is None:
        return _sliced_name(facts.single[e.id][1], facts, depth + 1)
    return None


@dataclass
class _Site:
    """The sum (or stack, or complex product) being read, with what its reading needs."""

    tree: ast.Module
    fn: ast.AST | None  # the function holding it (None: module level)
    cls: ast.ClassDef | None  # the class whose method that is
    names: _TorchNames
    facts: _Facts
    stmt: ast.stmt | None  # the statement holding it

    @classmethod
    def of(cls_, tree: ast.Module, fn: ast.AST | None, qualname: str, expr: ast.AST) -> _Site:
        owner = _class_def(tree, qualname.rsplit(".", 1)[0]) if qualname and "." in qualname else None
        facts = _facts_of(fn)
        stmt = None
        if fn is not None:
            stmt = next((s for s in walk(fn) if isinstance(s, ast.stmt) and s is not fn
                         and not isinstance(s, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef,
                                                ast.AsyncFunctionDef, ast.ClassDef, ast.AsyncFor, ast.AsyncWith))
                         and _inside(expr, s)), None)
        return cls_(tree, fn, owner, _TorchNames(tree), facts, stmt)


@dataclass(frozen=True)
class _Candidate:
    """A rotation operand of the sum, before its source is checked: the tensor it rotates and how
    the rotation is reached (``function``/``method``/``static`` call, ``inline`` cat)."""

    node: ast.expr
    x: ast.expr
    form: str
    name: str  # function or method name; for inline: the rotated tensor's name ("" for a cat in the sum)
    owner: str = ""  # "self" / the class name for method calls
    cat: ast.Call | None = None


def _candidate(e: ast.expr, site: _Site) -> _Candidate | None:
    """``e`` read as a call of a rotation (without checking the rotation yet), or None."""
    if isinstance(e, ast.Call) and len(e.args) == 1 and not e.keywords and not isinstance(e.args[0], ast.Starred):
        func = e.func
        if site.names.is_(func, "cat", "concat"):
            pass  # a concatenation with one argument: read below
        elif isinstance(func, ast.Name):
            return _Candidate(e, e.args[0], "function", func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            fn = site.fn
            first = (fn.args.posonlyargs + fn.args.args)[:1] if isinstance(fn, (ast.FunctionDef,
                                                                                 ast.AsyncFunctionDef)) else []
            if site.cls is not None and first and first[0].arg == owner and site.facts.bindings.get(owner) == 1:
                return _Candidate(e, e.args[0], "method", func.attr, owner)
            if owner not in site.facts.bindings and _class_def(site.tree, owner) is not None:
                return _Candidate(e, e.args[0], "static", func.attr, owner)
            return None
    cat, name = e, ""
    if isinstance(e, ast.Name):
        assigned = site.facts.assigned_value(e)
        if assigned is None:
            return None
        cat, name = assigned[1], e.id
    if isinstance(cat, ast.Call) and site.names.is_(cat.func, "cat", "concat") and cat.args \
            and isinstance(cat.args[0], (ast.Tuple, ast.List)) and len(cat.args[0].elts) == 2:
        root = _sliced_name(cat.args[0].elts[1], site.facts)
        if root is not None:
            return _Candidate(e, ast.Name(id=root, ctx=ast.Load()), "inline", name, cat=cat)
    return None


@dataclass(frozen=True)
class _Rotating:
    """A checked rotation operand: the layout, what the rewrite passes for it, what it deletes."""

    layout: str
    passed: str | None  # the rotation argument's text (None: the kernel's own, the statements deleted)
    delete: tuple[ast.stmt, ...] = ()


def _module_function(tree: ast.Module, name: str) -> ast.FunctionDef | str:
    """The module-level ``def name`` when it is the only module-level binding of ``name``."""
    defs, other = [], False
    for stmt in _module_level(tree.body):
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


def _check(cand: _Candidate, site: _Site, replaced: ast.expr) -> _Rotating | str:
    """The rotation ``cand`` reaches, read from its source; or why it is not a rotation."""
    if cand.form == "function":
        if cand.name in site.facts.bindings:
            return f"{cand.name} is a parameter or local of the calling function"
        fn = _module_function(site.tree, cand.name)
        if isinstance(fn, str):
            return fn
        layout, why = rotation_layout(fn, site.tree, "function")
        return _Rotating(layout, cand.name) if layout else why
    if cand.form in ("method", "static"):
        owner = site.cls if cand.form == "method" else _class_def(site.tree, cand.owner)
        fn = _method_def(site.tree, owner, cand.name)
        if isinstance(fn, str):
            return fn
        layout, why = rotation_layout(fn, site.tree, cand.form)
        if not layout and _rotation_param(fn, cand.form) is None:
            why = (f"{owner.name}.{cand.name} is neither a @staticmethod nor a method that leaves self alone"
                   if cand.form == "method" else f"{owner.name}.{cand.name} is not a @staticmethod of one argument")
        return _Rotating(layout, f"{cand.owner}.{cand.name}") if layout else why
    # inline: the half-split rotation of a name, in the calling function's statements
    root = cand.x.id
    reader = _InlineRotation(site.names, site.facts)
    try:
        got = reader.value(cand.cat, {root: "x"})
    except _NotHalfSplit as why:
        return f"the inline rotation {ast.unparse(cand.node)} is not the half-split rotation: {why}"
    if got != "rot":
        return f"the inline rotation {ast.unparse(cand.node)} is not the half-split rotation"
    names = set(reader.resolved) | ({cand.name} if cand.name else set())
    if not site.facts.bound_once(root) and not _unchanged_since(site, root, names):
        return f"{root} is assigned between its halves and the sum: the sum may read another value"
    run = _removable_run(site.facts, site.stmt, names, replaced) if site.stmt is not None else []
    if cand.name and not any(cand.name in (_statement_names(s) or ()) for s in run):
        return _Rotating(HALF_SPLIT, cand.name)  # its statement stays: the rotated tensor is handed over
    return _Rotating(HALF_SPLIT, None, tuple(run))


def _unchanged_since(site: _Site, root: str, names: set[str]) -> bool:
    """The statements binding ``names`` and the sum's statement share a block, and nothing between
    the first of them and the sum binds ``root`` (the sum's own assignment binds after reading)."""
    if site.stmt is None:
        return False
    where = site.facts.block_of(site.stmt)
    if where is None:
        return False
    block, end = where
    starts = []
    for name in names:
        bound = site.facts.single.get(name)
        index = next((i for i, s in enumerate(block) if bound is not None and s is bound[0]), None)
        if index is None:
            return False
        starts.append(index)
    first = min(starts, default=end)
    return not any(isinstance(n, ast.Name) and n.id == root and not isinstance(n.ctx, ast.Load)
                   for stmt in block[first:end] for n in walk(stmt))


@dataclass(frozen=True)
class RotaryParts:
    """``x * cos + rotate_half(x) * sin`` read from the source: the expressions' nodes."""

    expr: ast.BinOp
    x: ast.expr
    cos: ast.expr
    sin: ast.expr
    rotate_half: str | None  # what the rewrite passes as the rotation (None: the statements go)
    rotate_half_call: ast.expr  # the rotation operand in the sum
    layout: str = HALF_SPLIT
    delete: tuple[ast.stmt, ...] = ()

    @property
    def kernel(self) -> str:
        return "rotary" if self.layout == HALF_SPLIT else "rotary_interleaved"


# Methods whose result depends only on the tensor (and the constant arguments): an ``x`` written
# with them (``q.float()``) is the same tensor at both of its places and may be evaluated once.
_PURE_METHODS = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous"}


def _pure(e: ast.expr) -> bool:
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


def _unsafe_operand(e: ast.expr) -> bool:
    return any(isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)) for n in walk(e))


def _local_names(fn: ast.AST) -> set[str]:
    """Parameters and names assigned in ``fn`` (a function), nested scopes included (conservative)."""
    names: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = fn.args
        names |= {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
        names |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
    for n in walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
            names.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            names |= set(n.names)
    return names


def _same(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)


def rotary_parts(expr: ast.AST, tree: ast.Module, enclosing: ast.AST | None, qualname: str = "") -> RotaryParts | str:
    """Read ``expr`` as ``x * cos + rotation(x) * sin`` (either product first, either factor
    order): the parts, or why it is not that computation. ``enclosing``: the function holding it
    (``qualname``: its qualified name, ``Cls.method`` for a method)."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add)):
        return "the matched sum is not an addition"
    products = (expr.left, expr.right)
    if not all(isinstance(p, ast.BinOp) and isinstance(p.op, ast.Mult) for p in products):
        return "the addition's operands are not both products"
    site = _Site.of(tree, enclosing, qualname, expr)
    why = "neither product is rotate_half(x) * sin with x the other product's factor"
    for rotated, plain in (products, products[::-1]):
        for call, sin in ((rotated.left, rotated.right), (rotated.right, rotated.left)):
            cand = _candidate(call, site)
            if cand is None:
                continue
            x = cand.x
            why = (f"{ast.unparse(call)} rotates another tensor than the one multiplied by cos "
                   f"({ast.unparse(plain)})")
            for x_there, cos in ((plain.left, plain.right), (plain.right, plain.left)):
                if not _same(x_there, x):
                    continue
                got = _check(cand, site, expr)
                if isinstance(got, str):
                    return got
                if not _pure(x):
                    return f"x ({ast.unparse(x)}) has calls: it cannot be evaluated once instead of twice"
                if _unsafe_operand(cos) or _unsafe_operand(sin):
                    return "cos or sin assigns or yields"
                return RotaryParts(expr, x_there, cos, sin, got.passed, call, got.layout, got.delete)
    return why


# ---------------------------------------------------------------- pairs rotated in real numbers


def _terms(e: ast.expr, sign: int = 1) -> list[tuple[int, tuple[ast.expr, ast.expr]]] | None:
    """``e`` as a signed sum of products of two factors (``a * b - c * d``), else None."""
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
        left, right = _terms(e.left, sign), _terms(e.right, -sign if isinstance(e.op, ast.Sub) else sign)
        return None if left is None or right is None else left + right
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return _terms(e.operand, -sign)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult):
        factors = []
        for f in (e.left, e.right):
            while isinstance(f, ast.UnaryOp) and isinstance(f.op, ast.USub):
                sign, f = -sign, f.operand
            if isinstance(f, (ast.BinOp, ast.UnaryOp, ast.Constant, ast.BoolOp, ast.Compare, ast.IfExp)):
                return None
            factors.append(f)
        return [(sign, (factors[0], factors[1]))]
    return None


def _pair(a: ast.expr, b: ast.expr) -> tuple[str, str]:
    return tuple(sorted((ast.dump(a), ast.dump(b))))


_ANGLE_WORDS = ("cos", "sin", "freq", "theta", "angle", "rot")


def _solve(first: list, second: list) -> tuple[ast.expr, ast.expr, ast.expr, ast.expr] | str:
    """(x1, x2, cos, sin) with ``first == x1*cos - x2*sin`` and ``second == x2*cos + x1*sin``."""
    plus = [f for s, f in first if s > 0]
    minus = [f for s, f in first if s < 0]
    if len(plus) != 1 or len(minus) != 1:
        return "its first part is not a difference of two products (x1 * cos - x2 * sin)"
    if any(s < 0 for s, _ in second):
        return "its second part is not a sum of two products (x1 * sin + x2 * cos): a flipped sign"
    want = sorted(_pair(*f) for _, f in second)
    found = []
    for x1, c in (plus[0], plus[0][::-1]):
        for x2, s in (minus[0], minus[0][::-1]):
            if sorted((_pair(x2, c), _pair(x1, s))) == want:
                found.append((x1, x2, c, s))
    if not found:
        return "its parts pair the factors otherwise than x1 * cos - x2 * sin and x1 * sin + x2 * cos"

    def angles(sol) -> int:
        return sum(any(w in ast.unparse(t).lower() for w in _ANGLE_WORDS) for t in sol[2:])

    return max(found, key=angles)


@dataclass(frozen=True)
class PairParts:
    """``torch.stack((x1*cos - x2*sin, x1*sin + x2*cos), dim=-1)`` (or ``torch.cat`` of the same
    parts) read from the source."""

    call: ast.Call
    x1: ast.expr
    x2: ast.expr
    cos: ast.expr
    sin: ast.expr
    join: str  # "stack" or "cat"
    delete: tuple[ast.stmt, ...] = ()


def _part_statement(e: ast.expr, site: _Site) -> tuple[ast.expr, ast.stmt | None]:
    """A part of the stack: its expression (read from its assignment when it is a name assigned
    once) and that assignment."""
    assigned = site.facts.assigned_value(e)
    if assigned is not None and _terms(assigned[1]) is not None:
        return assigned[1], assigned[0]
    return e, None


def _pair_shape(call: ast.Call, site: _Site) -> tuple[str, list, list[ast.stmt]] | None:
    """(join, the two parts' terms, their statements) when ``call`` stacks or concatenates two
    signed sums of two products, else None."""
    if site.names.is_(call.func, "stack"):
        join = "stack"
    elif site.names.is_(call.func, "cat", "concat"):
        join = "cat"
    else:
        return None
    seq = call.args[0] if call.args else None
    if not isinstance(seq, (ast.Tuple, ast.List)) or len(seq.elts) != 2:
        return None
    terms, stmts = [], []
    for elt in seq.elts:
        value, stmt = _part_statement(elt, site)
        t = _terms(value)
        if t is None or len(t) != 2:
            return None
        terms.append(t)
        if stmt is not None:
            stmts.append(stmt)
    return join, terms, stmts


def _sibling(stmt: ast.stmt, site: _Site) -> bool:
    """A statement of another pairs rotation of the block (a part ``a * c - b * s`` assigned to a
    name, or a statement stacking two such parts): rewritten with it, stepped over."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        t = _terms(stmt.value)
        if t is not None and len(t) == 2:
            return True
    if isinstance(stmt, (ast.Assign, ast.Return, ast.Expr, ast.AugAssign, ast.AnnAssign)):
        return any(isinstance(n, ast.Call) and _pair_shape(n, site) is not None for n in walk(stmt))
    return False


def pair_parts(call: ast.Call, site: _Site) -> PairParts | str:
    """Read ``call`` as the pairs rotation; a :class:`NotACandidate` when it stacks anything else."""
    shape = _pair_shape(call, site)
    if shape is None:
        return NotACandidate(f"{ast.unparse(call.func)} does not join two sums of products")
    join, (first, second), stmts = shape
    if not _last_dim_arg(call, 1):
        return f"it {'stacks' if join == 'stack' else 'concatenates'} the rotated parts on another dimension than -1"
    solved = _solve(first, second)
    if isinstance(solved, str):
        return f"{ast.unparse(call)[:80]}: {solved}"
    x1, x2, cos, sin = solved
    for leaf in solved:
        if not _pure(leaf):
            return f"{ast.unparse(leaf)} has calls: it cannot be evaluated once instead of twice"
    delete: list[ast.stmt] = []
    if stmts:
        names = set().union(*(_statement_names(s) or set() for s in stmts))
        run = _removable_run(site.facts, site.stmt, names, call, lambda s: _sibling(s, site)) \
            if site.stmt is not None else []
        missing = [s for s in stmts if not any(s is r for r in run)]
        if missing:
            return (f"line {missing[0].lineno} ({ast.unparse(missing[0])[:60]}) computes a rotated part that "
                    "other code reads, or not right before the stack: it cannot be removed")
        delete = [s for s in run if any(s is t for t in stmts)]
    return PairParts(call, x1, x2, cos, sin, join, tuple(delete))


# ---------------------------------------------------------------- the complex rotation


@dataclass(frozen=True)
class ComplexParts:
    """``torch.view_as_real(z * freqs_cis)`` with ``z`` (or ``freqs_cis``) a ``view_as_complex``
    of the pairs of a real tensor's last dimension; the operands in source order."""

    call: ast.Call
    left: ast.expr
    right: ast.expr


def _complex_of_pairs(e: ast.expr, site: _Site) -> bool:
    """``e`` is (a name assigned once to) ``torch.view_as_complex(t.reshape(..., -1, 2))``
    (``.view``, ``.reshape(t.shape[:-1] + (-1, 2))``, ``.unflatten(-1, (-1, 2))``)."""
    assigned = site.facts.assigned_value(e)
    if assigned is not None:
        e = assigned[1]
    if not (isinstance(e, ast.Call) and site.names.is_(e.func, "view_as_complex") and len(e.args) == 1):
        return False
    inner = e.args[0]
    if not isinstance(inner, ast.Call) or not isinstance(inner.func, ast.Attribute) or inner.keywords:
        return False
    args = list(inner.args)
    if inner.func.attr in ("reshape", "view"):
        if len(args) == 1 and isinstance(args[0], ast.BinOp) and isinstance(args[0].op, ast.Add) \
                and isinstance(args[0].right, ast.Tuple):
            args = list(args[0].right.elts)
        return len(args) >= 2 and _int_const(args[-2]) == -1 and _int_const(args[-1]) == 2
    if inner.func.attr == "unflatten":
        return len(args) == 2 and _int_const(args[0]) == -1 and isinstance(args[1], (ast.Tuple, ast.List)) \
            and [_int_const(v) for v in args[1].elts] == [-1, 2]
    return False


def _parameter_attrs(tree: ast.Module, cls: ast.ClassDef | None) -> set[str]:
    """``self.<attr>`` names the class (or a same-file base) binds to an ``nn.Parameter(...)`` or
    registers with ``self.register_parameter("<attr>", ...)``."""
    out: set[str] = set()
    seen: set[str] = set()
    frontier = [cls] if cls is not None else []
    while frontier:
        c = frontier.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        for node in walk(c):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_parameter(node.value.func):
                out |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name) and t.value.id == "self"}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "register_parameter" and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
        frontier += [b for b in (_class_def(tree, base.id) for base in c.bases if isinstance(base, ast.Name))
                     if b is not None]
    return out


def _is_parameter(func: ast.expr) -> bool:
    """``nn.Parameter``, ``torch.nn.Parameter``, ``Parameter`` (torch's class by its API name)."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name == "Parameter"


def _learned_parameter(e: ast.expr, site: _Site, depth: int = 0) -> str | None:
    """The attribute of a learned parameter the factor ``e`` reads (following names assigned once
    in the function), else None. A rotation multiplies by unit-modulus factors built from the
    positions (a buffer, an argument, ``torch.polar(ones, angles)``); a factor read off a parameter
    is a learned complex weight, whatever the product looks like."""
    fn = site.fn
    first = (fn.args.posonlyargs + fn.args.args)[:1] if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) \
        else []
    if not first or site.cls is None or depth > 8:
        return None
    this = first[0].arg
    params = _parameter_attrs(site.tree, site.cls)
    for node in walk(e):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == this \
                and node.attr in params:
            return node.attr
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in site.facts.single:
            found = _learned_parameter(site.facts.single[node.id][1], site, depth + 1)
            if found:
                return found
    return None


def complex_parts(call: ast.Call, site: _Site) -> ComplexParts | str:
    if not (site.names.is_(call.func, "view_as_real") and len(call.args) == 1 and not call.keywords):
        return NotACandidate("not torch.view_as_real(a * b)")
    prod = call.args[0]
    if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        return NotACandidate("not torch.view_as_real(a * b)")
    pairs = [_complex_of_pairs(e, site) for e in (prod.left, prod.right)]
    if not any(pairs):
        return NotACandidate("neither factor is a view_as_complex of pairs of the last dimension")
    for factor, is_pairs in zip((prod.left, prod.right), pairs):
        learned = None if is_pairs else _learned_parameter(factor, site)
        if learned:
            return NotACandidate(f"the factor {ast.unparse(factor)} reads the learned parameter self.{learned}: a "
                                 "complex (spectral) mix, not a rotation by angles built from the positions")
    if _unsafe_operand(prod):
        return "an operand assigns or yields"
    return ComplexParts(call, prod.left, prod.right)


# ---------------------------------------------------------------- preconditions


def _span_key(node) -> tuple:
    sp = node.span
    return sp.line, sp.col, sp.end_line, sp.end_col


def _node_at(fn: ast.AST, span, kind) -> ast.AST | None:
    for n in walk(fn):
        if isinstance(n, kind) and (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) == (
                span.line, span.col, span.end_line, span.end_col):
            return n
    return None


def _binop_at(fn: ast.AST, span) -> ast.BinOp | None:
    return _node_at(fn, span, ast.BinOp)


def _matched(nodes) -> tuple[TensorOp | None, list[TensorOp]]:
    """(the sum, the two products) among a match's nodes."""
    add = next((n for n in nodes if isinstance(n, TensorOp) and n.op == "+"), None)
    products = [n for n in nodes if isinstance(n, TensorOp) and n.op == "*"]
    return add, products


def _form(nodes) -> str:
    """Which variant matched: ``sum``, ``complex`` or ``pairs``."""
    for n in nodes:
        if isinstance(n, Layer) and n.type == "torch.view_as_real":
            return "complex"
        if isinstance(n, Layer):
            return "pairs"
    return "sum"


_FOLDED = (ROTATE_HALF, ROTATE_EVERY_TWO, OTHER_ROTATION)


def _class_call(text: str, tree: ast.Module | None) -> bool:
    """``text`` is a call ``Cls.name(...)`` of a class defined in the file."""
    try:
        e = ast.parse(text, mode="eval").body
    except SyntaxError:
        return False
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and isinstance(e.func.value, ast.Name) \
        and tree is not None and _class_def(tree, e.func.value.id) is not None


def _def_at(tree: ast.Module | None, qualname: str) -> tuple[ast.FunctionDef | None, bool]:
    """(the ``def`` of ``qualname`` — a module-level function or ``Cls.method`` —, whether a method)."""
    if tree is None or not qualname:
        return None, False
    owner, _, name = qualname.rpartition(".")
    if not owner:
        fn = _module_function(tree, name)
        return (None if isinstance(fn, str) else fn), False
    cls = _class_def(tree, owner)
    fn = _method_def(tree, cls, name) if cls is not None else None
    return (fn if isinstance(fn, ast.FunctionDef) else None), True


def _negates(ctx: MatchContext, cat: Layer) -> bool:
    """A concatenation one of whose parts is negated (``torch.cat((-x2, x1), dim=-1)``)."""
    text = cat.args[0].value.text if cat.args and isinstance(cat.args[0].value, Const) else ""
    if re.search(r"(^|[(\[,])\s*-", text):
        return True
    producers = ctx.producers()
    for name, version in re.findall(r"([A-Za-z_][\w.]*)(?:#(\d+))?", text):
        made = producers.get((name, int(version or 0)))
        if isinstance(made, TensorOp) and made.op == "-" and len(made.args) == 1:
            return True
    return False


def _rotations_read(ctx: MatchContext, products: list[TensorOp]) -> list:
    """What the products multiply that is a rotation of some kind: folded calls, nodes inlined
    from a same-file function or method that negates and concatenates or stacks, a ``torch.cat``
    written in the function with a negated part, calls of a class of the file extraction left as
    text (``Cls.rotate_half(q)``). Anything else makes ``a * b + c * d`` no candidate at all."""
    producers = ctx.producers()
    tree = parse_file(ctx.source) if ctx.source is not None else None
    out = []
    for p in products:
        for a in p.args:
            if isinstance(a.value, Const) and "(" in a.value.text:
                if _class_call(a.value.text, tree):
                    out.append(a.value)
                continue
            made = producers.get((a.value.name, a.value.version)) if isinstance(a.value, Var) else None
            if not isinstance(made, Layer) or made.span is None:
                continue
            if made.type in _FOLDED or made.type in ("torch.cat", "torch.concat") and _negates(ctx, made):
                out.append(made)
            elif made.span.inlined_at:
                fn, method = _def_at(tree, made.span.function)
                if fn is not None and _rotation_like(fn, method):
                    out.append(made)
    return out


def _is_call_of(rotation: Layer, call: ast.Call, stmt_lines: range) -> bool:
    """``rotation`` (a matched node) is the rotation call ``call`` of the sum."""
    sp = rotation.span
    if rotation.type in _FOLDED:
        return (call.lineno, call.col_offset, call.end_lineno, call.end_col_offset) == (
            sp.line, sp.col, sp.end_line, sp.end_col)
    # inlined: the function it lies in is the one called, from the sum's statement
    return sp.function == call.func.id and bool(sp.inlined_at) and sp.inlined_at[-1] in stmt_lines


def _function_of(ctx: MatchContext, span) -> tuple[ast.Module | None, ast.AST | None]:
    tree = parse_file(ctx.source) if ctx.source is not None else None
    if tree is None:
        return None, None
    fn = function_ast(ctx.source, span.function, span.line) if span.function else tree
    return tree, fn


def _is_rotary_sum(ctx: MatchContext) -> str | None:
    add, products = _matched([mn.node for mn in ctx.match.nodes])
    rotations = _rotations_read(ctx, products)
    if not rotations:
        # any ``a*b + c*d`` fits the sum pattern: without a rotation it is not a candidate
        return NotACandidate("no product multiplies a call of a same-file rotation function")
    spans = [getattr(n, "span", None) for n in (add, *products)]
    if add is None or len(products) != 2 or None in spans or ctx.source is None:
        return "the matched sum has no source position"
    tree, fn = _function_of(ctx, add.span)
    expr = _binop_at(fn, add.span) if fn is not None else None
    if tree is None or expr is None:
        return f"no sum at line {add.span.line} in the source"
    # the products the pattern matched are the sum's operands (not products elsewhere on the path)
    operands = {(p.lineno, p.col_offset, p.end_lineno, p.end_col_offset) for p in (expr.left, expr.right)}
    if {_span_key(p) for p in products} != operands:
        return "the matched products are not the operands of the sum"
    parts = rotary_parts(expr, tree, fn if fn is not tree else None, add.span.function)
    if isinstance(parts, str):
        return parts
    call = parts.rotate_half_call
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == parts.rotate_half:
        stmt_lines = range(add.span.stmt_line, add.span.stmt_end_line + 1)
        folded = [r for r in rotations if isinstance(r, Layer) and (r.type in _FOLDED or r.span.inlined_at)]
        if folded and not any(_is_call_of(r, call, stmt_lines) for r in folded):
            return "the rotation the product reads is not the call in the sum"
    return None


def _is_rotary_layer(ctx: MatchContext, form: str) -> str | None:
    layer = next((mn.node for mn in ctx.match.nodes if isinstance(mn.node, Layer)), None)
    if layer is None or layer.span is None or ctx.source is None:
        return "the matched call has no source position"
    tree, fn = _function_of(ctx, layer.span)
    call = _node_at(fn, layer.span, ast.Call) if fn is not None else None
    if tree is None or call is None:
        return NotACandidate(f"no call at line {layer.span.line} in the source")
    site = _Site.of(tree, fn if fn is not tree else None, layer.span.function, call)
    if form == "complex":
        parts = complex_parts(call, site)
        if isinstance(parts, str):
            return parts
        product = next((mn.node for mn in ctx.match.nodes if isinstance(mn.node, TensorOp)), None)
        prod = call.args[0]
        if product is None or product.span is None or _span_key(product) != (
                prod.lineno, prod.col_offset, prod.end_lineno, prod.end_col_offset):
            return NotACandidate("the matched product is not the one view_as_real reads")
        return None
    parts = pair_parts(call, site)
    return parts if isinstance(parts, str) else None


def _is_rotary_embedding(ctx: MatchContext) -> str | None:
    """The matched site computes a rotary embedding in one of the forms of the module doc (read
    from the source: extraction does not keep slicing nor the order of a stack's parts); otherwise
    not a match, with why."""
    form = _form([mn.node for mn in ctx.match.nodes])
    if form == "sum":
        return _is_rotary_sum(ctx)
    return _is_rotary_layer(ctx, form)


# ---------------------------------------------------------------- codemod

KERNEL = "rotary"


def _text(ctx: FileContext, e: ast.expr) -> str:
    text = ctx.segment(e)
    return text if "\n" not in text else ast.unparse(e)


class RotaryCodemod(Codemod):
    rule = "rotary_embedding"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        nodes = [mn.node for mn in match.nodes]
        form = _form(nodes)
        if form == "sum":
            anchor_node, _ = _matched(nodes)
        else:
            anchor_node = next((n for n in nodes if isinstance(n, Layer)), None)
        if anchor_node is None or anchor_node.span is None:
            raise Skip("the matched site has no source position")
        expr = ctx.expr_at(anchor_node.span)
        fn = ctx.enclosing_function(expr)
        qualname = anchor_node.span.function
        if form == "sum":
            parts = rotary_parts(expr, ctx.tree, fn, qualname)
            if isinstance(parts, str):
                raise Skip(parts)
            kernel, args = parts.kernel, [_text(ctx, e) for e in (parts.x, parts.cos, parts.sin)]
            if parts.rotate_half is not None:
                args.append(parts.rotate_half)
            delete = parts.delete
        else:
            site = _Site.of(ctx.tree, fn, qualname, expr)
            parts = complex_parts(expr, site) if form == "complex" else pair_parts(expr, site)
            if isinstance(parts, str):
                raise Skip(parts)
            if form == "complex":
                kernel, args, delete = "rotary_complex", [_text(ctx, parts.left), _text(ctx, parts.right)], ()
            else:
                kernel = "rotary_pairs"
                args = [_text(ctx, e) for e in (parts.x1, parts.x2, parts.cos, parts.sin)]
                if parts.join == "cat":
                    args.append('join="cat"')
                delete = parts.delete
        spec, local = kernel_name(ctx, kernel)
        stmt = ctx.statement_of(expr)
        removed = tuple(pos(ctx, s) for s in sorted(delete, key=lambda s: s.lineno))
        forward = ForwardEdit(
            statements=(*removed, pos(ctx, stmt)), anchor=pos(ctx, stmt),
            expr_edits=(ExprEdit(ctx.char_span(expr), f"{local}({', '.join(args)})"),), delete=removed,
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))


# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    """What ran: the shapes of the sum (the kernel needs an even last dimension; an odd one would
    make every call fall back, so the site is not worth rewriting), of the complex product, or of
    the stacked parts."""
    form = _form(site.nodes)
    if form == "sum":
        shapes = [s for ops in site.ops for op in ops if op.name == "add" for s in op.input_shapes if s]
        if not shapes:
            return None, ""
        last = {tuple(s)[-1] for s in shapes if len(s)}
        if any(d % 2 for d in last):
            return f"the rotated last dimension is odd ({sorted(last)}): the kernel would always fall back", ""
        return None, f"rotary on {' + '.join(str(tuple(s)) for s in shapes)}"
    shapes = [tuple(s) for ops in site.ops for op in ops for s in op.input_shapes if s]
    what = "complex rotary" if form == "complex" else "rotary pairs"
    return None, f"{what} on {' , '.join(map(str, shapes))}" if shapes else ""


RULE = Rule(
    name="rotary_embedding",
    kernel="adopter.kernels.rotary",
    doc=DOC,
    dsl=DSL,
    codemod=RotaryCodemod(),
    runtime=Runtime(check=_runtime_check),
    fixtures="rotary_embedding",
    preconditions=(_is_rotary_embedding,),
    inlined_functions=rotation_functions,
)
