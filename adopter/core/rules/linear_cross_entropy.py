"""linear_cross_entropy: the LM head followed by the model's causal-LM loss, fused and chunked so the
``(tokens x vocab)`` logits never exist in training.

Rewrite (the codemod below), forward only — ``__init__``, the head module and the state dict stay:

    logits = self.lm_head(hidden_states)          (or hidden_states[:, slice_indices, :], ...)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
 => logits, loss = linear_cross_entropy(  # adopter: logits is None when training with labels ...
        self.lm_head, hidden_states, self.loss_function, labels=labels, vocab_size=self.config.vocab_size, **kwargs
    )

The loss call's arguments other than the logits are handed over verbatim. ``adopter.kernels.linear_cross_entropy``
decides at run time (see ``kernels/guarded_linear_cross_entropy.py``): training with labels, a plain
``nn.Linear`` head and transformers' ``ForCausalLMLoss`` run fused and return ``(None, loss)``;
anything else (eval, no labels, another loss function, ``ADOPTER_KEEP_LOGITS=1``) runs the original
statements. Statically, a site is only rewritten when nothing but the loss and the returned output
reads the logits.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from adopter.core.codemod.base import Codemod, arg_text, kernel_name, matched_exprs, module_handle, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ForwardEdit, StatementEdit
from adopter.core.match import MatchContext, NotACandidate, Refusal
from adopter.core.match.source import function_ast
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.rules._common import LINEAR
from adopter.core.structures import Match

DSL = """
rule linear_cross_entropy
init:
    torch.nn.Linear($hidden, $vocab) -> $head
forward:
    torch.nn.Linear@$head($h) -> $logits
