"""The analysis of one ``nn.Linear`` call as an LM head site, both forms, once per site: the rule's
precondition (:func:`head_feeds_loss`) runs it and hands the site it finds to the codemod on the
match (``Match.site``, see :mod:`.site`); the codemod runs it itself only for a match that comes
without one (built elsewhere than by the scan).

transformers' form (:mod:`.loss_function`) is looked for first, where the file names the loss
method; then the written-out form (:mod:`.written_out`), where the file can reach a cross entropy.
"""

from __future__ import annotations

import ast

from adopter.core.dsl import Span
from adopter.core.match import MatchContext, NotACandidate
from adopter.core.match.source import function_ast, parse_file, source_lines
from adopter.core.rules.linear_cross_entropy.file_facts import (
    calls_no_cross_entropy,
    function_at,
    might_be_cross_entropy,
)
from adopter.core.rules.linear_cross_entropy.loss_function import LOSS_METHOD, loss_function_site
from adopter.core.rules.linear_cross_entropy.site import NotAMatch, Site
from adopter.core.rules.linear_cross_entropy.written_out import cross_entropy_site
from adopter.core.syntax import walk


def _head_call(fn: ast.AST, span: Span) -> ast.Call | None:
    return next((n for n in walk(fn) if isinstance(n, ast.Call) and (n.lineno, n.col_offset, n.end_lineno,
                 n.end_col_offset) == (span.line, span.col, span.end_line, span.end_col)), None)


def analyse(source: str, span: Span, class_name: str | None) -> Site | str:
    """The site of the head call at ``span`` (in class ``class_name``) of the file ``source``, or
    why it is none: a reason, a :class:`~adopter.core.match.NotACandidate` (no LM head at all: not
    listed), or a :class:`~adopter.core.match.Refusal` (the logits are changed before the loss or
    read elsewhere, see the rule's DOC)."""
    lines = source_lines(source)

    def source_line(n: int) -> str:
        return lines[n - 1].strip()

    hf_reason = f"no self.{LOSS_METHOD} call"
    call = None
    if LOSS_METHOD in source:
        if "ForMaskedLM" in (class_name or ""):
            return "a masked-LM head (transformers picks ForMaskedLMLoss by the class name)"
        fn = function_ast(source, span.function, span.line)
        if fn is None:
            return "the head call is not found in the source"
        # a function that does not write the loss method's name cannot call it: no site to look for
        # (every Linear of a file is asked; most are in functions without it)
        mentions = any(LOSS_METHOD in line for line in lines[fn.lineno - 1:fn.end_lineno])
        call = _head_call(fn, span) if mentions else None
        if mentions and call is None:
            return "the head call is not found in the source"
    if call is not None:
        try:
            return loss_function_site(fn, call, source_line)
        except NotAMatch as exc:
            hf_reason = str(exc)
    if not might_be_cross_entropy(source):
        return NotACandidate(hf_reason)
    tree = parse_file(source)
    fn = function_at(tree, span) if tree is not None else None
    call = _head_call(fn, span) if fn is not None else None
    if call is None or calls_no_cross_entropy(tree, fn):
        return NotACandidate(hf_reason)
    try:
        return cross_entropy_site(tree, fn, call, source_line)
    except NotAMatch as exc:
        # a Linear that is no LM head (every Linear fits the one-layer pattern): not listed
        return NotACandidate(f"{hf_reason}; {exc}")


def head_feeds_loss(ctx: MatchContext) -> str | None:
    """The head's output is the logits of ``self.loss_function(...)``, or reaches torch's cross
    entropy laid out as ``(tokens, vocab)``; refused when the logits are changed before the loss or
    read elsewhere (see the DOC). The site found goes to the codemod on the match."""
    span = ctx.match.nodes[0].node.span
    if ctx.source is None or span is None:
        return NotACandidate("no source")
    # the precondition runs on every path through the site (a dozen in an MoE model's forward);
    # the analysis reads only the file's text, the head's position and the class name
    key = ("linear_cross_entropy site", span.function, span.line, span.col, span.end_line, span.end_col,
           ctx.match.class_name)
    found = ctx.file_cache.get(key)
    if found is None:
        found = ctx.file_cache[key] = analyse(ctx.source, span, ctx.match.class_name)
    if isinstance(found, str):
        return found
    ctx.keep_site(found)
    return None
