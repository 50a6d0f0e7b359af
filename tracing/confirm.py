"""Confirm static matches against what the instantiated model actually executes.

Rule-agnostic: what is specific to a rule (its runtime check, the layer sequence to look for,
the layers to keep whole) comes from the rule's :class:`~adopter.core.rule.Runtime`, looked up
by the match's rule name. For every static :class:`Match`:

* ``confirmed`` — in at least one module instance of the match's class, every matched node's
  source line produced graph nodes, in the matched order, with the matched data flow between
  them (a dropout's output reaches the add, the add's output the layer norm; three projections
  read the same tensor); and the rule's runtime check passes (e.g. the activation is a GeLU the
  kernel implements; shapes and biases fit).
* ``not-executed`` — the class runs in this model but the matched lines never execute under
  this configuration (``eager_attention_forward`` when the model uses SDPA; DPT's BatchNorm
  branch with ``use_batch_norm=False``), or they run without the matched data flow.
* ``rejected`` — the sequence executes, but the rule's runtime check fails (ReLU behind
  ``ACT2FN[config.hidden_act]``, q/k/v projections with different in_features...).
* ``untraced`` — no trace is available, or the class is not part of this model.

Runtime sequences of a rule (``Runtime.sequence``) that no static match covers come back as
``runtime-only`` matches.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch import nn

from adopter.core.dsl import Layer, Span, TensorOp, Var
from adopter.core.ops import FUNCTION_OP_NAMES, TENSOR_OP_NAMES
from adopter.core.rule import GraphOp, Rule, RuntimeSite, RuntimeStep
from adopter.core.rules import all_rules, find_rule
from adopter.core.structures import Match, MatchedNode

from .capture import Capture, CaptureError, capture_model, leaf_modules_of
from .source_map import NodeSource, enclosing_condition, enclosing_scope, map_nodes

# ------------------------------------------------------------------ op vocabulary

# Graph ops that only move/reshape data: data flow passes through them.
TRANSPARENT_OPS = {
    "view", "reshape", "_unsafe_view", "transpose", "permute", "contiguous", "to", "_to_copy",
    "clone", "expand", "unsqueeze", "squeeze", "flatten", "getitem", "alias", "type_as", "detach",
    "t", "float", "half", "bfloat16", "type", "lift_fresh_copy", "_assert_tensor_metadata",
    "dropout_identity",
}

# ------------------------------------------------------------------ graph access


@dataclass
class TraceIndex:
    """A capture plus per-node sources and lookups used by confirmation."""

    capture: Capture
    sources: list[NodeSource]
    by_name: dict[str, NodeSource]
    nodes: dict[str, torch.fx.Node]
    by_file: dict[str, list[NodeSource]]
    by_line: dict[tuple[str, int], list[NodeSource]]  # (file, line) of any frame -> nodes

    @classmethod
    def build(cls, capture: Capture) -> TraceIndex:
        sources = map_nodes(capture.graph_module)
        nodes = {n.name: n for n in capture.graph_module.graph.nodes}
        by_file: dict[str, list[NodeSource]] = defaultdict(list)
        by_line: dict[tuple[str, int], list[NodeSource]] = defaultdict(list)
        for s in sources:
            for f in {fr.file for fr in s.frames}:
                by_file[f].append(s)
            for key in {(fr.file, fr.line) for fr in s.frames}:
                by_line[key].append(s)
        return cls(capture, sources, {s.node_name: s for s in sources}, nodes, by_file, by_line)

    def at_lines(self, file: str, lines: range) -> list[NodeSource]:
        """Nodes with a frame at one of ``lines`` of ``file``, in graph order."""
        found = {}
        for line in lines:
            for s in self.by_line.get((file, line), ()):
                found[s.node_name] = s
        return sorted(found.values(), key=lambda s: s.index)

    def users(self, name: str) -> list[str]:
        return [u.name for u in self.nodes[name].users]

    def inputs(self, name: str) -> list[str]:
        return [a.name for a in self.nodes[name].all_input_nodes]

    def is_transparent(self, name: str) -> bool:
        src = self.by_name.get(name)
        if src is None:
            return False
        op = src.op_name
        if op in TRANSPARENT_OPS:
            return True
        # eval-mode dropout and identity-like modules pass data through in a symbolic trace
        return src.op == "call_module" and op in ("identity", "flatten")

    def flows(self, sources: set[str], targets: set[str]) -> bool:
        """Some target is reachable from some source through source/transparent nodes only."""
        seen = set()
        stack = list(sources)
        while stack:
            name = stack.pop()
            for user in self.users(name):
                if user in targets:
                    return True
                if user in seen:
                    continue
                seen.add(user)
                if user in sources or self.is_transparent(user):
                    stack.append(user)
        return False

    def roots(self, names: Iterable[str], exclude: set[str]) -> set[str]:
        """Data inputs of ``names`` from outside the group, followed back through transparent ops."""
        out = set()
        for name in names:
            for inp in self.inputs(name):
                if inp in exclude:
                    continue
                node = self.nodes[inp]
                if node.op in ("get_attr",) or (node.op == "placeholder" and _is_param(node)):
                    continue
                out |= self._root(inp)
        return out

    def _root(self, name: str) -> set[str]:
        while self.is_transparent(name):
            ins = [i for i in self.inputs(name) if self.nodes[i].op != "get_attr"]
            if len(ins) != 1:
                break
            name = ins[0]
        return {name}


def _is_param(node: torch.fx.Node) -> bool:
    # torch.export lifts parameters/buffers to placeholders named p_*/b_*/c_*
    return node.name.startswith(("p_", "b_", "c_"))


# ------------------------------------------------------------------ helpers on matches


def _attr_path(var: Var | None) -> str | None:
    """``self.encoder.layers[2]`` -> ``encoder.layers.2``; None if not an attribute of self."""
    if var is None or not var.name.startswith("self."):
        return None
    return var.name[len("self."):].replace("[", ".").replace("]", "")


def _join(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _span_lines(span: Span | None) -> range | None:
    if span is None:
        return None
    return range(span.line, max(span.line, span.end_line) + 1)


def _op_names_for(node) -> set[str] | None:
    if isinstance(node, TensorOp):
        key = node.op if len(node.args) != 1 else "u" + node.op
        return TENSOR_OP_NAMES.get(key) or TENSOR_OP_NAMES.get(node.op)
    if isinstance(node, Layer):
        last = node.type.rsplit(".", 1)[-1]
        return FUNCTION_OP_NAMES.get(last)
    return None


def _realpath(p: str) -> str:
    return os.path.realpath(p) if p else p


@functools.cache
def _class_file(cls: type) -> str | None:
    try:
        f = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    return os.path.realpath(f) if f else None


def _instances(model: nn.Module, class_name: str, file: str) -> list[tuple[str, nn.Module]]:
    """Module instances whose class (or a base whose forward they inherit) is ``class_name`` of ``file``."""
    out = []
    for path, module in model.named_modules():
        for klass in type(module).__mro__:
            if klass.__name__ == class_name and _class_file(klass) == file:
                out.append((path, module))
                break
    return out


# ------------------------------------------------------------------ per-match evaluation


@dataclass
class _Found:
    """The graph nodes each matched node produced in one instance."""

    instance: str
    groups: list[set[str]]
    missing: list[int]  # indexes of matched nodes with no graph node
    problem: str = ""  # order/data-flow failure


def _candidates(
    index: TraceIndex, match: Match, mnode: MatchedNode, instance: str, model: nn.Module
) -> set[str] | None:
    node = mnode.node
    span = getattr(node, "span", None)
    lines = _span_lines(span)
    file = match.file
    if lines is None:
        return None  # a node without position (a wildcard): nothing to look for
    out = set()
    sub = None
    module_var = getattr(node, "module", None) if isinstance(node, Layer) else None
    attr = _attr_path(module_var)
    if attr is not None:
        sub = _join(instance, attr)
        try:
            target = model.get_submodule(sub)
        except AttributeError:
            target = None
        if not isinstance(target, nn.Module):
            sub = None  # e.g. an activation function stored on self: match by line below
    if sub is not None:
        for s in index.at_lines(file, lines):
            if s.within(sub):
                out.add(s.node_name)
        return out
    names = _op_names_for(node)
    func = (span.function or "").rsplit(".", 1)[-1] if span is not None else ""
    for s in index.at_lines(file, lines):
        frame = s.innermost_frame_in(file)
        if frame is None or frame.line not in lines:
            continue
        if func and frame.function != func:
            continue
        if instance and not s.within(instance):
            continue
        if names is not None and s.op_name not in names:
            continue
        out.add(s.node_name)
    return out


def _flow_requirements(match: Match) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Pairs (i, j): node i's output is an input of node j; groups of nodes reading one same value."""
    nodes = [mn.node for mn in match.nodes]
    outputs = {}
    for i, n in enumerate(nodes):
        out = getattr(n, "output", None)
        if isinstance(out, Var):
            outputs[(out.name, out.version)] = i
    pairs = []
    readers: dict[tuple[str, int], list[int]] = defaultdict(list)
    for j, n in enumerate(nodes):
        for arg in getattr(n, "args", ()):
            v = arg.value
            if not isinstance(v, Var) or v.name.startswith("self."):
                continue
            key = (v.name, v.version)
            if key in outputs and outputs[key] != j:
                pairs.append((outputs[key], j))
            elif key not in outputs:
                readers[key].append(j)
    shared = [js for js in readers.values() if len(set(js)) > 1]
    return pairs, shared


