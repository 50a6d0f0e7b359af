"""fused_QKV codemod.

    __init__:  self.query = nn.Linear(H, A); self.key = nn.Linear(H, A); self.value = nn.Linear(H, A)
           =>  self.qkv = FusedQKV(H, A, names=("query", "key", "value"))
    forward:   q = self.query(x); k = self.key(x); v = self.value(x)
           =>  q, k, v = self.qkv(x)
      or, when the projections are used inside larger expressions
               (``self.query(x).view(...).transpose(1, 2)``):
               query_output, key_output, value_output = self.qkv(x)   # inserted before
               ... query_output.view(...).transpose(1, 2) ...

The kernel's state-dict hooks save and load ``query.weight`` etc. (``names=``), so the
checkpoint keys of the three original Linears are kept.
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import (
    Codemod,
    arg_text,
    attr_used_elsewhere,
    fresh_attr,
    fresh_local,
    init_statement,
    match_function,
    matched_exprs,
    pos,
    register,
)
from adopter.core.codemod.context import (
    FileContext,
    Skip,
    call_arguments,
    is_self_attr,
    literal,
    loads,
    simple_assign_target,
    stores,
)
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, InitEdit, StatementEdit
from adopter.core.structures import Match

KERNEL = "FusedQKV"
LINEAR_SIG = ("in_features", "out_features", "bias", "device", "dtype")


def _role(attr: str) -> str | None:
    try:
        from adopter.core.rules.fused_qkv import projection_role
    except ImportError:  # pragma: no cover - the rule module is another team's
        projection_role = None
    if projection_role is not None:
        return projection_role(attr)
    last = attr.lower()
    return "q" if "q" in last else "k" if "k" in last else "v" if "v" in last else None


@register
class FusedQKVCodemod(Codemod):
    rule = "fused_QKV"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        calls = [e for _, e in exprs]
        if len(calls) != 3 or not all(isinstance(c, ast.Call) for c in calls):
            raise Skip("expected three Linear calls")
        attrs = [is_self_attr(c.func) for c in calls]
        if not all(attrs) or len(set(attrs)) != 3:
            raise Skip("the projections must be three distinct modules self.<name>(x)")
        by_role = {}
        for attr, call in zip(attrs, calls):
            role = _role(attr)
            if role is None or role in by_role:
                raise Skip(f"cannot tell query/key/value apart ({', '.join(attrs)})")
            by_role[role] = (attr, call)
        if set(by_role) != {"q", "k", "v"}:
            raise Skip("projections are not one query, one key and one value")
        ordered = [by_role[r] for r in ("q", "k", "v")]
        inputs = set()
        for _, call in ordered:
            if len(call.args) != 1 or call.keywords:
                raise Skip("each projection must take exactly one tensor")
            inputs.add(ast.dump(call.args[0]))
        if len(inputs) != 1:
            raise Skip("the three projections read different inputs")
        source = ordered[0][1].args[0]
        if not isinstance(source, (ast.Name, ast.Attribute)):
            raise Skip("the projections' input must be a variable")
        cls = match.class_name
        if cls is None:
            raise Skip("fused_QKV needs the class that owns the projections")
        for attr, call in ordered:
            use = attr_used_elsewhere(ctx, cls, attr, [call])
            if use:
                raise Skip(f"self.{attr} is also used at line {use[0]} ({use[2]})")

        # ---- __init__
        inits = [init_statement(ctx, match, attr) for attr, _ in ordered]
        blocks = {id(ctx.block_of(stmt)[2]) for stmt, _, _ in inits}
        if len(blocks) != 1:
            raise Skip("the projections are constructed in different blocks")
        args = [call_arguments(call, LINEAR_SIG) for _, call, _ in inits]
        for a in args:
            if "in_features" not in a or "out_features" not in a:
                raise Skip("a projection Linear lacks in/out features")
            if "device" in a or "dtype" in a:
                raise Skip("a projection Linear passes device=/dtype=")
        texts = lambda key: [ast.unparse(a[key]) if key in a else None for a in args]
        if len(set(texts("in_features"))) != 1:
            raise Skip("the projections have different in_features")
        bias = set(texts("bias"))
        if len(bias) != 1:
            raise Skip("the projections differ in bias")
        bias_text = bias.pop()
        if bias_text is not None and literal(args[0]["bias"]) is True:
            bias_text = None
        q_out, k_out, v_out = texts("out_features")
        if k_out != v_out:
            raise Skip("key and value projections have different out_features")
        new_attr = fresh_attr(ctx, cls, "qkv")
        parts = [arg_text(ctx, args[0]["in_features"]), arg_text(ctx, args[0]["out_features"])]
        if bias_text is not None:
            parts.append(f"bias={arg_text(ctx, args[0]['bias'])}")
        parts.append("names=(" + ", ".join(f'"{attr}"' for attr, _ in ordered) + ")")
        if k_out != q_out:
            parts.append(f"kv_out_features={arg_text(ctx, args[1]['out_features'])}")
        construct = f"self.{new_attr} = {KERNEL}({', '.join(parts)})"
        init_stmts = sorted((s for s, _, _ in inits), key=lambda s: (s.lineno, s.col_offset))
        last = init_stmts[-1]
        init = InitEdit(replace=pos(ctx, last), construct=construct, delete=tuple(pos(ctx, s) for s in init_stmts[:-1]))

        # ---- forward
        stmts = [ctx.statement_of(call) for _, call in ordered]
        if len({id(ctx.block_of(s)[2]) for s in stmts}) != 1:
            raise Skip("the projections are computed in different blocks")
        in_order = sorted(set(stmts), key=lambda s: (s.lineno, s.col_offset), reverse=False)
        first, final = in_order[0], in_order[-1]
        between = [
            s
            for s in ctx.block_of(first)[2]
            if (first.lineno, first.col_offset) <= (s.lineno, s.col_offset) <= (final.lineno, final.col_offset)
        ]
        source_text = arg_text(ctx, source)
        fused_call = f"self.{new_attr}({source_text})"
        targets = [simple_assign_target(s) for s in stmts]
        whole = all(
            t is not None and getattr(s, "value", None) is call for t, s, (_, call) in zip(targets, stmts, ordered)
        ) and len(set(targets)) == 3 and len(set(stmts)) == 3
        source_names = loads(source) | ({source.id} if isinstance(source, ast.Name) else set())
        for s in between[1:]:
            if stores(s) & source_names and s is not final:
                raise Skip(f"{source_text} changes between the projections (line {s.lineno})")
        if whole:
            others = [s for s in between if s not in stmts]
            for s in others:
                clash = (loads(s) | stores(s)) & set(targets)
                if clash:
                    raise Skip(f"{', '.join(sorted(clash))} is used between the projections (line {s.lineno})")
            if (stores(first) - {targets[stmts.index(first)]}) or any(source_names & {t} for t in targets[:-1]):
                raise Skip("a projection rebinds its own input")
            forward = ForwardEdit(
                statements=tuple(pos(ctx, s) for s in in_order),
                anchor=pos(ctx, first),
                statement_edits=(StatementEdit(pos(ctx, first), f"{', '.join(targets)} = {fused_call}"),),
                delete=tuple(pos(ctx, s) for s in in_order[1:]),
            )
        else:
            taken: set[str] = set()
            names = [fresh_local(ctx, fn, f"{attr.split('.')[-1]}_output", taken) for attr, _ in ordered]
            forward = ForwardEdit(
                statements=tuple(pos(ctx, s) for s in in_order),
                anchor=pos(ctx, first),
                expr_edits=tuple(ExprEdit(ctx.char_span(call), name) for name, (_, call) in zip(names, ordered)),
                insert_before=(f"{', '.join(names)} = {fused_call}",),
            )
        return Edit(rule=self.rule, forward=forward, init=(init,), imports=(KERNEL,))
