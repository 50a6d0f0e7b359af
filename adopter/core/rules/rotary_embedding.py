"""rotary_embedding: ``x * cos + rotate_half(x) * sin`` (RoPE, the usual ``apply_rotary_pos_emb``)
computed without ``rotate_half``'s temporaries (``-x2``, the concatenation, the two products).

Rewrite (the codemod below), one expression per line, nothing else changes:
    q_embed = (q * cos) + (rotate_half(q) * sin)
 => q_embed = rotary(q, cos, sin, rotate_half)

The user's ``rotate_half`` is handed over: ``adopter.kernels.rotary`` runs the fused kernel when its
preconditions hold at run time (shapes, dtypes, no gradient wanted for cos/sin, the function still
the half-split rotation) and ``x * cos + rotate_half(x) * sin`` otherwise. Statically, the rotation
must be a module-level function of the same file whose *source* is the half-split rotation
``cat((-x[..., h:], x[..., :h]), dim=-1)`` with ``h = x.shape[-1] // 2`` — extraction inlines its
``-x2`` and ``torch.cat`` but not the slicing, so the slicing is read from the function's AST. An
interleaved rotation (GPT-J's ``rotate_every_two``, GLM's ``rotate_half`` on ``x[..., 0::2]``)
computes something else and is not a match, whatever it is named.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.codemod.base import Codemod, kernel_name, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit
from adopter.core.dsl import Layer, TensorOp, Var
from adopter.core.match import MatchContext, NotACandidate
from adopter.core.match.source import function_ast, parse_file
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.structures import Match

# Extraction inlines ``rotate_half(x)`` into the calling function (its ``-x2`` and ``torch.cat``,
# not the slicing). ``Rule.inlined_functions`` folds that run back into one call at the call site:
# module-level functions whose source is the half-split rotation become ``ROTATE_HALF``, other
# one-argument functions that negate and concatenate/stack (interleaved rotations, a flipped sign)
# ``OTHER_ROTATION``, turned down by the precondition with the reason. The rotation call is not a
# pattern node: the trace attributes its ops to the lines of the rotation function, not to the call
# site, so confirmation would not find it; the precondition checks that one product reads it.
ROTATE_HALF = "adopter.rotary.rotate_half"
OTHER_ROTATION = "adopter.rotary.other_rotation"

DSL = """
rule rotary_embedding
forward:
    $x * $cos -> $a; $r * $sin -> $b; $a + $b -> $out