def _evaluate_instance(index: TraceIndex, match: Match, instance: str, model: nn.Module) -> _Found:
    looked = [_candidates(index, match, mn, instance, model) for mn in match.nodes]
    missing = [i for i, g in enumerate(looked) if g is not None and not g]
    groups = [g or set() for g in looked]
    found = _Found(instance, groups, missing)
    if missing:
        return found
    pairs, shared = _flow_requirements(match)
    pairs = [(i, j) for i, j in pairs if looked[i] is not None and looked[j] is not None]
    shared = [[j for j in js if looked[j] is not None] for js in shared]
    shared = [js for js in shared if len(js) > 1]
    for i, j in pairs:
        if not index.flows(groups[i], groups[j]):
            found.problem = (
                f"line {match.nodes[i].node.span.line} does not feed line {match.nodes[j].node.span.line} at runtime"
            )
            return found
    for js in shared:
        roots = [index.roots(groups[j], groups[j]) for j in js]
        if not set.intersection(*roots):
            lines = ", ".join(str(match.nodes[j].node.span.line) for j in js)
            found.problem = f"lines {lines} do not read the same tensor at runtime"
            return found
    # order: data-connected nodes are ordered by construction; straight-line statements by line
    first = [min((index.by_name[n].index for n in g), default=-1) for g in groups]
    for a in range(len(groups)):
        for b in range(a + 1, len(groups)):
            sa, sb = match.nodes[a].node.span, match.nodes[b].node.span
            if looked[a] is None or looked[b] is None:
                continue
            if sa.function != sb.function or sa.stmt_line == sb.stmt_line or not sa.stmt_line:
                continue
            if (sa.stmt_line < sb.stmt_line) != (first[a] < first[b]):
                found.problem = f"lines {sa.line} and {sb.line} execute in the other order"
                return found
    return found


