"""The rule's codemod: the matched expression becomes one kernel call (``rotary``,
``rotary_interleaved``, ``rotary_complex``, ``rotary_pairs``) with the operands written as in the
source, and the statements only the rotation read (an inline rotation's, the pairs' parts) go."""

from __future__ import annotations

import ast

from adopter.core.codemod.base import Codemod, kernel_name, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit
from adopter.core.rules.rotary_embedding.complex_form import complex_parts
from adopter.core.rules.rotary_embedding.pairs_form import pair_parts
from adopter.core.rules.rotary_embedding.site import Site
from adopter.core.rules.rotary_embedding.sum_form import rotary_parts
from adopter.core.rules.rotary_embedding.variants import form_of, layer_node, sum_nodes
from adopter.core.structures import Match


def _text(ctx: FileContext, e: ast.expr) -> str:
    text = ctx.segment(e)
    return text if "\n" not in text else ast.unparse(e)


def _kernel_call(form: str, expr: ast.AST, ctx: FileContext, qualname: str) -> tuple[str, list[str], tuple]:
    """(kernel, its arguments' text, the statements deleted) for the ``form`` read at ``expr``."""
    fn = ctx.enclosing_function(expr)
    if form == "sum":
        parts = rotary_parts(expr, ctx.tree, fn, qualname)
        if isinstance(parts, str):
            raise Skip(parts)
        args = [_text(ctx, e) for e in (parts.x, parts.cos, parts.sin)]
        if parts.rotate_half is not None:
            args.append(parts.rotate_half)
        return parts.kernel, args, parts.delete
    site = Site.of(ctx.tree, fn, qualname, expr)
    parts = complex_parts(expr, site) if form == "complex" else pair_parts(expr, site)
    if isinstance(parts, str):
        raise Skip(parts)
    if form == "complex":
        return "rotary_complex", [_text(ctx, parts.left), _text(ctx, parts.right)], ()
    args = [_text(ctx, e) for e in (parts.x1, parts.x2, parts.cos, parts.sin)]
    if parts.join == "cat":
        args.append('join="cat"')
    return "rotary_pairs", args, parts.delete


class RotaryCodemod(Codemod):
    rule = "rotary_embedding"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        nodes = [mn.node for mn in match.nodes]
        form = form_of(nodes)
        anchor_node = sum_nodes(nodes)[0] if form == "sum" else layer_node(nodes)
        if anchor_node is None or anchor_node.span is None:
            raise Skip("the matched site has no source position")
        expr = ctx.expr_at(anchor_node.span)
        kernel, args, delete = _kernel_call(form, expr, ctx, anchor_node.span.function)
        spec, local = kernel_name(ctx, kernel)
        stmt = ctx.statement_of(expr)
        removed = tuple(pos(ctx, s) for s in sorted(delete, key=lambda s: s.lineno))
        forward = ForwardEdit(
            statements=(*removed, pos(ctx, stmt)), anchor=pos(ctx, stmt),
            expr_edits=(ExprEdit(ctx.char_span(expr), f"{local}({', '.join(args)})"),), delete=removed,
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))