"""

KERNEL = "linear_cross_entropy"
LOSS_METHOD = "loss_function"
# What the rewritten call says in the diff (the one observable difference of the fused path).
NOTE = "adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them"

DOC = """\
Fuses a causal language model's head with its loss: in training with labels the loss is computed
chunk by chunk over the tokens, with the gradients of the hidden states and of the head's weight
(and bias) produced per chunk, so the ``(tokens x vocab)`` logits never exist. A match is a
``torch.nn.Linear`` head module call ``<logits> = self.<head>(<hidden>)`` (any hidden-state
expression: ``hidden_states[:, slice_indices, :]``, ``slice_logits_to_keep(...)``'s result) whose
output is the logits argument (first positional or ``logits=``) of ``self.loss_function(...)`` in
the same function: transformers' causal-LM spelling ``loss = self.loss_function(logits=logits,
labels=labels, vocab_size=self.config.vocab_size, **kwargs)`` (about 110 modeling files) and its
positional form ``self.loss_function(logits, labels, self.vocab_size, **kwargs)``. The rewrite
needs ``loss = None`` / ``if <labels> is not None: loss = self.loss_function(...)`` right after the
head (otherwise the codemod says why it skips). At run time the fused path runs only when training
with labels (grad on, head in training mode), with a plain ``nn.Linear`` head and transformers'
``ForCausalLMLoss`` (same loss: labels shifted by one and padded with ``ignore_index``, or
``shift_labels``; ``ignore_index``; fp32 log-softmax; ``sum / num_items_in_batch`` or the mean) and
returns **no logits** (None) — eval, inference without labels, any other loss function or loss
keyword, and ``ADOPTER_KEEP_LOGITS=1`` / ``keep_logits()`` run the original code and return them.
Refused: ``logits-transformed`` — the logits are rebound or changed in place between the head
and the loss (Gemma2/3 ``final_logit_softcapping``, Cohere ``logit_scale``, a division by a
temperature); ``logits-read`` — the logits are read anywhere else than the loss call's logits
argument and the output the function packs them into (``CausalLMOutput(..., logits=logits)``,
a tuple), e.g. ``vocab_size=logits.shape[-1]`` or a second loss on them. Not a match: a head whose
output reaches no ``self.loss_function`` (``CrossEntropyLoss()`` written out, classification
heads), a Linear output not assigned to a plain name."""


# ---------------------------------------------------------------- the site, read from the function's ast


@dataclass
class HeadLossSite:
    """The head statement, the loss call reading its output and what surrounds them."""

    head_stmt: ast.Assign
    head_call: ast.Call
    logits: str  # name the head's output is bound to
    loss_call: ast.Call
    # filled by :func:`site_structure` (what the rewrite needs)
    loss_stmt: ast.Assign | None = None
    guard: ast.If | None = None
    labels: str = ""
    loss_none: list[ast.stmt] = field(default_factory=list)


class NotAMatch(Exception):
    """The Linear is not an LM head feeding ``self.loss_function``."""


def _parents(fn: ast.AST) -> dict[ast.AST, ast.AST]:
    out = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _statement(node: ast.AST, parents: dict) -> ast.stmt:
    while not isinstance(node, ast.stmt):
        node = parents[node]
    return node


def _at(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset


def _is_loss_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == LOSS_METHOD
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")


def _logits_argument(call: ast.Call) -> ast.expr | None:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg == "logits"), None)


def _labels_argument(call: ast.Call) -> ast.expr | None:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[1] if len(call.args) > 1 and not isinstance(call.args[1], ast.Starred) else None
    return next((k.value for k in call.keywords if k.arg == "labels"), None)


def _passes_vocab_size(call: ast.Call) -> bool:
    """A language-model loss call: ``vocab_size=...`` or a third positional argument naming a vocab
    size (``self.vocab_size``, ``self.config.text_config.vocab_size``); classification losses take
    ``(logits, labels, self.config)``."""
    if any(k.arg == "vocab_size" for k in call.keywords):
        return True
    third = call.args[2] if len(call.args) > 2 else None
    return third is not None and "vocab_size" in ast.unparse(third)


def find_site(fn: ast.AST, head_call: ast.Call) -> HeadLossSite:
    """The LM head site of ``head_call`` in ``fn``; raises :class:`NotAMatch` when the head's output
    reaches no ``self.loss_function`` as its logits."""
    parents = _parents(fn)
    head_stmt = _statement(head_call, parents)
    if not (isinstance(head_stmt, ast.Assign) and head_stmt.value is head_call and len(head_stmt.targets) == 1
            and isinstance(head_stmt.targets[0], ast.Name)):
        raise NotAMatch("the Linear's output is not assigned to a plain name")
    logits = head_stmt.targets[0].id
    calls = [n for n in ast.walk(fn) if _is_loss_call(n) and _at(n) > _at(head_stmt)
             and isinstance(_logits_argument(n), ast.Name) and _logits_argument(n).id == logits]
    if not calls:
        raise NotAMatch(f"{logits} reaches no self.{LOSS_METHOD}(...) as its logits")
    if len(calls) > 1:
        raise NotAMatch(f"{logits} reaches {len(calls)} self.{LOSS_METHOD} calls")
    if not _passes_vocab_size(calls[0]):
        raise NotAMatch(f"self.{LOSS_METHOD} gets no vocab_size: not a language-model loss")
    return HeadLossSite(head_stmt=head_stmt, head_call=head_call, logits=logits, loss_call=calls[0])


def _packed(name: ast.Name, parents: dict) -> bool:
    """``name`` is packed into a returned structure: an element of a tuple/list/dict display or an
    argument of a ``...Output...(...)`` constructor (transformers' ModelOutput classes)."""
    parent = parents.get(name)
    if isinstance(parent, ast.keyword):
        parent = parents.get(parent)
        if not isinstance(parent, ast.Call):
            return False
    if isinstance(parent, (ast.Tuple, ast.List)) or (isinstance(parent, ast.Dict) and name in parent.values):
        return True
    if isinstance(parent, ast.Call) and parent.func is not name:
        func = parent.func
        callee = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return "Output" in callee
    return False


def logits_refusal(fn: ast.AST, site: HeadLossSite, source_line) -> Refusal | None:
    """``logits-transformed`` when the logits change between the head and the loss; ``logits-read``
    when they are read elsewhere than the loss call's logits argument and a packed output."""
    parents = _parents(fn)
    name = site.logits
    loss_stmt = _statement(site.loss_call, parents)
    logits_arg = _logits_argument(site.loss_call)
    uses = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name and n is not logits_arg
                   and _at(n) > _end(site.head_stmt)), key=_at)
    # first whatever changes the logits before the loss, then any other read
    for node in uses:
        stmt = _statement(node, parents)
        if _at(node) >= _at(loss_stmt):
            break
        parent = parents.get(node)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            return Refusal("logits-transformed", f"line {stmt.lineno} rebinds {name} between the head and the "
                                                 f"loss ({source_line(stmt.lineno)}): the fused loss would take "
                                                 "the head's output")
        in_place = isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
        if in_place or (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)):
            return Refusal("logits-transformed", f"line {stmt.lineno} changes {name} in place between the head "
                                                 f"and the loss ({source_line(stmt.lineno)})")
    for node in uses:
        stmt = _statement(node, parents)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            break  # rebound after the loss: later reads see another value
        if _inside(node, site.loss_call):
            return Refusal("logits-read", f"the loss call reads {name} beside its logits argument "
                                          f"({source_line(stmt.lineno)})")
        if _at(node) > _end(loss_stmt) and _packed(node, parents):
            continue
        return Refusal("logits-read", f"line {stmt.lineno} reads {name} ({source_line(stmt.lineno)}): in training "
                                      "the fused path never computes the logits")
    return None


