"""What a rule is: one self-contained unit, declared in one module and found by name.

A :class:`Rule` carries everything the pipeline needs to know about it, so the layers
above (tracing, rewriting, verification, the CLI) never name a rule:

* ``dsl`` / ``variants`` — the patterns (static matching), ``preconditions`` — static checks;
* ``codemod`` — the edit synthesis (an object with ``analyze(match, ctx) -> Edit``), or None
  when the DSL ``=>`` target suffices (then the generic synthesis applies it);
* ``runtime`` — what the trace must check (:class:`Runtime`): a precondition on the module
  instances and graph ops that actually ran (:class:`RuntimeSite`), the layer sequence to
  look for when no static match covers it, and the layer classes a symbolic trace keeps whole;
* ``stochastic_attributes`` — attributes of the rewritten modules that hold a dropout
  probability, which equivalence checking sets to 0;
* ``kernel``, ``doc``, ``fixtures``.

Plain data only: nothing here imports torch. Runtime checks receive plain
:class:`GraphOp` records and the module objects, and import torch themselves when run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adopter.core.dsl import Layer, RuleText
from adopter.core.dsl_text import parse_rules
from adopter.core.structures import Match

__all__ = ["GraphOp", "Rule", "Runtime", "RuntimeSite", "RuntimeStep"]


@dataclass(frozen=True)
class GraphOp:
    """One traced graph node produced by a matched source node.

    ``name``: normalized op (``"gelu"``, ``"add"``, a module class name for call_module);
    ``kind``: the fx op (``call_function``, ``call_module``, ``call_method``);
    ``args``/``kwargs``: the constant arguments (a graph value is ``None``);
    ``input_shapes``: shapes of the data inputs (parameters excluded; None when unknown)."""

    name: str
    kind: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    input_shapes: tuple = ()


@dataclass(frozen=True)
class RuntimeSite:
    """A match as it ran in one module instance: what a rule's runtime check inspects.

    ``modules[i]`` is the module instance matched node ``i`` calls (None for a functional
    call, an operator, or an attribute that is no module); ``ops[i]`` the graph ops it produced."""

    match: Match
    instance: str  # module path of the instance ("" for the model or a module-level function)
    modules: tuple[Any, ...]
    ops: tuple[tuple[GraphOp, ...], ...]

    @property
    def nodes(self) -> list:
        return [mn.node for mn in self.match.nodes]


@dataclass(frozen=True)
class RuntimeStep:
    """One link of a runtime layer sequence (see :attr:`Runtime.sequence`).

    A step is a call of a module whose class is one of ``module_types`` (qualified names,
    e.g. ``torch.nn.modules.dropout.Dropout``), or runs inside a module whose class name is in
    ``module_class_names``, or is a graph op in ``ops``. ``kind`` is what the reported match
    node says (a DSL layer type or an operator symbol such as ``+``)."""

    kind: str
    module_types: tuple[str, ...] = ()
    module_class_names: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()

    @property
    def is_operator(self) -> bool:
        return not self.kind[:1].isalpha()


# (site) -> (failure or None, facts): the facts describe what ran ("Dropout(p=0.1) + LayerNorm...").
RuntimeCheck = Callable[[RuntimeSite], "tuple[str | None, str]"]


@dataclass(frozen=True)
class Runtime:
    """What a rule needs from the trace.

    ``check``: a precondition that only the running model can settle (the activation behind
    ``ACT2FN[config.hidden_act]``, shapes, biases); ``sequence``: the layer chain that, found in
    a trace with no static match covering it, is reported ``runtime-only``; ``leaf_modules``:
    module classes a symbolic trace must keep as one node (qualified class names, subclasses
    included, or a ``package.`` prefix for every class defined under it)."""

    check: RuntimeCheck | None = None
    sequence: tuple[RuntimeStep, ...] = ()
    leaf_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """A transformation rule: DSL variants, preconditions, codemod, runtime needs, kernel, docs."""

    name: str
    kernel: str
    doc: str
    dsl: str
    preconditions: tuple[Callable, ...] = ()
    # Edit synthesis: an object with ``analyze(match, ctx) -> Edit`` (see
    # :mod:`adopter.core.codemod.base`); None: synthesized from the DSL ``=>`` target.
    codemod: Any = field(default=None, compare=False)
    runtime: Runtime = field(default_factory=Runtime, compare=False)
    # Attributes of the modules this rule's rewrite leaves in the model that hold a dropout
    # probability (equivalence checks compare with every dropout off).
    stochastic_attributes: tuple[str, ...] = ()
    # Fixture folder name under tests/fixtures/rules/ (before/after sources of this rule).
    fixtures: str = ""
    # "lines": one match per distinct set of statements; "class": at most one per class
    # function (a whole attention computation reached through several paths).
    dedup: str = "lines"
    # Report a match whose nodes all lie in an inlined helper under that helper (once for
    # all callers). Off for rules whose match is about the calling class (attention).
    rehome: bool = True
    # A precondition violated on one path through the matched statements vetoes the
    # match on every path (the fused code would run on all of them).
    veto_across_paths: bool = True
    # The match is a chain: its first node's layer feeds its last through the rule's glue only
    # (conv -> BN, dropout -> add -> LayerNorm). Another method of the class keeps the rewrite out
    # (``method-divergence``) only when it computes that same chain; for other rules (parallel
    # projections), whenever it runs all the matched layers.
    chain: bool = False
    # The codemod joins matched statements that lie in different blocks by hoisting (paper
    # Fig. 4: statements before an ``if`` copied into every branch, those after it to the end of
    # every branch): a match it cannot join is refused (``branch-straddle``). False for a codemod
    # that handles blocks itself (attention: an ``if mask is not None`` around the add is absorbed).
    hoisting: bool = True
    # A layer class defined in the scanned file that derives from a ``torch.nn`` layer named in
    # the patterns and defines no method but ``__init__`` (so its forward is the parent's) is
    # matched as that parent (EfficientNet's ``EfficientNetDepthwiseConv2d(nn.Conv2d)``).
    # Its constructor arguments are not matched: its own signature differs from the parent's.
    match_subclasses: bool = False
    # A BatchNorm2d subclass (of the file or, read from its source, of another module) whose forward
    # applies submodules (an activation, a drop) to its batch norm and computes nothing else (timm's
    # ``BatchNormAct2d``) is matched as ``torch.nn.BatchNorm2d``: the rule's kernel takes such a
    # module and applies those submodules after it (checking at run time that it is one).
    match_norm_act: bool = False
    # Consecutive entries of an ``nn.Sequential`` fit the rule's two-layer pattern: matched
    # where the Sequential is built and rewritten there to ``adopter.kernels.GuardedSequential``,
    # which runs such pairs through the rule's kernel (the kernel named by ``kernel``).
    in_sequential: bool = False
    # ``(structures, source) -> {layer type: torch layer type}``: layer classes defined in the
    # scanned file that the rule treats as the named torch layer (a GeLU rule: same-file modules
    # whose forward is a GeLU of their input, e.g. BLOOM's ``BloomGelu``). Their call arguments
    # are matched as the torch layer's.
    layer_aliases: Callable | None = field(default=None, compare=False)
    # ``(structures, source) -> {function name: layer type}``: module-level functions of the
    # scanned file whose inlined body the rule sees as one call of that layer type (a GeLU rule:
    # ESM's ``def gelu(x)`` written-out erf GeLU -> ``torch.nn.functional.gelu``).
    inlined_functions: Callable | None = field(default=None, compare=False)
    variants: tuple[RuleText, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if not self.variants:
            variants = tuple(parse_rules(self.dsl, source_name=f"<rule {self.name}>"))
            if not variants:
                raise ValueError(f"rule {self.name}: DSL text holds no rule block")
            for v in variants:
                if v.name != self.name:
                    raise ValueError(f"rule {self.name}: DSL block named {v.name!r}")
            object.__setattr__(self, "variants", variants)

    @property
    def summary(self) -> str:
        """First sentence of the doc."""
        text = " ".join(self.doc.split())
        end = text.find(". ")
        return text if end < 0 else text[: end + 1]


def kernel_of(variant: RuleText) -> str:
    """The first layer type of a variant's forward target ("" when it has none)."""
    target = variant.forward.target
    for node in target.nodes if target is not None else ():
        if isinstance(node, Layer):
            return node.type
    return ""