"""

DOC = """\
Applies a rotary position embedding in one kernel: ``x * cos + rotate_half(x) * sin`` (``q`` and
``k`` lines of ``apply_rotary_pos_emb``, any operand order, parentheses or none, inside a larger
expression such as ``torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)``)
becomes ``rotary(x, cos, sin, rotate_half)``. A match needs: the same ``x`` in both products (a
name, attribute or subscript, optionally cast with ``.float()``/``.to(...)``: it is evaluated once
instead of twice), and ``rotate_half`` a call of a module-level function of the same file (not
rebound there, nor a parameter or local of the calling function) whose source is the half-split
rotation: ``x1 = x[..., : x.shape[-1] // 2]``, ``x2 = x[..., x.shape[-1] // 2 :]`` (``x.size(-1)``, the half
in a local, ``cat`` imported from torch), ``return torch.cat((-x2, x1), dim=-1)``. Partial rotary
(``q_rot = q[..., :rotary_dim]``, Phi/GPT-NeoX/StableLM) matches: the kernel rotates whatever it
is given, with cos/sin of the same last dimension. Not a match (computes something else): an
interleaved rotation (``x[..., ::2]``/``torch.stack(...).flatten(-2)``: GPT-J's
``rotate_every_two``, GLM's ``rotate_half``), ``cat((x2, -x1))``, a rotation of another tensor than
the one multiplied by cos, a rotation imported from another file or passed in. At run time
``adopter.kernels.rotary`` falls back to the original expression unless ``x`` is floating with an
even last dimension, cos/sin have ``x``'s dtype, device and last dimension and broadcast to
``x``'s shape (a single KV head ``k`` of shape ``(b, 1, s, d)`` is never widened), cos/sin need no
gradient, and the function passed is (still) the half-split rotation."""


# ---------------------------------------------------------------- the rotation's source


def _torch_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the ``torch`` module, names bound to ``torch.cat``) by module-level imports,
    those under ``if``/``try`` included (``if is_torch_available(): import torch``)."""
    modules, cats = set(), set()
    for stmt in _module_level(tree.body):
        if isinstance(stmt, ast.Import):
            modules |= {a.asname or a.name for a in stmt.names if a.name == "torch"}
        elif isinstance(stmt, ast.ImportFrom) and stmt.module == "torch" and not stmt.level:
            cats |= {a.asname or a.name for a in stmt.names if a.name == "cat"}
    return modules, cats


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


def _last_dim_arg(call: ast.Call, position: int) -> bool:
    """The call's ``dim`` (keyword, or positional at ``position``) is the constant -1."""
    dims = [k.value for k in call.keywords if k.arg == "dim"]
    if not dims and len(call.args) > position:
        dims = [call.args[position]]
    return len(dims) == 1 and _int_const(dims[0]) == -1


class _NotHalfSplit(Exception):
    """The rotation's source is not (provably) the half-split rotation; the message says why."""


@dataclass
class _Rotation:
    """Symbolic evaluation of a candidate ``rotate_half(x)`` body: each name holds one of
    ``x``, ``d`` (``x.shape[-1]``), ``h`` (``d // 2``), ``x1``/``x2`` (first/second half),
    ``-x1``/``-x2``, ``rot`` (``cat((-x2, x1), dim=-1)``)."""

    torch_modules: set[str]
    cat_names: set[str]

    def value(self, e: ast.expr, env: dict[str, str]) -> str:
        if isinstance(e, ast.Name) and e.id in env:
            return env[e.id]
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
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("stack", "flatten",
                                                                                            "unbind", "view"):
            raise _NotHalfSplit(f"it builds pairs ({ast.unparse(e)}): an interleaved rotation, not rotate_half")
        raise _NotHalfSplit(f"{ast.unparse(e)} is not part of the half-split rotation")

    def _is_x(self, e: ast.expr, env: dict[str, str]) -> bool:
        return isinstance(e, ast.Name) and env.get(e.id) == "x"

    def _is_cat(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Attribute) and func.attr == "cat":
            return isinstance(func.value, ast.Name) and func.value.id in self.torch_modules
        return isinstance(func, ast.Name) and func.id in self.cat_names

    def _slice(self, s: ast.expr, env: dict[str, str]) -> str:
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

    def _cat(self, call: ast.Call, env: dict[str, str]) -> str:
        seq = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "tensors"), None)
        if not isinstance(seq, (ast.Tuple, ast.List)) or not _last_dim_arg(call, 1):
            raise _NotHalfSplit(f"{ast.unparse(call)} is not a concatenation of two halves along dim=-1")
        got = [self.value(e, env) for e in seq.elts]
        if got != ["-x2", "x1"]:
            raise _NotHalfSplit(f"it returns cat(({', '.join(got)}), dim=-1), not cat((-x2, x1), dim=-1)")
        return "rot"


def half_split_rotation(fn: ast.FunctionDef, tree: ast.Module) -> str:
    """"" when ``fn(x)`` computes ``cat((-x[..., h:], x[..., :h]), dim=-1)`` with
    ``h = x.shape[-1] // 2``; otherwise why not."""
    a = fn.args
    params = a.posonlyargs + a.args
    if len(params) != 1 or a.vararg or a.kwarg or a.kwonlyargs:
        return f"{fn.name} does not take exactly one argument x"
    if fn.decorator_list:
        return f"{fn.name} is decorated"
    modules, cats = _torch_names(tree)
    rot = _Rotation(modules, cats)
    env = {params[0].arg: "x"}
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    try:
        for stmt in body[:-1]:
            if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
                raise _NotHalfSplit(f"line {stmt.lineno} is not a plain assignment")
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                env[target.id] = rot.value(stmt.value, env)
            else:
                raise _NotHalfSplit(f"line {stmt.lineno} ({ast.unparse(stmt)}) is not part of the half-split rotation")
        if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
            raise _NotHalfSplit("it does not end with a return of the rotation")
        if rot.value(body[-1].value, env) != "rot":
            raise _NotHalfSplit(f"it returns {ast.unparse(body[-1].value)}, not cat((-x2, x1), dim=-1)")
    except _NotHalfSplit as why:
        return f"{fn.name} is not the half-split rotate_half: {why}"
    return ""


def _rotation_like(fn: ast.FunctionDef) -> bool:
    """A one-argument function that negates something and concatenates or stacks: a rotation of
    some kind (worth a reason when it is not the half-split one)."""
    a = fn.args
    if len(a.posonlyargs + a.args) != 1 or a.vararg or a.kwarg or a.kwonlyargs:
        return False
    negates = any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) for n in ast.walk(fn))
    joins = any(isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
                and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in ("cat", "stack", "concat")
                for n in ast.walk(fn))
    return negates and joins


