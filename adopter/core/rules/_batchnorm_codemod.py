"""Conv_BatchNorm and Linear_BatchNorm codemods (paper Fig. 5), forward only.

    h = self.conv(h); h = self.bn(h)   =>   h = conv_bn(self.conv, self.bn, h)
    h = self.conv(h); h = self.bn(h); h = self.act(h)   =>   h = conv_bn(self.conv, self.bn, h, self.act)

``__init__`` and both modules stay (checkpoints, subclasses and factory-built layers are
untouched); ``adopter.kernels.conv_bn``/``linear_bn`` fold an eval-mode batch norm into the layer
at run time and call ``self.bn(self.conv(h))`` otherwise (training, a Conv2d subclass with its
own ``forward``, a BN without running statistics). When the batch norm is conditional (DPT:
applied under ``if self.use_batch_norm:``) the layer call is hoisted into both branches (Fig. 4)
and only the branch with the batch norm calls the kernel.

An activation applied to the batch norm's output alone, as the very next step (the next statement
reading only that output, or a call wrapped around the batch norm call), is handed to ``conv_bn``
too: a module reference (``self.act``: whatever it is at run time, the kernel applies a plain ReLU
in the conv's epilogue and calls anything else on the result) or a functional ReLU
(``F.relu``/``torch.relu``). Modules built in ``__init__`` as a layer that is no activation
(``nn.MaxPool2d``, ``nn.Dropout``...) are left outside: handing them over would gain nothing.
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
from adopter.core.codemod.context import FileContext, Skip, is_self_attr, simple_assign_target
from adopter.core.codemod.edits import Edit
from adopter.core.dsl import Layer
from adopter.core.structures import Match


class _LayerBatchNorm(Codemod):
    kernel = ""
    takes_activation = False  # the kernel takes the activation applied to the batch norm's output
    first_suffix = ""  # "Conv2d" / "Linear"
    bn_suffix = ""

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        # The first pattern node: its type may be a same-file subclass (``modeling_x.DepthwiseConv``).
        first = next((e for (n, e), mn in zip(exprs, match.nodes) if isinstance(n, Layer)
                      and (n.type.endswith(self.first_suffix) or mn.pattern_index == 0)), None)
        # The second: a BatchNorm, or a module matched as one (a norm+act class of another file)
        norm = next((e for (n, e), mn in zip(exprs, match.nodes) if isinstance(n, Layer)
                     and (n.type.endswith(self.bn_suffix) or mn.pattern_index == 1)), None)
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
        call = f"{kernel}({layer}, {bn}, {arg_text(ctx, first.args[0])}"
        moved = [(first.func, first), (first.args[0], first)]
        activation = self.takes_activation and _activation_after(ctx, norm, match.class_name)
        if activation:
            plan = ChainPlan(ctx, fn, [first, norm, activation])
            plan.anchor_text = f"{call}, {arg_text(ctx, activation.func)})"
            plan.moved = moved
            try:
                return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))
            except Skip:
                pass  # (the activation stays where it is)
        plan = ChainPlan(ctx, fn, [first, norm])
        plan.anchor_text = f"{call})"
        plan.moved = moved
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))


class ConvBatchNorm(_LayerBatchNorm):
    rule = "Conv_BatchNorm"
    takes_activation = True
    kernel = "conv_bn"
    first_suffix = "Conv2d"
    bn_suffix = "BatchNorm2d"


class LinearBatchNorm(_LayerBatchNorm):
    rule = "Linear_BatchNorm"
    kernel = "linear_bn"
    first_suffix = "Linear"
    bn_suffix = "BatchNorm1d"


# torch.nn layers that are no pointwise activation: a module built as one of these and applied
# after the batch norm stays outside the kernel call (nothing to fuse; the diff would only confuse)
_NOT_ACTIVATIONS = frozenset({
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "Linear", "Dropout", "Dropout2d", "MaxPool2d", "AvgPool2d",
    "AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "BatchNorm2d", "GroupNorm", "LayerNorm", "InstanceNorm2d",
    "Sequential", "ModuleList", "Flatten", "Upsample", "PixelShuffle", "Embedding", "ZeroPad2d",
})
_RELU_FUNCTIONS = frozenset({"F.relu", "torch.relu", "torch.nn.functional.relu", "nn.functional.relu", "functional.relu"})


def _activation_after(ctx: FileContext, norm: ast.Call, class_name: str | None) -> ast.Call | None:
    """The call that applies an activation to the batch norm's output and nothing else, right
    after it: ``act(<norm call>)``, or ``h = <norm call>`` followed by a statement ``... act(h) ...``
    where ``act(h)`` is its value; ``act`` a module reference on ``self`` (not built as a layer that
    is no activation) or a functional ReLU. None when there is none."""
    parent = ctx.parent(norm)
    if isinstance(parent, ast.Call) and parent.args == [norm]:
        candidate = parent
    else:
        stmt = ctx.statement_of(norm)
        name = simple_assign_target(stmt)
        if name is None or stmt.value is not norm:
            return None
        block = ctx.block_of(stmt)[2]
        index = block.index(stmt)
        if index + 1 >= len(block):
            return None
        following = block[index + 1]
        candidate = getattr(following, "value", None)
        if not (isinstance(candidate, ast.Call) and len(candidate.args) == 1 and isinstance(candidate.args[0], ast.Name)
                and candidate.args[0].id == name):
            return None
    if candidate.keywords or len(candidate.args) != 1 or isinstance(candidate.args[0], ast.Starred):
        return None
    func = candidate.func
    attr = is_self_attr(func)
    if attr is not None:
        built = ctx.class_attr_stores(class_name, attr) if class_name else []
        for stmt in built:
            value = getattr(stmt, "value", None)
            if isinstance(value, ast.Call):
                callee = value.func
                last = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
                if last in _NOT_ACTIVATIONS:
                    return None
        return candidate
    if ctx.segment(func) in _RELU_FUNCTIONS:
        return candidate
    return None
