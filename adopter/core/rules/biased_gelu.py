"""biased_GeLU: fuse a biased Linear and the GeLU applied to its output (EPOI ``FusedLinearBiasGeLU``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from adopter.core.dsl import Layer, Var
from adopter.core.match import MatchContext, local_type_names
from adopter.core.rules import Rule
from adopter.core.rules._common import const_text, intermediates_unused, kwarg
from adopter.core.rules._config_defaults import (
    config_annotation,
    config_defaults,
    config_defines,
    local_origin,
    param_passed,
)
from adopter.core.rules._gelu_wrappers import gelu_functions, gelu_module_classes

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
    torch.nn.Linear@$lin($x) -> $h; {'|'.join(GELU_MODULES + (ACT2FN,))}($h) -> $out
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
``transformers.activations.gelu`` (a module-level exact-erf ``GELUActivation``), a module
class defined in the same file whose ``forward`` only returns a GeLU of its input (``gelu(x)``,
a written-out erf/tanh GeLU formula, or ``Fn.apply(x)`` of a same-file autograd Function whose
forward is that formula and whose backward its derivative: LXMERT's ``GeLU``, BLOOM's
``BloomGelu``; the arithmetic is checked numerically from the source, never executed), a
call of a same-file function ``def f(x): return <exact erf GeLU of x>`` (ESM's ``gelu``), or an
activation looked up from a key (``ACT2FN[...]``/``get_activation``, bound in ``__init__``
or looked up and called in one expression, ``ACT2FN[self.config.hidden_act](h)``) that is
a GeLU key or cannot be resolved statically. Keys are resolved without executing
anything: ``config.<attr>`` (or ``name = getattr(config, "<attr>", default)``) from the
literal defaults of ``<attr>`` in the sibling ``configuration_*.py`` — ``default`` when
the configuration class (and its bases up to ``PreTrainedConfig``) never defines
``<attr>``, e.g. ``summary_activation`` of ConvBERT's sequence summary; a constructor
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


def _getattr_key(text: str) -> tuple[str, object] | None:
    """``getattr(config, "attr", default)`` written as the key itself: (attr, default)."""
    try:
        e = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "getattr" and len(e.args) == 3
            and "config" in ast.unparse(e.args[0]) and isinstance(e.args[1], ast.Constant)
            and isinstance(e.args[1].value, str)):
        try:
            return e.args[1].value, ast.literal_eval(e.args[2])
        except Exception:
            return None
    return None


def _getattr_defaults(ctx: MatchContext, config_class: str | None, attr: str, fallback) -> tuple[frozenset | None, str]:
    """Defaults of ``getattr(config, attr, fallback)``: the configuration's when it defines
    ``attr``, ``fallback`` when it certainly does not, unknown otherwise."""
    where = config_class or "the model's configuration"
    defaults = config_defaults(ctx.structures.file, attr, config_class)
    if defaults is not None:
        return defaults, where
    if not _only_own_configs(ctx) or config_defines(ctx.structures.file, attr, config_class) is not False:
        return None, ""
    # The annotation may name another class than the one passed at run time (CLVP annotates
    # ClvpConfig, passes ClvpEncoderConfig): add the defaults of any class that defines it.
    others = config_defaults(ctx.structures.file, attr) or frozenset()
    return frozenset([fallback]) | others, f"{where}, which defines no {attr} (getattr default)"


def _only_own_configs(ctx: MatchContext) -> bool:
    """The file imports configuration classes only from its sibling ``configuration_<model>.py``
    (no other model's configuration, no ``AutoConfig``): a config it receives is one of those."""
    own = Path(ctx.structures.file).name
    if not own.startswith("modeling_"):
        return False
    own_module = "configuration_" + own[len("modeling_"):-len(".py")]
    for fq in ctx.structures.imports.values():
        if "AutoConfig" in fq or "CONFIG_MAPPING" in fq:
            return False
        m = re.search(r"(?:^|\.)(configuration_\w+)\.", fq)
        if m and m.group(1) != own_module:
            return False
    return True


# Stands for "no such configuration attribute": ``config.<attr>`` would raise.
UNDEFINED = "<undefined>"


def _attribute_defaults(ctx: MatchContext, config_class: str | None, attr: str) -> tuple[frozenset | None, str]:
    """Defaults of ``config.<attr>``; ``{UNDEFINED}`` when no configuration class of the model
    defines it (the code cannot run with the model's configuration: an unused copied class
    such as SEW-D's ``ContextPooler`` reading DeBERTa's ``pooler_hidden_act``)."""
    where = config_class or "the model's configuration"
    defaults = config_defaults(ctx.structures.file, attr, config_class)
    if defaults is not None:
        return defaults, where
    if (config_defaults(ctx.structures.file, attr) is None and _only_own_configs(ctx)
            and config_defines(ctx.structures.file, attr) is False):
        return frozenset([UNDEFINED]), f"{where}, which defines no {attr}"
    return None, ""


def _key_defaults(ctx: MatchContext, span, text: str, in_init: bool = True) -> tuple[frozenset | None, str]:
    """Possible default values of an activation key expression, and where they come from.
    ``span`` locates the code using the key (an ``__init__`` binding, or the inline
    ``ACT2FN[key](h)`` call when ``in_init`` is False)."""
    config_class = config_annotation(ctx.source, ctx.cls.name) if ctx.cls is not None else None
    m = _CONFIG_ATTR.match(text)
    if m:
        return _attribute_defaults(ctx, config_class, m.group(1))
    ga = _getattr_key(text)
    if ga is not None:
        return _getattr_defaults(ctx, config_class, *ga)
    if not re.match(r"^[A-Za-z_][A-Za-z_0-9]*$", text) or ctx.source is None or span is None:
        return None, ""
    origin = local_origin(ctx.source, span.function, text, span.line)
    if origin is None:
        return None, ""
    kind, value = origin
    if kind == "default":
        cls = span.function.rpartition(".")[0]
        if not in_init:
            return None, ""  # a parameter of forward: each caller decides
        if cls and param_passed(ctx.source, cls.rsplit(".", 1)[-1], text):
            return None, ""  # some instantiation in the file passes its own activation
        return frozenset([value]), f"the default of parameter {text}"
    if kind == "config":
        return _attribute_defaults(ctx, config_class, value[0])
    if kind == "getattr":
        return _getattr_defaults(ctx, config_class, *value)
    return None, ""


def _activation_is_gelu(ctx: MatchContext) -> str | None:
    act_node = next((mn.node for mn in ctx.match.nodes if mn.pattern_index == 1), None)
    if not isinstance(act_node, Layer) or act_node.type != ACT2FN:
        return None
    act = act_node.module
    if act is None:
        # ``ACT2FN[key](h)``: extraction passes the key as the ``activation`` keyword
        texts = [const_text(a.value) for a in act_node.args if a.keyword == "activation"]
        texts = [t for t in texts if t is not None]
        span, in_init = act_node.span, False
    else:
        binding = next(
            (ib for ib in ctx.init_bindings
             if isinstance(act, Var) and ib.attr == act.name and ib.layer.type == ACT2FN
             and (ib.container is None or ib.container == act.name)),
            None,
        )
        if binding is None:
            return None  # activation passed in from outside: unknown, runtime decides
        texts = [binding.activation] if getattr(binding, "activation", None) else _activation_key_texts(binding.layer)
        span, in_init = binding.span, True
    for text in texts:
        defaults, where = _key_defaults(ctx, span, text, in_init)
        if not defaults or (None in defaults and len(defaults) > 1):
            continue
        if not any(isinstance(d, str) and d in GELU_KEYS for d in defaults):
            shown = ", ".join(sorted(d if d == UNDEFINED else repr(d) for d in defaults))
            return f"activation {text} defaults to {shown} (not GeLU) in {where}"
    return None


def _gelu_module_aliases(structures, source: str | None) -> dict[str, str]:
    """Same-file modules whose forward is a GeLU of their input match as ``torch.nn.GELU``
    (LXMERT's ``GeLU``, BLOOM's ``BloomGelu``; see :mod:`adopter.core.rules._gelu_wrappers`)."""
    if not source or not structures.classes:
        return {}
    bases = {c.name: tuple(c.bases) for c in structures.classes}
    if not any(b == ("torch.nn.Module",) for b in bases.values()):
        return {}
    out: dict[str, str] = {}
    for name in gelu_module_classes(source, dict(structures.imports), bases):
        for ty in local_type_names(structures, name):
            out[ty] = "torch.nn.GELU"
    return out


def _gelu_functions(structures, source: str | None) -> dict[str, str]:
    """Same-file ``def gelu(x)`` computing exact GeLU (ESM's erf formula): the matcher folds its
    inlined body back into one ``torch.nn.functional.gelu`` call. Only exact (erf) ones: the
    rewrite reads a folded call like a functional ``gelu(x)``, whose default mode is exact."""
    if not source or "def " not in source:
        return {}
    bases = {c.name: tuple(c.bases) for c in structures.classes}
    return {name: "torch.nn.functional.gelu"
            for name, mode in gelu_functions(source, dict(structures.imports), bases).items() if mode == "none"}


RULE = Rule(
    name="biased_GeLU",
    kernel="adopter.kernels.FusedLinearBiasGeLU",
    doc=DOC,
    dsl=DSL,
    preconditions=(intermediates_unused("$h"), _linear_has_bias, _activation_is_gelu),
    layer_aliases=_gelu_module_aliases,
    inlined_functions=_gelu_functions,
)
