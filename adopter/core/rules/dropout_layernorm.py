"""Dropout_LayerNorm: fuse ``LayerNorm(Dropout(x) + residual)`` (EPOI ``FusedDropoutAddLayerNorm``).

Rewrite (the codemod below):
    __init__:  self.LayerNorm = nn.LayerNorm(S, eps=E); self.dropout = nn.Dropout(P)
           =>  self.LayerNorm = FusedDropoutAddLayerNorm(S, p=P, eps=E)
    forward:   h = self.dropout(h); h = self.LayerNorm(h + r)
           =>  h = self.LayerNorm(h, r)

The LayerNorm's attribute name is reused, so its ``weight``/``bias`` keys stay. The
dropout binding stays when the dropout module is still used elsewhere.
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import (
    ChainPlan,
    Codemod,
    arg_text,
    attr_used_elsewhere,
    format_call,
    init_statement,
    match_function,
    matched_exprs,
    place_construction,
    pos,
)
from adopter.core.codemod.context import FileContext, Skip, call_arguments, is_self_attr
from adopter.core.codemod.edits import Edit, InitEdit
from adopter.core.dsl import Layer, TensorOp
from adopter.core.match import MatchContext
from adopter.core.rule import Rule, Runtime, RuntimeSite, RuntimeStep
from adopter.core.rules._common import DROPOUT, LAYER_NORM, first_of, intermediates_unused
from adopter.core.structures import Match

DSL = """
rule Dropout_LayerNorm
init:
    torch.nn.Dropout($p) -> $drop; torch.nn.LayerNorm($shape, eps=$eps) -> $ln
forward:
    torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out
