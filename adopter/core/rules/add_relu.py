"""Add_ReLU: the end of a residual block, ``relu(x + residual)``, in one pass over memory.

Rewrite (the codemod below), forward only — ``__init__`` and the modules stay:
    out += identity; out = self.relu(out)   =>   out = add_relu(self.relu, out, identity, in_place=True)
    out = self.relu(out + identity)         =>   out = add_relu(self.relu, out, identity)
    return F.relu(x + shortcut)             =>   return add_relu(F.relu, x, shortcut)

``adopter.kernels.add_relu`` runs aten's ``_add_relu`` (one read of each operand, one write) when,
at run time, the activation is a ReLU, the operands are float CPU tensors of one shape computed by
the kernels from finite data (a NaN must stay a NaN, as ``torch.relu`` keeps it), no gradient is
recorded and, in place, nothing else can see the sum; and the source's own ops otherwise.
"""

from __future__ import annotations

import ast
from dataclasses import replace

from adopter.core.codemod.base import ChainPlan, Codemod, arg_text, kernel_name, match_function, matched_exprs
from adopter.core.codemod.context import FileContext, Skip, is_self_attr, simple_assign_target
from adopter.core.codemod.edits import Edit
from adopter.core.dsl import Layer, TensorOp
from adopter.core.match import MatchContext
from adopter.core.rule import Rule, Runtime, RuntimeSite, RuntimeStep
from adopter.core.rules._activation_keys import (
    ACT2FN,
    KernelActivations,
    settle_activation_node,
)
from adopter.core.rules._common import intermediates_unused
from adopter.core.structures import Match
from adopter.core.syntax import walk

RELU_KERNEL = KernelActivations(frozenset({"relu"}), "ReLU", "not ReLU", "{'relu'}")

DSL = f"""
rule Add_ReLU
forward:
    $x + $res -> $sum; torch.nn.ReLU|{ACT2FN}($sum) -> $out

rule Add_ReLU
forward:
    $x + $res -> $sum; torch.nn.functional.relu($sum) -> $out

rule Add_ReLU
forward:
    $x + $res -> $sum; torch.relu($sum) -> $out

rule Add_ReLU
forward:
    $x + $res -> $sum; torch.nn.functional.relu_($sum) -> $out

rule Add_ReLU
forward:
    $x + $res -> $sum; torch.relu_($sum) -> $out

rule Add_ReLU
forward:
    $x + $res -> $sum; torch.Tensor.relu($sum) -> $out

rule Add_ReLU
forward:
    $x + $res -> $sum; torch.Tensor.relu_($sum) -> $out
"""

# what the kernel is handed for a ReLU called as a tensor method: ``(a + b).relu()`` computes
# ``torch.Tensor.relu(a + b)``; ``out.relu_()`` / ``F.relu_(out)`` write the ReLU into the sum
_METHOD_ACTIVATIONS = {"relu": "torch.Tensor.relu", "relu_": "torch.Tensor.relu_"}

DOC = """\
Fuses a residual add and the ReLU applied to the sum (the end of a ResNet block). A match is
an addition (``a + b``, or ``a += b`` in place) whose result is directly the input of a ReLU:
a ``torch.nn.ReLU`` module bound in ``__init__`` (``inplace`` or not), an activation looked
up from a key (``ACT2FN[...]``) whose configuration default is ``"relu"`` (conditional when
the source does not settle it: a trace does), ``F.relu``/``torch.relu`` called with the
sum alone, their in-place spellings ``F.relu_``/``torch.relu_`` (detectron2's ``out += shortcut;
out = F.relu_(out)``), or the tensor methods ``(a + b).relu()`` / ``out.relu_()``. The rewrite hands the kernel the ReLU, both operands and whether the add was in
place; the kernel decides at run time (a ReLU, CPU float32/64 operands of one shape known
finite, no gradient) and runs the source's own ops otherwise. Not a match: a sum also read
elsewhere (unless the add is in place and the ReLU rebinds the same name), ReLU6, LeakyReLU,
other activations, keyword arguments (``F.relu(x, inplace=True)``), a sum that passes
through another op (dropout, drop-path, a scale) before the ReLU."""


