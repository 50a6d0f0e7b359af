"""Core matcher: a rule pattern as a sub-sequence of one path's nodes.

Values bind consistently (:func:`same_value`), nodes match by type, normalized arguments and
operator (:func:`match_node`), and :func:`match_pattern` lists every sub-sequence match, using
a per-path index of node positions by type (``_PathIndex``) to find candidates.
"""

from __future__ import annotations

import ast
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from adopter.core.dsl import Arg, Const, Layer, Node, Pattern, TensorOp, Value, Var, Wildcard
from adopter.core.structures import PathStructure

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


_ALTERNATIVES: dict[str, tuple[str, ...]] = {}


def _type_alternatives(t: str) -> tuple[str, ...]:
    alts = _ALTERNATIVES.get(t)
    if alts is None:
        if len(_ALTERNATIVES) > 4096:
            _ALTERNATIVES.clear()
        alts = _ALTERNATIVES[t] = tuple(t.split("|"))
    return alts


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


# id(pattern) -> (pattern, every key its nodes name, None when one is a wildcard)
_PATTERN_KEY_SETS: dict[int, tuple[Pattern, frozenset | None]] = {}


def _pattern_key_set(pattern: Pattern) -> frozenset | None:
    hit = _PATTERN_KEY_SETS.get(id(pattern))
    if hit is None or hit[0] is not pattern:
        keys = [_pattern_keys(pn) for pn in pattern.nodes]
        hit = _PATTERN_KEY_SETS[id(pattern)] = (
            pattern, None if any(k is None for k in keys) else frozenset(k for ks in keys for k in ks))
    return hit[1]


# id(pattern) -> (pattern, key alternatives of each of its non-wildcard nodes)
_PATTERN_NEEDS: dict[int, tuple[Pattern, tuple[tuple[str, ...], ...]]] = {}
_MISSING = object()


class _PathIndex:
    """Positions of the nodes of one path by type, for fast candidate lookup."""

    def __init__(self, nodes: Sequence[Node], key_cache: dict | None = None, aliases: dict[str, str] | None = None):
        self.nodes = nodes
        self.aliases = aliases or None
        by_key: dict[str, list[int]] = {}
        keys: list[str | None] = []
        cache = key_cache if key_cache is not None else {}
        get = cache.get
        for i, n in enumerate(nodes):
            k = get(id(n), _MISSING)
            if k is _MISSING:
                k = cache[id(n)] = _node_key(n)
            if aliases and isinstance(n, Layer) and n.type in aliases:
                k = "L:" + aliases[n.type]
            keys.append(k)
            if k is not None:
                lst = by_key.get(k)
                if lst is None:
                    by_key[k] = [i]
                else:
                    lst.append(i)
        self.by_key = by_key
        self.keys = keys
        self._readers: dict[str, list[int]] | None = None
        self._projections: dict[frozenset, tuple[list[int], tuple[int, ...]]] | None = None

    def readers(self, name: str) -> list[int]:
        """Positions of the nodes that read a variable named ``name`` (an argument or the module
        called), ascending; built on first use."""
        readers = self._readers
        if readers is None:
            readers = self._readers = {}
            for i, n in enumerate(self.nodes):
                for a in getattr(n, "args", ()):
                    if isinstance(a.value, Var):
                        lst = readers.setdefault(a.value.name, [])
                        if not lst or lst[-1] != i:
                            lst.append(i)
                mod = getattr(n, "module", None)
                if isinstance(mod, Var):
                    lst = readers.setdefault(mod.name, [])
                    if not lst or lst[-1] != i:
                        lst.append(i)
        return readers.get(name, [])

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

    def projection(self, pattern: Pattern) -> tuple[list[int], tuple[int, ...]] | None:
        """The positions of the nodes whose type a node of ``pattern`` names, ascending, and their
        identities: all that :func:`_search` of ``pattern`` looks at. None for a pattern with a
        wildcard (it looks at every node)."""
        needs = _pattern_key_set(pattern)
        if needs is None:
            return None
        cache = self._projections
        if cache is None:
            cache = self._projections = {}
        hit = cache.get(needs)
        if hit is None:
            by_key = self.by_key
            positions = sorted(p for k in needs for p in by_key.get(k, ()))
            nodes = self.nodes
            hit = cache[needs] = (positions, tuple(id(nodes[p]) for p in positions))
        return hit

    def candidates_reading(self, pn: Node, start: int, name: str) -> list[int]:
        """:meth:`candidates` that read a variable named ``name``."""
        keys = _pattern_keys(pn)
        lst = self.readers(name)
        lst = lst[bisect_left(lst, start):]
        if keys is None:
            return lst
        node_keys = self.keys
        return [i for i in lst if node_keys[i] in keys]

    def has_all(self, pattern: Pattern) -> bool:
        by_key = self.by_key
        hit = _PATTERN_NEEDS.get(id(pattern))
        if hit is None or hit[0] is not pattern:
            needs = tuple(keys for keys in map(_pattern_keys, pattern.nodes) if keys is not None)
            hit = _PATTERN_NEEDS[id(pattern)] = (pattern, needs)
        for keys in hit[1]:
            for k in keys:
                if k in by_key:
                    break
            else:
                return False
        return True