# ------------------------------------------------------------------ runtime preconditions


def _module_for(model: nn.Module, instance: str, node) -> nn.Module | None:
    attr = _attr_path(getattr(node, "module", None))
    if attr is None:
        return None
    try:
        return model.get_submodule(_join(instance, attr))
    except AttributeError:
        return None


def _shape(index: TraceIndex, name: str):
    val = index.nodes[name].meta.get("val")
    if val is None:
        tm = index.nodes[name].meta.get("tensor_meta")
        return tuple(tm.shape) if tm is not None else None
    return tuple(val.shape) if hasattr(val, "shape") else None


def _graph_op(index: TraceIndex, name: str) -> GraphOp:
    node = index.nodes[name]

    def constant(value):
        return None if isinstance(value, torch.fx.Node) else value

    data_inputs = [i for i in index.inputs(name) if index.nodes[i].op != "get_attr"]
    return GraphOp(
        name=index.by_name[name].op_name,
        kind=node.op,
        args=tuple(constant(a) for a in node.args),
        kwargs={k: constant(v) for k, v in node.kwargs.items()},
        input_shapes=tuple(_shape(index, i) for i in data_inputs),
    )


def runtime_site(index: TraceIndex, match: Match, found: _Found, model: nn.Module) -> RuntimeSite:
    """What the rule's runtime check sees of ``match`` in one instance."""
    nodes = [mn.node for mn in match.nodes]
    ops = tuple(
        tuple(_graph_op(index, n) for n in sorted(group, key=lambda n: index.by_name[n].index))
        for group in found.groups
    )
    return RuntimeSite(
        match=match,
        instance=found.instance,
        modules=tuple(_module_for(model, found.instance, n) for n in nodes),
        ops=ops,
    )


