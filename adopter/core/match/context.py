"""What rule preconditions see: :class:`MatchContext` and the data-flow helpers over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from adopter.core.dsl import Layer, Node, RuleText, Value, Var
from adopter.core.match.core import same_value
from adopter.core.structures import (
    PRECISION_CODES,
    ClassInfo,
    FileStructures,
    FunctionStructures,
    InitBinding,
    Match,
    PathStructure,
)


class Refusal(str):
    """A precondition failure of a precision class: the match is reported ``refused`` with
    ``code`` (a key of :data:`PRECISION_CODES`) and this text as its reason, instead of being
    dropped silently as a failure of a plain (returned ``str``) precondition is."""

    code: str

    def __new__(cls, code: str, reason: str) -> Refusal:
        if code not in PRECISION_CODES:
            raise ValueError(f"unknown precision code {code!r}")
        out = super().__new__(cls, reason)
        out.code = code
        return out


class NotACandidate(str):
    """A precondition failure that says the rule's (deliberately loose) pattern fits a site the
    rule is not about at all — every ``nn.Linear`` fits an LM-head pattern, every ``a*b + c*d`` a
    rotary one: the match is dropped without being listed among the rejected matches, which
    report sites that look like the rule's and are not."""


class RuleLike(Protocol):
    name: str
    variants: tuple[RuleText, ...]
    preconditions: tuple[Callable[[MatchContext], str | None], ...]
    dedup: str  # "lines" or "class"


class MatchContext:
    """Everything a precondition may look at.

    What a precondition reads of the path (``path``, ``node_indices``, ``path_cache``, and so
    ``producers``/``readers``/``uses_outside``) is recorded in ``read_path``: a verdict reached
    without reading the path holds on every path through the same matched nodes, and the driver
    asks it once per function (``match.driver``)."""

    def __init__(self, match: Match, structures: FileStructures, function: FunctionStructures,
                 path: PathStructure, cls: ClassInfo | None, init_bindings: tuple[InitBinding, ...],
                 node_indices: tuple[int, ...], variant: RuleText | None = None,
                 extra: dict[str, Any] | None = None, path_cache: dict[str, Any] | None = None,
                 source: str | None = None, file_cache: dict[Any, Any] | None = None):
        self.match = match
        self.structures = structures
        self.function = function
        self._path = path
        self.cls = cls
        self.init_bindings = init_bindings
        self._node_indices = node_indices  # positions in path.nodes of the matched nodes
        self.variant = variant
        self.extra: dict[str, Any] = {} if extra is None else extra
        # shared by every match on the same path (e.g. the path's producer map)
        self._path_cache: dict[str, Any] = {} if path_cache is None else path_cache
        # the file's source text when the caller has it (source-level checks)
        self.source = source
        # shared by every match of the file, every rule, in one matching run (``match_structures``):
        # a rule's analysis of a site, which its precondition is asked again on every path through
        # the site (keys start with the rule's name)
        self.file_cache: dict[Any, Any] = {} if file_cache is None else file_cache
        self.read_path = False
        self.producer_reads: dict[tuple[str, int], Node | None] = {}

    @property
    def path(self) -> PathStructure:
        self.read_path = True
        return self._path

    @property
    def node_indices(self) -> tuple[int, ...]:
        self.read_path = True
        return self._node_indices

    @property
    def path_cache(self) -> dict[str, Any]:
        self.read_path = True
        return self._path_cache

    def producers(self) -> Producers:
        """(name, version) -> the node of the path whose output it is. The values looked up are
        recorded (``producer_reads``): a verdict that read the path only through them holds on
        another path whose producers of the same values are equal nodes."""
        return Producers(producers_of(self._path, self._path_cache), self)

    def readers(self) -> dict[tuple[str, int], list[int]]:
        """(name, version) -> positions of the path's nodes that read it."""
        rd = self.path_cache.get("readers")
        if rd is None:
            rd = {}
            for i, n in enumerate(self.path.nodes):
                for v in _arg_vars(n):
                    rd.setdefault((v.name, v.version), []).append(i)
            self.path_cache["readers"] = rd
        return rd

    def conditional(self, code: str, condition: str) -> None:
        """Mark the match ``conditional``: it holds only if ``condition`` (a precondition that
        calls this returns None: the match is kept, for a trace to settle)."""
        if code not in PRECISION_CODES:
            raise ValueError(f"unknown precision code {code!r}")
        self.extra.setdefault("conditional", (code, condition))

    def keep_site(self, site: Any) -> None:
        """Hand what the rule's analysis found at this match to its codemod: the match is kept with
        ``Match.site`` set (read back with :func:`site_of`)."""
        self.extra["site"] = site

    def binding(self, name: str) -> Value | None:
        return self.match.bindings.get(name)

    def init_binding_for(self, attr: Value | None) -> InitBinding | None:
        """The ``__init__`` binding of ``self.<attr>`` (the last one when several)."""
        if not isinstance(attr, Var):
            return None
        found = None
        for ib in self.init_bindings:
            if ib.attr == attr.name:
                found = ib
        return found


