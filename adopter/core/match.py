"""Pattern matching (paper §3.4): rule patterns against extracted model structures.

For every entry function and every one of its control-flow paths, the forward
source pattern of each rule variant is matched as a *sub-sequence*: pattern nodes
must match path nodes in order, other path nodes may sit between them. Abstract
variables (``$x``) are bound consistently across the pattern — a variable binds to
a concrete :class:`Var` (name *and* SSA version) or to a :class:`Const` (its text) —
so only data-connected nodes match. Then the init pattern is matched, in any order,
against the ``__init__`` bindings of the class (and of its bases in the same file),
sharing the bindings made by the forward pattern (``@$drop`` links the called module
to its ``self.dropout = nn.Dropout(...)``). Finally the rule's preconditions run;
each returns a reason string when the match must be dropped.

Node matching details (all documented because rules depend on them):

* Layer types: the pattern type is ``a|b|...``; the concrete FQN must equal one of them.
* Arguments: for layer types with a known signature (:data:`SIGNATURES`: constructor
  signatures for ``torch.nn`` classes, applied to calls that are not made through a
  module, i.e. constructions in ``__init__`` and function calls) positional and
  keyword arguments are normalized to parameter names on both sides, so
  ``nn.Dropout(0.1)`` and ``nn.Dropout(p=0.1)`` are the same. A positional pattern
  argument is required; a keyword pattern argument that the concrete call does not
  pass is simply left unbound (the default applies). Extra concrete arguments are ignored.
* Tensor ops: same operator and arity; ``+`` and ``*`` are commutative (both argument
  orders are tried).
* Variables in patterns that are not abstract (``self.training``) match a concrete
  variable of that name (any version) or a constant with that text; constants match
  constants with the same value (``'gelu'`` == ``"gelu"``).
* ``self.<attr>`` variables compare by name only (attributes carry no SSA version).
* Same-file subclasses (rules with ``match_subclasses``): a layer type defined in the scanned
  file as a subclass of a ``torch.nn`` layer that defines no method but ``__init__`` (forward
  inherited) matches a pattern naming the parent (:func:`layer_subclass_aliases`); the
  arguments of its construction are not matched (its constructor has its own signature).
* Rule hooks over the scanned file: ``Rule.layer_aliases`` names more same-file layer classes
  that match as a torch layer (biased_GeLU: modules whose forward is a GeLU), and
  ``Rule.inlined_functions`` same-file functions whose inlined body the rule sees as one call
  (:func:`fold_inlined_calls`: ESM's ``gelu(x)`` as ``torch.nn.functional.gelu``).

Results are de-duplicated with :meth:`Match.key` after re-homing: a match whose nodes all
lie in one function other than the entry (a helper inlined into several ``forward``s,
e.g. ``eager_attention_forward``) is reported once, under that function. When the same
statements match on several paths and preconditions add different nodes on each (attention
projections: GPT-2's ``self.q_attn`` on the cross-attention path, ``self.c_attn`` on the
self-attention one), the variant reported is the best by :func:`variant_rank`: the one that
runs in every configuration of the class and without optional inputs.
"""

from __future__ import annotations

import ast
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from adopter.core.dsl import Arg, Const, Layer, Node, Pattern, RuleText, Span, TensorOp, Value, Var, Wildcard
from adopter.core.structures import (
    ClassInfo,
    FileStructures,
    FunctionStructures,
    InitBinding,
    Match,
    MatchedNode,
    PathStructure,
)

__all__ = [
    "SIGNATURES",
    "MatchContext",
    "RuleLike",
    "class_init_bindings",
    "fold_inlined_calls",
    "layer_subclass_aliases",
    "match_init",
    "match_pattern",
    "match_structures",
    "optional_inputs",
    "optional_module_attrs",
    "reads",
    "uses_outside",
    "variant_rank",
]

# Parameter names of layer constructors / functions whose arguments rules bind.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "torch.nn.Dropout": ("p", "inplace"),
    "torch.nn.LayerNorm": ("normalized_shape", "eps", "elementwise_affine", "bias"),
    "torch.nn.Linear": ("in_features", "out_features", "bias"),
    "torch.nn.Conv2d": (
        "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
        "padding_mode",
    ),
    "torch.nn.BatchNorm1d": ("num_features", "eps", "momentum", "affine", "track_running_stats"),
    "torch.nn.BatchNorm2d": ("num_features", "eps", "momentum", "affine", "track_running_stats"),
    "torch.nn.GELU": ("approximate",),
    "torch.nn.Softmax": ("dim",),
    "torch.nn.functional.softmax": ("input", "dim", "_stacklevel", "dtype"),
    "torch.softmax": ("input", "dim", "dtype"),
    "torch.Tensor.softmax": ("self", "dim", "dtype"),
    "torch.nn.functional.dropout": ("input", "p", "training", "inplace"),
    "torch.nn.functional.gelu": ("input", "approximate"),
    "torch.matmul": ("input", "other"),
    "torch.Tensor.matmul": ("self", "other"),
    "torch.bmm": ("input", "mat2"),
    "torch.Tensor.transpose": ("self", "dim0", "dim1"),
}

Bindings = dict  # str -> Value


