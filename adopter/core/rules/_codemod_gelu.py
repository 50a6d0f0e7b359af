"""biased_GeLU codemod.

    __init__:  self.dense = nn.Linear(I, O); self.act = nn.GELU()   (or ACT2FN["gelu"], ...)
           =>  self.dense = FusedLinearBiasGeLU(I, O, approximate="none")
    forward:   h = self.dense(h); h = self.act(h)       (or F.gelu(h))
           =>  h = self.dense(h)

The Linear's attribute is reused (``dense.weight``/``dense.bias`` keys stay). An
activation chosen at run time (``ACT2FN[config.hidden_act]``) is only rewritten when
the caller passes the model ``config`` and it names a GeLU; from source alone the edit
would hard-code GeLU for every config.
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
    pos,
    register,
)
from adopter.core.codemod.context import FileContext, Skip, call_arguments, is_literal, is_self_attr, literal
from adopter.core.codemod.edits import Edit, InitEdit
from adopter.core.dsl import Layer
from adopter.core.structures import Match

KERNEL = "FusedLinearBiasGeLU"
LINEAR_SIG = ("in_features", "out_features", "bias", "device", "dtype")

# transformers activation keys / classes -> the kernel's ``approximate`` mode.
GELU_KEYS = {
    "gelu": "none",
    "gelu_python": "none",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_python_tanh": "tanh",
    "gelu_accurate": "tanh",
}
GELU_CLASSES = {
    "GELU": None,  # torch.nn.GELU: read its approximate= argument
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}


def _callee_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


@register
class BiasedGeLU(Codemod):
    rule = "biased_GeLU"

    def _activation_mode(self, ctx: FileContext, match: Match, act: ast.Call, act_node: Layer) -> tuple[str, str | None]:
        """(approximate mode, attribute of the activation module or None for functional)."""
        attr = is_self_attr(act.func)
        if attr is None:
            # functional gelu(x, approximate=...)
            if _callee_name(act.func) != "gelu":
                raise Skip(f"{ctx.segment(act.func)} is not a GeLU")
            args = call_arguments(act, ("input", "approximate"))
            mode = literal(args.get("approximate")) if "approximate" in args else "none"
            if mode not in ("none", "tanh"):
                raise Skip("GeLU approximate= is not a literal 'none'/'tanh'")
            return mode, None
        stmts = ctx.class_attr_stores(match.class_name, attr) if match.class_name else []
        if not stmts:
            raise Skip(f"self.{attr} is not assigned in the class")
        modes = set()
        for stmt in stmts:
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if self._dead_for_config(ctx, value):
                continue
            modes.add(self._mode_of(ctx, value, attr))
        if len(modes) != 1:
            raise Skip(f"self.{attr} is assigned different activations")
        return modes.pop(), attr

    def _dead_for_config(self, ctx: FileContext, value: ast.expr | None) -> bool:
        """``self.act = config.hidden_act`` (the non-string branch of transformers'
        ``isinstance(config.hidden_act, str)``) cannot be the callable used when the given
        config holds a string there."""
        if ctx.config is None or not isinstance(value, ast.Attribute):
            return False
        base = ast.unparse(value.value)
        if base not in ("config", "self.config"):
            return False
        return isinstance(getattr(ctx.config, value.attr, None), str)

    def _mode_of(self, ctx: FileContext, value: ast.expr | None, attr: str) -> str:
        if isinstance(value, ast.Call):
            name = _callee_name(value.func)
            if name in GELU_CLASSES:
                if GELU_CLASSES[name] is not None:
                    return GELU_CLASSES[name]
                args = call_arguments(value, ("approximate",))
                mode = literal(args.get("approximate")) if "approximate" in args else "none"
                if mode not in ("none", "tanh"):
                    raise Skip("nn.GELU approximate= is not a literal")
                return mode
            if name == "get_activation" and value.args:
                return self._key_mode(ctx, value.args[0])
        if isinstance(value, ast.Subscript) and _callee_name(value.value) == "ACT2FN":
            return self._key_mode(ctx, value.slice)
        text = ctx.segment(value) if value is not None else "?"
        raise Skip(f"self.{attr} = {text} is not a known GeLU")

    def _key_mode(self, ctx: FileContext, key: ast.expr) -> str:
        value = literal(key)
        if not is_literal(value):
            attr = None
            node = key
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
                base = ast.unparse(node.value)
                if base in ("config", "self.config") or base.endswith("config"):
                    attr = node.attr
            if ctx.config is None or attr is None or not hasattr(ctx.config, attr):
                raise Skip(
                    f"activation ACT2FN[{ctx.segment(key)}] is chosen at run time; "
                    "rewriting would hard-code GeLU for every config"
                )
            value = getattr(ctx.config, attr)
        if value not in GELU_KEYS:
            raise Skip(f"activation {value!r} is not a GeLU")
        return GELU_KEYS[value]

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        if len(exprs) != 2:
            raise Skip("expected a Linear call and a GeLU call")
        (_, lin), (act_node, act) = exprs
        if not isinstance(lin, ast.Call) or not isinstance(act, ast.Call):
            raise Skip("Linear and GeLU must be calls")
        lin_attr = is_self_attr(lin.func)
        if lin_attr is None or len(lin.args) != 1 or lin.keywords:
            raise Skip("the Linear must be a module self.<name>(x)")
        if not act.args or act.args[0] is not lin and not isinstance(act.args[0], ast.Name):
            raise Skip("GeLU does not read the Linear output")
        cls = match.class_name
        if cls is None:
            raise Skip("biased_GeLU needs the class that owns the Linear")
        mode, act_attr = self._activation_mode(ctx, match, act, act_node)
        use = attr_used_elsewhere(ctx, cls, lin_attr, [lin])
        if use:
            raise Skip(f"self.{lin_attr} is also used at line {use[0]} ({use[2]})")
        lin_stmt, lin_call, _ = init_statement(ctx, match, lin_attr)
        args = call_arguments(lin_call, LINEAR_SIG)
        if "in_features" not in args or "out_features" not in args:
            raise Skip("Linear without in/out features")
        for name in ("device", "dtype"):
            if name in args:
                raise Skip(f"Linear passes {name}=, which the fused kernel does not take")
        keywords = []
        if "bias" in args:
            if literal(args["bias"]) is False:
                raise Skip(f"self.{lin_attr} has no bias")
            keywords.append(("bias", arg_text(ctx, args["bias"])))
        if mode != "none":
            keywords.append(("approximate", repr(mode).replace("'", '"')))
        construct = f"self.{lin_attr} = " + format_call(
            KERNEL, [arg_text(ctx, args["in_features"]), arg_text(ctx, args["out_features"])], keywords
        )
        deletes = []
        if act_attr is not None and attr_used_elsewhere(ctx, cls, act_attr, [act]) is None:
            stores = ctx.class_attr_stores(cls, act_attr)
            # Only a single unconditional binding is removed; a config-dependent if/else
            # binding stays (an activation holds no parameters, so state dicts don't change).
            init_fn = ctx.enclosing_function(lin_stmt)
            if len(stores) == 1 and ctx.block_of(stores[0])[0] is init_fn and isinstance(stores[0], ast.Assign):
                deletes.append(stores[0])
        plan = ChainPlan(ctx, fn, [lin, act])
        plan.anchor_text = f"self.{lin_attr}({arg_text(ctx, lin.args[0])})"
        plan.moved = [(lin.args[0], lin)]
        forward = plan.build()
        init = InitEdit(replace=pos(ctx, lin_stmt), construct=construct, delete=tuple(pos(ctx, s) for s in deletes))
        return Edit(rule=self.rule, forward=forward, init=(init,), imports=(KERNEL,))