def _check_preconditions(
    index: TraceIndex, match: Match, found: _Found, model: nn.Module, rule: Rule | None
) -> tuple[str | None, str]:
    """``(failure or None, facts)`` from the rule's runtime check in one instance."""
    check = rule.runtime.check if rule is not None else None
    if check is None:
        return None, ""
    return check(runtime_site(index, match, found, model))


# ------------------------------------------------------------------ confirmation


def _confirm_one(index: TraceIndex, match: Match, model: nn.Module, rule: Rule | None) -> Match:
    file = _realpath(match.file)
    match_r = replace(match, file=file) if file != match.file else match
    if match.class_name:
        instances = [p for p, _ in _instances(model, match.class_name, file)]
        if not instances:
            return replace(
                match, status="untraced",
                reason=f"class {match.class_name} is not part of this model (no instance of it)",
            )
    else:
        if file not in index.by_file and not any(_class_file(type(m)) == file for m in model.modules()):
            return replace(match, status="untraced", reason=f"{os.path.basename(file)} is not part of this model")
        instances = [""]
    results = [_evaluate_instance(index, match_r, inst, model) for inst in instances]
    ok = [r for r in results if not r.missing and not r.problem]
    where = "function " + match.function if not match.class_name else f"{match.class_name}"
    if ok:
        failures, facts = [], ""
        for r in ok:
            failure, facts_r = _check_preconditions(index, match_r, r, model, rule)
            if failure:
                failures.append((r.instance, failure))
            else:
                facts = facts or facts_r
        if len(failures) == len(ok):
            inst, failure = failures[0]
            return replace(match, status="rejected", reason=f"runtime precondition fails in {inst or 'model'}: {failure}")
        n = len(ok) - len(failures)
        label = "instance" if n == 1 else "instances"
        first = next(r.instance for r in ok if r.instance not in {i for i, _ in failures})
        reason = f"runs in {n} {label} (e.g. {first or 'model'})" if match.class_name else f"runs ({n} call site{'s' if n != 1 else ''})"
        if match.class_name is None:
            reason = f"runs in {len(_instances_running(index, match_r, results[0]))} module instance(s)"
        if facts:
            reason += f"; {facts}"
        if failures:
            reason += f"; precondition fails in {len(failures)} other: {failures[0][1]}"
        return replace(match, status="confirmed", reason=reason)
    partial = [r for r in results if len(r.missing) < len(match.nodes)]
    problem = next((r.problem for r in results if r.problem), "")
    if problem:
        return replace(match, status="not-executed", reason=f"{where} runs but {problem}")
    lines = sorted({match.nodes[i].node.span.line for r in results for i in r.missing if match.nodes[i].node.span})
    if partial:
        r = min(partial, key=lambda r: len(r.missing))
        lines = sorted({match.nodes[i].node.span.line for i in r.missing})
    line_text = ", ".join(map(str, lines))
    # say why, where the source says it: the branch or the helper function holding the lines
    functions = sorted({f for f in (enclosing_scope(file, ln)[0] for ln in lines) if f}
                       - {f"{match.class_name}.{match.function}", match.function})
    if functions:
        line_text += f" (in {', '.join(functions)})"
    condition = next((c for c in (enclosing_condition(file, ln) for ln in lines) if c), None)
    if condition:
        line_text += f" (under `{condition}`)"
    if match.class_name:
        reason = (
            f"{match.class_name} runs ({len(instances)} instance{'s' if len(instances) != 1 else ''}) "
            f"but line{'s' if len(lines) != 1 else ''} {line_text} never execute{'s' if len(lines) == 1 else ''} "
            f"under this configuration"
        )
    else:
        reason = f"{match.function} line{'s' if len(lines) != 1 else ''} {line_text} never execute{'s' if len(lines) == 1 else ''} under this configuration"
    return replace(match, status="not-executed", reason=reason)


