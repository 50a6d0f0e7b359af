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

Each of the last three names its cause in ``Match.trace_code`` (:data:`.trace_codes.TRACE_CODES`:
``lines-not-run``, ``not-fed``, ``not-in-model``...); the ``reason`` says it in prose.

A ``conditional`` match (the source does not settle whether the kernel applies, e.g. the
activation behind ``ACT2FN[config.hidden_act]``) is settled the same way (its ``condition`` is
kept); a ``refused`` one (a precision precondition fails) is returned unchanged.

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
from adopter.core.rule import GraphOp, Rule, RuntimeSite
from adopter.core.rules import all_rules, find_rule
from adopter.core.structures import Match, MatchedNode

from .build_sites import built_at, recorded
from .capture import Capture, CaptureError, capture_model, leaf_modules_of
from .runtime_only import find_runtime_only
from .source_map import enclosing_condition, enclosing_scope
from .trace_codes import TraceCode, traced
from .trace_index import TraceIndex, realpath

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


@functools.cache
def _class_file(cls: type) -> str | None:
    f = _main_class_file(cls) if cls.__module__ == "__main__" else None
    if f is None:
        try:
            f = inspect.getsourcefile(cls)
        except (TypeError, OSError):
            return None
    return os.path.realpath(f) if f else None


def _main_class_file(cls: type) -> str | None:
    """Where a class of the script being run or of a notebook cell was compiled: its ``forward``'s
    (else ``__init__``'s) file name (``__main__.__file__`` is no cell's, and a notebook has none)."""
    for name in ("forward", "__init__"):
        code = getattr(inspect.unwrap(vars(cls)[name]), "__code__", None) if name in vars(cls) else None
        if code is not None:
            return code.co_filename
    return None


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
    problem_code: TraceCode | None = None  # its trace code


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
            found.problem_code = "not-fed"
            return found
    for js in shared:
        roots = [index.roots(groups[j], groups[j]) for j in js]
        if not set.intersection(*roots):
            lines = ", ".join(str(match.nodes[j].node.span.line) for j in js)
            found.problem = f"lines {lines} do not read the same tensor at runtime"
            found.problem_code = "inputs-differ"
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
                found.problem_code = "out-of-order"
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


def _torch_class(type_name: str) -> type | None:
    if not type_name.startswith("torch.nn."):
        return None
    cls = getattr(nn, type_name.rsplit(".", 1)[-1], None)
    return cls if isinstance(cls, type) else None


def _confirm_sequential(index: TraceIndex, match: Match, model: nn.Module, rule: Rule | None) -> Match:
    """A pair of entries of an ``nn.Sequential``, matched where it is built: confirmed when a
    Sequential this model built there runs two consecutive children of the matched classes, the
    first feeding the second, and the rule's runtime check passes on them."""
    file = realpath(match.file)
    span = match.sequential
    if not recorded(model):
        return traced(match, "untraced", (
            "where a Sequential was built is known only for models adopter instantiates "
            "(adopter scan --model, optimize, verify)"), "sequential-unrecorded")
    built = built_at(model, file, span.line, span.end_line)
    if not built:
        return traced(match, "not-executed", (
            f"no nn.Sequential of this model is built at line {span.line} under this configuration"),
            "sequential-not-built")
    wanted = [_torch_class(mn.node.type) for mn in match.nodes if isinstance(mn.node, Layer)]
    confirmed, failure = [], ""
    for path, seq in built:
        names = list(seq._modules)
        for a, b in zip(names, names[1:]):
            first, second = seq._modules[a], seq._modules[b]
            if any(cls is not None and not isinstance(mod, cls) for cls, mod in zip(wanted, (first, second))):
                continue
            groups = [{s.node_name for s in index.sources if s.within(_join(path, n))} for n in (a, b)]
            if not all(groups) or not index.flows(groups[0], groups[1]):
                continue
            if rule is not None and rule.runtime.check is not None:
                site = RuntimeSite(
                    match=match, instance=path, modules=(first, second),
                    ops=tuple(tuple(_graph_op(index, n) for n in sorted(g, key=lambda n: index.by_name[n].index))
                              for g in groups),
                )
                problem, facts = rule.runtime.check(site)
                if problem:
                    failure = failure or problem
                    continue
            confirmed.append(f"{_join(path, a)} -> {b}")
    if confirmed:
        more = f" and {len(confirmed) - 1} more" if len(confirmed) > 1 else ""
        return traced(match, "confirmed", f"runs in the Sequential built here: {confirmed[0]}{more}")
    if failure:
        return traced(match, "rejected", f"runtime precondition fails: {failure}", "runtime-check")
    return traced(match, "not-executed", (
        f"the nn.Sequential built at line {span.line} does not run two such consecutive children"),
        "sequential-pair-not-run")