class RuleLike(Protocol):
    name: str
    variants: tuple[RuleText, ...]
    preconditions: tuple[Callable[[MatchContext], str | None], ...]
    dedup: str  # "lines" or "class"


@dataclass
class MatchContext:
    """Everything a precondition may look at."""

    match: Match
    structures: FileStructures
    function: FunctionStructures
    path: PathStructure
    cls: ClassInfo | None
    init_bindings: tuple[InitBinding, ...]
    node_indices: tuple[int, ...]  # positions in path.nodes of the matched nodes
    variant: RuleText | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # shared by every match on the same path (e.g. the path's producer map)
    path_cache: dict[str, Any] = field(default_factory=dict)
    # the file's source text when the caller has it (source-level checks)
    source: str | None = None

    def producers(self) -> dict[tuple[str, int], Node]:
        """(name, version) -> the node of the path whose output it is."""
        prod = self.path_cache.get("producers")
        if prod is None:
            prod = {}
            for n in self.path.nodes:
                out = getattr(n, "output", None)
                if isinstance(out, Var):
                    prod.setdefault((out.name, out.version), n)
            self.path_cache["producers"] = prod
        return prod

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


# ---------------------------------------------------------------- values


def _const_key(text: str) -> Any:
    try:
        return ("lit", repr(ast.literal_eval(text)))
    except Exception:
        return ("text", text.replace(" ", ""))


def same_value(a: Value, b: Value) -> bool:
    if isinstance(a, Var) and isinstance(b, Var):
        if a.name != b.name:
            return False
        if a.name.startswith("self.") or a.version == 0 and b.version == 0:
            return True
        return a.version == b.version
    if isinstance(a, Const) and isinstance(b, Const):
        return a.text == b.text or _const_key(a.text) == _const_key(b.text)
    return False


def _bind(pv: Value, cv: Value | None, b: Bindings) -> Bindings | None:
    if cv is None:
        return None
    if isinstance(pv, Var):
        if pv.name[:1] == "$":  # pv.is_abstract, without the property call (hot path)
            bound = b.get(pv.name)
            if bound is None:
                nb = dict(b)
                nb[pv.name] = cv
                return nb
            return b if same_value(bound, cv) else None
        if isinstance(cv, Var):
            return b if cv.name == pv.name and (pv.version == 0 or pv.version == cv.version) else None
        return b if cv.text == pv.name else None
    # pattern constant
    if isinstance(cv, Const):
        return b if same_value(pv, cv) else None
    return None


# ---------------------------------------------------------------- nodes


def _normalize_args(type_: str, args: Sequence[Arg]) -> tuple[list[Value], dict[str, Value], set[str]]:
    """(positional beyond the signature, keyword -> value, keywords that came from positions)."""
    sig = SIGNATURES.get(type_)
    positional: list[Value] = []
    keywords: dict[str, Value] = {}
    from_pos: set[str] = set()
    i = 0
    for a in args:
        if a.keyword is not None:
            keywords[a.keyword] = a.value
            continue
        if sig is not None and i < len(sig):
            keywords[sig[i]] = a.value
            from_pos.add(sig[i])
        else:
            positional.append(a.value)
        i += 1
    return positional, keywords, from_pos


def _match_args(p_args: Sequence[Arg], c_args: Sequence[Arg], c_type: str, b: Bindings) -> Bindings | None:
    """``c_type`` selects the signature: a constructor's for a layer constructed in ``__init__``
    or called as a function, none (positions as written) for a call through a module."""
    p_pos, p_kw, p_req = _normalize_args(c_type, p_args)
    c_pos, c_kw, _ = _normalize_args(c_type, c_args)
    if len(p_pos) > len(c_pos):
        return None
    for pv, cv in zip(p_pos, c_pos):
        b = _bind(pv, cv, b)
        if b is None:
            return None
    for kw, pv in p_kw.items():
        cv = c_kw.get(kw)
        if cv is None:
            if kw in p_req:
                return None
            continue  # optional keyword: default applies
        b = _bind(pv, cv, b)
        if b is None:
            return None
    return b


def _type_alternatives(t: str) -> tuple[str, ...]:
    return tuple(t.split("|"))


_COMMUTATIVE = {"+", "*"}


def match_node(pn: Node, cn: Node, b: Bindings, aliases: dict[str, str] | None = None) -> Bindings | None:
    """Bindings extended so that pattern node ``pn`` matches concrete node ``cn``, or None.
    ``aliases`` maps same-file layer subclasses to the ``torch.nn`` type they behave as."""
    if isinstance(pn, Wildcard):
        return b
    if isinstance(pn, Layer):
        if not isinstance(cn, Layer):
            return None
        alternatives = _type_alternatives(pn.type)
        aliased = False
        if cn.type not in alternatives:
            if not aliases or aliases.get(cn.type) not in alternatives:
                return None
            aliased = True
        if pn.module is not None:
            b = _bind(pn.module, cn.module, b)
            if b is None:
                return None
        if not (aliased and cn.module is None):
            # a subclass's construction has its own signature: its arguments are not compared
            b = _match_args(pn.args, cn.args, cn.type if cn.module is None else "", b)
        if b is None:
            return None
        if pn.output is not None:
            b = _bind(pn.output, cn.output, b)
        return b
    if isinstance(pn, TensorOp):
        if not isinstance(cn, TensorOp) or cn.op != pn.op or len(cn.args) != len(pn.args):
            return None
        orders = [cn.args]
        if pn.op in _COMMUTATIVE and len(cn.args) == 2:
            orders.append((cn.args[1], cn.args[0]))
        for c_args in orders:
            nb: Bindings | None = b
            for pa, ca in zip(pn.args, c_args):
                nb = _bind(pa.value, ca.value, nb)
                if nb is None:
                    break
            if nb is not None and pn.output is not None:
                nb = _bind(pn.output, cn.output, nb)
            if nb is not None:
                return nb
        return None
    return None


