"""Dropout_LayerNorm: fuse ``LayerNorm(Dropout(x) + residual)`` (EPOI ``FusedDropoutAddLayerNorm``).

Rewrite (the codemod below), forward only — ``__init__`` and the modules stay:
    h = self.dropout(h); h = self.LayerNorm(h + r)
 => h = dropout_add_layer_norm(self.dropout, self.LayerNorm, h, r)

``adopter.kernels.dropout_add_layer_norm`` runs the fused kernel when, at run time, the modules
are a plain ``nn.Dropout`` and ``nn.LayerNorm`` and the shapes agree, and
``self.LayerNorm(self.dropout(h) + r)`` otherwise.
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

KERNEL = "dropout_add_layer_norm"


class DropoutLayerNorm(Codemod):
    rule = "Dropout_LayerNorm"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        drop = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith("Dropout")), None)
        add = next((e for n, e in exprs if isinstance(n, TensorOp) and n.op == "+"), None)
        norm = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith("LayerNorm")), None)
        if not (isinstance(drop, ast.Call) and isinstance(add, ast.BinOp) and isinstance(norm, ast.Call)):
            raise Skip("match does not have a Dropout call, a `+` and a LayerNorm call")
        if len(drop.args) != 1 or drop.keywords or len(norm.args) != 1 or norm.keywords:
            raise Skip("Dropout/LayerNorm calls must take exactly one tensor")
        separate_calls(drop, norm)
        drop_module = module_handle(ctx, drop, "Dropout")
        norm_module = module_handle(ctx, norm, "LayerNorm")
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
        spec, kernel = kernel_name(ctx, KERNEL)
        plan = ChainPlan(ctx, fn, [drop, add, norm])
        plan.anchor_text = (
            f"{kernel}({drop_module}, {norm_module}, {arg_text(ctx, drop.args[0])}, {arg_text(ctx, residual)})"
        )
        plan.moved = [(drop.func, drop), (drop.args[0], drop), (residual, add)]
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))

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
    kernel="adopter.kernels.dropout_add_layer_norm",
    doc=DOC,
    dsl=DSL,
    codemod=DropoutLayerNorm(),
    runtime=RUNTIME,
    fixtures="Dropout_LayerNorm",
    preconditions=(intermediates_unused("$y", "$sum"), _dropout_is_not_layernorm),
)
