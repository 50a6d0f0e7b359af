"""biased_GeLU: fuse a biased Linear and the GeLU applied to its output (EPOI ``FusedLinearBiasGeLU``).

Rewrite (the codemod below):
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
import re
from pathlib import Path
from typing import Any

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
)
from adopter.core.codemod.context import FileContext, Skip, call_arguments, is_literal, is_self_attr, literal
from adopter.core.codemod.edits import Edit, InitEdit
from adopter.core.dsl import Layer, Var
from adopter.core.match import MatchContext, local_type_names
from adopter.core.rule import Rule, Runtime, RuntimeSite, RuntimeStep
from adopter.core.rules._common import LINEAR, const_text, intermediates_unused, kwarg
from adopter.core.rules._config_defaults import (
    config_annotation,
    config_defaults,
    config_defines,
    local_origin,
    param_passed,
)
from adopter.core.rules._gelu_wrappers import gelu_functions, gelu_module_classes
from adopter.core.structures import Match

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
forward:
    torch.nn.Linear@$lin($x) -> $h; {'|'.join(GELU_MODULES + (ACT2FN,))}($h) -> $out

rule biased_GeLU
init:
    torch.nn.Linear($in, $out_features) -> $lin
forward:
    torch.nn.Linear@$lin($x) -> $h; torch.nn.functional.gelu($h) -> $out
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


# ---------------------------------------------------------------- codemod

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

# ---------------------------------------------------------------- runtime

# GeLU variants by activation class name: what the fused kernel's ``approximate`` must be.
GELU_CLASSES = {
    "GELU": None,  # torch.nn.GELU: read .approximate
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "GELUPytorchTanh": "tanh",
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}
_NOT_KERNEL_GELU = {
    "QuickGELUActivation": "QuickGELU (x*sigmoid(1.702x)) is not the GeLU the kernel implements",
    "ClippedGELUActivation": "clipped GeLU is not the GeLU the kernel implements",
}


def gelu_kind(module: Any) -> tuple[str | None, str]:
    """``("none"|"tanh", description)`` for a GeLU activation the fused kernel implements
    (its ``approximate`` argument), else ``(None, why not)``; inspects the module instance."""
    import torch
    from torch import nn

    name = type(module).__name__
    if isinstance(module, nn.GELU):
        return module.approximate, f"nn.GELU(approximate={module.approximate!r})"
    if module is torch.nn.functional.gelu:
        return "none", "F.gelu (exact)"
    approx = GELU_CLASSES.get(name)
    if approx:
        return approx, f"{name} ({'exact' if approx == 'none' else 'tanh-approximate'} GeLU)"
    if name in _NOT_KERNEL_GELU:
        return None, _NOT_KERNEL_GELU[name]
    return None, f"activation is {name}, not a GeLU"


def _graph_gelu_approximate(ops) -> str | None:
    """``approximate`` of a functional gelu among the traced ops (None: no gelu ran)."""
    for op in ops:
        if op.name == "gelu" and op.kind == "call_function":
            approx = op.kwargs.get("approximate")
            if approx is None and len(op.args) > 1:
                approx = op.args[1]
            return approx or "none"
    return None


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    mods = site.modules
    linears = [m for m in mods if isinstance(m, nn.Linear)]
    act_i = next((i for i in range(len(site.nodes)) if not isinstance(mods[i], nn.Linear)), None)
    if act_i is None:
        return None, ""
    act_mod = mods[act_i]
    approx = _graph_gelu_approximate(site.ops[act_i])
    if act_mod is None:
        # ``self.act = config.hidden_act`` callables or functional calls: look at the graph
        if approx is None:
            return "the activation that runs is not a GeLU", ""
        kind, desc = approx, f"gelu (approximate={approx!r})"
    else:
        kind, desc = gelu_kind(act_mod)
        if approx is not None and kind is not None:
            kind = approx
            desc = f"{type(act_mod).__name__} (approximate={approx!r})"
    if kind is None:
        return desc, ""
    facts = f"GeLU {'exact' if kind == 'none' else 'tanh'}: {desc}; kernel approximate={kind!r}"
    if linears:
        lin = linears[0]
        facts += f"; Linear {lin.in_features}->{lin.out_features} bias={lin.bias is not None}"
    return None, facts


RUNTIME = Runtime(
    check=_runtime_check,
    sequence=(
        RuntimeStep("torch.nn.Linear", module_types=(LINEAR,)),
        # a GeLU activation module (transformers' ACT2FN classes, nn.GELU) or a functional gelu
        RuntimeStep("gelu", module_class_names=frozenset(GELU_CLASSES), ops=frozenset({"gelu"})),
    ),
    # Activations stay whole in a symbolic trace so the check sees which one runs; transformers'
    # ACT2FN modules (GELUActivation, NewGELUActivation, ...) too.
    leaf_modules=(
        LINEAR, "torch.nn.modules.activation.GELU", "torch.nn.modules.activation.ReLU",
        "torch.nn.modules.activation.SiLU", "torch.nn.modules.activation.Tanh", "transformers.activations.",
    ),
)

RULE = Rule(
    name="biased_GeLU",
    kernel="adopter.kernels.FusedLinearBiasGeLU",
    doc=DOC,
    dsl=DSL,
    codemod=BiasedGeLU(),
    runtime=RUNTIME,
    fixtures="biased_GeLU",
    preconditions=(intermediates_unused("$h"), _linear_has_bias, _activation_is_gelu),
    layer_aliases=_gelu_module_aliases,
    inlined_functions=_gelu_functions,
)