def _inside(node: ast.AST, container: ast.AST) -> bool:
    return _at(container) <= _at(node) and _end(node) <= _end(container)


def site_structure(fn: ast.AST, site: HeadLossSite) -> HeadLossSite:
    """Fill in the statements the rewrite replaces; raises :class:`Skip` when the shape is not
    ``head; [loss = None]; if <labels> is not None: loss = self.loss_function(...)``."""
    parents = _parents(fn)
    loss_stmt = _statement(site.loss_call, parents)
    if not (isinstance(loss_stmt, ast.Assign) and loss_stmt.value is site.loss_call and len(loss_stmt.targets) == 1
            and isinstance(loss_stmt.targets[0], ast.Name)):
        raise Skip(f"line {loss_stmt.lineno}: the loss call is not assigned to a plain name")
    loss = loss_stmt.targets[0].id
    guard = parents.get(loss_stmt)
    labels = _labels_argument(site.loss_call)
    if not isinstance(labels, ast.Name):
        raise Skip("the loss call's labels are not a plain name")
    if not (isinstance(guard, ast.If) and guard.body == [loss_stmt] and not guard.orelse
            and _is_not_none_test(guard.test, labels.id)):
        raise Skip(f"line {loss_stmt.lineno}: the loss is not computed alone under `if {labels.id} is not None:` "
                   "(the kernel returns no loss exactly when the labels are None)")
    block = _block(site.head_stmt, parents)
    if guard not in block:
        raise Skip(f"the head (line {site.head_stmt.lineno}) and the loss's `if` (line {guard.lineno}) are in "
                   "different blocks")
    between = block[block.index(site.head_stmt) + 1:block.index(guard)]
    for stmt in between:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == loss and isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
            raise Skip(f"line {stmt.lineno} lies between the head and the loss (the fused call replaces both)")
    call = site.loss_call
    if any(isinstance(a, ast.Starred) for a in call.args):
        raise Skip("the loss call unpacks positional arguments")
    if call.args and (len(call.args) < 2 or any(k.arg in ("logits", "labels") for k in call.keywords)):
        raise Skip("the loss call passes the logits positionally but not the labels")
    if not call.args and call.keywords and call.keywords[0].arg is None and "logits" not in [
            k.arg for k in call.keywords]:
        raise Skip("the loss call passes no logits argument")
    site.loss_stmt, site.guard, site.labels, site.loss_none = loss_stmt, guard, labels.id, between
    return site


def _is_not_none_test(test: ast.expr, name: str) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == name
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _block(stmt: ast.stmt, parents: dict) -> list[ast.stmt]:
    owner = parents[stmt]
    for name in ("body", "orelse", "finalbody"):
        block = getattr(owner, name, None)
        if isinstance(block, list) and stmt in block:
            return block
    for handler in getattr(owner, "handlers", ()):
        if stmt in handler.body:
            return handler.body
    return [stmt]


