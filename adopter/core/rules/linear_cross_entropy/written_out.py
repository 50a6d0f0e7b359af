"""The written-out form of the site (issue 24): the head's output reaching torch's cross entropy as
the source writes it out (nanoGPT, minGPT, GPT-2 style, torchtitan/litgpt-style helpers).

``F.cross_entropy(logits.view(-1, logits.size(-1)), ...)``, an ``nn.CrossEntropyLoss`` (bound in
``__init__``, a local, or built inline), a shift ``logits[..., :-1, :].contiguous()`` on the way, or
a module-level helper of the same file that is provably that expression (:mod:`.inline`). What the
code computes decides, never a name. :func:`cross_entropy_site` reads the site off the function's
tree, refuses it when the logits change before the loss or are read elsewhere, and gives it as a
:class:`~.site.CrossEntropySite`.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from adopter.core.match import Refusal
from adopter.core.match.source import same_file_lineage
from adopter.core.rules.linear_cross_entropy import flow
from adopter.core.rules.linear_cross_entropy.flow import ends, starts
from adopter.core.rules.linear_cross_entropy.heads import classifier_head, pooled
from adopter.core.rules.linear_cross_entropy.inline import inline_helper, tensor_params
from adopter.core.rules.linear_cross_entropy.layout import ce_input, chain, layout
from adopter.core.rules.linear_cross_entropy.names import (
    class_of,
    import_map,
    module_function,
    names_in,
    qualified,
    single_assign,
    stored_names,
)
from adopter.core.rules.linear_cross_entropy.site import CrossEntropySite, ExprRef, Layout, NotAMatch, span_of
from adopter.core.syntax import walk

CE_FUNCTION = "torch.nn.functional.cross_entropy"
CE_MODULES = ("torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss")


@dataclass
class _Reading:
    """A cross entropy the head's output reaches, as read off the function's tree (its nodes)."""

    head_stmt: ast.Assign
    logits: str
    loss_call: ast.Call  # the call in the function: the cross entropy, or the helper's call
    loss_fn: ast.expr  # what the kernel gets as the cross entropy
    args: list[ast.expr]  # the cross entropy's positional arguments after its input
    keywords: list[ast.keyword]  # ... and its keywords other than ``input``
    layout: Layout
    reads: set[int]  # ids of the Name nodes of the function the layout reads (allowed)
    shift_stmt: ast.Assign | None = None  # ``shift_logits = logits[..., :-1, :].contiguous()``
    shift: str = ""
    helper: ast.FunctionDef | None = None
    guards: list[ast.expr] = field(default_factory=list)  # see CrossEntropySite.guards


def _refs(inlined: bool) -> Callable[[ast.expr], ExprRef]:
    """How the rewrite gets an expression's text: from the source at its place, or, for a site whose
    cross entropy is an inlined helper's (expressions built from the helper's body and the call's
    arguments), its unparsed text."""
    if inlined:
        return lambda node: ExprRef(text=ast.unparse(node))
    return lambda node: ExprRef(at=span_of(node))


def cross_entropy_site(tree: ast.Module, fn: ast.AST, head_call: ast.Call, source_line) -> CrossEntropySite | Refusal:
    """The site of ``head_call`` in ``fn`` (a function of ``tree``), or the refusal of its logits
    (:func:`_refusal`); raises :class:`NotAMatch` when the head's output reaches no cross entropy it
    lays out as ``(tokens, vocab)``. ``source_line(n)`` is line ``n`` of the file."""
    reading = _read(tree, fn, head_call)
    parents = flow.parent_map(fn)
    early = _early_returns(fn, reading, parents)
    refusal = _refusal(fn, reading, early, parents, source_line)
    if refusal is not None:
        return refusal
    ref = _refs(reading.helper is not None)
    return CrossEntropySite(
        logits=reading.logits, loss_call=span_of(reading.loss_call), loss_fn=ref(reading.loss_fn),
        args=tuple(ref(a) for a in reading.args), unpacks_args=any(isinstance(a, ast.Starred) for a in reading.args),
        keywords=tuple((k.arg, ref(k.value)) for k in reading.keywords), layout=reading.layout,
        shift=reading.shift, shift_value=span_of(reading.shift_stmt.value) if reading.shift_stmt is not None else None,
        helper=reading.helper.name if reading.helper is not None else "",
        guards=tuple(ast.unparse(g) for g in reading.guards), early_returns=tuple(span_of(r.value) for r in early))


# ---------------------------------------------------------------- reading the site


def _module_construction(node: ast.AST | None, imports: dict[str, str], local: set[str]) -> bool:
    return isinstance(node, ast.Call) and qualified(node.func, imports, local) in CE_MODULES


def _self_attr_is_ce(tree: ast.Module, cls: ast.ClassDef | None, attr: str, imports: dict[str, str]) -> bool:
    """``self.<attr>`` is assigned once in the class (or a same-file base class): an
    ``nn.CrossEntropyLoss(...)``."""
    stores, assigns = [], []
    for c in same_file_lineage(tree, cls):
        for node in walk(c):
            if isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                stores.append(node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                assigns.append(node)  # (the statement of the one store, found without a parents map)
    if len(stores) != 1:
        return False
    stmt = next((a for a in assigns if a.targets[0] is stores[0]), None)
    return stmt is not None and _module_construction(stmt.value, imports, set())


def _classify(call: ast.Call, fn: ast.AST, tree: ast.Module, imports: dict[str, str], local: set[str]
              ) -> tuple[str, ast.expr] | None:
    """``(kind, loss_fn expression)`` when ``call`` calls torch's cross entropy (``"function"``,
    ``"module"``) or a module-level helper of the file (``"helper"``), else None."""
    func = call.func
    if qualified(func, imports, local) == CE_FUNCTION:
        return "function", func
    if _module_construction(func, imports, local):
        return "module", func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        if _self_attr_is_ce(tree, class_of(tree, fn), func.attr, imports):
            return "module", func
        return None
    if isinstance(func, ast.Name):
        if func.id in local:
            bound = single_assign(fn, func.id)
            if bound is not None and _module_construction(bound.value, imports, local):
                return "module", func
            return None
        bound = single_assign(tree, func.id)
        if bound is not None and _module_construction(bound.value, imports, set()):
            return "module", func
        if module_function(tree, func.id) is not None:
            return "helper", func
    return None


def _read(tree: ast.Module, fn: ast.AST, head_call: ast.Call) -> _Reading:
    """The cross entropy the head's output reaches in ``fn``; raises :class:`NotAMatch` when none
    (or several) does, in a layout the kernel replays, or when the head reads a pooled vector."""
    parents = flow.parent_map(fn)
    if head_call.args:
        why = pooled(head_call.args[0], fn)
        if why:
            raise NotAMatch(f"a classifier over a pooled vector ({why}), not a language-model head over "
                            "every token")
    head_stmt, logits = flow.head_assignment(head_call, parents)
    imports = import_map(tree, fn)
    local = stored_names(fn)
    # shift_logits = logits[..., :-1, :].contiguous(): assigned once, after the head
    shifts: dict[str, tuple[ast.Assign, list, list]] = {}
    for node in walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and starts(node) > starts(head_stmt) and node.targets[0].id != logits \
                and names_in(node.value, {logits}):
            try:
                base, ops, reads = chain(node.value, {logits}, imports, local)
            except NotAMatch:
                continue
            name = node.targets[0].id
            if ops and all(k in ("rows", "contiguous", "float") for k, _ in ops) \
                    and single_assign(fn, name) is node and not flow.dominated(head_stmt, node, parents):
                shifts[name] = (node, ops, reads)
    found, why_not = [], []
    for call in sorted((n for n in walk(fn) if isinstance(n, ast.Call) and starts(n) > ends(head_stmt)), key=starts):
        if not names_in(call, {logits, *shifts}):
            continue
        classified = _classify(call, fn, tree, imports, local)
        if classified is None:
            continue
        kind, loss_fn = classified
        helper = None
        guards: list[ast.expr] = []
        ce_call = call
        if kind == "helper":
            helper = module_function(tree, call.func.id)

            def torch_cross_entropy(expr: ast.expr) -> bool:
                inner = _classify(expr, fn, tree, imports, local) if isinstance(expr, ast.Call) else None
                return inner is not None and inner[0] != "helper"

            try:
                expr, guards = inline_helper(helper, call, tensor_params(helper, call, {logits, *shifts}),
                                             accept=torch_cross_entropy)
            except NotAMatch as exc:
                why_not.append(str(exc))
                continue
            if any(names_in(g, {logits, *shifts}) for g in guards):
                # the guard runs before the head: it cannot read the logits
                why_not.append(f"the call of {helper.name} decides its branch from the logits")
                continue
            free = {n.id for n in walk(expr) if isinstance(n, ast.Name)} - {
                n.id for n in walk(call) if isinstance(n, ast.Name)}
            if not isinstance(expr, ast.Call) or free & local:
                why_not.append(f"helper {helper.name} does not return torch's cross entropy of its arguments")
                continue
            inner = _classify(expr, fn, tree, imports, local)
            if inner is None or inner[0] == "helper":
                why_not.append(f"helper {helper.name} does not return torch's cross entropy of its arguments")
                continue
            kind, loss_fn = inner
            ce_call = expr
        input_expr, args, keywords = ce_input(ce_call)
        if input_expr is None or not names_in(input_expr, {logits, *shifts}):
            continue
        try:
            base, ops, reads = chain(input_expr, {logits, *shifts}, imports, local)
            shift_stmt = None
            if base in shifts:
                shift_stmt, shift_ops, shift_reads = shifts[base]
                if starts(shift_stmt) > starts(call):
                    raise NotAMatch(f"{base} is assigned after the cross entropy")
                ops, reads = shift_ops + ops, shift_reads + reads
            found_layout = layout(ops, _refs(helper is not None))
        except NotAMatch as exc:
            why_not.append(str(exc))
            continue
        where = flow.dominated(head_stmt, flow.statement(call, parents), parents)
        if where:
            why_not.append(f"the cross entropy: {where}")
            continue
        found.append(_Reading(
            head_stmt=head_stmt, logits=logits, loss_call=call, loss_fn=loss_fn, args=args, keywords=keywords,
            layout=found_layout, reads=set(map(id, reads)), shift_stmt=shift_stmt,
            shift=base if shift_stmt is not None else "", helper=helper, guards=guards))
    if not found:
        raise NotAMatch(f"{logits} reaches no cross entropy it lays out as (tokens, vocab)"
                        + (f" ({why_not[0]})" if why_not else ""))
    if len(found) > 1:
        raise NotAMatch(f"{logits} reaches {len(found)} cross entropies")
    # last: it reads the whole file (cached per tree)
    classifier = classifier_head(tree, fn, head_call)
    if classifier:
        raise NotAMatch(classifier)
    return found[0]


# ---------------------------------------------------------------- what else reads the logits


def _refusal(fn: ast.AST, site: _Reading, early: list[ast.Return], parents: dict, source_line) -> Refusal | None:
    """``logits-transformed`` when the logits (or the shift's name) change between the head and the
    cross entropy; ``logits-read`` when they are read elsewhere than the cross entropy's input
    layout and an output the function packs them into after it."""
    loss_stmt = flow.statement(site.loss_call, parents)
    names = {site.logits} | ({site.shift} if site.shift else set())
    for name in sorted(names):
        origin = site.head_stmt if name == site.logits else site.shift_stmt  # where the name gets its value
        uses = sorted((n for n in walk(fn) if isinstance(n, ast.Name) and n.id == name
                       and id(n) not in site.reads and starts(n) > ends(site.head_stmt)
                       and not (site.shift_stmt is not None and n is site.shift_stmt.targets[0])), key=starts)
        for node in uses:
            stmt = flow.statement(node, parents)
            if flow.exclusive(stmt, site.head_stmt, parents):
                continue
            if starts(stmt) < starts(loss_stmt) and name == site.logits and stmt in early:
                continue  # the rewrite runs the head on that path (see the codemod)
            if starts(stmt) < starts(loss_stmt):
                refusal = flow.transformed(node, stmt, parents, source_line)
                if refusal is not None:
                    return refusal
                return Refusal("logits-read", f"line {stmt.lineno} reads {name} before the loss "
                                              f"({source_line(stmt.lineno)}): in training the fused path never "
                                              "computes the logits")
            if isinstance(node.ctx, (ast.Store, ast.Del)) or flow.killed(node, origin, name, fn, parents):
                continue
            if flow.inside(node, site.loss_call):
                return Refusal("logits-read", f"the cross entropy reads {name} beside its input "
                                              f"({source_line(stmt.lineno)})")
            if name == site.logits and starts(node) > ends(loss_stmt) and (
                    flow.packed(node, parents) or (flow.returned(node, parents) and _stored_on_self(loss_stmt))):
                continue
            return Refusal("logits-read", f"line {stmt.lineno} reads {name} ({source_line(stmt.lineno)}): in "
                                          "training the fused path never computes the logits")
    if site.helper is not None:
        # the helper's body: its cross entropy must not read the logits beside the input
        inlined = [n for a in site.args + [k.value for k in site.keywords] for n in walk(a)
                   if isinstance(n, ast.Name) and n.id in names]
        if inlined:
            return Refusal("logits-read", f"helper {site.helper.name} reads the logits beside the cross "
                                          f"entropy's input ({source_line(site.loss_call.lineno)})")
    return None


def loss_target(stmt: ast.stmt) -> ast.expr | None:
    """The one target of ``<loss> = <cross entropy>``: a plain name or ``self.<attr>``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target = stmt.targets[0]
    if isinstance(target, ast.Name) or (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                        and target.value.id == "self"):
        return target
    return None


def _stored_on_self(loss_stmt: ast.stmt) -> bool:
    """The loss goes to ``self.<attr>`` (llama2.c's ``self.last_loss``), the logits being returned
    alone: the output is the logits and the loss is read off the module. The convention of a
    returned ``(logits, loss)`` applies: in training the fused path returns the loss and no logits
    (the kernel's LogitsNotComputedWarning says so)."""
    target = loss_target(loss_stmt)
    return isinstance(target, ast.Attribute) and isinstance(loss_stmt, ast.Assign) and isinstance(
        loss_stmt.value, ast.Call)


def _early_returns(fn: ast.AST, site: _Reading, parents: dict) -> list[ast.Return]:
    """The ``return`` statements between the head and the loss that read the logits, each after the
    head in its block or in ``if``s below it (:func:`~.flow.dominated`): such a path leaves the
    function with the head's output and never reaches the loss, so the rewrite runs the head there."""
    loss_stmt = flow.statement(site.loss_call, parents)
    out = []
    for node in walk(fn):
        if isinstance(node, ast.Return) and node.value is not None and ends(site.head_stmt) <= starts(node) \
                and starts(node) < starts(loss_stmt) and names_in(node.value, {site.logits}) \
                and not flow.dominated(site.head_stmt, node, parents) \
                and not any(isinstance(n, (ast.Lambda, ast.NamedExpr)) for n in walk(node.value)):
            out.append(node)
    return sorted(out, key=starts)
