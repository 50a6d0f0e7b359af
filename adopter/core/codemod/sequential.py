"""Rewrite of a matched ``nn.Sequential`` pair where the Sequential is built (issue 11):

    nn.Sequential(conv3x3(a, b), norm_layer(b), nn.ReLU())
 => GuardedSequential(conv3x3(a, b), norm_layer(b), nn.ReLU())

Only the callee changes; the entries, their order and names (``OrderedDict`` keys) stay, so the
children and the state dict are the original's. ``adopter.kernels.GuardedSequential`` runs
consecutive children through a guarded kernel when, at run time, they form a pair it fuses, and
calls them one after the other otherwise. Every pair matched in one Sequential yields this same
edit (the engine applies it once).
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import kernel_name, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit
from adopter.core.structures import Match

KERNEL = "GuardedSequential"


class SequentialCodemod:
    """The codemod of every match with ``Match.sequential`` set (rules with ``in_sequential``)."""

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        span = match.sequential
        if span is None:
            raise Skip("not an nn.Sequential pair")
        call = ctx.expr_at(span)
        if not isinstance(call, ast.Call):
            raise Skip("the nn.Sequential construction is not a call")
        func = call.func
        if call.keywords:
            raise Skip("nn.Sequential called with keywords")
        if ctx.enclosing_function(call) is None:
            raise Skip("the nn.Sequential is built outside a function")
        spec, local = kernel_name(ctx, KERNEL)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
            # ``super().__init__(...)`` of an nn.Sequential subclass (torchvision's
            # Conv2dNormActivation, DenseNet's layers): the class derives from GuardedSequential
            # instead, an nn.Sequential itself (same children, isinstance checks unchanged)
            stmt, base = self._sequential_base(ctx, call)
            edit = ExprEdit(ctx.char_span(base), local)
        else:
            stmt = ctx.statement_of(call)
            edit = ExprEdit(ctx.char_span(func), local)
        forward = ForwardEdit(statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(edit,))
        return Edit(rule=match.rule, forward=forward, imports=(spec,))

    @staticmethod
    def _sequential_base(ctx: FileContext, call: ast.Call) -> tuple[ast.ClassDef, ast.expr]:
        name = ctx.enclosing_class_name(call)
        cls = ctx.classes.get(name) if name else None
        if cls is None:
            raise Skip("super().__init__ outside a class")
        bases = [b for b in cls.bases if ctx.segment(b).split(".")[-1] == "Sequential"]
        if len(bases) != 1:
            # the Sequential base is reached through another class of the file
            raise Skip(f"{name} does not name nn.Sequential among its bases")
        return cls, bases[0]


SEQUENTIAL_CODEMOD = SequentialCodemod()

CALL_KERNEL = "run_sequential"


class SequentialCallCodemod:
    """The codemod of a pair of an ``nn.Sequential`` that another file builds (a helper of another
    module or of an installed package: ``self.mlp = make_mlp(dim)``) and this one calls: the call
    becomes ``run_sequential(self.mlp, x)``, which runs the Sequential's children as
    ``GuardedSequential`` runs them when it is, at that call, a plain ``nn.Sequential``, and calls it
    as before otherwise. ``__init__`` and the helper stay as they are. Every pair matched in one
    call yields this same edit."""

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        spans = {(mn.node.span.line, mn.node.span.col) for mn in match.nodes if mn.node.span is not None}
        if len(spans) != 1:
            raise Skip("not the call of one nn.Sequential")
        call = ctx.expr_at(match.nodes[0].node.span)
        if not isinstance(call, ast.Call):
            raise Skip("the nn.Sequential call is not a call")
        if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
            raise Skip("the nn.Sequential is called with other than one tensor")
        if ctx.enclosing_function(call) is None:
            raise Skip("the nn.Sequential is called outside a function")
        spec, local = kernel_name(ctx, CALL_KERNEL)
        stmt = ctx.statement_of(call)
        text = f"{local}({ctx.segment(call.func)}, {ctx.segment(call.args[0])})"
        forward = ForwardEdit(statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt),
                              expr_edits=(ExprEdit(ctx.char_span(call), text),))
        return Edit(rule=match.rule, forward=forward, imports=(spec,))


SEQUENTIAL_CALL_CODEMOD = SequentialCallCodemod()