def _confirm_one(index: TraceIndex, match: Match, model: nn.Module, rule: Rule | None) -> Match:
    if match.sequential is not None:
        return _confirm_sequential(index, match, model, rule)
    file = realpath(match.file)
    match_r = replace(match, file=file) if file != match.file else match
    if match.class_name:
        instances = [p for p, _ in _instances(model, match.class_name, file)]
        if not instances:
            return traced(match, "untraced", f"class {match.class_name} is not part of this model (no instance of it)",
                          "not-in-model")
    else:
        if file not in index.by_file and not any(_class_file(type(m)) == file for m in model.modules()):
            return traced(match, "untraced", f"{os.path.basename(file)} is not part of this model", "not-in-model")
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
            return traced(match, "rejected", f"runtime precondition fails in {inst or 'model'}: {failure}",
                          "runtime-check")
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
        return traced(match, "confirmed", reason)
    partial = [r for r in results if len(r.missing) < len(match.nodes)]
    flawed = next((r for r in results if r.problem), None)
    if flawed is not None:
        return traced(match, "not-executed", f"{where} runs but {flawed.problem}", flawed.problem_code)
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
    return traced(match, "not-executed", reason, "lines-not-run")


def _modules_of(match: Match) -> frozenset[str]:
    return frozenset(
        mn.node.module.name for mn in match.nodes if getattr(getattr(mn.node, "module", None), "name", None)
    )


def _confirmed_through_its_pair(match: Match, matches: Sequence[Match]) -> Match:
    """A ``not-executed`` match over the same modules as a ``confirmed`` match of its rule in its
    class (``forward_intermediates`` running the Conv+BN pair ``forward_features`` runs, which the
    trace of ``forward`` never reaches) is confirmed too: every method that runs a pair gets the
    same rewrite, or one model answers two ways; the pair's modules are what the trace checked."""
    if match.status != "not-executed" or not match.class_name or match.sequential is not None:
        return match
    modules = _modules_of(match)
    if not modules:
        return match
    for other in matches:
        if (other.status == "confirmed" and other.rule == match.rule and other.class_name == match.class_name
                and realpath(other.file) == realpath(match.file) and _modules_of(other) == modules):
            return traced(match, "confirmed", (
                f"the pair {', '.join(sorted(modules))} that {other.function} runs (line {min(other.lines or [0])}); "
                f"{match.function} did not run in the trace, and every method that runs the pair gets its rewrite"
            ))
    return match


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
            return [m if m.status == "refused" else traced(m, "untraced", reason, "capture-failed") for m in matches]
    index = TraceIndex.build(capture)
    # A refused match stays refused (a precision precondition fails whatever runs); a conditional
    # one is settled here like a static one (confirmed, rejected...), keeping its condition.
    out = [m if m.status == "refused" else _confirm_one(index, m, model, find_rule(m.rule, rules)) for m in matches]
    out = [_confirmed_through_its_pair(m, out) for m in out]
    if runtime_only:
        files = scanned_files if scanned_files is not None else {m.file for m in matches} or None
        extra = find_runtime_only(index, model, matches, rules or all_rules())
        if files is not None:
            wanted = {realpath(str(f)) for f in files}
            extra = [m for m in extra if m.file in wanted]
        out += extra
    return out


# ------------------------------------------------------------------ notes on reasons


def with_config_note(match: Match, attn: str) -> Match:
    """Name the attention implementation where the lines that did not run are eager attention code."""
    if match.trace_code == "lines-not-run" and "eager" in match.reason:
        return replace(match, reason=match.reason.replace(
            "under this configuration", f"under this configuration (attn_implementation={attn})"))
    return match