def could_match(pattern: Pattern, present: set[str]) -> bool:
    """:meth:`_PathIndex.has_all` against a set of keys (those of several paths together)."""
    hit = _PATTERN_NEEDS.get(id(pattern))
    if hit is None or hit[0] is not pattern:
        needs = tuple(keys for keys in map(_pattern_keys, pattern.nodes) if keys is not None)
        hit = _PATTERN_NEEDS[id(pattern)] = (pattern, needs)
    return all(any(k in present for k in keys) for keys in hit[1])


def function_keys(paths: Iterable[PathStructure], key_cache: dict, alias_maps: list[dict[str, str]]) -> set[str]:
    """The keys (``_node_key``) of every node on any of ``paths`` (a function's), each also under the
    type any of ``alias_maps`` gives it: a superset of the keys of each path's :class:`_PathIndex`
    (``key_cache``: the one the indexes share)."""
    present: set[str] = set()
    seen: set[int] = set()
    for path in paths:
        for n in path.nodes:
            if id(n) in seen:
                continue
            seen.add(id(n))
            k = key_cache.get(id(n), _MISSING)
            if k is _MISSING:
                k = key_cache[id(n)] = _node_key(n)
            if k is None:
                continue
            present.add(k)
            if alias_maps and k[:2] == "L:":
                for aliases in alias_maps:
                    to = aliases.get(n.type)
                    if to is not None:
                        present.add("L:" + to)
    return present


MAX_MATCHES_PER_PATH = 200

# (id(pattern node), aliases in use) -> (pattern node, the abstract variables a node must read to match it)
_REQUIRED_READS: dict[tuple[int, bool], tuple[Node, tuple[str, ...]]] = {}


def _required_reads(pn: Node, aliased: bool) -> tuple[str, ...]:
    """The abstract variables of ``pn`` that every node matching it reads (:func:`match_node`): a
    tensor op's operands, a layer's module and, where no alias can skip the comparison of a
    subclass's arguments, its positional arguments (a keyword of the pattern may be absent and
    defaulted)."""
    hit = _REQUIRED_READS.get((id(pn), aliased))
    if hit is not None and hit[0] is pn:
        return hit[1]
    names: list[str] = []
    if isinstance(pn, TensorOp):
        names = [a.value.name for a in pn.args if isinstance(a.value, Var) and a.value.name[:1] == "$"]
    elif isinstance(pn, Layer):
        if isinstance(pn.module, Var) and pn.module.name[:1] == "$":
            names.append(pn.module.name)
        if not aliased:
            names += [a.value.name for a in pn.args
                      if a.keyword is None and isinstance(a.value, Var) and a.value.name[:1] == "$"]
    out = tuple(dict.fromkeys(names))
    _REQUIRED_READS[(id(pn), aliased)] = (pn, out)
    return out


def _search(pattern: Pattern, index: _PathIndex, b: Bindings) -> Iterator[tuple[tuple[int, ...], Bindings]]:
    pnodes = pattern.nodes
    n_p = len(pnodes)
    aliased = index.aliases is not None

    def rec(pi: int, start: int, b: Bindings, acc: tuple[int, ...]):
        if pi == n_p:
            yield acc, b
            return
        pn = pnodes[pi]
        # a variable already bound to a variable of the path: only the nodes reading it can match
        # (same_value compares names first), found by the path's reader index instead of trying
        # every node of the type
        read = None
        if b:
            for name in _required_reads(pn, aliased):
                bound = b.get(name)
                if isinstance(bound, Var):
                    read = bound.name
                    break
        cands = index.candidates(pn, start) if read is None else index.candidates_reading(pn, start, read)
        for ni in cands:
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