def rotation_functions(structures, source: str | None) -> dict[str, str]:
    """``Rule.inlined_functions``: module-level functions of the file whose inlined body is one
    rotation call — ``ROTATE_HALF`` for the half-split rotation, ``OTHER_ROTATION`` for other
    rotations (turned down by the precondition, with the reason)."""
    if not source or "def " not in source:
        return {}
    tree = parse_file(source)
    if tree is None:
        return {}
    out: dict[str, str] = {}
    for stmt in _module_level(tree.body):
        if isinstance(stmt, ast.FunctionDef):
            if not half_split_rotation(stmt, tree):
                out[stmt.name] = ROTATE_HALF
            elif _rotation_like(stmt):
                out[stmt.name] = OTHER_ROTATION
    return out


# ---------------------------------------------------------------- the matched expression


@dataclass(frozen=True)
class RotaryParts:
    """``x * cos + rotate_half(x) * sin`` read from the source: the expressions' nodes."""

    expr: ast.BinOp
    x: ast.expr
    cos: ast.expr
    sin: ast.expr
    rotate_half: str  # the module-level function's name
    rotate_half_call: ast.Call


# Methods whose result depends only on the tensor (and the constant arguments): an ``x`` written
# with them (``q.float()``) is the same tensor at both of its places and may be evaluated once.
_PURE_METHODS = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous"}


def _pure(e: ast.expr) -> bool:
    """``e`` reads names, attributes and items only (plus pure casts): evaluating it once instead
    of twice changes nothing."""
    for n in ast.walk(e):
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
    return any(isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)) for n in ast.walk(e))


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
                         for n in ast.walk(stmt))
    if not defs:
        return f"{name} is not a function defined in this file"
    if len(defs) > 1 or other:
        return f"{name} is bound more than once at module level"
    return defs[0]


