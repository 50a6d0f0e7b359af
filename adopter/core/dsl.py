"""The model-structure DSL (paper Fig. 2) as plain typed objects.

A *model structure* is a sequence of nodes. A node is either a DL layer call
``type(inputs) -> output`` or a tensor op ``a + b -> c`` / ``- a -> c``.
Patterns use the same objects, with abstract variables (``$name``) and the
wildcard node ``*``.

Text form (parsed by :mod:`adopter.core.dsl_text`)::

    torch.nn.Dropout@self.dropout(hidden_states#1) -> hidden_states#2;
    hidden_states#2 + input_tensor -> tmp_1;
    torch.nn.LayerNorm@self.LayerNorm(tmp_1) -> hidden_states#3

Extensions over the paper, each needed for precision:

* ``name#k`` — SSA version of a variable. The extractor gives every assignment
  a new version, so a match on ``$x`` binding ``hidden_states#2`` really is
  data flow, not a reused name.
* ``@module`` — the module object through which a layer was called
  (``self.dropout``); in patterns ``@$d`` binds it so the init pattern can be
  matched against the exact ``__init__`` binding of that attribute.
* ``a|b`` in a pattern's layer type — alternatives (``torch.softmax|torch.nn.functional.softmax``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Union


def _fast_frozen_init(cls):
    """Give a frozen dataclass an ``__init__`` that fills the instance dict in one call.

    The generated one sets each field through ``object.__setattr__``; extraction builds
    millions of these nodes, spans and variables, and that was a few percent of a scan.
    Everything else (eq, hash, repr, frozen assignment) stays the dataclass's own."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    namespace: dict = {}
    params = []
    for f in fields:
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: default_factory is not supported here")
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    items = ", ".join(f"{f.name!r}: {f.name}" for f in fields)
    exec(f"def __init__(self, {', '.join(params)}):\n    self.__dict__.update({{{items}}})\n", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls


@_fast_frozen_init
@dataclass(frozen=True)
class Span:
    """Exact source position of a node: ast conventions (1-based lines, 0-based columns).

    ``function`` is the qualified name of the function whose body holds the code
    (``BertSelfOutput.forward``, ``eager_attention_forward``) — with inter-procedural
    extraction one structure mixes nodes from several functions.
    ``stmt_line``/``stmt_end_line`` delimit the enclosing *statement*, which is what
    the rewriter deletes or replaces.
    """

    line: int
    col: int
    end_line: int
    end_col: int
    function: str = ""
    stmt_line: int = 0
    stmt_end_line: int = 0
    # Lines of the call expressions through which this node was inlined (outermost
    # first); empty for a node written directly in the entry function.
    inlined_at: tuple[int, ...] = ()


@_fast_frozen_init
@dataclass(frozen=True)
class Var:
    """A variable: concrete (``hidden_states``, ``self.dense``, ``tmp_1``) or abstract (``$x``).

    ``version`` is the SSA version (0 = the value on entry / never reassigned);
    patterns leave it at 0 and ignore it.
    """

    name: str
    version: int = 0

    @property
    def is_abstract(self) -> bool:
        return self.name.startswith("$")

    def __str__(self) -> str:
        return f"{self.name}#{self.version}" if self.version else self.name


@_fast_frozen_init
@dataclass(frozen=True)
class Const:
    """A constant or any expression we keep verbatim: ``-1``, ``0.1``, ``'gelu'``,
    ``config.hidden_size * 3``. ``text`` is normalized source text (``ast.unparse``)."""

    text: str

    def __str__(self) -> str:
        return self.text


Value = Union[Var, Const]


@_fast_frozen_init
@dataclass(frozen=True)
class Arg:
    """One input of a node; ``keyword`` is set for ``name=value`` arguments."""

    value: Value
    keyword: str | None = None

    def __str__(self) -> str:
        return f"{self.keyword}={self.value}" if self.keyword else str(self.value)


@_fast_frozen_init
@dataclass(frozen=True)
class Layer:
    """``type(args) -> output``.

    ``type`` is the fully qualified name (``torch.nn.LayerNorm``,
    ``torch.nn.functional.softmax``, ``torch.Tensor.view`` for tensor methods).
    ``module`` is the object the layer was called through (``self.LayerNorm``), or
    None for functions. ``bound`` is set when the call went through a ``functools.partial``
    (``self.attn_fn(x)`` of ``self.attn_fn = partial(F.softmax, dim=-1)``): the position of
    the function the partial binds (``F.softmax`` there), where a rewrite changes it; the
    partial's bound arguments are in ``args``. Not compared, like ``span`` (one call site
    resolves through one partial: an attribute assigned two holds none), which keeps the hash
    of the millions of nodes a scan builds what it was.
    """

    type: str
    args: tuple[Arg, ...] = ()
    output: Var | None = None
    module: Var | None = None
    span: Span | None = field(default=None, compare=False)
    bound: Span | None = field(default=None, compare=False)


@_fast_frozen_init
@dataclass(frozen=True)
class TensorOp:
    """``a op b -> c`` (binary) or ``op a -> c`` (unary). ``op`` is the Python operator
    symbol: ``+ - * / // % ** @`` or unary ``-``/``~``."""

    op: str
    args: tuple[Arg, ...] = ()
    output: Var | None = None
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Wildcard:
    """``*`` in a pattern: any one node."""


Node = Union[Layer, TensorOp, Wildcard]


@dataclass(frozen=True)
class Pattern:
    nodes: tuple[Node, ...]


@dataclass(frozen=True)
class RulePart:
    """One rule item ``source => target`` (paper §3.3); ``target`` is None for a rule whose
    codemod is written in Python."""

    source: Pattern
    target: Pattern | None


@dataclass(frozen=True)
class RuleText:
    """A transformation rule's DSL: an init part R_i and a forward (composition) part R_c."""

    name: str
    init: RulePart | None
    forward: RulePart
