"""Activation keys settled without running anything (shared by the rules that fuse an
activation: biased_GeLU, gated_MLP).

``ACT2FN[config.hidden_act]`` / ``get_activation(key)``: the key's possible values are read from
the literal defaults of the model's sibling ``configuration_*.py`` (``config.<attr>``,
``getattr(config, "<attr>", default)``), a constructor parameter's default, or a choice between
two constants; anything else is unknown and the rule marks its match conditional.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adopter.catalogue import GELU_CONFIG_KEYS, TRANSFORMERS_GELUS
from adopter.core.dsl import Layer, Var
from adopter.core.match import MatchContext
from adopter.core.rules._common import const_text
from adopter.core.rules._config_defaults import (
    config_annotation,
    config_defaults,
    config_defines,
    local_origin,
    param_passed,
)

_TA = "transformers.activations."


# Activation modules computing exact (erf) GeLU or its tanh approximation: both are kernel modes.
GELU_MODULES = ("torch.nn.GELU", *(_TA + name for name in TRANSFORMERS_GELUS))


ACT2FN = _TA + "ACT2FN"  # ACT2FN[key] / get_activation(key) with a key unknown statically


GELU_KEYS = set(GELU_CONFIG_KEYS)


CONFIG_ATTR = re.compile(r"^(?:self\.)?(?:config|cfg|.*_config)\.([A-Za-z_][A-Za-z_0-9]*)$")


def activation_key_texts(layer: Layer) -> list[str]:
    out = []
    for a in layer.args:
        t = const_text(a.value)
        if t is not None:
            out.append(t)
    return out


def getattr_key(text: str) -> tuple[str, object] | None:
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


def getattr_defaults(ctx: MatchContext, config_class: str | None, attr: str, fallback) -> tuple[frozenset | None, str]:
    """Defaults of ``getattr(config, attr, fallback)``: the configuration's when it defines
    ``attr``, ``fallback`` when it certainly does not, unknown otherwise."""
    where = config_class or "the model's configuration"
    defaults = config_defaults(ctx.structures.file, attr, config_class)
    if defaults is not None:
        return defaults, where
    if not only_own_configs(ctx) or config_defines(ctx.structures.file, attr, config_class) is not False:
        return None, ""
    # The annotation may name another class than the one passed at run time (CLVP annotates
    # ClvpConfig, passes ClvpEncoderConfig): add the defaults of any class that defines it.
    others = config_defaults(ctx.structures.file, attr) or frozenset()
    return frozenset([fallback]) | others, f"{where}, which defines no {attr} (getattr default)"


def only_own_configs(ctx: MatchContext) -> bool:
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


def attribute_defaults(ctx: MatchContext, config_class: str | None, attr: str) -> tuple[frozenset | None, str]:
    """Defaults of ``config.<attr>``; ``{UNDEFINED}`` when no configuration class of the model
    defines it (the code cannot run with the model's configuration: an unused copied class
    such as SEW-D's ``ContextPooler`` reading DeBERTa's ``pooler_hidden_act``)."""
    where = config_class or "the model's configuration"
    defaults = config_defaults(ctx.structures.file, attr, config_class)
    if defaults is not None:
        return defaults, where
    if (config_defaults(ctx.structures.file, attr) is None and only_own_configs(ctx)
            and config_defines(ctx.structures.file, attr) is False):
        return frozenset([UNDEFINED]), f"{where}, which defines no {attr}"
    return None, ""


def key_defaults(ctx: MatchContext, span, text: str, in_init: bool = True) -> tuple[frozenset | None, str]:
    """Possible default values of an activation key expression, and where they come from.
    ``span`` locates the code using the key (an ``__init__`` binding, or the inline
    ``ACT2FN[key](h)`` call when ``in_init`` is False)."""
    config_class = config_annotation(ctx.source, ctx.cls.name) if ctx.cls is not None else None
    m = CONFIG_ATTR.match(text)
    if m:
        return attribute_defaults(ctx, config_class, m.group(1))
    ga = getattr_key(text)
    if ga is not None:
        return getattr_defaults(ctx, config_class, *ga)
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
        return attribute_defaults(ctx, config_class, value[0])
    if kind == "getattr":
        return getattr_defaults(ctx, config_class, *value)
    return None, ""


GELU_KEYS_TEXT = "{'gelu', 'gelu_new', 'gelu_pytorch_tanh', ...}"  # GELU_KEYS, shortened for reports


def constant_choice(text: str) -> tuple[str, object, object] | None:
    """``'gelu' if c else 'relu'`` (a key chosen between two constants): ``(c, 'gelu', 'relu')``."""
    try:
        e = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if isinstance(e, ast.IfExp) and isinstance(e.body, ast.Constant) and isinstance(e.orelse, ast.Constant):
        return ast.unparse(e.test), e.body.value, e.orelse.value
    return None


@dataclass(frozen=True)
class KernelActivations:
    """The activation keys a kernel computes, and how reports name them."""

    keys: frozenset
    name: str  # "GeLU": conditions read "GeLU only if ..."
    not_name: str  # "not GeLU": why a key whose every value is another activation is no match
    keys_text: str  # the keys, shortened for reports


def settle_activation_keys(ctx: MatchContext, texts: list[str], span, in_init: bool, kernel: KernelActivations,
                           what: str) -> str | None:
    """Settle the key expressions ``texts`` of an ``ACT2FN[...]`` lookup: None (a plain match)
    when every default of every key is one ``kernel`` computes; the reason (no match) when none
    is; ``conditional`` (``needs-config``, marked on ``ctx``) when the source does not settle it
    (no resolvable default, defaults that differ, a choice between a kernel key and another
    constant): a trace settles it. ``what`` names the lookup in the conditions."""
    name, keys = kernel.name, kernel.keys
    if not texts:
        ctx.conditional("needs-config", f"{name} only if the key of {what} is in {kernel.keys_text}")
    for text in texts:
        choice = constant_choice(text)
        if choice is not None:
            test, a, b = choice
            ka, kb = a in keys, b in keys
            if not (ka or kb):
                return f"activation {text} is {a!r} or {b!r} ({kernel.not_name})"
            if not (ka and kb):
                ctx.conditional("needs-config", f"{name} only if {test if ka else f'not ({test})'} (key {text})")
            continue
        defaults, where = key_defaults(ctx, span, text, in_init)
        if not defaults or (None in defaults and len(defaults) > 1):
            ctx.conditional("needs-config", f"{name} only if {text} in {kernel.keys_text} (no configuration "
                                            "default resolves it)")
            continue
        computed = {d for d in defaults if isinstance(d, str) and d in keys}
        shown = ", ".join(sorted(d if d == UNDEFINED else repr(d) for d in defaults))
        if not computed:
            return f"activation {text} defaults to {shown} ({kernel.not_name}) in {where}"
        if len(computed) < len(defaults):
            ctx.conditional("needs-config", f"{name} only if {text} in {kernel.keys_text} (its defaults in "
                                            f"{where}: {shown})")
    return None


def settle_activation_node(ctx: MatchContext, act_node: Layer | None, kernel: KernelActivations) -> str | None:
    """A rule's precondition on its activation node: None (a plain match) when the node is not an
    ``ACT2FN`` lookup (the pattern settled it: a module or function of the kernel's activation) or
    its keys settle as ``kernel`` computes; the reason when they settle as none; ``conditional``
    (``needs-config``) when the source does not settle it (an activation passed in from outside,
    keys without one resolvable default): a trace settles it."""
    if not isinstance(act_node, Layer) or act_node.type != ACT2FN:
        return None
    texts, span, in_init, what = activation_key_lookup(ctx, act_node)
    if texts is None:
        ctx.conditional("needs-config", f"{kernel.name} only if the activation {what} passed in is one")
        return None
    return settle_activation_keys(ctx, texts, span, in_init, kernel, what)


def activation_key_lookup(ctx: MatchContext, act_node: Layer) -> tuple[list[str] | None, Any, bool, str]:
    """Key expressions of an ``ACT2FN`` activation node: (texts, span, bound in __init__, what the
    conditions call it); texts None when the activation comes from outside the class (a trace must
    settle it)."""
    act = act_node.module
    if act is None:  # ``ACT2FN[key](g)``: extraction passes the key as the ``activation`` keyword
        texts = [t for t in (const_text(a.value) for a in act_node.args if a.keyword == "activation") if t is not None]
        return texts, act_node.span, False, "the lookup"
    binding = next(
        (ib for ib in ctx.init_bindings
         if isinstance(act, Var) and ib.attr == act.name and ib.layer.type == ACT2FN
         and (ib.container is None or ib.container == act.name)),
        None,
    )
    if binding is None:
        return None, None, True, str(act)
    texts = [binding.activation] if getattr(binding, "activation", None) else activation_key_texts(binding.layer)
    return texts, binding.span, True, str(act)