def _node_key(n: Node) -> str | None:
    if isinstance(n, Layer):
        return "L:" + n.type
    if isinstance(n, TensorOp):
        return "T:" + n.op
    return None


_PATTERN_KEYS: dict[int, tuple[Node, tuple[str, ...] | None]] = {}


def _pattern_keys(pn: Node) -> tuple[str, ...] | None:
    hit = _PATTERN_KEYS.get(id(pn))
    if hit is not None and hit[0] is pn:
        return hit[1]
    keys = _compute_pattern_keys(pn)
    _PATTERN_KEYS[id(pn)] = (pn, keys)
    return keys


def _compute_pattern_keys(pn: Node) -> tuple[str, ...] | None:
    if isinstance(pn, Layer):
        return tuple("L:" + t for t in _type_alternatives(pn.type))
    if isinstance(pn, TensorOp):
        return ("T:" + pn.op,)
    return None  # wildcard


class _PathIndex:
    """Positions of the nodes of one path by type, for fast candidate lookup."""

    def __init__(self, nodes: Sequence[Node], key_cache: dict | None = None, aliases: dict[str, str] | None = None):
        self.nodes = nodes
        self.aliases = aliases or None
        by_key: dict[str, list[int]] = {}
        cache = key_cache if key_cache is not None else {}
        for i, n in enumerate(nodes):
            nid = id(n)
            k = cache.get(nid, 0)
            if k == 0:
                k = cache[nid] = _node_key(n)
            if aliases and isinstance(n, Layer) and n.type in aliases:
                k = "L:" + aliases[n.type]
            if k is not None:
                lst = by_key.get(k)
                if lst is None:
                    by_key[k] = [i]
                else:
                    lst.append(i)
        self.by_key = by_key

    def candidates(self, pn: Node, start: int) -> Iterable[int]:
        keys = _pattern_keys(pn)
        if keys is None:
            return range(start, len(self.nodes))
        if len(keys) == 1:
            lst = self.by_key.get(keys[0], ())
            return lst[bisect_left(lst, start):] if lst else ()
        merged: list[int] = []
        for k in keys:
            lst = self.by_key.get(k)
            if lst:
                merged.extend(lst[bisect_left(lst, start):])
        merged.sort()
        return merged

    def has_all(self, pattern: Pattern) -> bool:
        by_key = self.by_key
        for pn in pattern.nodes:
            keys = _pattern_keys(pn)
            if keys is None:
                continue
            for k in keys:
                if k in by_key:
                    break
            else:
                return False
        return True


MAX_MATCHES_PER_PATH = 200


def _search(pattern: Pattern, index: _PathIndex, b: Bindings) -> Iterator[tuple[tuple[int, ...], Bindings]]:
    pnodes = pattern.nodes
    n_p = len(pnodes)

    def rec(pi: int, start: int, b: Bindings, acc: tuple[int, ...]):
        if pi == n_p:
            yield acc, b
            return
        pn = pnodes[pi]
        for ni in index.candidates(pn, start):
            nb = match_node(pn, index.nodes[ni], b, index.aliases)
            if nb is not None:
                yield from rec(pi + 1, ni + 1, nb, acc + (ni,))

    for count, result in enumerate(rec(0, 0, b, ()), start=1):
        yield result
        if count >= MAX_MATCHES_PER_PATH:
            return


def match_pattern(
    pattern: Pattern, nodes: Sequence[Node], bindings: Bindings | None = None
) -> list[tuple[tuple[int, ...], Bindings]]:
    """All sub-sequence matches of ``pattern`` in ``nodes``: (node positions, bindings)."""
    index = _PathIndex(nodes)
    if not index.has_all(pattern):
        return []
    return list(_search(pattern, index, dict(bindings or {})))


# ---------------------------------------------------------------- init


def class_init_bindings(structures: FileStructures, cls: ClassInfo | None) -> tuple[InitBinding, ...]:
    """``__init__`` bindings of ``cls`` followed by those of its bases defined in the same file
    (a subclass that does not rebind an attribute inherits the base's binding)."""
    if cls is None:
        return ()
    by_name = {c.name: c for c in structures.classes}
    out: list[InitBinding] = []
    seen_attrs: set[str] = set()
    seen_classes: set[str] = set()
    todo = [cls]
    while todo:
        c = todo.pop(0)
        if c.name in seen_classes:
            continue
        seen_classes.add(c.name)
        attrs_here = set()
        for ib in c.init_bindings:
            if ib.attr not in seen_attrs:
                out.append(ib)
                attrs_here.add(ib.attr)
        seen_attrs |= attrs_here
        for base in c.bases:
            short = base.rsplit(".", 1)[-1]
            if short in by_name:
                todo.append(by_name[short])
    return tuple(out)