# ---------------------------------------------------------------- preconditions


def _head_call(fn: ast.AST, span) -> ast.Call | None:
    return next((n for n in ast.walk(fn) if isinstance(n, ast.Call) and (n.lineno, n.col_offset, n.end_lineno,
                 n.end_col_offset) == (span.line, span.col, span.end_line, span.end_col)), None)


def head_feeds_loss(ctx: MatchContext) -> str | None:
    """The head's output is the logits of ``self.loss_function(...)``; refused when the logits are
    changed before the loss or read elsewhere (see the DOC)."""
    node = ctx.match.nodes[0].node
    span = node.span
    if ctx.source is None or span is None or LOSS_METHOD not in ctx.source:
        return NotACandidate(f"no self.{LOSS_METHOD} call")
    if "ForMaskedLM" in (ctx.match.class_name or ""):
        return "a masked-LM head (transformers picks ForMaskedLMLoss by the class name)"
    fn = function_ast(ctx.source, span.function, span.line)
    call = _head_call(fn, span) if fn is not None else None
    if call is None:
        return "the head call is not found in the source"
    try:
        site = find_site(fn, call)
    except NotAMatch as exc:
        # a Linear that is no LM head (every Linear fits the one-layer pattern): not listed
        return NotACandidate(str(exc))
    lines = ctx.source.split("\n")
    return logits_refusal(fn, site, lambda n: lines[n - 1].strip())


# ---------------------------------------------------------------- codemod


class LinearCrossEntropy(Codemod):
    rule = "linear_cross_entropy"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        (_, head_call), = exprs
        fn = ctx.enclosing_function(head_call)
        if fn is None or not isinstance(head_call, ast.Call) or len(head_call.args) != 1 or head_call.keywords:
            raise Skip("the head must be a module called with one tensor inside a function")
        try:
            site = find_site(fn, head_call)
        except NotAMatch as exc:
            raise Skip(str(exc)) from None
        refusal = logits_refusal(fn, site, lambda n: ctx.lines[n - 1].strip())
        if refusal is not None:
            raise Skip(str(refusal))
        site = site_structure(fn, site)
        call = site.loss_call
        head = module_handle(ctx, head_call, "head")
        hidden = arg_text(ctx, head_call.args[0])
        if call.args:  # (logits, labels, rest...): the kernel gets (labels, rest...)
            rest = [arg_text(ctx, a) for a in call.args[1:]]
        else:
            rest = []
        rest += [f"{k.arg}={arg_text(ctx, k.value)}" if k.arg else f"**{arg_text(ctx, k.value)}"
                 for k in call.keywords if k.arg != "logits"]
        spec, kernel = kernel_name(ctx, KERNEL)
        args = ", ".join([head, hidden, arg_text(ctx, call.func)] + rest)
        text = f"{site.logits}, {site.loss_stmt.targets[0].id} = {kernel}(  # {NOTE}\n    {args}\n)"
        statements = [site.head_stmt, *site.loss_none, site.guard]
        forward = ForwardEdit(
            statements=tuple(pos(ctx, s) for s in statements),
            anchor=pos(ctx, site.guard),
            statement_edits=(StatementEdit(pos(ctx, site.guard), text),),
            delete=tuple(pos(ctx, s) for s in statements[:-1]),
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))


# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    head = site.modules[0] if site.modules else None
    if not isinstance(head, nn.Linear):
        return f"the head that runs is {type(head).__name__}, not an nn.Linear", ""
    return None, (f"head Linear {head.in_features}->{head.out_features} bias={head.bias is not None}; fused only "
                  "when training with labels and transformers' ForCausalLMLoss (checked per call)")


RULE = Rule(
    name="linear_cross_entropy",
    kernel="adopter.kernels.linear_cross_entropy",
    doc=DOC,
    dsl=DSL,
    codemod=LinearCrossEntropy(),
    runtime=Runtime(check=_runtime_check, leaf_modules=(LINEAR,)),
    fixtures="linear_cross_entropy",
    preconditions=(head_feeds_loss,),
)
