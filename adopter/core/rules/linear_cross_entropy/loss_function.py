"""transformers' form of the site: the head's output is the logits of ``self.loss_function(...)``.

``loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
**kwargs)`` (about 110 modeling files) and its positional spelling ``self.loss_function(logits,
labels, self.vocab_size, **kwargs)``: :func:`loss_function_site` finds the one such call the head's
output reaches as its logits and refuses the site when the logits change before it or are read
elsewhere than in it and a packed output.
"""

from __future__ import annotations

import ast

from adopter.core.match import Refusal
from adopter.core.rules.linear_cross_entropy import flow
from adopter.core.rules.linear_cross_entropy.flow import ends, starts
from adopter.core.rules.linear_cross_entropy.site import LossFunctionSite, NotAMatch, span_of
from adopter.core.syntax import walk

LOSS_METHOD = "loss_function"


def is_loss_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == LOSS_METHOD
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")


def logits_argument(call: ast.Call) -> ast.expr | None:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg == "logits"), None)


def labels_argument(call: ast.Call) -> ast.expr | None:
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


def loss_function_site(fn: ast.AST, head_call: ast.Call, source_line) -> LossFunctionSite | Refusal:
    """The site of ``head_call`` in ``fn``, or the refusal of its logits (:func:`_logits_refusal`);
    raises :class:`NotAMatch` when the head's output reaches no ``self.loss_function`` as its
    logits. ``source_line(n)`` is line ``n`` of the file, for the refusal's message."""
    parents = flow.parent_map(fn)
    head_stmt, logits = flow.head_assignment(head_call, parents)
    calls = [n for n in walk(fn) if is_loss_call(n) and starts(n) > starts(head_stmt)
             and isinstance(logits_argument(n), ast.Name) and logits_argument(n).id == logits]
    if not calls:
        raise NotAMatch(f"{logits} reaches no self.{LOSS_METHOD}(...) as its logits")
    if len(calls) > 1:
        raise NotAMatch(f"{logits} reaches {len(calls)} self.{LOSS_METHOD} calls")
    loss_call = calls[0]
    if not _passes_vocab_size(loss_call):
        raise NotAMatch(f"self.{LOSS_METHOD} gets no vocab_size: not a language-model loss")
    refusal = _logits_refusal(fn, parents, head_stmt, logits, loss_call, source_line)
    return refusal if refusal is not None else LossFunctionSite(logits=logits, loss_call=span_of(loss_call))


def _logits_refusal(fn: ast.AST, parents: dict, head_stmt: ast.Assign, name: str, loss_call: ast.Call,
                    source_line) -> Refusal | None:
    """``logits-transformed`` when the logits change between the head and the loss; ``logits-read``
    when they are read elsewhere than the loss call's logits argument and a packed output."""
    loss_stmt = flow.statement(loss_call, parents)
    logits_arg = logits_argument(loss_call)
    uses = sorted((n for n in walk(fn) if isinstance(n, ast.Name) and n.id == name and n is not logits_arg
                   and starts(n) > ends(head_stmt)), key=starts)
    # first whatever changes the logits before the loss, then any other read
    for node in uses:
        if starts(node) >= starts(loss_stmt):
            break
        refusal = flow.transformed(node, flow.statement(node, parents), parents, source_line)
        if refusal is not None:
            return refusal
    for node in uses:
        stmt = flow.statement(node, parents)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            break  # rebound after the loss: later reads see another value
        if flow.inside(node, loss_call):
            return Refusal("logits-read", f"the loss call reads {name} beside its logits argument "
                                          f"({source_line(stmt.lineno)})")
        if starts(node) > ends(loss_stmt) and flow.packed(node, parents):
            continue
        return Refusal("logits-read", f"line {stmt.lineno} reads {name} ({source_line(stmt.lineno)}): in training "
                                      "the fused path never computes the logits")
    return None