def _local_names(fn: ast.AST) -> set[str]:
    """Parameters and names assigned in ``fn`` (a function), nested scopes included (conservative)."""
    names: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = fn.args
        names |= {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
        names |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
            names.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            names |= set(n.names)
    return names


def _same(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)


def rotary_parts(expr: ast.AST, tree: ast.Module, enclosing: ast.AST | None) -> RotaryParts | str:
    """Read ``expr`` as ``x * cos + rotate_half(x) * sin`` (either product first, either factor
    order): the parts, or why it is not that computation. ``enclosing``: the function holding it."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add)):
        return "the matched sum is not an addition"
    products = (expr.left, expr.right)
    if not all(isinstance(p, ast.BinOp) and isinstance(p.op, ast.Mult) for p in products):
        return "the addition's operands are not both products"
    local = _local_names(enclosing) if enclosing is not None else set()
    why = "neither product is rotate_half(x) * sin with x the other product's factor"
    for rotated, plain in (products, products[::-1]):
        for call, sin in ((rotated.left, rotated.right), (rotated.right, rotated.left)):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 1
                    and not call.keywords and not isinstance(call.args[0], ast.Starred)):
                continue
            x = call.args[0]
            why = (f"{ast.unparse(call)} rotates another tensor than the one multiplied by cos "
                   f"({ast.unparse(plain)})")
            for x_there, cos in ((plain.left, plain.right), (plain.right, plain.left)):
                if not _same(x_there, x):
                    continue
                name = call.func.id
                if name in local:
                    return f"{name} is a parameter or local of the calling function"
                fn = _module_function(tree, name)
                if isinstance(fn, str):
                    return fn
                why = half_split_rotation(fn, tree)
                if why:
                    return why
                if not _pure(x):
                    return f"x ({ast.unparse(x)}) has calls: it cannot be evaluated once instead of twice"
                if _unsafe_operand(cos) or _unsafe_operand(sin):
                    return "cos or sin assigns or yields"
                return RotaryParts(expr, x, cos, sin, name, call)
    return why


# ---------------------------------------------------------------- precondition


def _binop_at(fn: ast.AST, span) -> ast.BinOp | None:
    for n in ast.walk(fn):
        if isinstance(n, ast.BinOp) and (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) == (
                span.line, span.col, span.end_line, span.end_col):
            return n
    return None


def _matched(nodes) -> tuple[TensorOp | None, list[TensorOp]]:
    """(the sum, the two products) among a match's nodes."""
    add = next((n for n in nodes if isinstance(n, TensorOp) and n.op == "+"), None)
    products = [n for n in nodes if isinstance(n, TensorOp) and n.op == "*"]
    return add, products


def _rotations_read(ctx: MatchContext, products: list[TensorOp]) -> list[Layer]:
    """The rotation calls the products multiply: folded calls, or (where the fold could not place
    the inlined run, e.g. inside a caller that inlines the helper in turn) the inlined
    ``torch.cat`` a same-file function returns (which may also be where ``x`` came from)."""
    producers = ctx.producers()
    out = []
    for p in products:
        for a in p.args:
            made = producers.get((a.value.name, a.value.version)) if isinstance(a.value, Var) else None
            if not isinstance(made, Layer) or made.span is None:
                continue
            if made.type in (ROTATE_HALF, OTHER_ROTATION) or (
                    made.type == "torch.cat" and made.span.inlined_at and "." not in made.span.function):
                out.append(made)
    return out


def _is_call_of(rotation: Layer, call: ast.Call, stmt_lines: range) -> bool:
    """``rotation`` (a matched node) is the rotation call ``call`` of the sum."""
    sp = rotation.span
    if rotation.type != "torch.cat":
        return (call.lineno, call.col_offset, call.end_lineno, call.end_col_offset) == (
            sp.line, sp.col, sp.end_line, sp.end_col)
    # inlined: the function it lies in is the one called, from the sum's statement
    return sp.function == call.func.id and sp.inlined_at[-1] in stmt_lines


def _is_rotary_embedding(ctx: MatchContext) -> str | None:
    """The matched sum is ``x * cos + rotate_half(x) * sin`` with the half-split rotation (read
    from the source: extraction does not keep the slicing); otherwise not a match, with why."""
    add, products = _matched([mn.node for mn in ctx.match.nodes])
    rotations = _rotations_read(ctx, products)
    if not rotations:
        # any ``a*b + c*d`` fits the sum pattern: without a rotation it is not a candidate
        return NotACandidate("no product multiplies a call of a same-file rotation function")
    spans = [getattr(n, "span", None) for n in (add, *products)]
    if add is None or len(products) != 2 or None in spans or ctx.source is None:
        return "the matched sum has no source position"
    tree = parse_file(ctx.source)
    fn = function_ast(ctx.source, add.span.function, add.span.line) if add.span.function else tree
    expr = _binop_at(fn, add.span) if fn is not None else None
    if tree is None or expr is None:
        return f"no sum at line {add.span.line} in the source"
    # the products the pattern matched are the sum's operands (not products elsewhere on the path)
    operands = {(p.lineno, p.col_offset, p.end_lineno, p.end_col_offset) for p in (expr.left, expr.right)}
    if {(p.span.line, p.span.col, p.span.end_line, p.span.end_col) for p in products} != operands:
        return "the matched products are not the operands of the sum"
    parts = rotary_parts(expr, tree, fn if fn is not tree else None)
    if isinstance(parts, str):
        return parts
    stmt_lines = range(add.span.stmt_line, add.span.stmt_end_line + 1)
    if not any(_is_call_of(r, parts.rotate_half_call, stmt_lines) for r in rotations):
        return "the rotation the product reads is not the call in the sum"
    return None


# ---------------------------------------------------------------- codemod

KERNEL = "rotary"


class RotaryCodemod(Codemod):
    rule = "rotary_embedding"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        add, _ = _matched([mn.node for mn in match.nodes])
        if add is None or add.span is None:
            raise Skip("the matched sum has no source position")
        expr = ctx.expr_at(add.span)
        parts = rotary_parts(expr, ctx.tree, ctx.enclosing_function(expr))
        if isinstance(parts, str):
            raise Skip(parts)
        spec, local = kernel_name(ctx, KERNEL)
        args = [ctx.segment(e) if "\n" not in ctx.segment(e) else ast.unparse(e) for e in (parts.x, parts.cos, parts.sin)]
        text = f"{local}({', '.join(args)}, {parts.rotate_half})"
        stmt = ctx.statement_of(expr)
        forward = ForwardEdit(
            statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(ExprEdit(ctx.char_span(expr), text),)
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))


# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    """What ran: the shapes of the sum (the kernel needs an even last dimension; an odd one would
    make every call fall back, so the site is not worth rewriting)."""
    shapes = [s for ops in site.ops for op in ops if op.name == "add" for s in op.input_shapes if s]
    if not shapes:
        return None, ""
    last = {tuple(s)[-1] for s in shapes if len(s)}
    if any(d % 2 for d in last):
        return f"the rotated last dimension is odd ({sorted(last)}): the kernel would always fall back", ""
    return None, f"rotary on {' + '.join(str(tuple(s)) for s in shapes)}"


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