def _relu_of_the_sum_alone(ctx: MatchContext) -> str | None:
    """The ReLU is called with the sum and nothing else: a keyword (``inplace=True``) is a call
    the codemod does not rewrite, so a scan must not call it a match either."""
    act_node = next((mn.node for mn in ctx.match.nodes if mn.pattern_index == 1), None)
    if isinstance(act_node, Layer) and (len(act_node.args) != 1 or any(a.keyword for a in act_node.args)):
        return "the ReLU is called with more than the sum"
    return None


def _activation_is_relu(ctx: MatchContext) -> str | None:
    """An activation looked up from a key must be a ReLU (settled from the configuration's
    defaults; conditional when the source leaves it open)."""
    act_node = next((mn.node for mn in ctx.match.nodes if mn.pattern_index == 1), None)
    return settle_activation_node(ctx, act_node, RELU_KERNEL)


# ---------------------------------------------------------------- codemod

KERNEL = "add_relu"


class AddReLU(Codemod):
    rule = "Add_ReLU"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        op = next((mn for mn in match.nodes if isinstance(mn.node, TensorOp)), None)
        in_place = ctx.augassign_at(op.node.span) if op is not None and op.node.span is not None else None
        exprs = matched_exprs(replace(match, nodes=tuple(mn for mn in match.nodes if mn is not op))
                              if in_place is not None else match, ctx)
        fn = match_function(match, ctx, exprs)
        add = in_place or next((e for n, e in exprs if isinstance(n, TensorOp)), None)
        act = next((e for n, e in exprs if isinstance(n, Layer)), None)
        operand = _relu_operand(act)
        if operand is None:
            raise Skip("the ReLU must be called with the sum alone")
        activation = _activation_text(ctx, act)
        spec, kernel = kernel_name(ctx, KERNEL)
        if isinstance(add, ast.BinOp) and isinstance(add.op, ast.Add):
            anchor_text = f"{kernel}({activation}, {arg_text(ctx, add.left)}, {arg_text(ctx, add.right)})"
            if operand is add:  # act(a + b), (a + b).relu()
                plan = ChainPlan(ctx, fn, [act])
                plan.anchor_text = anchor_text
                return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))
            # s = a + b, then as the next statement s = act(s) / return act(s): the sum is not kept
            stmt = ctx.statement_of(add)
            name = simple_assign_target(stmt)
            if name is None or stmt.value is not add:
                raise Skip("the sum is part of a larger expression")
            self._next_rebinds(ctx, stmt, act, name)
            plan = _FoldPlan(ctx, fn, [act])
            plan.folded = stmt
            plan.anchor_text = anchor_text
            return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))
        return self._in_place(ctx, fn, add, act, activation, kernel, spec)

    @staticmethod
    def _next_rebinds(ctx: FileContext, stmt: ast.stmt, act: ast.Call, name: str) -> None:
        """The statement after ``stmt`` is ``name = act(name)`` or ``return act(name)``: the sum
        bound to ``name`` is read by the ReLU alone."""
        block = ctx.block_of(stmt)[2]
        index = block.index(stmt)
        following = block[index + 1] if index + 1 < len(block) else None
        act_stmt = ctx.statement_of(act)
        operand = _relu_operand(act)
        if following is not act_stmt or not (isinstance(operand, ast.Name) and operand.id == name):
            raise Skip("the ReLU is not the next statement, applied to the sum")
        rebinds = simple_assign_target(act_stmt) == name and act_stmt.value is act
        if not (rebinds or (isinstance(act_stmt, ast.Return) and act_stmt.value is act)):
            raise Skip(f"the ReLU's result is not bound to {name!r} again nor returned (the sum stays readable)")

    def _in_place(self, ctx: FileContext, fn: ast.FunctionDef, add, act: ast.Call, activation: str, kernel: str,
                  spec: str) -> Edit:
        """``x += r`` then, as the very next statement, ``x = act(x)`` or ``return act(x)``."""
        stmt = add if isinstance(add, ast.AugAssign) else ctx.statement_of(add)
        if not (isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add) and isinstance(stmt.target, ast.Name)):
            raise Skip("the sum is neither 'a + b' nor 'name += b'")
        name = stmt.target.id
        self._next_rebinds(ctx, stmt, act, name)
        plan = _FoldPlan(ctx, fn, [act])
        plan.folded = stmt
        plan.anchor_text = f"{kernel}({activation}, {name}, {arg_text(ctx, stmt.value)}, in_place=True)"
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))


