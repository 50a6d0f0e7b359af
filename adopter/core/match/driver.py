"""The driver: every rule on every path of every function of one file (:func:`match_structures`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from adopter.core.dsl import Layer, Pattern
from adopter.core.match.context import (
    MatchContext,
    NotACandidate,
    Refusal,
    RuleLike,
    conditional_of,
    producers_of,
    run_preconditions,
    site_of,
)
from adopter.core.match.core import _PathIndex, _search, could_match, function_keys
from adopter.core.match.init_match import class_init_bindings, match_init
from adopter.core.match.local_layers import (
    cast_subclass_aliases,
    fold_inlined_calls,
    inherited_dependence,
    layer_subclass_aliases,
    norm_act_aliases,
    shared_call_dependence,
)
from adopter.core.match.post import (
    _dedup_key,
    _rehome,
    _resolve_overlaps,
    _superseded_by_other_rules,
    _VariantRanker,
    _veto_inconsistent_paths,
)
from adopter.core.match.precision import method_divergence, straddle_refusal, torchscript_refusal, type_dependence
from adopter.core.match.sequential import is_sequential_expansion, match_sequentials
from adopter.core.structures import (
    ClassInfo,
    FileStructures,
    FunctionStructures,
    InitBinding,
    Match,
    MatchedNode,
    PathStructure,
)


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


@dataclass(frozen=True)
class _Verdict:
    """What the preconditions said of one match: why it fails, or the condition it holds under,
    the site the rule's analysis kept and the nodes it added."""

    reason: str | None
    conditional: tuple[str, str] | None
    site: object
    extra_nodes: object
    # the path's producers the preconditions looked up, and what they found
    producer_reads: tuple[tuple[tuple[str, int], object], ...] = ()

    def holds_on(self, path: PathStructure, path_cache: dict) -> bool:
        """Reached on another path: it holds on ``path`` when that path's producers of the values
        looked up are the nodes (or the same absence) the preconditions saw: equal nodes (a
        statement interpreted again after a fork makes an equal node, same call, same operands,
        same position) say the same to a precondition."""
        if not self.producer_reads:
            return True
        producers = producers_of(path, path_cache)
        return all(producers.get(key) == node for key, node in self.producer_reads)


def _verdict_key(rule: RuleLike, variant, m: Match) -> tuple | None:
    """The same rule variant on the same nodes of one function, with the same bindings: the
    preconditions see the same thing unless they read the path. None when a binding is unhashable."""
    try:
        return ("verdict", id(rule), id(variant), tuple(id(mn.node) for mn in m.nodes), frozenset(m.bindings.items()),
                tuple(id(b) for b in m.init_nodes), frozenset(m.init_bindings.items()))
    except TypeError:
        return None


def _search_once(pattern: Pattern, index: _PathIndex, memo: dict | None) -> list[tuple[tuple[int, ...], dict, list | None]]:
    """:func:`_search` of ``pattern`` on the path of ``index`` as (positions, bindings, box),
    taken from ``memo`` (one function's) when an earlier path had the same nodes of the pattern's
    types in the same order: the search looks at no other node (a wildcard pattern, which can, is
    searched on every path, its box None). A box is shared by the paths that find the same nodes:
    the match built from them the first time goes in it (:func:`_match_path`)."""
    projection = index.projection(pattern) if memo is not None else None
    if projection is None:
        return [(ps, b, None) for ps, b in _search(pattern, index, {})]
    positions, ids = projection
    key = ("search", id(pattern), id(index.aliases) if index.aliases else 0, ids)
    found = memo.get(key)
    if found is None:
        rank = {p: r for r, p in enumerate(positions)}
        found = memo[key] = [(tuple(rank[p] for p in ps), b, []) for ps, b in _search(pattern, index, {})]
    return [(tuple(positions[r] for r in ranks), b, box) for ranks, b, box in found]


