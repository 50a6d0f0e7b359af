"""Runtime-only sites: a rule's layer sequence (``Runtime.sequence``) found in the trace where
no static match covers it — reported so the static pass's misses are visible."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from torch import nn

from adopter.core.dsl import Layer, Span, TensorOp, Var
from adopter.core.rule import Rule, RuntimeStep
from adopter.core.structures import Match, MatchedNode

from .build_sites import BUILT_AT
from .source_map import NodeSource
from .trace_index import TraceIndex, realpath


def _in_module_of(src: NodeSource, classes: tuple[str, ...]) -> str | None:
    """Path of the innermost module of one of ``classes`` (qualified names) the node ran in."""
    for path, cls in reversed(src.module_stack):
        if cls in classes:
            return path
    return None


def _in_leaf(src: NodeSource) -> bool:
    return bool(src.module_stack) and src.module_stack[-1][1].startswith("torch.nn.modules.")


def _module_nodes(index: TraceIndex, path: str) -> list[NodeSource]:
    """Nodes that ran inside the module instance at ``path`` (built once per trace)."""
    by_path = index.__dict__.get("_by_module_path")
    if by_path is None:
        by_path = defaultdict(list)
        for s in index.sources:
            for p in {p for p, _ in s.module_stack}:
                by_path[p].append(s)
        index.__dict__["_by_module_path"] = by_path
    return by_path.get(path, [])


def _module_group(index: TraceIndex, path: str) -> tuple[str, set[str]]:
    return path, {s.node_name for s in _module_nodes(index, path)}


def _step_group(index: TraceIndex, step: RuntimeStep, src: NodeSource) -> tuple[str, set[str]] | None:
    """``(key, nodes)`` of the step this node belongs to (all nodes of one module call), or None."""
    if step.module_types:
        path = _in_module_of(src, step.module_types)
        return None if path is None else _module_group(index, path)
    if step.module_class_names:
        for path, cls in reversed(src.module_stack):
            if cls.rsplit(".", 1)[-1] in step.module_class_names:
                return _module_group(index, path)
    if src.op_name in step.ops and not _in_leaf(src):
        return src.node_name, {src.node_name}
    return None


def _call_site(index: TraceIndex, nodes: set[str]) -> NodeSource:
    first = min((index.by_name[n] for n in nodes), key=lambda s: s.index)
    return first


def find_runtime_only(
    index: TraceIndex, model: nn.Module, matches: Sequence[Match], rules: Iterable[Rule] = ()
) -> list[Match]:
    rules = list(rules)
    covered: dict[tuple[str, str], set[int]] = defaultdict(set)
    built_here: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    # a match of a rule that supersedes others (Rule ``supersedes``) covers their sites too
    supersedes = {r.name: tuple(getattr(r, "supersedes", ()) or ()) for r in rules}
    for m in matches:
        covered[(m.rule, realpath(m.file))].update(m.lines)
        for inner in supersedes.get(m.rule, ()):
            covered[(inner, realpath(m.file))].update(m.lines)
        if m.sequential is not None:
            built_here[(m.rule, realpath(m.file))].append((m.sequential.line, m.sequential.end_line))

    def in_matched_sequential(rule: str, chain) -> bool:
        """The chain's modules are children of one nn.Sequential built where a static match of
        ``rule`` sits (matched once there, not at each call)."""
        parents = {path.rpartition(".")[0] for path, _g in chain}
        if len(parents) != 1:
            return False
        try:
            seq = model.get_submodule(parents.pop())
        except AttributeError:
            return False
        site = seq.__dict__.get(BUILT_AT)
        return site is not None and any(a <= site[1] <= b for a, b in built_here.get((rule, site[0]), ()))
    found: dict[tuple, list] = {}
    sequences = {r.name: r.runtime.sequence for r in rules if getattr(getattr(r, "runtime", None), "sequence", ())}
    for rule, steps in sequences.items():
        for src in index.sources:
            first = _step_group(index, steps[0], src)
            if first is None or src.node_name != min(first[1], key=lambda n: index.by_name[n].index):
                continue
            chain = [first]
            for step in steps[1:]:
                nxt = None
                prev_nodes = chain[-1][1]
                for user in _direct_users(index, prev_nodes):
                    g = _step_group(index, step, index.by_name[user])
                    if g is not None and g[0] != chain[-1][0]:
                        nxt = g
                        break
                if nxt is None:
                    break
                chain.append(nxt)
            if len(chain) != len(steps):
                continue
            # as the static rules require: no intermediate value is read outside the chain
            # (ViT's ``hidden_states + residual`` also feeds the next residual: not fusable)
            if any(not set(_direct_users(index, a[1])) <= b[1] for a, b in zip(chain, chain[1:])):
                continue
            if in_matched_sequential(rule, chain):
                continue
            sites = [_call_site(index, g[1]) for g in chain]
            # Only sequences written in one function of one class instance are rewritable
            # at the source; chains across module boundaries (ViT's dropout in ViTSelfOutput,
            # residual add in ViTLayer) are runtime facts, not source matches.
            if any(s.file is None for s in sites) or len({(s.file, s.function) for s in sites}) != 1:
                continue
            owners = {_owner_path(s, s.class_name) for s in sites}
            if len(owners) != 1:
                continue
            file = sites[0].file
            lines = tuple(s.line for s in sites)
            if covered[(rule, file)] & set(lines):
                continue
            key = (rule, file, lines)
            found.setdefault(key, []).append((chain, sites, owners.pop()))
    out = []
    for (rule, file, lines), occurrences in found.items():
        chain, sites, owner_path = occurrences[0]
        owner_class = sites[-1].class_name
        nodes = []
        for i, ((path, _group), site, step) in enumerate(zip(chain, sites, sequences[rule])):
            span = Span(site.line, 0, site.line, 0, function=site.function or "")
            if step.is_operator:
                nodes.append(MatchedNode(i, TensorOp(step.kind, span=span)))
            else:
                kind = step.kind
                owner = _owner_path(site, owner_class)
                module = None
                rel = path[len(owner) + 1:] if owner and path.startswith(owner + ".") else (path if not owner else "")
                if rel and path in _module_paths(site):
                    module = Var("self." + rel)
                nodes.append(MatchedNode(i, Layer(kind, module=module, span=span)))
        function = (sites[-1].function or "").rsplit(".", 1)[-1]
        n = len(occurrences)
        out.append(
            Match(
                rule=rule,
                file=file,
                class_name=owner_class,
                function=function,
                nodes=tuple(nodes),
                status="runtime-only",
                reason=(
                    f"executes at lines {', '.join(map(str, lines))} in {n} instance{'s' if n != 1 else ''} "
                    f"(e.g. {owner_path or 'the model'}) but no static match covers it"
                ),
            )
        )
    return out


def _module_paths(site: NodeSource) -> set[str]:
    return {p for p, _ in site.module_stack}


def _owner_path(site: NodeSource, class_name: str | None) -> str:
    if class_name:
        for path, cls in reversed(site.module_stack):
            if cls.rsplit(".", 1)[-1] == class_name:
                return path
    return ""


def _direct_users(index: TraceIndex, names: set[str]) -> list[str]:
    """Nodes outside ``names`` fed by them, through transparent ops; in graph order."""
    out, seen, stack = [], set(), list(names)
    while stack:
        name = stack.pop()
        for user in index.users(name):
            if user in names or user in seen:
                continue
            seen.add(user)
            if index.is_transparent(user):
                stack.append(user)
            elif user in index.by_name:
                out.append(user)
    return sorted(out, key=lambda n: index.by_name[n].index)


