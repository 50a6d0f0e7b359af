"""gated_MLP: the gated MLP of LLMs (SwiGLU, GeGLU) — ``down(act(gate(x)) * up(x))``.

Rewrite (the codemod below), forward only — ``__init__`` and the three projections stay:
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
 => down_proj = gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act_fn, x)
(any operand order, split into statements, ``F.silu``/``nn.SiLU``/``F.gelu``/``nn.GELU``/
``ACT2FN[...]`` spellings; a functional activation's extra arguments follow ``x``:
``gated_mlp(self.w1, self.w3, self.w2, F.gelu, x, approximate="tanh")``).

``adopter.kernels.gated_mlp`` decides at run time: plain ``nn.Linear`` projections and an
activation the kernel computes (SiLU, exact or tanh GeLU — recognized by what the instance is, so
``ACT2FN[config.hidden_act]`` is SiLU for Llama and ``gelu_pytorch_tanh`` for Gemma) run the fused
``act(g) * u`` whose backward recomputes ``act(g)``; anything else (``hidden_act="relu"``) runs the
original expression. The activation key is never resolved into the source: when the source cannot
settle it the match is ``conditional`` (``needs-config``) and the trace settles it.
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
from adopter.core.codemod.context import FileContext, Skip, is_self_attr
from adopter.core.codemod.edits import Edit
from adopter.core.dsl import Layer, TensorOp
from adopter.core.match import MatchContext
from adopter.core.rule import Rule, Runtime, RuntimeSite

# The key resolution shared with the GeLU rule (configuration defaults, getattr defaults,
# constructor parameter defaults, ``'a' if c else 'b'`` choices): only the set of keys the kernel
# computes differs.
from adopter.core.rules._activation_keys import (
    ACT2FN,
    GELU_KEYS,
    GELU_MODULES,
    KernelActivations,
    activation_key_lookup,
    settle_activation_keys,
)
from adopter.core.rules._common import LINEAR, intermediates_unused
from adopter.core.structures import Match

_TA = "transformers.activations."
SILU_MODULES = ("torch.nn.SiLU", _TA + "SiLUActivation")
ACT_FUNCTIONS = ("torch.nn.functional.silu", "torch.nn.functional.gelu")
# Activation keys whose ACT2FN entry the kernel computes: SiLU ("swish" is nn.SiLU) and GeLUs.
SILU_KEYS = frozenset({"silu", "swish"})
KERNEL_KEYS = SILU_KEYS | GELU_KEYS
ACTIVATIONS = "|".join(SILU_MODULES + GELU_MODULES + ACT_FUNCTIONS + (ACT2FN,))

_INIT = ("torch.nn.Linear($gate_in, $gate_out) -> $gate; torch.nn.Linear($up_in, $up_out) -> $up; "
         "torch.nn.Linear($down_in, $down_out) -> $down")
_GATE = "torch.nn.Linear@$gate($x) -> $g"
_UP = "torch.nn.Linear@$up($x) -> $u"
_ACT = f"{ACTIVATIONS}($g) -> $a"
_TAIL = "$a * $u -> $h; torch.nn.Linear@$down($h) -> $out"  # ``*`` matches either operand order

# One variant per order the three calls can run in (the matcher follows execution order):
# ``act(gate(x)) * up(x)``; ``up(x) * act(gate(x))``; ``g = gate(x); u = up(x); act(g) * u``.
DSL = "\n".join(
    f"rule gated_MLP\ninit:\n    {_INIT}\nforward:\n    {'; '.join(order)}; {_TAIL}\n"
    for order in ((_GATE, _ACT, _UP), (_UP, _GATE, _ACT), (_GATE, _UP, _ACT))
)

DOC = """\
Fuses the activation-times-up product of a gated MLP (SwiGLU, GeGLU):
``down(act(gate(x)) * up(x))`` with three ``torch.nn.Linear`` modules bound in ``__init__``
(any attribute names: ``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``), the gate
and up projections reading the very same tensor, the product (``*``, either operand order)
the down projection's input, in one expression or split over statements. The activation is
``torch.nn.SiLU``, ``F.silu``, ``torch.nn.GELU``, ``F.gelu`` (any ``approximate``),
transformers' ``SiLUActivation`` and GeLU classes, or an activation looked up from a key
(``ACT2FN[config.hidden_act]``): a match when every configuration default of the key is one
the kernel computes (``silu``, ``swish``, the GeLU keys), not a match when none is (``relu``,
``quick_gelu``, ``gelu_10``...), ``conditional`` (``needs-config``) when the source does not
settle it — the trace checks the activation instance that runs. The intermediates (``g``,
``act(g)``, ``u``, the product) must be read nowhere else. Not a match: another operation
between the product and the down projection, an activation of the product (``act(g * u)``),
gate and up reading different tensors, a same-file activation class. At run time the kernel
fuses only plain ``nn.Linear`` projections of one gate/up width and a SiLU/GeLU instance; anything
else runs the original expression. Parameters and the state dict are unchanged."""


# ---------------------------------------------------------------- preconditions


def _act_node(match: Match) -> Layer | None:
    return next((mn.node for mn in match.nodes
                 if isinstance(mn.node, Layer) and mn.node.type != "torch.nn.Linear"), None)


KERNEL_ACTIVATIONS = KernelActivations(
    KERNEL_KEYS, "SiLU/GeLU", "neither SiLU nor GeLU", "{'silu', 'swish', 'gelu', 'gelu_pytorch_tanh', ...}")


def _activation_is_computed(ctx: MatchContext) -> str | None:
    """The activation looked up from a key is one the kernel computes (SiLU or a GeLU): plain
    match when every default of the key is such a key, not a match when none is, ``conditional``
    (``needs-config``) when the source does not settle it (a trace checks the instance)."""
    act_node = _act_node(ctx.match)
    if act_node is None or act_node.type != ACT2FN:
        return None  # spelled as a SiLU/GeLU module or function: the pattern settled it
    texts, span, in_init, what = activation_key_lookup(ctx, act_node)
    if texts is None:
        ctx.conditional("needs-config", f"SiLU/GeLU only if the activation {what} passed in is one")
        return None
    return settle_activation_keys(ctx, texts, span, in_init, KERNEL_ACTIVATIONS, what)


# ---------------------------------------------------------------- codemod

KERNEL = "gated_mlp"


def _defined_here(ctx: FileContext, name: str) -> bool:
    return any(isinstance(s, (ast.ClassDef, ast.FunctionDef)) and s.name == name for s in ctx.tree.body)


def _local_activation(ctx: FileContext, match: Match, act: ast.Call) -> str | None:
    """A same-file class or function the activation call runs: the kernel recognizes torch and
    transformers activations at run time, so such a site would always fall back."""
    func = act.func
    if isinstance(func, ast.Name):
        return func.id if _defined_here(ctx, func.id) else None
    attr = is_self_attr(func)
    if attr is None or match.class_name is None:
        return None
    for stmt in ctx.class_attr_stores(match.class_name, attr):
        value = getattr(stmt, "value", None)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and _defined_here(ctx, value.func.id):
            return value.func.id
    return None


def _inside(node: ast.AST, container: ast.AST) -> bool:
    return (node.lineno, node.col_offset) >= (container.lineno, container.col_offset) and (
        node.end_lineno, node.end_col_offset) <= (container.end_lineno, container.end_col_offset)


def _one_tensor_call(call: ast.expr, what: str) -> ast.Call:
    if not isinstance(call, ast.Call) or len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        raise Skip(f"the {what} projection must be a module called with one tensor")
    return call


class GatedMLP(Codemod):
    rule = "gated_MLP"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        if len(exprs) != 5:
            raise Skip("expected gate, activation, up, product and down")
        by_role = self._roles(match, exprs)
        gate = _one_tensor_call(by_role["gate"], "gate")
        up = _one_tensor_call(by_role["up"], "up")
        down = _one_tensor_call(by_role["down"], "down")
        act, product = by_role["act"], by_role["product"]
        if not isinstance(act, ast.Call) or not act.args:
            raise Skip("the activation must be a call")
        if any(isinstance(a, ast.Starred) for a in act.args) or any(k.arg is None for k in act.keywords):
            raise Skip("the activation call unpacks arguments")
        if not isinstance(product, ast.BinOp) or not isinstance(product.op, ast.Mult):
            raise Skip("the product must be a `*` expression")
        separate_calls(gate, up, down, act)
        local = _local_activation(ctx, match, act)
        if local is not None:
            raise Skip(
                f"the activation is {local}, defined in this file: the kernel recognizes torch and transformers "
                "activations at run time and would always run the original code"
            )
        modules = [module_handle(ctx, gate, "gate projection"), module_handle(ctx, up, "up projection"),
                   module_handle(ctx, down, "down projection")]
        activation = arg_text(ctx, act.func)  # a reference or an ACT2FN[...] lookup, evaluated where it was
        extra = [arg_text(ctx, a) for a in act.args[1:]] + [f"{k.arg}={arg_text(ctx, k.value)}" for k in act.keywords]
        spec, kernel = kernel_name(ctx, KERNEL)
        # Execution order, outermost expressions only: a call nested in another matched expression
        # goes away with it; a matched expression of its own statement must be that statement's
        # whole right-hand side (ChainPlan checks), the down call is the anchor.
        ordered = [e for _, e in exprs[:-1]]
        outer = [e for e in ordered if not any(o is not e and _inside(e, o) for o in ordered + [down])]
        plan = ChainPlan(ctx, fn, outer + [down])
        plan.anchor_text = f"{kernel}({', '.join(modules + [activation, arg_text(ctx, gate.args[0])] + extra)})"
        plan.moved = [(gate.func, gate), (up.func, up), (down.func, down), (act.func, act), (gate.args[0], gate)]
        plan.moved += [(a, act) for a in act.args[1:]] + [(k.value, act) for k in act.keywords]
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))

    @staticmethod
    def _roles(match: Match, exprs) -> dict[str, ast.expr]:
        """gate / up / down / act / product expressions, by the module each matched call binds."""
        modules = {name: match.bindings.get(name) for name in ("$gate", "$up", "$down")}
        out: dict[str, ast.expr] = {}
        for node, expr in exprs:
            if isinstance(node, TensorOp):
                out["product"] = expr
            elif isinstance(node, Layer) and node.type == "torch.nn.Linear":
                role = next((r for r, m in modules.items() if m is not None and node.module == m), None)
                if role is None or role[1:] in out:
                    raise Skip("cannot tell the gate, up and down projections apart")
                out[role[1:]] = expr
            else:
                out["act"] = expr
        if set(out) != {"gate", "up", "down", "act", "product"}:
            raise Skip("expected gate, activation, up, product and down")
        return out


# ---------------------------------------------------------------- runtime

# Activation instances the kernel computes, by class name (transformers' ACT2FN classes included).
_SILU_CLASSES = {"SiLU", "SiLUActivation"}
_GELU_CLASSES = {"GELU", "GELUActivation", "NewGELUActivation", "GELUTanh", "PytorchGELUTanh",
                 "FastGELUActivation", "AccurateGELUActivation"}


def _graph_activation(ops) -> str | None:
    """The functional SiLU/GeLU among traced ops (``silu``, ``gelu(approximate=...)``), or None."""
    for op in ops:
        if op.kind != "call_function":
            continue
        if op.name == "silu":
            return "silu"
        if op.name == "gelu":
            approx = op.kwargs.get("approximate") or (op.args[1] if len(op.args) > 1 else None) or "none"
            return f"gelu (approximate={approx!r})"
    return None


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    linears = [m for m in site.modules if isinstance(m, nn.Linear)]
    act_i = next((i for i, n in enumerate(site.nodes)
                  if isinstance(n, Layer) and n.type != "torch.nn.Linear"), None)
    if act_i is None:
        return None, ""
    act_mod = site.modules[act_i]
    if act_mod is None:
        desc = _graph_activation(site.ops[act_i])
        if desc is None:
            return "the activation that runs is neither a SiLU nor a GeLU", ""
    else:
        name = type(act_mod).__name__
        if name not in _SILU_CLASSES | _GELU_CLASSES:
            return f"activation is {name}, neither a SiLU nor a GeLU the kernel computes", ""
        desc = f"{name}(approximate={act_mod.approximate!r})" if isinstance(act_mod, nn.GELU) else name
    facts = f"gated MLP, activation {desc}"
    if len(linears) == 3:
        gate = linears[0]
        facts += f"; Linear {gate.in_features}->{gate.out_features}->{linears[-1].out_features}"
    return None, facts


RUNTIME = Runtime(
    check=_runtime_check,
    # No runtime-only sequence: a gated MLP is two branches joined by a product, which a layer
    # chain does not describe; static matches are confirmed by the trace.
    sequence=(),
    # Activations stay whole in a symbolic trace so the check sees which one runs.
    leaf_modules=(
        LINEAR, "torch.nn.modules.activation.SiLU", "torch.nn.modules.activation.GELU",
        "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.Tanh", "transformers.activations.",
    ),
)

RULE = Rule(
    name="gated_MLP",
    kernel="adopter.kernels.gated_mlp",
    doc=DOC,
    dsl=DSL,
    codemod=GatedMLP(),
    runtime=RUNTIME,
    fixtures="gated_MLP",
    preconditions=(intermediates_unused("$g", "$a", "$u", "$h"), _activation_is_computed),
)
