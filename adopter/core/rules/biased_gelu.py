"""biased_GeLU: fuse a biased Linear and the GeLU applied to its output (EPOI ``FusedLinearBiasGeLU``).

Rewrite (the codemod below), forward only — ``__init__`` and the modules stay:
    h = self.dense(h); h = self.act(h)       (or F.gelu(h), ACT2FN[config.hidden_act](h), ...)
 => h = linear_gelu(self.dense, self.act, h)

``adopter.kernels.linear_gelu`` decides at run time: an ``nn.Linear`` and an activation the fused
kernel computes (``nn.GELU``, ``F.gelu``, the transformers GeLU classes, with their approximation)
run fused; anything else (a config that selects ``relu``, a LoRA-wrapped Linear) runs
``self.act(self.dense(h))``. Nothing about the analysed config is written into the source.
"""

from __future__ import annotations

import ast
from typing import Any

from adopter.catalogue import NOT_KERNEL_GELUS, TRANSFORMERS_GELUS
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
from adopter.core.codemod.context import FileContext, Skip, is_self_attr, stores
from adopter.core.codemod.edits import Edit
from adopter.core.match import MatchContext, local_type_names
from adopter.core.rule import Rule, Runtime, RuntimeSite, RuntimeStep
from adopter.core.rules._activation_keys import (
    ACT2FN,
    CONFIG_ATTR,
    GELU_KEYS,
    GELU_KEYS_TEXT,
    GELU_MODULES,
    KernelActivations,
    settle_activation_node,
)
from adopter.core.rules._common import LINEAR, const_text, intermediates_unused, kwarg
from adopter.core.rules._config_defaults import (
    config_annotation,
    config_defaults,
)
from adopter.core.rules._gelu_wrappers import gelu_functions, gelu_module_classes
from adopter.core.structures import Match

