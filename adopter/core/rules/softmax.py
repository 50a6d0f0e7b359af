"""softmax: drop-in replacement of torch softmax calls by the triton kernel ``adopter.kernels.softmax``.

Rewrite (the codemod below):
    forward:  F.softmax(x, dim=-1, dtype=torch.float32)  =>  softmax(x, dim=-1, dtype=torch.float32)
              x.softmax(-1)                              =>  softmax(x, dim=-1)
    __init__: self.softmax = nn.Softmax(dim=-1)          =>  self.softmax = Softmax(dim=-1)
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import (
    Codemod,
    arg_text,
    init_statement,
    kernel_name,
    matched_exprs,
    pos,
)
from adopter.core.codemod.context import FileContext, Skip, call_arguments, is_self_attr
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, InitEdit
from adopter.core.dsl import Layer
from adopter.core.rule import Rule, Runtime
from adopter.core.structures import Match

DSL = """
rule softmax
forward:
    torch.nn.functional.softmax|torch.softmax|torch.Tensor.softmax|torch.special.softmax($x) -> $y

rule softmax
init:
    torch.nn.Softmax() -> $m
forward:
    torch.nn.Softmax@$m($x) -> $y

# nn.Softmax(dim=-1)(x): the module is constructed and called in one expression
rule softmax
forward:
    torch.nn.Softmax() -> $m
"""

DOC = """\
Replaces softmax with the triton softmax kernel (same signature: ``input, dim, dtype``).
A match is every call of ``torch.nn.functional.softmax`` (however imported: ``F.softmax``,
``nn.functional.softmax``), ``torch.softmax``, ``torch.special.softmax``, the tensor method
``x.softmax(...)``, a ``torch.nn.Softmax`` module bound in ``__init__`` and called in
``forward``, or one constructed and called inline (``nn.Softmax(dim=-1)(x)``); one match per
call site. Not a match: ``log_softmax``, ``gumbel_softmax``,
sparse/masked softmax variants, user functions named ``softmax``, and calls in code that
extraction does not reach (nested lambdas)."""


# ---------------------------------------------------------------- codemod

SIGNATURES = {
    "torch.nn.functional.softmax": ("input", "dim", "_stacklevel", "dtype"),
    "torch.softmax": ("input", "dim", "dtype"),
    "torch.special.softmax": ("input", "dim", "dtype"),
    "torch.Tensor.softmax": ("dim", "dtype"),
}


class SoftmaxCodemod(Codemod):
    rule = "softmax"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        if len(exprs) != 1 or not isinstance(exprs[0][1], ast.Call) or not isinstance(exprs[0][0], Layer):
            raise Skip("expected one softmax call")
        node, call = exprs[0]
        if isinstance(call.func, ast.Call):
            return self._inline_module(ctx, call)
        if node.type == "torch.nn.Softmax" or is_self_attr(call.func):
            return self._module(match, ctx, call)
        signature = SIGNATURES.get(node.type)
        if signature is None:
            raise Skip(f"{node.type} is not a softmax this codemod knows")
        args = call_arguments(call, signature)
        if node.type == "torch.Tensor.softmax":
            if not isinstance(call.func, ast.Attribute):
                raise Skip("tensor method call without a receiver")
            args["input"] = call.func.value
        if "input" not in args:
            raise Skip("softmax without input")
        if "dim" not in args:
            raise Skip("softmax without dim= (implicit dim is deprecated and ambiguous)")
        spec, local = kernel_name(ctx, "softmax")
        keywords = [f"dim={arg_text(ctx, args['dim'])}"]
        if "dtype" in args:
            keywords.append(f"dtype={arg_text(ctx, args['dtype'])}")
        text = f"{local}({arg_text(ctx, args['input'])}, {', '.join(keywords)})"
        stmt = ctx.statement_of(call)
        forward = ForwardEdit(
            statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(ExprEdit(ctx.char_span(call), text),)
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

    def _inline_module(self, ctx: FileContext, call: ast.Call) -> Edit:
        """``nn.Softmax(dim=-1)(x)`` -> ``softmax(x, dim=-1)``."""
        ctor = call.func
        name = ctor.func.attr if isinstance(ctor.func, ast.Attribute) else getattr(ctor.func, "id", "")
        if name != "Softmax" or len(call.args) != 1 or call.keywords:
            raise Skip("inline module call is not nn.Softmax(dim)(x)")
        args = call_arguments(ctor, ("dim",))
        if "dim" not in args:
            raise Skip("nn.Softmax() without dim (implicit dim is deprecated and ambiguous)")
        spec, local = kernel_name(ctx, "softmax")
        text = f"{local}({arg_text(ctx, call.args[0])}, dim={arg_text(ctx, args['dim'])})"
        stmt = ctx.statement_of(call)
        forward = ForwardEdit(
            statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(ExprEdit(ctx.char_span(call), text),)
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

    def _module(self, match: Match, ctx: FileContext, call: ast.Call) -> Edit:
        attr = is_self_attr(call.func)
        if attr is None:
            raise Skip("Softmax module must be called as self.<name>(x)")
        stmt, ctor, _ = init_statement(ctx, match, attr)
        args = call_arguments(ctor, ("dim",))
        spec, local = kernel_name(ctx, "Softmax")
        dim = f"dim={arg_text(ctx, args['dim'])}" if "dim" in args else ""
        if not dim:
            raise Skip("nn.Softmax() without dim (implicit dim is deprecated and ambiguous)")
        construct = f"self.{attr} = {local}({dim})"
        return Edit(rule=self.rule, forward=None, init=(InitEdit(replace=pos(ctx, stmt), construct=construct),), imports=(spec,))

RULE = Rule(
    name="softmax",
    kernel="adopter.kernels.softmax",
    doc=DOC,
    dsl=DSL,
    codemod=SoftmaxCodemod(),
    # nn.Softmax stays one node in a symbolic trace so its call site maps to the source line.
    runtime=Runtime(leaf_modules=("torch.nn.modules.activation.Softmax",)),
    fixtures="softmax",
)
