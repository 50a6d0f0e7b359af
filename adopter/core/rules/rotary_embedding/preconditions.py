"""The rule's precondition: the matched site computes a rotary embedding in one of the forms (read
from the source: extraction does not keep slicing nor the order of a stack's parts); otherwise not
a match, with why. A sum ``a * b + c * d`` is a candidate only when a product reads a rotation of
some kind in the extracted graph (a folded rotation call, a concatenation with a negated part, the
inlined body of a same-file rotation-like function, a ``Cls.rotate_half(x)`` call); which rotation
it is, and the rest, :mod:`.sum_form` reads from the source."""

from __future__ import annotations

import ast
import re

from adopter.core.dsl import Const, Layer, Span, TensorOp, Var
from adopter.core.match import MatchContext, NotACandidate
from adopter.core.match.source import function_ast, parse_file
from adopter.core.rules.rotary_embedding.complex_form import complex_parts
from adopter.core.rules.rotary_embedding.pairs_form import pair_parts
from adopter.core.rules.rotary_embedding.rotation import FOLDED, rotation_like
from adopter.core.rules.rotary_embedding.scope import class_def, method_def, module_function
from adopter.core.rules.rotary_embedding.site import Site
from adopter.core.rules.rotary_embedding.sum_form import rotary_parts
from adopter.core.rules.rotary_embedding.variants import (
    form_of,
    layer_node,
    node_at,
    position,
    span_position,
    sum_nodes,
)


def _class_call(text: str, tree: ast.Module | None) -> bool:
    """``text`` is a call ``Cls.name(...)`` of a class defined in the file."""
    try:
        e = ast.parse(text, mode="eval").body
    except SyntaxError:
        return False
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and isinstance(e.func.value, ast.Name) \
        and tree is not None and class_def(tree, e.func.value.id) is not None


def _def_at(tree: ast.Module | None, qualname: str) -> tuple[ast.FunctionDef | None, bool]:
    """(the ``def`` of ``qualname`` — a module-level function or ``Cls.method`` —, whether a method)."""
    if tree is None or not qualname:
        return None, False
    owner, _, name = qualname.rpartition(".")
    if not owner:
        fn = module_function(tree, name)
        return (None if isinstance(fn, str) else fn), False
    cls = class_def(tree, owner)
    fn = method_def(tree, cls, name) if cls is not None else None
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


def _rotations_read(ctx: MatchContext, products: list[TensorOp]) -> list[Layer | Const]:
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
            if made.type in FOLDED or made.type in ("torch.cat", "torch.concat") and _negates(ctx, made):
                out.append(made)
            elif made.span.inlined_at:
                fn, method = _def_at(tree, made.span.function)
                if fn is not None and rotation_like(fn, method):
                    out.append(made)
    return out


def _is_call_of(rotation: Layer, call: ast.Call, stmt_lines: range) -> bool:
    """``rotation`` (a matched node) is the rotation call ``call`` of the sum."""
    sp = rotation.span
    if rotation.type in FOLDED:
        return position(call) == span_position(sp)
    # inlined: the function it lies in is the one called, from the sum's statement
    return sp.function == call.func.id and bool(sp.inlined_at) and sp.inlined_at[-1] in stmt_lines


def _function_of(ctx: MatchContext, span: Span) -> tuple[ast.Module | None, ast.AST | None]:
    """(the file's tree, the function holding ``span``, or the tree at module level)."""
    tree = parse_file(ctx.source) if ctx.source is not None else None
    if tree is None:
        return None, None
    fn = function_ast(ctx.source, span.function, span.line) if span.function else tree
    return tree, fn


def _is_rotary_sum(ctx: MatchContext) -> str | None:
    """The matched ``a * b + c * d`` is ``x * cos + rotation(x) * sin``, the rotation the one the
    extracted graph shows the product reading."""
    add, products = sum_nodes([mn.node for mn in ctx.match.nodes])
    rotations = _rotations_read(ctx, products)
    if not rotations:
        # any ``a*b + c*d`` fits the sum pattern: without a rotation it is not a candidate
        return NotACandidate("no product multiplies a call of a same-file rotation function")
    spans = [getattr(n, "span", None) for n in (add, *products)]
    if add is None or len(products) != 2 or None in spans or ctx.source is None:
        return "the matched sum has no source position"
    tree, fn = _function_of(ctx, add.span)
    expr = node_at(fn, add.span, ast.BinOp) if fn is not None else None
    if tree is None or expr is None:
        return f"no sum at line {add.span.line} in the source"
    # the products the pattern matched are the sum's operands (not products elsewhere on the path)
    if {span_position(p.span) for p in products} != {position(p) for p in (expr.left, expr.right)}:
        return "the matched products are not the operands of the sum"
    parts = rotary_parts(expr, tree, fn if fn is not tree else None, add.span.function)
    if isinstance(parts, str):
        return parts
    call = parts.rotate_half_call
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == parts.rotate_half:
        stmt_lines = range(add.span.stmt_line, add.span.stmt_end_line + 1)
        folded = [r for r in rotations if isinstance(r, Layer) and (r.type in FOLDED or r.span.inlined_at)]
        if folded and not any(_is_call_of(r, call, stmt_lines) for r in folded):
            return "the rotation the product reads is not the call in the sum"
    return None


def _is_rotary_layer(ctx: MatchContext, form: str) -> str | None:
    """The matched ``view_as_real`` or stack is the complex or the pairs rotation."""
    layer = layer_node(mn.node for mn in ctx.match.nodes)
    if layer is None or layer.span is None or ctx.source is None:
        return "the matched call has no source position"
    tree, fn = _function_of(ctx, layer.span)
    call = node_at(fn, layer.span, ast.Call) if fn is not None else None
    if tree is None or call is None:
        return NotACandidate(f"no call at line {layer.span.line} in the source")
    site = Site.of(tree, fn if fn is not tree else None, layer.span.function, call)
    if form == "complex":
        parts = complex_parts(call, site)
        if isinstance(parts, str):
            return parts
        product = next((mn.node for mn in ctx.match.nodes if isinstance(mn.node, TensorOp)), None)
        prod = call.args[0]
        if product is None or product.span is None or span_position(product.span) != position(prod):
            return NotACandidate("the matched product is not the one view_as_real reads")
        return None
    parts = pair_parts(call, site)
    return parts if isinstance(parts, str) else None


def is_rotary_embedding(ctx: MatchContext) -> str | None:
    """The matched site computes a rotary embedding in one of the forms of the module doc (read
    from the source: extraction does not keep slicing nor the order of a stack's parts); otherwise
    not a match, with why."""
    form = form_of(mn.node for mn in ctx.match.nodes)
    if form == "sum":
        return _is_rotary_sum(ctx)
    return _is_rotary_layer(ctx, form)