_NO_INIT = object()  # (a box's content: the init pattern does not match)


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
    file_cache: dict | None = None,
    memo: dict | None = None,
) -> None:
    """Match ``rule`` on one path into ``accepted``/``rejected`` (keyed by :func:`_dedup_key`).

    With a ``ranker``, a key accepted on an earlier path is replaced by a later path's variant
    with other nodes that ranks better (see :func:`variant_rank`). ``file_cache``: shared by the
    preconditions of every match of the file (``MatchContext.file_cache``). ``memo``: shared by the
    paths of one function (its searches, see :func:`_search_once`, and verdicts): a verdict reached
    without reading the path (``MatchContext.read_path``) is taken again for the same rule variant on
    the same nodes with the same bindings, where the producers it looked up are equal nodes on this
    path (:meth:`_Verdict.holds_on`)."""
    veto = getattr(rule, "veto_across_paths", True)
    rehome = getattr(rule, "rehome", True)
    for variant in rule.variants:
        if not index.has_all(variant.forward.source):
            continue
        for positions, b, box in _search_once(variant.forward.source, index, memo):
            if box:  # built on an earlier path from the same nodes
                if box[0] is _NO_INIT:
                    continue
                m, homed, key = box[0]
            else:
                nodes = tuple(MatchedNode(pi, path.nodes[ni]) for pi, ni in enumerate(positions))
                m = Match(rule=rule.name, file=structures.file, class_name=fs.class_name,
                          function=fs.function, nodes=nodes, bindings=b, variant=variant)
                if variant.init is not None:
                    r = match_init(variant.init.source, init_list, b, index.aliases)
                    if r is None:
                        if box is not None:
                            box.append(_NO_INIT)
                        continue
                    init_nodes, ib = r
                    init_only = {k: v for k, v in ib.items() if k not in b}
                    m = replace(m, init_nodes=init_nodes, init_bindings=init_only)
                homed = _rehome(m, structures) if rehome else m
                key = _dedup_key(homed)
                if box is not None:
                    box.append((m, homed, key))
            if found_on is not None:
                found_on.setdefault(key, set()).add(path_id)
            if veto and key in rejected and rejected[key].status != "refused":
                continue  # (a refused key is still checked: a plain failure elsewhere outranks it)
            if not veto and key in accepted and ranker is None:
                continue
            verdict_key = _verdict_key(rule, variant, m) if memo is not None else None
            verdict = None
            if verdict_key is not None:
                for earlier in memo.get(verdict_key, ()):
                    if earlier.holds_on(path, path_cache):
                        verdict = earlier
                        break
            if verdict is None:
                ctx = MatchContext(m, structures, fs, path, cls, init_list, positions, variant,
                                   path_cache=path_cache, source=source,
                                   file_cache=file_cache if file_cache is not None else {})
                reason = run_preconditions(rule.preconditions, ctx)
                if not reason:
                    # precision classes every rule shares (the rule's own come from its preconditions)
                    entry = f"{fs.class_name}.{fs.function}" if fs.class_name else fs.function
                    reason = torchscript_refusal(m, entry, structures, source) or (
                        straddle_refusal(m, source) if getattr(rule, "hoisting", True) else None)
                verdict = _Verdict(reason, conditional_of(ctx) if not reason else None,
                                   site_of(ctx) if not reason else None, ctx.extra.get("extra_nodes"),
                                   tuple(ctx.producer_reads.items()))
                if verdict_key is not None and not ctx.read_path:
                    memo.setdefault(verdict_key, []).append(verdict)
            reason = verdict.reason
            cond = verdict.conditional
            if cond is not None:
                m = replace(m, status="conditional", code=cond[0], condition=cond[1])
                homed = _rehome(m, structures) if rehome else m
            site = verdict.site
            if site is not None:  # what the rule's analysis found, for its codemod
                m = replace(m, site=site)
                homed = _rehome(m, structures) if rehome else m
            extra = verdict.extra_nodes
            if not reason and extra:
                # nodes a precondition found part of the match (attention projections)
                more = tuple(MatchedNode(-1, n) for n in extra if all(n is not mn.node for mn in m.nodes))
                both = sorted(m.nodes + more, key=lambda mn: (mn.node.span.line, mn.node.span.col)
                              if mn.node.span is not None else (0, 0))
                m = replace(m, nodes=tuple(both))
                homed = _rehome(m, structures) if rehome else m
            if reason:
                # The fused code would run on every path through these statements:
                # a violation on any of them vetoes the match. A plain failure outranks a
                # precision refusal: only a match every plain precondition accepts is "refused".
                prev = rejected.get(key)
                if isinstance(reason, Refusal):
                    if prev is None:
                        rejected[key] = replace(homed, status="refused", code=reason.code, reason=str(reason))
                elif prev is None or prev.status == "refused":
                    rejected[key] = replace(homed, status="static", code="", reason=reason)
                if veto:
                    accepted.pop(key, None)
                continue
            if veto and key in rejected:
                continue  # refused on another path
            kept = accepted.get(key)
            if kept is None or (
                ranker is not None and kept.nodes != homed.nodes and ranker.rank(homed) < ranker.rank(kept)
            ):
                accepted[key] = homed