class _FoldPlan(ChainPlan):
    """``s = a + b`` / ``s += b`` followed by ``s = act(s)``: the sum's statement is deleted, the
    ReLU call (the anchor) becomes the kernel call; both statements are adjacent, so its
    operands read what they read in the sum."""

    folded: ast.stmt

    def build(self):
        from adopter.core.codemod.base import pos
        from adopter.core.codemod.edits import ExprEdit, ForwardEdit

        ctx = self.ctx
        anchor = self.calls[-1]
        anchor_stmt = ctx.statement_of(anchor)
        return ForwardEdit(
            statements=(pos(ctx, self.folded), pos(ctx, anchor_stmt)),
            anchor=pos(ctx, anchor_stmt),
            expr_edits=(ExprEdit(ctx.char_span(anchor), self.anchor_text),),
            delete=(pos(ctx, self.folded),),
        )


def _is_method_relu(act: ast.Call) -> bool:
    """``<tensor>.relu()`` / ``<tensor>.relu_()``: a method call on an expression that is not a
    module attribute, a name or a module path (``F.relu_(x)``, ``torch.relu_(x)`` take an argument)."""
    func = act.func
    return (isinstance(func, ast.Attribute) and func.attr in _METHOD_ACTIVATIONS and not act.args
            and not act.keywords)


def _relu_operand(act: ast.AST) -> ast.expr | None:
    """The tensor the ReLU is applied to: its one argument, or a method call's receiver."""
    if not isinstance(act, ast.Call) or act.keywords:
        return None
    if _is_method_relu(act):
        return act.func.value
    if len(act.args) != 1 or isinstance(act.args[0], ast.Starred):
        return None
    return act.args[0]


def _activation_text(ctx: FileContext, act: ast.Call) -> str:
    if _is_method_relu(act):
        if not any(isinstance(stmt, ast.Import) and any(a.name == "torch" and a.asname is None for a in stmt.names)
                   for stmt in ctx.tree.body):
            raise Skip("the tensor method's ReLU is handed to the kernel as torch.Tensor.relu: "
                       "the file does not import torch at module level")
        return _METHOD_ACTIVATIONS[act.func.attr]
    func = act.func
    if is_self_attr(func) is None and not isinstance(func, (ast.Name, ast.Attribute)):
        raise Skip(f"the ReLU {ctx.segment(func)!r} is not a module or function reference")
    if isinstance(func, ast.Subscript) or any(isinstance(n, ast.Call) for n in walk(func)):
        raise Skip(f"the ReLU {ctx.segment(func)!r} is looked up in the call (ACT2FN[...](x))")
    return arg_text(ctx, func)


# ---------------------------------------------------------------- runtime (trace)


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    act = next((m for m in site.modules if m is not None), None)
    if act is not None:
        if type(act) is not nn.ReLU:
            return f"the activation that runs is {type(act).__name__}, not nn.ReLU", ""
        return None, f"nn.ReLU(inplace={act.inplace})"
    if any(op.name in ("relu", "relu_") for ops in site.ops for op in ops):
        return None, "functional relu"
    return "no ReLU ran on the sum", ""


RUNTIME = Runtime(
    check=_runtime_check,
    sequence=(
        RuntimeStep("add", ops=frozenset({"add", "add_", "iadd"})),
        RuntimeStep("relu", module_types=("torch.nn.modules.activation.ReLU",), ops=frozenset({"relu", "relu_"})),
    ),
    leaf_modules=("torch.nn.modules.activation.ReLU",),
)

RULE = Rule(
    name="Add_ReLU",
    kernel="adopter.kernels.add_relu",
    doc=DOC,
    dsl=DSL,
    codemod=AddReLU(),
    runtime=RUNTIME,
    fixtures="Add_ReLU",
    preconditions=(intermediates_unused("$sum"), _relu_of_the_sum_alone, _activation_is_relu),
)
