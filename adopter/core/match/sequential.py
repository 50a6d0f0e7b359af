"""Pairs of ``nn.Sequential`` entries (:class:`~adopter.core.structures.SequentialBuild`).

A Sequential runs its entries one after the other, each feeding the next and nothing else,
so two consecutive entries are the same data flow as ``b(a(x))`` in a ``forward``. They are
matched where the Sequential is built — once, however many call sites run it — against the
rules that opt in (``Rule.in_sequential``), with the same patterns and preconditions as any
forward match, on a synthetic path holding one node per entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from adopter.core.dsl import Arg, Layer, Var
from adopter.core.match.context import MatchContext, Refusal, RuleLike, conditional_of, run_preconditions, site_of
from adopter.core.match.core import _PathIndex, _search
from adopter.core.match.init_match import match_init
from adopter.core.structures import (
    FileStructures,
    FunctionStructures,
    InitBinding,
    Match,
    MatchedNode,
    PathStructure,
    SequentialBuild,
)

UNKNOWN = "?"
# type combinations tried per Sequential when entries have several candidate types
_MAX_COMBINATIONS = 16


def _paths(build: SequentialBuild) -> list[tuple[tuple[Layer, ...], tuple[InitBinding, ...]]]:
    tag = f"<Sequential@{build.span.line}:{build.span.col}>"
    choices = [e.types or (UNKNOWN,) for e in build.entries]
    out = []
    for combo in itertools.islice(itertools.product(*choices), _MAX_COMBINATIONS):
        nodes, inits = [], []
        prev = Var(f"{tag}.input")
        for k, (entry, ty) in enumerate(zip(build.entries, combo)):
            module = Var(f"self.{tag}[{k}]")
            out_var = Var(f"{tag}#{k}")
            nodes.append(Layer(ty, (Arg(prev),), out_var, module, entry.span))
            inits.append(InitBinding(attr=module.name, layer=Layer(ty, entry.args, module, None, entry.span),
                                     span=entry.span))
            prev = out_var
        out.append((tuple(nodes), tuple(inits)))
    return out


def match_sequentials(
    structures: FileStructures, rules: Sequence[RuleLike], aliases: dict[str, dict[str, str]] | None = None
) -> list[Match]:
    """Matches of the opted-in ``rules`` over consecutive entries of every built Sequential
    (``refused`` ones included: the caller reports them apart). ``aliases``: per rule name, the
    same-file layer classes it treats as torch layers."""
    aliases = aliases or {}
    rules = [r for r in rules if getattr(r, "in_sequential", False)]
    out: dict[tuple, Match] = {}
    refused: dict[tuple, Match] = {}
    if not rules:
        return []
    for build in structures.sequentials:
        if len(build.entries) < 2 or any(e.span is None for e in build.entries):
            continue
        function = build.function.rsplit(".", 1)[-1]
        for nodes, inits in _paths(build):
            path = PathStructure(nodes)
            fs = FunctionStructures(build.class_name, function, (path,), build.span)
            indexes: dict[str, _PathIndex] = {}
            for rule in rules:
                index = indexes.get(rule.name)
                if index is None:
                    index = indexes[rule.name] = _PathIndex(path.nodes, {}, aliases.get(rule.name) or None)
                for variant in rule.variants:
                    if not index.has_all(variant.forward.source):
                        continue
                    for positions, b in _search(variant.forward.source, index, {}):
                        matched = tuple(MatchedNode(pi, nodes[ni]) for pi, ni in enumerate(positions))
                        m = Match(rule=rule.name, file=structures.file, class_name=build.class_name,
                                  function=function, nodes=matched, bindings=b, variant=variant,
                                  sequential=build.span)
                        if variant.init is not None:
                            r = match_init(variant.init.source, inits, b, index.aliases)
                            if r is None:
                                continue
                            init_nodes, ib = r
                            m = replace(m, init_nodes=init_nodes,
                                        init_bindings={k: v for k, v in ib.items() if k not in b})
                        ctx = MatchContext(m, structures, fs, path, None, inits, positions, variant)
                        reason = run_preconditions(rule.preconditions, ctx)
                        if isinstance(reason, Refusal):
                            refused.setdefault(m.key(), replace(m, status="refused", code=reason.code,
                                                                reason=str(reason)))
                        if reason:
                            continue
                        cond = conditional_of(ctx) or _entry_types_condition(build, nodes, positions)
                        if cond is not None:
                            m = replace(m, status="conditional", code=cond[0], condition=cond[1])
                        site = site_of(ctx)
                        if site is not None:  # what the rule's analysis found, for its codemod
                            m = replace(m, site=site)
                        out.setdefault(m.key(), m)
    # a pair refused for one combination of entry types and matched for another is reported matched
    out.update({k: m for k, m in refused.items() if k not in out})
    return sorted(out.values(), key=lambda m: (m.lines[:1] or [0], m.rule))


def _entry_types_condition(build: SequentialBuild, nodes, positions) -> tuple[str, str] | None:
    """An entry built by a factory that may return other layers (timm's ``create_conv2d``: Conv2d,
    Conv2dSame, MixedConv2d...): the pair holds only when it returns the matched one."""
    parts = []
    for ni in positions:
        others = [t for t in build.entries[ni].types if t != nodes[ni].type]
        if others:
            shown = ", ".join(sorted(t.rsplit(".", 1)[-1] for t in others))
            parts.append(f"entry {ni} is {nodes[ni].type.replace('torch.nn.', 'nn.')}, not {shown}")
    return ("needs-config", "; ".join(parts)) if parts else None


def is_sequential_expansion(match: Match) -> bool:
    """A forward match whose layers are all entries of Sequentials called at one place
    (``self.seq(x)`` expanded): the same pairs are matched once where the Sequential is built."""
    layers = [mn.node for mn in match.nodes if isinstance(mn.node, Layer)]
    if len(layers) != len(match.nodes) or not layers:
        return False
    if not all(n.module is not None and n.module.name.endswith("]") for n in layers):
        return False
    spans = {(n.span.line, n.span.col) for n in layers if n.span is not None}
    return len(spans) == 1


__all__ = ["match_sequentials", "is_sequential_expansion"]