def _instances_running(index: TraceIndex, match: Match, found: _Found) -> set[str]:
    paths = set()
    for g in found.groups:
        for n in g:
            paths.add(index.by_name[n].module_path or "")
    return paths


def confirm_matches(
    model: nn.Module,
    example_inputs: dict[str, Any],
    matches: Sequence[Match],
    *,
    capture: Capture | None = None,
    runtime_only: bool = True,
    scanned_files: Iterable[str] | None = None,
    rules: Sequence[Rule] = (),
) -> list[Match]:
    """Set ``status``/``reason`` of every match from a trace of ``model`` on ``example_inputs``;
    append ``runtime-only`` matches for executed rule sequences no static match covers.

    ``rules``: the rules in use (a match's rule is looked up there first, then in the registry;
    runtime-only sequences are those of ``rules``, or of every registered rule when empty).

    Runtime-only sequences are reported for ``scanned_files`` (the files the static pass looked
    at); when not given, for the files of ``matches`` (every file when ``matches`` is empty).
    """
    if capture is None:
        try:
            capture = capture_model(model, example_inputs, leaf_modules=leaf_modules_of(rules or all_rules()))
        except CaptureError as exc:
            reason = f"model could not be traced: {exc}"
            return [replace(m, status="untraced", reason=reason) for m in matches]
    index = TraceIndex.build(capture)
    out = [_confirm_one(index, m, model, find_rule(m.rule, rules)) for m in matches]
    if runtime_only:
        files = scanned_files if scanned_files is not None else {m.file for m in matches} or None
        extra = find_runtime_only(index, model, matches, rules or all_rules())
        if files is not None:
            wanted = {_realpath(str(f)) for f in files}
            extra = [m for m in extra if m.file in wanted]
        out += extra
    return out


# ------------------------------------------------------------------ runtime-only sequences


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
    covered: dict[tuple[str, str], set[int]] = defaultdict(set)
    for m in matches:
        covered[(m.rule, _realpath(m.file))].update(m.lines)
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


# ------------------------------------------------------------------ model ids


def confirm_model_id(
    matches: Sequence[Match],
    model_id: str,
    device: str | None = None,
    *,
    scanned_files: Iterable[str] | None = None,
    **build_kwargs,
) -> list[Match]:
    """Build ``model_id`` (see :func:`adopter.tracing.models.build_model`) and confirm ``matches``
    (raises :class:`~adopter.tracing.models.TracingError` when the model cannot be built or fed)."""
    from .models import build_model

    built = build_model(model_id, device=device, **build_kwargs)
    attn = getattr(built.config, "_attn_implementation", None)
    out = confirm_matches(built.model, built.example_inputs, matches, scanned_files=scanned_files)
    if attn:
        out = [with_config_note(m, attn) for m in out]
    return out


def with_config_note(match: Match, attn: str) -> Match:
    """Name the attention implementation where the lines that did not run are eager attention code."""
    if match.status == "not-executed" and "eager" in match.reason and "under this configuration" in match.reason:
        return replace(match, reason=match.reason.replace(
            "under this configuration", f"under this configuration (attn_implementation={attn})"))
    return match
