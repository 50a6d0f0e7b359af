"""The site model of linear_cross_entropy: what the analysis of one LM head found, as the rule's
precondition hands it to its codemod on the match (``Match.site``), so a site is analysed once.

The analysis reads a syntax tree of the scanned text and the codemod reads its own: ``FileContext``
parses the text again unless the scan's tree is still the last one extracted, and a scan with
several workers sends its matches back pickled. So a site holds no syntax-tree node: statements and
expressions are given by their exact positions (:class:`~adopter.core.dsl.Span`, ast's conventions,
the contract every match's spans already keep: the codemod finds them again in its tree with
``FileContext.expr_at``), names as strings, and an expression the analysis put together itself
(an inlined helper's cross entropy, which has no place in the file) as its text.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.dsl import Span


class NotAMatch(Exception):
    """The Linear is not an LM head feeding the model's loss (the reason says why)."""


def span_of(node: ast.AST) -> Span:
    """The exact position of ``node`` (ast's line and UTF-8 byte column conventions)."""
    return Span(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


@dataclass(frozen=True)
class ExprRef:
    """An expression the rewrite writes into the kernel call: where it is in the file (``at``: the
    codemod reads its source text there, unparsed when it spans lines), or its text when it is in
    no place of the file (an inlined helper's expression, unparsed by the analysis)."""

    at: Span | None = None
    text: str = ""


# One element of the rows subscript ``logits[rows]``: None for ``...``, else the slice's
# (lower, upper, step) bounds, None where the slice leaves one out.
RowsElement = tuple[ExprRef | None, ExprRef | None, ExprRef | None] | None


@dataclass(frozen=True)
class Layout:
    """How the source turns the logits into the cross entropy's ``(tokens, vocab)`` input, in this
    order: ``logits[rows]``, ``.contiguous()``, ``.view/.reshape(-1, vocab)`` or ``.flatten(a, b)``,
    ``.float()``; or the classes moved to dim 1 (``logits.transpose(1, 2)``), alone or with ``.float()``."""

    rows: tuple[RowsElement, ...] | None = None  # None: no rows subscript
    contiguous: bool = False
    # "view", "reshape", flatten's (start, end) dims, or how the classes of (b, n, vocab) logits go to
    # dim 1 for a (b, n) target, as the source writes it: ("transpose", 1, 2), ("permute", 0, 2, 1),
    # ("rearrange", "b n c -> b c n")
    flatten: str | tuple = "view"
    vocab: ExprRef | None = None  # None: the logits' own last size (``logits.size(-1)``)
    upcast: bool = False


@dataclass(frozen=True)
class LossFunctionSite:
    """transformers' form: ``<logits> = self.<head>(<hidden>)`` whose output is the logits argument
    of the function's one ``self.loss_function(...)``, a language-model loss (it gets a vocab size),
    the logits neither changed before the loss nor read elsewhere but in a packed output."""

    logits: str  # the name the head's output is bound to
    loss_call: Span  # the ``self.loss_function(...)`` call


@dataclass(frozen=True)
class CrossEntropySite:
    """The written-out form: the head's output reaching torch's cross entropy laid out as
    ``(tokens, vocab)`` (``F.cross_entropy``, an ``nn.CrossEntropyLoss``, or a same-file helper that
    is one), the logits neither changed before the loss nor read elsewhere but in a packed output."""

    logits: str  # the name the head's output is bound to
    loss_call: Span  # the call in the function: the cross entropy, or the helper's call
    loss_fn: ExprRef  # what the kernel gets as the cross entropy
    args: tuple[ExprRef, ...]  # the cross entropy's positional arguments after its input
    unpacks_args: bool  # one of them is ``*<expr>``
    keywords: tuple[tuple[str | None, ExprRef], ...]  # its keywords but ``input`` (None: ``**<expr>``)
    layout: Layout
    shift: str = ""  # ``shift_logits`` of ``shift_logits = logits[..., :-1, :].contiguous()`` on the way
    shift_value: Span | None = None  # that assignment's value
    helper: str = ""  # the same-file helper inlined as the cross entropy ("" when called directly)
    # tests (source text, of the helper call's arguments) under which the inlined helper is that
    # cross entropy: the rewrite fuses only when they hold at run time, the helper's call otherwise
    guards: tuple[str, ...] = ()
    # values of the ``return`` statements that leave with the logits before the loss
    # (litgpt's ``if targets is None: return logits``): the rewrite runs the head there
    early_returns: tuple[Span, ...] = ()


Site = LossFunctionSite | CrossEntropySite