def _expands_built_elsewhere(match: Match, elsewhere: set) -> bool:
    """Every layer of ``match`` is an element of a Sequential built in another file."""
    return bool(elsewhere) and all(
        mn.node.module is not None and mn.node.module.name in elsewhere for mn in match.nodes
        if isinstance(mn.node, Layer))


def match_structures(
    structures: FileStructures,
    rules: Iterable[RuleLike],
    rejected: list[Match] | None = None,
    *,
    source: str | None = None,
    superseded: list[Match] | None = None,
) -> list[Match]:
    """All matches of ``rules`` in one file's structures, de-duplicated, in source order.

    Matches dropped by a precondition are appended to ``rejected`` (with ``reason`` set)
    when a list is given. ``source`` (the file's text) enables source-level checks such
    as intermediates escaping through plain assignments or ``return``. Matches set aside
    because another match of their rule claims the same nodes are appended to
    ``superseded`` when a list is given (a rewrite of the kept one may let them match later).
    """
    rules = list(rules)
    classes = {c.name: c for c in structures.classes}
    accepted: list[dict] = [{} for _ in rules]
    rejected_by_rule: list[dict] = [{} for _ in rules]
    found_on: list[dict] = [{} for _ in rules]
    key_cache: dict[int, str | None] = {}
    file_cache: dict = {}  # (MatchContext.file_cache)
    optional_by_class: dict[str | None, frozenset] = {}
    opted_in = [r for r in rules if getattr(r, "match_subclasses", False)]
    aliases = layer_subclass_aliases(structures, source, _pattern_layer_types(opted_in)) if opted_in else {}
    # per rule: same-file subclasses (opted in) plus the rule's own same-file layer aliases
    rule_aliases: list[dict[str, str]] = []
    # same-file Linear/LayerNorm subclasses whose forward only casts dtypes: every rule
    cast_aliases = cast_subclass_aliases(structures, source)
    foreign = getattr(structures, "foreign_layers", None) or {}
    local_norm_act = norm_act_aliases(structures, source) if any(
        getattr(r, "match_norm_act", False) for r in rules) else {}
    for rule in rules:
        own = dict(aliases) if getattr(rule, "match_subclasses", False) else {}
        if foreign and getattr(rule, "match_subclasses", False):
            # layer classes of other modules: those that only fix ``__init__``; norm+act modules
            # for the rules whose kernel takes them
            norm_act = getattr(rule, "match_norm_act", False)
            own.update({ty: base for ty, (base, applies) in foreign.items() if applies is None or norm_act})
        if local_norm_act and getattr(rule, "match_norm_act", False):
            own.update(local_norm_act)
        own = {**cast_aliases, **own}
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
    alias_maps = [a for a in {id(a): a for a in rule_aliases if a}.values()]
    for seen in dict.fromkeys(id(st) for st in rule_structures):
        st_rules = [i for i, st in enumerate(rule_structures) if id(st) == seen]
        st = rule_structures[st_rules[0]]
        own_cache = key_cache if st is structures else {}
        init_lists: dict = {}  # class name -> its init bindings (the same for all its functions)
        for f_index, fs in enumerate(st.functions):
            cls = classes.get(fs.class_name) if fs.class_name else None
            init_list = init_lists.get(fs.class_name if cls is not None else None)
            if init_list is None:
                init_list = init_lists[fs.class_name if cls is not None else None] = class_init_bindings(st, cls)
            # the rules a path of this function can match at all: every node of a variant's pattern
            # has its type somewhere in the function (most functions hold none of most rules)
            present = function_keys(fs.paths, own_cache, alias_maps)
            live = [i for i in st_rules if any(could_match(v.forward.source, present) for v in rules[i].variants)]
            if not live:
                continue
            ranker = _VariantRanker(st, cls, fs, source, optional_by_class)
            memo: dict = {}  # (_match_path: what the paths of one function share)
            for p_index, path in enumerate(fs.paths):
                index = _PathIndex(path.nodes, own_cache)
                aliased_indexes: dict[int, _PathIndex] = {}
                path_cache: dict = {}
                for i in live:
                    rule = rules[i]
                    use = index
                    if rule_aliases[i]:
                        key = id(rule_aliases[i]) if rule_aliases[i] != aliases else -1
                        use = aliased_indexes.get(key)
                        if use is None:
                            use = aliased_indexes[key] = _PathIndex(path.nodes, {}, rule_aliases[i])
                    _match_path(rule, st, fs, cls, init_list, path, use, accepted[i], rejected_by_rule[i],
                                path_cache, source, found_on[i], (f_index, p_index), ranker, file_cache, memo)
    span_sets_by: dict[int, dict] = {}
    for i, rule in enumerate(rules):
        if getattr(rule, "veto_across_paths", True):
            span_sets = span_sets_by.setdefault(id(rule_structures[i]), {})
            _veto_inconsistent_paths(rule_structures[i], accepted[i], rejected_by_rule[i], found_on[i], span_sets)
    position_maps_by: dict[int, dict] = {}
    for i, rule in enumerate(rules):
        maps = position_maps_by.setdefault(id(rule_structures[i]), {})
        for key, m, verdict in type_dependence(rule_structures[i], accepted[i], found_on[i], maps, source):
            if isinstance(verdict, Refusal):
                del accepted[i][key]
                rejected_by_rule[i][key] = replace(m, status="refused", code=verdict.code, reason=str(verdict))
            elif isinstance(verdict, str):
                del accepted[i][key]
                rejected_by_rule[i][key] = replace(m, reason=verdict)
            else:
                accepted[i][key] = replace(m, status="conditional", code=verdict[0], condition=verdict[1])
        # a base's method run with each subclass's own layers: a match some subclasses lack; one
        # call that fuses one way on each branch of a configuration ``if``
        for key, m, verdict in inherited_dependence(rule_structures[i], accepted[i], found_on[i]) + \
                shared_call_dependence(rule_structures[i], accepted[i], source):
            accepted[i][key] = replace(m, status="conditional", code=verdict[0], condition=verdict[1])
    for i, rule in enumerate(rules):
        found = list(accepted[i].items())
        for index, verdict in method_divergence([m for _, m in found], source, getattr(rule, "chain", False)).items():
            key, m = found[index]
            del accepted[i][key]
            rejected_by_rule[i][key] = replace(m, status="refused", code=verdict.code, reason=str(verdict))
    results: list[Match] = []
    for i, rule in enumerate(rules):
        found = list(accepted[i].values())
        kept = _resolve_overlaps(rule, found)
        results.extend(kept)
        if superseded is not None and len(kept) < len(found):
            kept_ids = {id(m) for m in kept}
            superseded.extend(m for m in found if id(m) not in kept_ids)
        if rejected is not None:
            rejected.extend(m for k, m in rejected_by_rule[i].items()
                            if k not in accepted[i] and not isinstance(m.reason, NotACandidate))
    in_sequential = {r.name for r in rules if getattr(r, "in_sequential", False)}
    if in_sequential:
        # (a Sequential built in another file is matched where this one calls it: no build here)
        elsewhere = {b.container for c in structures.classes for b in c.init_bindings if b.built_elsewhere}
        results = [m for m in results if not (m.rule in in_sequential and is_sequential_expansion(m)
                                              and not _expands_built_elsewhere(m, elsewhere))]
        for m in match_sequentials(structures, rules, dict(zip((r.name for r in rules), rule_aliases))):
            if m.status != "refused":
                results.append(m)
            elif rejected is not None:
                rejected.append(m)
    # a rule's match inside a bigger match of a rule that supersedes it (Rule ``supersedes``)
    results, inside = _superseded_by_other_rules(rules, results)
    if rejected is not None:
        rejected.extend(inside)
    results.sort(key=lambda m: (m.lines[:1] or [0], m.rule))
    return results
