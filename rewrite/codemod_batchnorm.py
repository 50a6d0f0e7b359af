"""Conv_BatchNorm and Linear_BatchNorm codemods (paper Fig. 5).

    __init__:  self.conv = nn.Conv2d(A...); self.bn = nn.BatchNorm2d(C, eps=E)
           =>  self.conv = FusedConv2dBatchNorm2d(A..., bn_eps=E, bn_name="bn")
    forward:   h = self.conv(h); h = self.bn(h)   =>   h = self.conv(h)

The convolution's attribute is reused and ``bn_name`` tells the kernel's state-dict
hooks where the batch-norm keys live, so checkpoints load both ways. When the batch
norm is conditional (DPT: built and applied under ``if self.use_batch_norm:``) the
construction goes under that same condition and the forward call is hoisted (Fig. 4);
with the attribute reused both branches end up identical and collapse back.
"""

from __future__ import annotations

import ast

from adopter.rewrite.analysis import FileContext, Skip, call_arguments, is_self_attr
from adopter.rewrite.codemod_base import (
    ChainPlan,
    Codemod,
    arg_text,
    attr_used_elsewhere,
    forward_condition_chain,
    init_statement,
    match_function,
    matched_exprs,
    place_construction,
    pos,
    register,
)
from adopter.rewrite.edits import Edit, InitEdit

from adopter.dsl import Layer
from adopter.structures import Match

BN_SIG = ("num_features", "eps", "momentum", "affine", "track_running_stats", "device", "dtype")
CONV_SIG = (
    "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
    "padding_mode", "device", "dtype",
)
LINEAR_SIG = ("in_features", "out_features", "bias", "device", "dtype")


class _LayerBatchNorm(Codemod):
    kernel = ""
    first_suffix = ""  # "Conv2d" / "Linear"
    bn_suffix = ""
    first_sig: tuple[str, ...] = ()

    def first_args(self, ctx: FileContext, call: ast.Call) -> tuple[list[str], list[tuple[str, str]]]:
        raise NotImplementedError

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        first = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith(self.first_suffix)), None)
        norm = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith(self.bn_suffix)), None)
        if not isinstance(first, ast.Call) or not isinstance(norm, ast.Call):
            raise Skip(f"match does not have a {self.first_suffix} call and a {self.bn_suffix} call")
        first_attr, bn_attr = is_self_attr(first.func), is_self_attr(norm.func)
        if not first_attr or not bn_attr:
            raise Skip("both layers must be modules called as self.<name>(x)")
        if len(first.args) != 1 or first.keywords or len(norm.args) != 1 or norm.keywords:
            raise Skip("both calls must take exactly one tensor")
        cls = match.class_name
        if cls is None:
            raise Skip(f"{self.rule} needs the class that owns the layers")
        for attr, call in ((first_attr, first), (bn_attr, norm)):
            use = attr_used_elsewhere(ctx, cls, attr, [call])
            if use:
                raise Skip(f"self.{attr} is also used at line {use[0]} ({use[2]})")
        first_stmt, first_call, _ = init_statement(ctx, match, first_attr)
        bn_stmt, bn_call, _ = init_statement(ctx, match, bn_attr)
        positional, keywords = self.first_args(ctx, first_call)
        bn_args = call_arguments(bn_call, BN_SIG)
        for name in ("device", "dtype"):
            if name in bn_args:
                raise Skip(f"{self.bn_suffix} passes {name}=, which the fused kernel does not take")
        for name in ("eps", "momentum", "affine", "track_running_stats"):
            if name in bn_args:
                keywords.append((f"bn_{name}", arg_text(ctx, bn_args[name])))
        keywords.append(("bn_name", f'"{bn_attr}"'))
        parts = positional + [f"{k}={v}" for k, v in keywords]
        construct = f"self.{first_attr} = {self.kernel}({', '.join(parts)})"
        reads = set()
        for node in ast.walk(first_call):
            if isinstance(node, ast.Name):
                reads.add(node.id)
        for node in bn_args.values():
            reads |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        target, init_chain = place_construction(ctx, first_stmt, [bn_stmt], reads)
        fwd_chain = forward_condition_chain(ctx, first, norm)
        if init_chain != fwd_chain:
            raise Skip(
                f"self.{bn_attr} is built under {init_chain or 'no condition'} but applied under "
                f"{fwd_chain or 'no condition'}"
            )
        deletes = [s for s in (first_stmt, bn_stmt) if s is not target]
        if init_chain:
            # The plain layer stays for the branch without batch norm; the fused module
            # replaces it (same attribute) when the condition holds.
            deletes = []
        plan = ChainPlan(ctx, fn, [first, norm])
        plan.anchor_text = f"self.{first_attr}({arg_text(ctx, first.args[0])})"
        plan.moved = [(first.args[0], first)]
        forward = plan.build()
        init = InitEdit(replace=pos(ctx, target), construct=construct, delete=tuple(pos(ctx, s) for s in deletes))
        return Edit(rule=self.rule, forward=forward, init=(init,), imports=(self.kernel,))


@register
class ConvBatchNorm(_LayerBatchNorm):
    rule = "Conv_BatchNorm"
    kernel = "FusedConv2dBatchNorm2d"
    first_suffix = "Conv2d"
    bn_suffix = "BatchNorm2d"

    def first_args(self, ctx, call):
        args = call_arguments(call, CONV_SIG)
        for name in ("device", "dtype"):
            if name in args:
                raise Skip(f"Conv2d passes {name}=, which the fused kernel does not take")
        # Positional arguments stay positional, keywords stay keywords: Conv2d's signature.
        positional = [arg_text(ctx, a) for a in call.args]
        keywords = [(kw.arg, arg_text(ctx, kw.value)) for kw in call.keywords]
        return positional, keywords


@register
class LinearBatchNorm(_LayerBatchNorm):
    rule = "Linear_BatchNorm"
    kernel = "FusedLinearBatchNorm1d"
    first_suffix = "Linear"
    bn_suffix = "BatchNorm1d"

    def first_args(self, ctx, call):
        args = call_arguments(call, LINEAR_SIG)
        for name in ("device", "dtype"):
            if name in args:
                raise Skip(f"Linear passes {name}=, which the fused kernel does not take")
        if "in_features" not in args or "out_features" not in args:
            raise Skip("Linear without in/out features")
        positional = [arg_text(ctx, args["in_features"]), arg_text(ctx, args["out_features"])]
        keywords = [("bias", arg_text(ctx, args["bias"]))] if "bias" in args else []
        return positional, keywords