def match_init(
    pattern: Pattern, bindings_list: Sequence[InitBinding], b: Bindings, aliases: dict[str, str] | None = None
) -> tuple[tuple[InitBinding, ...], Bindings] | None:
    """Match every init pattern node against a distinct ``__init__`` binding (any order)."""
    pnodes = pattern.nodes

    def rec(pi: int, used: tuple[int, ...], b: Bindings):
        if pi == len(pnodes):
            return used, b
        pn = pnodes[pi]
        for j, ib in enumerate(bindings_list):
            if j in used:
                continue
            nb = match_node(pn, ib.layer, b, aliases)
            if nb is not None:
                r = rec(pi + 1, used + (j,), nb)
                if r is not None:
                    return r
        return None

    r = rec(0, (), b)
    if r is None:
        return None
    used, nb = r
    return tuple(bindings_list[j] for j in used), nb


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


# ---------------------------------------------------------------- same-file layer subclasses


def layer_subclass_aliases(
    structures: FileStructures, source: str | None, layer_types: Iterable[str] | None = None
) -> dict[str, str]:
    """Layer types defined in the file that behave as a ``torch.nn`` layer: type -> that layer.

    A class qualifies when it derives (directly or through classes of the same file) from a
    ``torch.nn`` class other than ``Module``/containers and neither it nor those same-file
    bases define any method but ``__init__`` — its forward is the torch layer's
    (``class EfficientNetDepthwiseConv2d(nn.Conv2d)`` only fixes ``groups`` in ``__init__``).
    Needs the source (methods are read from its ``ast``); without it, none qualifies.
    ``layer_types`` (the torch layers the rules name) limits the parents looked for.
    """
    if source is None or not structures.classes:
        return {}
    wanted = set(layer_types) if layer_types is not None else None
    if not any(
        b.startswith("torch.nn.") and b.rsplit(".", 1)[-1] not in _NOT_LAYERS and (wanted is None or b in wanted)
        for c in structures.classes for b in c.bases
    ):
        return {}  # no class derives from such a layer: skip reading the methods (parses the file)
    from adopter.core.rules._source_uses import class_attribute_reads  # the matcher's source helper

    methods_of = {name: methods for name, (_bases, methods) in class_attribute_reads(source).items()}
    by_name = {c.name: c for c in structures.classes}
    out: dict[str, str] = {}
    for cls in structures.classes:
        name, seen, torch_base = cls.name, set(), None
        while name in by_name and name not in seen:
            seen.add(name)
            if name not in methods_of or methods_of[name]:
                break  # unknown, or defines forward/other methods: computes something else
            bases = by_name[name].bases
            torch_bases = [b for b in bases if b.startswith("torch.nn.") and b.rsplit(".", 1)[-1] not in _NOT_LAYERS]
            local = [b.rsplit(".", 1)[-1] for b in bases if b.rsplit(".", 1)[-1] in by_name]
            if len(bases) != 1:
                break  # mixins: another class may change the behaviour
            if torch_bases:
                torch_base = torch_bases[0]
                break
            if not local:
                break
            name = local[0]
        if torch_base is None:
            continue
        for ty in local_type_names(structures, cls.name):
            out[ty] = torch_base
    return out


_NOT_LAYERS = {"Module", "ModuleList", "ModuleDict", "Sequential", "ParameterList", "ParameterDict"}


def local_type_names(structures: FileStructures, class_name: str) -> list[str]:
    """How extraction names a layer of a class defined in the scanned file (``modeling_x.Cls``)."""
    stem = structures.file.replace("\\", "/").rsplit("/", 1)[-1]
    stem = stem.removesuffix(".py")
    return [f"{stem}.{class_name}", class_name]


# ---------------------------------------------------------------- folded same-file helper functions