def producers_of(path: PathStructure, path_cache: dict[str, Any]) -> dict[tuple[str, int], Node]:
    """(name, version) -> the node of ``path`` whose output it is (kept in ``path_cache``)."""
    prod = path_cache.get("producers")
    if prod is None:
        prod = {}
        for n in path.nodes:
            out = getattr(n, "output", None)
            if isinstance(out, Var):
                prod.setdefault((out.name, out.version), n)
        path_cache["producers"] = prod
    return prod


class Producers:
    """A path's producer map as a precondition reads it: lookups by key are recorded on the
    context (``MatchContext.producer_reads``); anything that reads the whole map (iterating it)
    counts as reading the path."""

    __slots__ = ("_map", "_ctx")

    def __init__(self, mapping: dict[tuple[str, int], Node], ctx: MatchContext):
        self._map = mapping
        self._ctx = ctx

    def _read(self, key: object) -> Node | None:
        found = self._map.get(key)  # type: ignore[call-overload]
        self._ctx.producer_reads[key] = found  # type: ignore[index]
        return found

    def _whole(self) -> dict[tuple[str, int], Node]:
        self._ctx.read_path = True
        return self._map

    def get(self, key: tuple[str, int], default: Any = None) -> Any:
        found = self._read(key)
        return default if found is None else found

    def __getitem__(self, key: tuple[str, int]) -> Node:
        found = self._read(key)
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key: object) -> bool:
        return self._read(key) is not None

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())

    def items(self):
        return self._whole().items()

    def keys(self):
        return self._whole().keys()

    def values(self):
        return self._whole().values()


# ---------------------------------------------------------------- data-flow helpers


def _arg_vars(n: Node) -> Iterator[Var]:
    for a in getattr(n, "args", ()):
        if isinstance(a.value, Var):
            yield a.value
    mod = getattr(n, "module", None)
    if isinstance(mod, Var):
        yield mod


def reads(n: Node, v: Value) -> bool:
    """Whether node ``n`` reads value ``v`` (as an argument or the module it calls)."""
    if not isinstance(v, Var):
        return False
    return any(same_value(a, v) for a in _arg_vars(n))


# Tensor methods whose second argument only contributes its shape/dtype.
_METADATA_ARG_METHODS = {"torch.Tensor.reshape_as", "torch.Tensor.view_as", "torch.Tensor.expand_as",
                         "torch.Tensor.type_as"}


def _reads_data(n: Node, v: Var) -> bool:
    if isinstance(n, Layer) and n.type in _METADATA_ARG_METHODS:
        args = [a.value for a in n.args if isinstance(a.value, Var)]
        return bool(args) and same_value(args[0], v)
    return True


def uses_outside(ctx: MatchContext, v: Value) -> list[Node]:
    """Nodes of the matched path, other than the matched ones, that read the data of ``v``
    (``y.reshape_as(v)`` reads only its shape and does not count)."""
    if not isinstance(v, Var):
        return []
    inside = set(ctx.node_indices)
    if v.name.startswith("self.") or v.version == 0:
        positions = [i for (name, _), lst in ctx.readers().items() if name == v.name for i in lst]
    else:
        positions = ctx.readers().get((v.name, v.version), [])
    nodes = ctx.path.nodes
    return [nodes[i] for i in sorted(set(positions)) if i not in inside and _reads_data(nodes[i], v)]


def run_preconditions(preconditions, ctx: MatchContext) -> str | None:
    """The first failure of ``preconditions`` on ``ctx`` (a :class:`Refusal` for a precision
    class), or None; a passing precondition may have marked the match conditional
    (:meth:`MatchContext.conditional`, read back with :func:`conditional_of`)."""
    for pre in preconditions:
        reason = pre(ctx)
        if reason:
            return reason
    return None


def conditional_of(ctx: MatchContext) -> tuple[str, str] | None:
    """``(code, condition)`` when a precondition marked the match conditional."""
    return ctx.extra.get("conditional")


def site_of(ctx: MatchContext) -> Any:
    """What a precondition kept for the codemod (:meth:`MatchContext.keep_site`), or None."""
    return ctx.extra.get("site")