GELU_KERNEL = KernelActivations(frozenset(GELU_KEYS), "GeLU", "not GeLU", GELU_KEYS_TEXT)

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
call of a same-file function ``def f(x): return <exact erf GeLU of x>`` (ESM's ``gelu``), a
same-class helper method ``def gelu(self, x): return F.gelu(x)`` called as ``self.gelu(h)``
(the rewrite hands the kernel ``F.gelu`` while ``type(self).gelu`` is that method, the method
itself — which the kernel runs unfused — when a subclass overrides it), or an
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




def _linear_has_bias(ctx: MatchContext) -> str | None:
    for ib in ctx.match.init_nodes:
        b = kwarg(ib.layer, "bias", 2)
        text = const_text(b) if b is not None else None
        if text in ("False", "0"):
            return f"{ib.attr} has no bias"
        m = CONFIG_ATTR.match(text or "")
        if m:
            config_class = config_annotation(ctx.source, ctx.cls.name) if ctx.cls is not None else None
            defaults = config_defaults(ctx.structures.file, m.group(1), config_class)
            if defaults and all(d is False for d in defaults):
                return f"{ib.attr} has no bias by default ({text} defaults to False)"
    return None




















def _activation_is_gelu(ctx: MatchContext) -> str | None:
    """The activation looked up from a key is a GeLU: plain match when every default of the key
    is a GeLU key; not a match when none is; ``conditional`` (``needs-config``) when the source
    does not settle it (no resolvable default, defaults that differ, a choice between a GeLU and
    another constant, an activation passed in from outside): a trace settles it."""
    act_node = next((mn.node for mn in ctx.match.nodes if mn.pattern_index == 1), None)
    return settle_activation_node(ctx, act_node, GELU_KERNEL)


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

KERNEL = "linear_gelu"


def _module_level_fqn(ctx: FileContext, name: str) -> str:
    """What a module-level import binds ``name`` to (``F`` -> ``torch.nn.functional``), else ``?``."""
    found = "?"
    for st in ctx.tree.body:
        if isinstance(st, ast.Import):
            for al in st.names:
                if al.asname == name:
                    found = al.name
                elif al.asname is None and al.name.split(".", 1)[0] == name:
                    found = name
        elif isinstance(st, ast.ImportFrom) and st.level == 0 and st.module:
            for al in st.names:
                if (al.asname or al.name) == name:
                    found = f"{st.module}.{al.name}"
    return found


def _gelu_method(ctx: FileContext, match: Match, act: ast.Call) -> str | None:
    """The activation as the kernel should receive it when the GeLU is a same-class helper
    method ``def gelu(self, x): return F.gelu(x)`` called as ``self.gelu(h)``: handed over as
    the bound method the kernel would not recognize (it always ran the original), so the
    functional is passed while the method is the class's own —
    ``(F.gelu if type(self).gelu is Owner.gelu else self.gelu)``: a subclass overriding the
    helper gets its override (the kernel then runs the original). None when not such a call."""
    attr = is_self_attr(act.func)
    if attr is None or match.class_name is None or len(act.args) != 1 or act.keywords:
        return None
    found = ctx.method_in_class_family(match.class_name, attr)
    if found is None:
        return None
    owner, method = found
    if not isinstance(ctx.tree, ast.Module) or not any(
            isinstance(st, ast.ClassDef) and st.name == owner for st in ctx.tree.body):
        return None  # the rewrite names the owner class: a module-level one only
    a = method.args
    if method.decorator_list or a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults \
            or len(a.args) != 2:
        return None
    body = [st for st in method.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return None
    call = body[0].value
    if (len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Name)
            or call.args[0].id != a.args[1].arg):
        return None  # exact GeLU of the parameter only: the kernel is handed no extra arguments
    func = ast.unparse(call.func)
    root = func.split(".", 1)[0]
    if _module_level_fqn(ctx, root) + func[len(root):] != "torch.nn.functional.gelu":
        return None
    if any(ctx.class_attr_stores(c, attr) for c in [match.class_name, owner, *ctx.subclasses(owner)]):
        return None  # an instance attribute of that name shadows the method
    fn = ctx.enclosing_function(act)
    if fn is not None and root in stores(fn):
        return None  # the functional's module name means something else in the rewritten function
    return f"({func} if type(self).{attr} is {owner}.{attr} else self.{attr})"


class BiasedGeLU(Codemod):
    rule = "biased_GeLU"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        if len(exprs) != 2:
            raise Skip("expected a Linear call and a GeLU call")
        (_, lin), (_, act) = exprs
        if not isinstance(lin, ast.Call) or not isinstance(act, ast.Call):
            raise Skip("Linear and GeLU must be calls")
        if len(lin.args) != 1 or lin.keywords:
            raise Skip("the Linear must be a module called with one tensor")
        if not act.args or (act.args[0] is not lin and not isinstance(act.args[0], ast.Name)):
            raise Skip("GeLU does not read the Linear output")
        if any(isinstance(a, ast.Starred) for a in act.args) or any(k.arg is None for k in act.keywords):
            raise Skip("the GeLU call unpacks arguments")
        separate_calls(lin, act)
        local = ctx.same_file_callable(match.class_name, act)
        method = _gelu_method(ctx, match, act)
        if local is not None:
            raise Skip(
                f"the GeLU is {local}, defined in this file: the kernel recognizes torch and transformers "
                "GeLUs at run time and would always run the original code"
            )
        linear = module_handle(ctx, lin, "Linear")
        # a reference or an ACT2FN[...] lookup, evaluated where it was; a same-class GeLU helper
        # method as the functional it returns (guarded on the method being the class's own)
        activation = method or arg_text(ctx, act.func)
        extra = [arg_text(ctx, a) for a in act.args[1:]] + [f"{k.arg}={arg_text(ctx, k.value)}" for k in act.keywords]
        spec, kernel = kernel_name(ctx, KERNEL)
        plan = ChainPlan(ctx, fn, [lin, act])
        plan.anchor_text = f"{kernel}({', '.join([linear, activation, arg_text(ctx, lin.args[0])] + extra)})"
        plan.moved = [(lin.func, lin), (lin.args[0], lin)]
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))

# ---------------------------------------------------------------- runtime

# GeLU variants by activation class name: what the fused kernel's ``approximate`` must be.
GELU_CLASSES = {"GELU": None, **TRANSFORMERS_GELUS}  # torch.nn.GELU: read .approximate
_NOT_KERNEL_GELU = NOT_KERNEL_GELUS


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
    chain=True,
    kernel="adopter.kernels.linear_gelu",
    doc=DOC,
    dsl=DSL,
    codemod=BiasedGeLU(),
    runtime=RUNTIME,
    fixtures="biased_GeLU",
    preconditions=(intermediates_unused("$h"), _linear_has_bias, _activation_is_gelu),
    layer_aliases=_gelu_module_aliases,
    inlined_functions=_gelu_functions,
    # Sequential entries (``nn.Sequential(conv, bn, ...)``): rewritten to GuardedSequential where built.
    in_sequential=True,
)