def _call_sites(source: str, names: Iterable[str]) -> dict[tuple[int, str], list]:
    """``(line, name) -> [(call, qualified function, enclosing simple statement)]`` for every call
    ``name(...)`` in the file's functions (``Cls.method`` or ``func``)."""
    wanted = set(names)
    out: dict[tuple[int, str], list] = {}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return out

    def visit_function(fn, qual: str) -> None:
        simple = [st for st in ast.walk(fn) if isinstance(st, ast.stmt) and st is not fn
                  and not isinstance(st, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith,
                                          ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not type(st).__name__ in ("Match", "TryStar")]
        for st in simple:
            for c in ast.walk(st):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in wanted:
                    out.setdefault((c.lineno, c.func.id), []).append((c, qual, st))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit_function(node, node.name)
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit_function(m, f"{node.name}.{m.name}")
    return out


def fold_inlined_calls(structures: FileStructures, fold: dict[str, str], source: str | None) -> FileStructures:
    """``structures`` with each inlined call of a same-file function named in ``fold`` (name ->
    layer type) replaced by one functional ``Layer`` of that type at the call expression.

    Extraction inlines ``gelu(h)`` of ``def gelu(x): return x * 0.5 * (1.0 + torch.erf(...))``
    into its arithmetic; a rule that knows the function computes one op sees it as that op.
    A run is folded only when it is unambiguous: one call of the name on its line (in a simple
    statement), the run's nodes contiguous, functional (no module call), reading one outside
    value, and no temporary of the run read after it. Otherwise the nodes stay as they are.
    """
    if not fold or source is None:
        return structures
    sites = _call_sites(source, fold)
    if not sites:
        return structures
    changed = False
    functions = []
    for fs in structures.functions:
        paths = []
        for path in fs.paths:
            nodes = _fold_path(path.nodes, fold, sites)
            if nodes is not path.nodes:
                changed = True
                path = replace(path, nodes=nodes)
            paths.append(path)
        functions.append(replace(fs, paths=tuple(paths)) if paths != list(fs.paths) else fs)
    return replace(structures, functions=tuple(functions)) if changed else structures


def _fold_path(nodes: Sequence[Node], fold: dict[str, str], sites: dict) -> Sequence[Node]:
    out: list[Node] = []
    i, changed = 0, False
    while i < len(nodes):
        n = nodes[i]
        sp = getattr(n, "span", None)
        if sp is None or sp.function not in fold or not sp.inlined_at:
            out.append(n)
            i += 1
            continue
        j = i
        while j < len(nodes) and getattr(nodes[j], "span", None) is not None \
                and nodes[j].span.function == sp.function and nodes[j].span.inlined_at == sp.inlined_at:
            j += 1
        folded = _fold_run(nodes, i, j, fold[sp.function], sites.get((sp.inlined_at[-1], sp.function), []))
        if folded is None:
            out.extend(nodes[i:j])
        else:
            out.append(folded)
            changed = True
        i = j
    return tuple(out) if changed else nodes


def _fold_run(nodes: Sequence[Node], i: int, j: int, layer_type: str, calls: list) -> Layer | None:
    if len(calls) != 1:
        return None  # several calls on the line (or none seen): the run cannot be placed
    call, qual, stmt = calls[0]
    run = nodes[i:j]
    made: set = set()
    inputs: set = set()
    for n in run:
        if isinstance(n, Layer) and n.module is not None:
            return None
        if not isinstance(n, (Layer, TensorOp)):
            return None
        for a in n.args:
            v = a.value
            if isinstance(v, Var) and (v.name, v.version) not in made:
                inputs.add((v.name, v.version))
        out = getattr(n, "output", None)
        if isinstance(out, Var):
            made.add((out.name, out.version))
    last = run[-1].output
    if len(inputs) != 1 or not isinstance(last, Var):
        return None
    temps = made - {(last.name, last.version)}
    for n in nodes[j:]:
        if any(isinstance(a.value, Var) and (a.value.name, a.value.version) in temps for a in n.args):
            return None  # an intermediate of the helper is read later: not one opaque op
    (name, version), = inputs
    sp = run[0].span
    span = Span(line=call.lineno, col=call.col_offset, end_line=call.end_lineno, end_col=call.end_col_offset,
                function=qual, stmt_line=stmt.lineno, stmt_end_line=stmt.end_lineno, inlined_at=sp.inlined_at[:-1])
    return Layer(type=layer_type, args=(Arg(Var(name, version)),), output=last, module=None, span=span)


# ---------------------------------------------------------------- preferred path variant


def optional_module_attrs(structures: FileStructures, cls: ClassInfo | None, source: str | None) -> frozenset:
    """``self.<attr>`` modules that some instances of ``cls`` do not have: bound in
    ``__init__`` (of the class or the same-file base that binds it) only on some branches.

    GPT-2's ``self.q_attn`` is built under ``if self.is_cross_attention:`` alone, while
    ``self.c_attn`` is built on both branches of that ``if``: ``q_attn`` is optional. With the
    source, a binding counts as always present when every way through its function assigns
    the attribute (both branches of each ``if`` on the way; a branch that raises counts as
    assigning; ``x if c else None``/``c and x`` values do not). Without the source (callers
    that only have structures), an attribute bound under a condition at a single site is
    taken as optional and one bound at several sites as built on alternative branches.
    """
    if cls is None:
        return frozenset()
    by_name = {c.name: c for c in structures.classes}
    bindings: dict[str, list[InitBinding]] = {}
    seen: set[str] = set()
    todo = [cls]
    while todo:
        c = todo.pop(0)
        if c.name in seen:
            continue
        seen.add(c.name)
        here: dict[str, list[InitBinding]] = {}
        for ib in c.init_bindings:
            if ib.container is None and ib.attr not in bindings:
                here.setdefault(ib.attr, []).append(ib)
        bindings.update(here)  # the class closest to ``cls`` that binds an attribute decides
        todo.extend(by_name[b.rsplit(".", 1)[-1]] for b in c.bases if b.rsplit(".", 1)[-1] in by_name)
    optional = set()
    for attr, ibs in bindings.items():
        if any(not ib.conditional for ib in ibs):
            continue
        if source is not None and _always_assigned_in_source(source, attr, ibs):
            continue
        if source is None and len({ib.span.line for ib in ibs if ib.span is not None}) > 1:
            continue
        optional.add(attr)
    return frozenset(optional)


def _always_assigned_in_source(source: str, attr: str, ibs: list[InitBinding]) -> bool:
    from adopter.core.rules._source import function_ast  # the matcher's source helper

    first = next((ib for ib in ibs if ib.span is not None and ib.span.function), None)
    if first is None:
        return False
    fn = function_ast(source, first.span.function, first.span.line)
    if fn is None:
        return False
    return _block_assigns(getattr(fn, "body", []), attr.split(".", 1)[-1])


def _block_assigns(body: list[ast.stmt], attr: str) -> bool:
    """Whether every way through ``body`` assigns ``self.<attr>`` a value that is not optional."""
    for st in body:
        if isinstance(st, ast.Raise):
            return True  # this way never completes: nothing is missing on it
        if isinstance(st, (ast.Assign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            if any(
                isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                and t.attr == attr for t in targets
            ) and st.value is not None and not isinstance(st.value, (ast.IfExp, ast.BoolOp, ast.Constant)):
                return True
        elif (isinstance(st, ast.If) and _block_assigns(st.body, attr) and _block_assigns(st.orelse, attr)) or (
            isinstance(st, (ast.With, ast.AsyncWith, ast.Try)) and _block_assigns(st.body, attr)
        ):
            return True
    return False


def optional_inputs(fs: FunctionStructures, source: str | None) -> frozenset:
    """Parameters of the entry function that default to ``None`` (``encoder_hidden_states=None``):
    inputs the caller may not pass. Needs the source (none without it)."""
    if source is None or fs.span is None:
        return frozenset()
    from adopter.core.rules._source import function_ast  # the matcher's source helper

    qual = f"{fs.class_name}.{fs.function}" if fs.class_name else fs.function
    fn = function_ast(source, qual, fs.span.line + 1)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return frozenset()
    a = fn.args
    positional = a.posonlyargs + a.args
    pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
    pairs += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    return frozenset(p.arg for p, d in pairs if isinstance(d, ast.Constant) and d.value is None)


def variant_rank(m: Match, optional_attrs: frozenset, optional_args: frozenset = frozenset()) -> tuple[int, int, int]:
    """Order of preference between path variants of one match (the same core statements,
    :func:`_dedup_key`) that differ in the nodes a precondition added (``extra_nodes``:
    attention projections, a position-bias add). Lower is better:

    1. fewer nodes calling a module that only some instances have
       (:func:`optional_module_attrs`): the variant that runs in every configuration of the
       class — GPT-2's self-attention path through ``self.c_attn`` rather than the
       cross-attention path through ``self.q_attn`` (built only with
       ``is_cross_attention=True``), which a plain GPT-2 never executes;
    2. fewer nodes reading an input of the entry function that defaults to ``None``
       (:func:`optional_inputs`): ``self.key(hidden_states)`` rather than
       ``self.key(encoder_hidden_states)`` on the ``if encoder_hidden_states is not None:``
       branch (ConvBERT, 2023 BERT) — the branch a caller that does not pass the input runs;
    3. more matched nodes: the path that runs more of the matched computation (T5's
       ``if position_bias is not None: scores = scores + position_bias`` taken);
    4. ties keep the variant found first (path order).

    Only the choice between variants of one place depends on this, never whether a match
    exists. The trace confirms the reported lines, so the variant reported is the one a
    model in its common configuration executes.
    """
    optional = reads_optional = 0
    for mn in m.nodes:
        module = getattr(mn.node, "module", None)
        if isinstance(module, Var) and module.name in optional_attrs:
            optional += 1
        if optional_args and any(
            isinstance(a.value, Var) and a.value.version == 0 and a.value.name in optional_args
            for a in getattr(mn.node, "args", ())
        ):
            reads_optional += 1
    return (optional, reads_optional, -len(m.nodes))


def _pattern_layer_types(rules: Sequence[RuleLike]) -> set[str]:
    """Every layer type the rules' forward and init patterns name (``a|b`` split)."""
    out: set[str] = set()
    for rule in rules:
        for variant in rule.variants:
            for part in (variant.forward, variant.init):
                if part is None:
                    continue
                for n in part.source.nodes:
                    if isinstance(n, Layer):
                        out.update(n.type.split("|"))
    return out


class _VariantRanker:
    """:func:`variant_rank` for the matches of one entry function; what it needs from the
    source is computed only when two variants of one match are compared (rarely)."""

    def __init__(self, structures: FileStructures, cls: ClassInfo | None, fs: FunctionStructures,
                 source: str | None, by_class: dict):
        self.structures, self.cls, self.fs, self.source, self.by_class = structures, cls, fs, source, by_class
        self._args: frozenset | None = None

    def rank(self, m: Match) -> tuple[int, int, int]:
        name = self.cls.name if self.cls is not None else None
        if name not in self.by_class:
            self.by_class[name] = optional_module_attrs(self.structures, self.cls, self.source)
        if self._args is None:
            self._args = optional_inputs(self.fs, self.source)
        return variant_rank(m, self.by_class[name], self._args)


# ---------------------------------------------------------------- driver


def _rehome(m: Match, structures: FileStructures) -> Match:
    """Report a match whose nodes all lie in one other function under that function."""
    funcs = {mn.node.span.function for mn in m.nodes if mn.node.span is not None and mn.node.span.function}
    if len(funcs) != 1:
        return m
    (qual,) = funcs
    entry = f"{m.class_name}.{m.function}" if m.class_name else m.function
    if qual == entry:
        return m
    class_names = {c.name for c in structures.classes}
    head, _, tail = qual.rpartition(".")
    if head and head in class_names:
        return replace(m, class_name=head, function=tail)
    if head:
        # nested function or method of an unknown class: keep the entry's class
        return replace(m, function=qual)
    return replace(m, class_name=None, function=qual)


def _dedup_key(m: Match) -> tuple:
    """:meth:`Match.key` plus the modules called: layers inside one ``nn.Sequential`` share
    the call's line but are different places (``self.block[0]`` vs ``self.block[3]``)."""
    return m.key() + (tuple(str(getattr(mn.node, "module", None)) for mn in m.nodes),)


def _match_path(
    rule: RuleLike,
    structures: FileStructures,
    fs: FunctionStructures,
    cls: ClassInfo | None,
    init_list: tuple[InitBinding, ...],
    path: PathStructure,
    index: _PathIndex,
    accepted: dict,
    rejected: dict,
    path_cache: dict,
    source: str | None = None,
    found_on: dict | None = None,
    path_id: tuple = (),
    ranker: _VariantRanker | None = None,
) -> None:
    """Match ``rule`` on one path into ``accepted``/``rejected`` (keyed by :func:`_dedup_key`).

    With a ``ranker``, a key accepted on an earlier path is replaced by a later path's variant
    with other nodes that ranks better (see :func:`variant_rank`)."""
    veto = getattr(rule, "veto_across_paths", True)
    rehome = getattr(rule, "rehome", True)
    for variant in rule.variants:
        if not index.has_all(variant.forward.source):
            continue
        for positions, b in _search(variant.forward.source, index, {}):
            nodes = tuple(MatchedNode(pi, path.nodes[ni]) for pi, ni in enumerate(positions))
            m = Match(rule=rule.name, file=structures.file, class_name=fs.class_name,
                      function=fs.function, nodes=nodes, bindings=b, variant=variant)
            if variant.init is not None:
                r = match_init(variant.init.source, init_list, b, index.aliases)
                if r is None:
                    continue
                init_nodes, ib = r
                init_only = {k: v for k, v in ib.items() if k not in b}
                m = replace(m, init_nodes=init_nodes, init_bindings=init_only)
            homed = _rehome(m, structures) if rehome else m
            key = _dedup_key(homed)
            if found_on is not None:
                found_on.setdefault(key, set()).add(path_id)
            if veto and key in rejected:
                continue
            if not veto and key in accepted and ranker is None:
                continue
            ctx = MatchContext(m, structures, fs, path, cls, init_list, positions, variant, path_cache=path_cache,
                               source=source)
            reason = None
            for pre in rule.preconditions:
                reason = pre(ctx)
                if reason:
                    break
            extra = ctx.extra.get("extra_nodes")
            if not reason and extra:
                # nodes a precondition found part of the match (attention projections)
                more = tuple(MatchedNode(-1, n) for n in extra if all(n is not mn.node for mn in m.nodes))
                both = sorted(m.nodes + more, key=lambda mn: (mn.node.span.line, mn.node.span.col)
                              if mn.node.span is not None else (0, 0))
                m = replace(m, nodes=tuple(both))
                homed = _rehome(m, structures) if rehome else m
            if reason:
                # The fused code would run on every path through these statements:
                # a violation on any of them vetoes the match.
                rejected.setdefault(key, replace(homed, reason=reason))
                if veto:
                    accepted.pop(key, None)
                continue
            kept = accepted.get(key)
            if kept is None or (
                ranker is not None and kept.nodes != homed.nodes and ranker.rank(homed) < ranker.rank(kept)
            ):
                accepted[key] = homed


def match_structures(
    structures: FileStructures,
    rules: Iterable[RuleLike],
    rejected: list[Match] | None = None,
    *,
    source: str | None = None,
) -> list[Match]:
    """All matches of ``rules`` in one file's structures, de-duplicated, in source order.

    Matches dropped by a precondition are appended to ``rejected`` (with ``reason`` set)
    when a list is given. ``source`` (the file's text) enables source-level checks such
    as intermediates escaping through plain assignments or ``return``.
    """
    rules = list(rules)
    classes = {c.name: c for c in structures.classes}
    accepted: list[dict] = [{} for _ in rules]
    rejected_by_rule: list[dict] = [{} for _ in rules]
    found_on: list[dict] = [{} for _ in rules]
    key_cache: dict[int, str | None] = {}
    optional_by_class: dict[str | None, frozenset] = {}
    opted_in = [r for r in rules if getattr(r, "match_subclasses", False)]
    aliases = layer_subclass_aliases(structures, source, _pattern_layer_types(opted_in)) if opted_in else {}
    # per rule: same-file subclasses (opted in) plus the rule's own same-file layer aliases
    rule_aliases: list[dict[str, str]] = []
    for rule in rules:
        own = dict(aliases) if getattr(rule, "match_subclasses", False) else {}
        hook = getattr(rule, "layer_aliases", None)
        if hook is not None:
            own.update(hook(structures, source))
        rule_aliases.append(own)
    # per rule: the structures it sees (same-file helper functions folded back into one call)
    rule_structures: list[FileStructures] = []
    for rule in rules:
        hook = getattr(rule, "inlined_functions", None)
        fold = hook(structures, source) if hook is not None and source else {}
        rule_structures.append(fold_inlined_calls(structures, fold, source) if fold else structures)
    for seen in dict.fromkeys(id(st) for st in rule_structures):
        st_rules = [i for i, st in enumerate(rule_structures) if id(st) == seen]
        st = rule_structures[st_rules[0]]
        own_cache = key_cache if st is structures else {}
        for f_index, fs in enumerate(st.functions):
            cls = classes.get(fs.class_name) if fs.class_name else None
            init_list = class_init_bindings(st, cls)
            ranker = _VariantRanker(st, cls, fs, source, optional_by_class)
            for p_index, path in enumerate(fs.paths):
                index = _PathIndex(path.nodes, own_cache)
                aliased_indexes: dict[int, _PathIndex] = {}
                path_cache: dict = {}
                for i in st_rules:
                    rule = rules[i]
                    use = index
                    if rule_aliases[i]:
                        key = id(rule_aliases[i]) if rule_aliases[i] != aliases else -1
                        use = aliased_indexes.get(key)
                        if use is None:
                            use = aliased_indexes[key] = _PathIndex(path.nodes, {}, rule_aliases[i])
                    _match_path(rule, st, fs, cls, init_list, path, use, accepted[i], rejected_by_rule[i],
                                path_cache, source, found_on[i], (f_index, p_index), ranker)
    span_sets_by: dict[int, dict] = {}
    for i, rule in enumerate(rules):
        if getattr(rule, "veto_across_paths", True):
            span_sets = span_sets_by.setdefault(id(rule_structures[i]), {})
            _veto_inconsistent_paths(rule_structures[i], accepted[i], rejected_by_rule[i], found_on[i], span_sets)
    results: list[Match] = []
    for i, rule in enumerate(rules):
        results.extend(_resolve_overlaps(rule, list(accepted[i].values())))
        if rejected is not None:
            rejected.extend(m for k, m in rejected_by_rule[i].items() if k not in accepted[i])
    results.sort(key=lambda m: (m.lines[:1] or [0], m.rule))
    return results


def _span_key(n: Node) -> tuple | None:
    sp = getattr(n, "span", None)
    if sp is None:
        return None
    return (sp.line, sp.col, getattr(sp, "inlined_at", ()), getattr(n, "type", getattr(n, "op", "")))


def _veto_inconsistent_paths(
    structures: FileStructures, accepted: dict, rejected: dict, found_on: dict, span_sets: dict
) -> None:
    """A rewrite replaces statements on every path through them: when another path runs all
    the matched statements but the pattern does not match there (the same calls read other
    values, e.g. k/v projections of ``key_value_states`` on a cross-attention path), the
    match is dropped."""
    for key, m in list(accepted.items()):
        keys = [_span_key(mn.node) for mn in m.nodes]
        if any(k is None for k in keys):
            continue
        needed = set(keys)
        where = found_on.get(key, set())
        for f_index in {f for f, _ in where}:
            fs = structures.functions[f_index]
            for p_index, path in enumerate(fs.paths):
                if (f_index, p_index) in where:
                    continue
                spans = span_sets.get((f_index, p_index))
                if spans is None:
                    spans = span_sets[(f_index, p_index)] = frozenset(
                        k for k in map(_span_key, path.nodes) if k is not None
                    )
                if needed <= spans:
                    del accepted[key]
                    rejected.setdefault(key, replace(
                        m, reason="on another control-flow path the same statements are not connected this way"
                    ))
                    break
            if key not in accepted:
                break


def _node_ids(m: Match) -> set:
    return {
        (mn.node.span.line, mn.node.span.col, mn.node.span.inlined_at if hasattr(mn.node.span, "inlined_at") else (),
         str(getattr(mn.node, "module", None)), getattr(mn.node, "type", getattr(mn.node, "op", "")))
        for mn in m.nodes
        if mn.node.span is not None
    }


def _resolve_overlaps(rule: RuleLike, found: list[Match]) -> list[Match]:
    """One rule must not claim the same statement twice (e.g. a fourth Linear on the same
    input for fused_QKV): keep the earliest match; with ``dedup == "class"`` keep one match
    per class and function (several paths through one attention computation)."""
    found = sorted(found, key=lambda m: (m.lines, -len(m.nodes)))
    kept: list[Match] = []
    claimed: set = set()
    per_class: set = set()
    for m in found:
        if getattr(rule, "dedup", "lines") == "class":
            ck = (m.class_name, m.function)
            if ck in per_class:
                continue
            per_class.add(ck)
        ids = _node_ids(m)
        if ids & claimed:
            continue
        claimed |= ids
        kept.append(m)
    return kept
