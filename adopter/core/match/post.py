"""Post-processing of the matches found on paths: the preferred path variant of one match
(:func:`variant_rank`), re-homing into the function that holds the nodes, the veto of
matches whose statements are connected otherwise on another path, and overlaps."""

from __future__ import annotations

import ast
from dataclasses import replace

from adopter.core.dsl import Node, Var
from adopter.core.match.context import RuleLike
from adopter.core.match.init_match import class_and_bases
from adopter.core.match.source import function_ast
from adopter.core.structures import ClassInfo, FileStructures, FunctionStructures, InitBinding, Match

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
    bindings: dict[str, list[InitBinding]] = {}
    for c in class_and_bases(structures, cls):
        here: dict[str, list[InitBinding]] = {}
        for ib in c.init_bindings:
            if ib.container is None and ib.attr not in bindings:
                here.setdefault(ib.attr, []).append(ib)
        bindings.update(here)  # the class closest to ``cls`` that binds an attribute decides
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


# ---------------------------------------------------------------- de-duplication


# (structures, names of its classes) of the structures :func:`_rehome` saw last
_CLASS_NAMES: list = [None, frozenset()]


def _rehome(m: Match, structures: FileStructures) -> Match:
    """Report a match whose nodes all lie in one other function under that function."""
    funcs = {mn.node.span.function for mn in m.nodes if mn.node.span is not None and mn.node.span.function}
    if len(funcs) != 1:
        return m
    (qual,) = funcs
    entry = f"{m.class_name}.{m.function}" if m.class_name else m.function
    if qual == entry:
        return m
    if _CLASS_NAMES[0] is not structures:
        _CLASS_NAMES[:] = [structures, frozenset(c.name for c in structures.classes)]
    class_names = _CLASS_NAMES[1]
    head, _, tail = qual.rpartition(".")
    if head and head in class_names:
        return replace(m, class_name=head, function=tail)
    owner, _, nested = qual.partition(".")
    if head and owner in class_names:
        # a function nested in a method (``def stem(x)`` inside ``forward``): the method's class,
        # the name within it (``forward.stem``), as a method's is
        return replace(m, class_name=owner, function=nested)
    if head:
        # nested function or method of an unknown class: keep the entry's class
        return replace(m, function=qual)
    return replace(m, class_name=None, function=qual)


def _dedup_key(m: Match) -> tuple:
    """:meth:`Match.key` plus the modules called: layers inside one ``nn.Sequential`` share
    the call's line but are different places (``self.block[0]`` vs ``self.block[3]``)."""
    return m.key() + (tuple(str(getattr(mn.node, "module", None)) for mn in m.nodes),)


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


def _superseded_by_other_rules(rules, matches: list[Match]) -> tuple[list[Match], list[Match]]:
    """(kept, set aside): a match of a rule that another rule ``supersedes`` (``getattr(rule,
    "supersedes", ())``, rule names) is set aside when all its nodes are nodes of one match of
    that rule: the bigger match fuses them (a GeGLU's gate Linear + GeLU is part of the gated
    MLP). Set-aside matches carry the reason."""
    claims = {r.name: frozenset(getattr(r, "supersedes", ()) or ()) for r in rules}
    big = [(m, _node_ids(m)) for m in matches if claims.get(m.rule)]
    if not big:
        return matches, []
    kept: list[Match] = []
    aside: list[Match] = []
    for m in matches:
        ids = None
        for other, other_ids in big:
            if other is m or m.rule not in claims[other.rule]:
                continue
            ids = _node_ids(m) if ids is None else ids
            if ids and ids < other_ids:
                lines = ", ".join(str(n) for n in sorted(set(other.lines)))
                aside.append(replace(m, reason=f"part of a {other.rule} match (lines {lines}), which fuses it"))
                break
        else:
            kept.append(m)
    return kept, aside


def _resolve_overlaps(rule: RuleLike, found: list[Match]) -> list[Match]:
    """One rule must not claim the same statement twice (e.g. a fourth Linear on the same
    input for a QKV rule): keep the earliest match; with ``dedup == "class"`` keep one match
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
