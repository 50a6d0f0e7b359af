"""biased_GeLU: fuse a biased Linear and the GeLU applied to its output (EPOI ``FusedLinearBiasGeLU``)."""

from __future__ import annotations

import re

from adopter.dsl import Layer, Var
from adopter.match import MatchContext
from adopter.rules import Rule
from adopter.rules._common import const_text, intermediates_unused, kwarg
from adopter.rules._config_defaults import config_annotation, config_defaults, local_origin, param_passed

_TA = "transformers.activations."
# Activation modules computing exact (erf) GeLU or its tanh approximation: both are kernel modes.
GELU_MODULES = (
    "torch.nn.GELU",
    _TA + "GELUActivation",
    _TA + "NewGELUActivation",
    _TA + "GELUTanh",
    _TA + "PytorchGELUTanh",
    _TA + "FastGELUActivation",
    _TA + "AccurateGELUActivation",
)
ACT2FN = _TA + "ACT2FN"  # ACT2FN[key] / get_activation(key) with a key unknown statically
GELU_KEYS = {"gelu", "gelu_new", "gelu_fast", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate"}

DSL = f"""
rule biased_GeLU
init:
    torch.nn.Linear($in, $out_features) -> $lin
    => adopter.kernels.FusedLinearBiasGeLU($in, $out_features) -> $lin
forward:
    torch.nn.Linear@$lin($x) -> $h; {'|'.join(GELU_MODULES + (ACT2FN,))}@$act($h) -> $out
    => adopter.kernels.FusedLinearBiasGeLU@$lin($x) -> $out

rule biased_GeLU
init:
    torch.nn.Linear($in, $out_features) -> $lin
    => adopter.kernels.FusedLinearBiasGeLU($in, $out_features) -> $lin
forward:
    torch.nn.Linear@$lin($x) -> $h; torch.nn.functional.gelu($h) -> $out
    => adopter.kernels.FusedLinearBiasGeLU@$lin($x) -> $out
"""

DOC = """\
Fuses a linear layer with bias and the GeLU applied directly to its output. A match is a
``torch.nn.Linear`` module call (bound in ``__init__``, ``nn.Sequential`` members
included) whose output is directly the input of a GeLU: ``torch.nn.functional.gelu``, a
``torch.nn.GELU`` module, a transformers GeLU activation module (``GELUActivation``,
``NewGELUActivation``, ``GELUTanh``, ``FastGELUActivation``, ``AccurateGELUActivation``),
or an activation module looked up from a key (``ACT2FN[...]``/``get_activation``) that is
a GeLU key or cannot be resolved statically. Keys are resolved without executing
anything: ``config.<attr>`` (or ``name = getattr(config, "<attr>", ...)``) from the
literal defaults of ``<attr>`` in the sibling ``configuration_*.py``; a constructor
parameter from its literal default when no instantiation in the file passes it. When
every possible default is a non-GeLU key (``silu``, ``relu``, ``quick_gelu``, ``tanh``,
None) it is not a match; otherwise it matches statically and tracing confirms. Not a
match: a known non-GeLU activation (ReLU, SiLU, QuickGELU, clipped ``gelu_10``), any op
between Linear and GeLU, a Linear output also read elsewhere, a bias-free Linear
(``bias=False``, or ``bias=config.<attr>`` whose configuration defaults are all
``False``, e.g. Llama/Gemma ``mlp_bias``)."""


_CONFIG_ATTR = re.compile(r"^(?:self\.)?(?:config|cfg|.*_config)\.([A-Za-z_][A-Za-z_0-9]*)$")


def _linear_has_bias(ctx: MatchContext) -> str | None:
    for ib in ctx.match.init_nodes:
        b = kwarg(ib.layer, "bias", 2)
        text = const_text(b) if b is not None else None
        if text in ("False", "0"):
            return f"{ib.attr} has no bias"
        m = _CONFIG_ATTR.match(text or "")
        if m:
            config_class = config_annotation(ctx.source, ctx.cls.name) if ctx.cls is not None else None
            defaults = config_defaults(ctx.structures.file, m.group(1), config_class)
            if defaults and all(d is False for d in defaults):
                return f"{ib.attr} has no bias by default ({text} defaults to False)"
    return None


def _activation_key_texts(layer: Layer) -> list[str]:
    out = []
    for a in layer.args:
        t = const_text(a.value)
        if t is not None:
            out.append(t)
    return out


def _key_defaults(ctx: MatchContext, binding, text: str) -> tuple[frozenset | None, str]:
    """Possible default values of an activation key expression, and where they come from."""
    config_class = config_annotation(ctx.source, ctx.cls.name) if ctx.cls is not None else None
    m = _CONFIG_ATTR.match(text)
    if m:
        where = config_class or "the model's configuration"
        return config_defaults(ctx.structures.file, m.group(1), config_class), where
    if not re.match(r"^[A-Za-z_][A-Za-z_0-9]*$", text) or ctx.source is None or binding.span is None:
        return None, ""
    origin = local_origin(ctx.source, binding.span.function, text, binding.span.line)
    if origin is None:
        return None, ""
    kind, value = origin
    if kind == "default":
        cls = binding.span.function.rpartition(".")[0]
        if cls and param_passed(ctx.source, cls.rsplit(".", 1)[-1], text):
            return None, ""  # some instantiation in the file passes its own activation
        return frozenset([value]), f"the default of parameter {text}"
    if kind == "config":
        attr, _fallback = value
        defaults = config_defaults(ctx.structures.file, attr, config_class)
        if defaults is None:
            return None, ""
        return defaults, config_class or "the model's configuration"
    return None, ""


def _activation_is_gelu(ctx: MatchContext) -> str | None:
    act_node = next((mn.node for mn in ctx.match.nodes if mn.pattern_index == 1), None)
    if not isinstance(act_node, Layer) or act_node.type != ACT2FN:
        return None
    act = ctx.binding("$act")
    binding = next(
        (ib for ib in ctx.init_bindings
         if isinstance(act, Var) and ib.attr == act.name and ib.layer.type == ACT2FN
         and (ib.container is None or ib.container == act.name)),
        None,
    )
    if binding is None:
        return None  # activation passed in from outside: unknown, runtime decides
    texts = [binding.activation] if getattr(binding, "activation", None) else _activation_key_texts(binding.layer)
    for text in texts:
        defaults, where = _key_defaults(ctx, binding, text)
        if not defaults or (None in defaults and len(defaults) > 1):
            continue
        if not any(isinstance(d, str) and d in GELU_KEYS for d in defaults):
            shown = ", ".join(sorted(repr(d) for d in defaults))
            return f"activation {text} defaults to {shown} (not GeLU) in {where}"
    return None


RULE = Rule(
    name="biased_GeLU",
    kernel="adopter.kernels.FusedLinearBiasGeLU",
    doc=DOC,
    dsl=DSL,
    preconditions=(intermediates_unused("$h"), _linear_has_bias, _activation_is_gelu),
)
