"""What static extraction produces from one source file (paper §3.2), and what
matching produces from that (§3.4). Plain dataclasses; data flows one way:

    source text --extract--> FileStructures --match--> [Match] --trace--> [Match with status]
    --rewrite--> edits --verify--> result
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from adopter.core.dsl import Layer, Node, RuleText, Span, Value

# ---------------------------------------------------------------- extraction


@dataclass(frozen=True)
class InitBinding:
    """``self.<attr> = <layer type>(args)`` in ``__init__`` (possibly under an ``if``).

    ``layer`` is a :class:`Layer` whose ``output`` is ``Var("self.<attr>")``.
    ``conditional`` is True when the assignment is inside a branch.
    ``container`` is set for layers inside ``nn.ModuleList``/``nn.Sequential``
    (``"self.layers[*]"``), ``activation`` holds the key for ``ACT2FN[...]`` lookups.
    """

    attr: str  # "self.dropout"
    layer: Layer
    conditional: bool = False
    container: str | None = None
    span: Span | None = None
    # ACT2FN[...]/get_activation(...) key as written (``'gelu'``, ``config.hidden_act``).
    activation: str | None = None
    # the type comes from the trace (the class of the submodule at run time), not the source
    runtime: bool = False
    # an element of an ``nn.Sequential`` built in another file (a helper of another module or an
    # installed package, read, never imported): its pairs are matched where this file calls it
    built_elsewhere: bool = False


@dataclass(frozen=True)
class PathStructure:
    """One control-flow path of a composition function, inlined inter-procedurally."""

    nodes: tuple[Node, ...]


@dataclass(frozen=True)
class FunctionStructures:
    """All paths of one entry function (``forward`` of a class, or a module-level function)."""

    class_name: str | None
    function: str  # "forward", or the module-level function's name
    paths: tuple[PathStructure, ...]
    span: Span | None = None
    # True when the path count hit the extractor's cap and further paths were dropped.
    capped: bool = False
    # Data flow that involves no DL node: each key Var is a plain copy (``a = b``, an inlined
    # function's returned value bound by the caller) or a join ("phi": the value after an
    # ``if`` whose branches assigned different versions without any DL node) of the listed
    # Vars. A matcher may follow it to connect ``key_layer#1`` to ``key_layer#3`` across
    # ``if past_key_values is not None: key_layer = cache.update(...)``.
    sources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ClassInfo:
    name: str
    bases: tuple[str, ...]  # resolved fully qualified base names where known
    is_module: bool  # an nn.Module subclass (directly or through bases in this file)
    init_bindings: tuple[InitBinding, ...]
    span: Span | None = None
    # Every attribute read anywhere in the class outside __init__ (``self.dropout``),
    # with the lines reading it: the rewriter keeps init statements that are still used.
    attr_uses: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class SequentialEntry:
    """One entry of an ``nn.Sequential`` where it is built: the candidate layer types of the
    expression (``()`` when unknown), its constructor args and its position in the source."""

    types: tuple[str, ...]
    args: tuple = ()
    span: Span | None = None
    # stands for any number of children (appended in a loop, a comprehension, ``*unknown``)
    many: bool = False


@dataclass(frozen=True)
class SequentialBuild:
    """An ``nn.Sequential(...)`` construction (inline, ``*layers``, an ``OrderedDict``), in
    ``__init__``, a method or a factory function: consecutive entries run one after the other,
    so a pair of them is a match *where the Sequential is built* (once, whoever calls it)."""

    class_name: str | None
    function: str  # qualified name of the function building it ("ResNet._make_layer", "conv_bn")
    span: Span  # the ``nn.Sequential(...)`` call
    callee: tuple[int, int, int, int]  # (line, col, end_line, end_col) of ``nn.Sequential`` (bytes)
    entries: tuple[SequentialEntry, ...]


@dataclass(frozen=True)
class FileStructures:
    """Everything extracted from one file."""

    file: str
    classes: tuple[ClassInfo, ...]
    functions: tuple[FunctionStructures, ...]  # entry functions: each class's forward + module-level fns
    imports: dict[str, str] = field(default_factory=dict)  # local name -> fully qualified name
    sequentials: tuple[SequentialBuild, ...] = ()
    # layer classes of other files (read, never imported) that derive from a torch layer: type ->
    # (that torch layer, None when the class only fixes ``__init__``, or the submodules a norm+act
    # class's forward applies after its batch norm: ``("drop", "act")``)
    foreign_layers: dict = field(default_factory=dict)


# ---------------------------------------------------------------- matching

# Precision classes (issue 11): a match the pattern fits but whose kernel is not provably
# applicable is reported ``conditional`` (a configuration decides; a trace settles it) or
# ``refused`` (a precondition of the kernel fails), never as a plain match. Code -> what it means.
PRECISION_CODES = {
    "logits-transformed": "the logits are changed between the LM head and the loss (soft-capping, scaling): the "
                          "fused loss takes the head's output as the logits",
    "logits-read": "the logits are read beside the loss (other than being returned): the fused loss never "
                   "computes them",
    "needs-config": "the layer (an activation looked up from a key, a module bound on some branches only) is "
                    "the one the kernel computes only under some configurations",
    "dim-not-last": "the normalised dimension is not provably the last one (the kernel normalises rows)",
    "not-a-layernorm": "the norm is looked up (dict, factory) and is not provably an nn.LayerNorm",
    "branch-straddle": "the matched statements lie under different branches (or a loop) and the rewrite "
                       "cannot bring them into one block",
    "torchscript": "the code is compiled by torch.jit.script, which cannot call the Python kernel",
    "method-divergence": "another method of the class computes the same chain of layers without the rewrite (it "
                         "reads the value between them, say): rewriting one method alone would make the class "
                         "answer two ways",
    "norm-variant": "the code normalizes like the kernel but computes a variant it does not (eps outside the "
                    "square root, a bias, no float32 upcast, other casts, more than the norm)",
    "probs-read": "the attention scores or probabilities are read besides the output product (returned as "
                  "attention weights, stored): SDPA never computes them",
    "probs-dtype": "the attention probabilities are computed in another dtype than the scores' (a cast or dtype= "
                     "around it): another math than SDPA's",
}

# "rejected" (tracing): the sequence executes but a runtime-only precondition fails (the
# activation behind ACT2FN[...] is not a GeLU, q/k/v projections differ in in_features...).
# "conditional" (static): the pattern fits and the kernel applies only under a configuration the
# source does not settle (``Match.condition`` says which); a trace settles it (confirmed or
# rejected). "refused" (static): the pattern fits but a precision precondition fails — the kernel
# is not provably applicable (``Match.code`` names the class, ``reason`` says why). Only
# ``static`` and ``confirmed`` matches are predictions; only ``confirmed`` ones (``static`` ones
# for ``adopter rewrite``) are ever rewritten. A trace names the cause of an ``untraced``,
# ``not-executed`` or ``rejected`` status in ``Match.trace_code``.
MatchStatus = Literal[
    "static", "confirmed", "not-executed", "untraced", "runtime-only", "rejected", "conditional", "refused"
]


@dataclass(frozen=True)
class MatchedNode:
    """A pattern node paired with the concrete node it matched."""

    pattern_index: int
    node: Node


@dataclass(frozen=True)
class Match:
    """One place where a rule applies.

    ``bindings`` maps abstract variables of the forward pattern (``$x``) to concrete
    values; ``init_bindings`` maps the init pattern's abstract variables; ``init_nodes``
    are the matched ``__init__`` bindings (what the rewriter deletes/replaces).
    """

    rule: str
    file: str
    class_name: str | None
    function: str
    nodes: tuple[MatchedNode, ...]
    bindings: dict[str, Value] = field(default_factory=dict)
    init_nodes: tuple[InitBinding, ...] = ()
    init_bindings: dict[str, Value] = field(default_factory=dict)
    status: MatchStatus = "static"
    reason: str = ""
    # The rule variant whose patterns matched (when the matcher records it): the generic
    # codemod synthesizes the rewrite from its target patterns.
    variant: RuleText | None = field(default=None, compare=False, repr=False)
    # Set for a pair of ``nn.Sequential`` entries: the ``nn.Sequential(...)`` call building them
    # (the nodes are the entry expressions; ``function`` is the building function).
    sequential: Span | None = None
    # Precision class (see :data:`adopter.core.match.PRECISION_CODES`): why a match is
    # ``conditional`` or ``refused`` (``needs-config``, ``dim-not-last``...); kept after a trace
    # settles a conditional match.
    code: str = ""
    # What a ``conditional`` match needs to hold ("GeLU only if config.hidden_act in {...}").
    condition: str = ""
    # Why a trace gave the match its status, where the status has several causes (``not-in-model``,
    # ``lines-not-run``...: a key of :data:`adopter.tracing.trace_codes.TRACE_CODES`).
    trace_code: str = ""
    # What the rule's analysis found at this site (a rule's own frozen dataclass), set by a
    # precondition (``MatchContext.keep_site``) for the rule's codemod, which then need not
    # analyse the site again. Positions and names only, no syntax-tree node: the codemod reads
    # its own parse of the text, and matches travel between processes.
    site: object | None = field(default=None, compare=False, repr=False)

    @property
    def lines(self) -> list[int]:
        return [mn.node.span.line for mn in self.nodes if mn.node.span is not None]

    def key(self) -> tuple:
        """Identity for de-duplication across paths: same rule on the same expressions.

        Positions include columns: two calls on one line (``softmax(a, 1) * softmax(a, 2)``)
        are two matches."""
        positions = tuple(
            (mn.node.span.line, mn.node.span.col) for mn in self.nodes if mn.node.span is not None
        )
        return (self.rule, self.file, self.class_name, positions)

    def to_json(self) -> dict:
        return {
            "rule": self.rule,
            "file": self.file,
            "class": self.class_name,
            "function": self.function,
            "lines": self.lines,
            "status": self.status,
            **({"built_in": f"nn.Sequential at line {self.sequential.line}"} if self.sequential else {}),
            **({"reason": self.reason} if self.reason else {}),
            **({"code": self.code} if self.code else {}),
            **({"condition": self.condition} if self.condition else {}),
            **({"trace_code": self.trace_code} if self.trace_code else {}),
        }