"""

DOC = """\
Fuses a dropout, a residual add and a layer norm into one kernel. A match is a call of
a ``torch.nn.Dropout`` module whose output is added (``+``, either operand order, nested
or through assignments) to another tensor, the sum being the input of a
``torch.nn.LayerNorm`` module call, all on one control-flow path of a ``forward`` (or a
helper it calls), with both modules bound in ``__init__`` of the class (or a base class
in the same file). Not a match: functional ``nn.functional.dropout``; LayerNorm before
Dropout (embeddings); other norm classes (RMSNorm, custom LayerNorm); Dropout and
LayerNorm that are not connected through the add; a dropout output or sum that is also
read by another node outside the three matched ones (fusion would drop it); the same
module used as both layers."""


def _dropout_is_not_layernorm(ctx: MatchContext) -> str | None:
    drop, ln = ctx.binding("$drop"), ctx.binding("$ln")
    if drop is not None and drop == ln:
        return "Dropout and LayerNorm are the same module"
    return None


# ---------------------------------------------------------------- codemod

KERNEL = "FusedDropoutAddLayerNorm"
LAYERNORM_SIG = ("normalized_shape", "eps", "elementwise_affine", "bias", "device", "dtype")
DROPOUT_SIG = ("p", "inplace")


class DropoutLayerNorm(Codemod):
    rule = "Dropout_LayerNorm"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        drop = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith("Dropout")), None)
        add = next((e for n, e in exprs if isinstance(n, TensorOp) and n.op == "+"), None)
        norm = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith("LayerNorm")), None)
        if not all(isinstance(e, (ast.Call, ast.BinOp)) for e in (drop, add, norm)):
            raise Skip("match does not have a Dropout call, a `+` and a LayerNorm call")
        drop_attr, norm_attr = is_self_attr(drop.func), is_self_attr(norm.func)
        if not drop_attr or not norm_attr:
            raise Skip("Dropout and LayerNorm must be modules called as self.<name>(...)")
        if len(drop.args) != 1 or drop.keywords or len(norm.args) != 1 or norm.keywords:
            raise Skip("Dropout/LayerNorm calls must take exactly one tensor")
        # Which operand of the add is the dropout output? (nested call or its assigned name)
        drop_stmt = ctx.statement_of(drop)
        drop_out = drop if drop_stmt is ctx.statement_of(add) else None
        residual = None
        for this, other in ((add.left, add.right), (add.right, add.left)):
            if this is drop or (
                drop_out is None
                and isinstance(this, ast.Name)
                and isinstance(drop_stmt, ast.Assign)
                and len(drop_stmt.targets) == 1
                and isinstance(drop_stmt.targets[0], ast.Name)
                and drop_stmt.targets[0].id == this.id
            ):
                residual = other
                break
        if residual is None:
            raise Skip("the `+` does not read the dropout output")
        if norm.args[0] is not add:
            add_stmt = ctx.statement_of(add)
            arg = norm.args[0]
            if not (
                isinstance(arg, ast.Name)
                and isinstance(add_stmt, ast.Assign)
                and add_stmt.value is add
                and [t.id for t in add_stmt.targets if isinstance(t, ast.Name)] == [arg.id]
            ):
                raise Skip("the LayerNorm does not read the sum")
        cls = match.class_name
        if cls is None:
            raise Skip("Dropout_LayerNorm needs the class that owns the modules")
        use = attr_used_elsewhere(ctx, cls, norm_attr, [norm])
        if use:
            raise Skip(f"self.{norm_attr} is also used at line {use[0]} ({use[2]})")

        norm_stmt, norm_call, _ = init_statement(ctx, match, norm_attr)
        drop_stmt_init, drop_call, _ = init_statement(ctx, match, drop_attr)
        norm_args = call_arguments(norm_call, LAYERNORM_SIG)
        drop_args = call_arguments(drop_call, DROPOUT_SIG)
        if "normalized_shape" not in norm_args:
            raise Skip("LayerNorm without normalized_shape")
        keywords = [("p", arg_text(ctx, drop_args["p"]) if "p" in drop_args else "0.5")]
        for name in ("eps", "elementwise_affine", "bias"):
            if name in norm_args:
                keywords.append((name, arg_text(ctx, norm_args[name])))
        for name in ("device", "dtype"):
            if name in norm_args:
                raise Skip(f"LayerNorm passes {name}=, which the fused kernel does not take")
        construct = f"self.{norm_attr} = " + format_call(
            KERNEL, [arg_text(ctx, norm_args["normalized_shape"])], keywords
        )
        reads = set()
        for node in list(norm_args.values()) + list(drop_args.values()):
            reads |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        keep_dropout = attr_used_elsewhere(ctx, cls, drop_attr, [drop]) is not None
        absorbed = [] if keep_dropout else [drop_stmt_init]
        target, cond = place_construction(ctx, norm_stmt, absorbed or [drop_stmt_init], reads)
        if cond:
            raise Skip("Dropout and LayerNorm are constructed under different conditions")
        if target is not norm_stmt and keep_dropout:
            raise Skip("the construction would need values bound after the LayerNorm")
        deletes = [] if keep_dropout else [s for s in (drop_stmt_init, norm_stmt) if s is not target]
        plan = ChainPlan(ctx, fn, [drop, add, norm])
        plan.anchor_text = f"self.{norm_attr}({arg_text(ctx, drop.args[0])}, {arg_text(ctx, residual)})"
        plan.moved = [(drop.args[0], drop), (residual, add)]
        forward = plan.build()
        init = InitEdit(replace=pos(ctx, target), construct=construct, delete=tuple(pos(ctx, s) for s in deletes))
        return Edit(rule=self.rule, forward=forward, init=(init,), imports=(KERNEL,))

# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    drop = first_of(site.modules, nn.Dropout)
    ln = first_of(site.modules, nn.LayerNorm)
    if ln is None:
        return "the norm that runs is not an nn.LayerNorm", ""
    add_i = next((i for i, n in enumerate(site.nodes) if isinstance(n, TensorOp)), None)
    if add_i is not None:
        for op in site.ops[add_i]:
            shapes = op.input_shapes
            if len(shapes) == 2 and None not in shapes and shapes[0] != shapes[1]:
                return f"residual add broadcasts ({list(shapes[0])} + {list(shapes[1])})", ""
    p = drop.p if drop is not None else "?"
    return None, f"Dropout(p={p}) + LayerNorm{tuple(ln.normalized_shape)} eps={ln.eps}"


RUNTIME = Runtime(
    check=_runtime_check,
    sequence=(
        RuntimeStep("torch.nn.Dropout", module_types=(DROPOUT,)),
        RuntimeStep("+", ops=frozenset({"add", "add_"})),
        RuntimeStep("torch.nn.LayerNorm", module_types=(LAYER_NORM,)),
    ),
    leaf_modules=(DROPOUT, LAYER_NORM),
)

RULE = Rule(
    name="Dropout_LayerNorm",
    kernel="adopter.kernels.FusedDropoutAddLayerNorm",
    doc=DOC,
    dsl=DSL,
    codemod=DropoutLayerNorm(),
    runtime=RUNTIME,
    # FusedDropoutAddLayerNorm keeps the dropout probability as ``p``.
    stochastic_attributes=("p",),
    fixtures="Dropout_LayerNorm",
    preconditions=(intermediates_unused("$y", "$sum"), _dropout_is_not_layernorm),
)
