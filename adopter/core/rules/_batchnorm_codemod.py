"""Conv_BatchNorm and Linear_BatchNorm codemods (paper Fig. 5), forward only.

    h = self.conv(h); h = self.bn(h)   =>   h = conv_bn(self.conv, self.bn, h)

``__init__`` and both modules stay (checkpoints, subclasses and factory-built layers are
untouched); ``adopter.kernels.conv_bn``/``linear_bn`` fold an eval-mode batch norm into the layer
at run time and call ``self.bn(self.conv(h))`` otherwise (training, a Conv2d subclass with its
own ``forward``, a BN without running statistics). When the batch norm is conditional (DPT:
applied under ``if self.use_batch_norm:``) the layer call is hoisted into both branches (Fig. 4)
and only the branch with the batch norm calls the kernel.
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import (
    ChainPlan,
    Codemod,
    arg_text,
    kernel_name,
    match_function,
    matched_exprs,
    module_handle,
    separate_calls,
)
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit
from adopter.core.dsl import Layer
from adopter.core.structures import Match


class _LayerBatchNorm(Codemod):
    kernel = ""
    first_suffix = ""  # "Conv2d" / "Linear"
    bn_suffix = ""

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        # The first pattern node: its type may be a same-file subclass (``modeling_x.DepthwiseConv``).
        first = next((e for (n, e), mn in zip(exprs, match.nodes) if isinstance(n, Layer)
                      and (n.type.endswith(self.first_suffix) or mn.pattern_index == 0)), None)
        norm = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith(self.bn_suffix)), None)
        if not isinstance(first, ast.Call) or not isinstance(norm, ast.Call):
            raise Skip(f"match does not have a {self.first_suffix} call and a {self.bn_suffix} call")
        separate_calls(first, norm)
        if len(first.args) != 1 or first.keywords or len(norm.args) != 1 or norm.keywords:
            raise Skip("both calls must take exactly one tensor")
        arg = norm.args[0]
        first_stmt = ctx.statement_of(first)
        feeds = arg is first or (
            isinstance(arg, ast.Name) and isinstance(first_stmt, ast.Assign) and first_stmt.value is first
            and [t.id for t in first_stmt.targets if isinstance(t, ast.Name)] == [arg.id]
        )
        if not feeds:
            raise Skip(f"the {self.bn_suffix} reads {ctx.segment(arg)!r}, not the {self.first_suffix} output itself")
        layer = module_handle(ctx, first, self.first_suffix)
        bn = module_handle(ctx, norm, self.bn_suffix)
        spec, kernel = kernel_name(ctx, self.kernel)
        plan = ChainPlan(ctx, fn, [first, norm])
        plan.anchor_text = f"{kernel}({layer}, {bn}, {arg_text(ctx, first.args[0])})"
        plan.moved = [(first.func, first), (first.args[0], first)]
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))


class ConvBatchNorm(_LayerBatchNorm):
    rule = "Conv_BatchNorm"
    kernel = "conv_bn"
    first_suffix = "Conv2d"
    bn_suffix = "BatchNorm2d"


class LinearBatchNorm(_LayerBatchNorm):
    rule = "Linear_BatchNorm"
    kernel = "linear_bn"
    first_suffix = "Linear"
    bn_suffix = "BatchNorm1d"
