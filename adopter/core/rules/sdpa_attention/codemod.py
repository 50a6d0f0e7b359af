"""The codemod of sdpa_attention: the region :mod:`.site` read becomes one kernel call.

The statements before the output product that only computed the scores and probabilities are
deleted; the output product (``attn @ v``, wherever it sits in its statement) becomes
``sdpa(q, <key as written>, v, scale=..., mask=..., fill=..., dropout=...)``; a mask or
fill added under ``if <test>:`` is passed as ``(m if <test> else None)``. Statements that build a
mask from the scores' shape (in that ``if`` or before it) stay where they are, their reads of the
scores' last two sizes and device taken from the query and key (:func:`shape_text`); only the
update of the scores leaves the ``if``. Where the condition may not be evaluated a second time (it
calls a function, or the branch rebinds a name it reads) the update becomes ``<fresh> = m`` in the
branch, ``<fresh> = None`` takes the place of the scores' product, and the call reads ``<fresh>``:

    sim = einsum(...)                           fill_mask = None
    if exists(mask):                            if exists(mask):
        mask = rearrange(mask, "b j -> b 1 1 j")    mask = rearrange(mask, "b j -> b 1 1 j")
        sim = sim.masked_fill(~mask, v)    =>       fill_mask = ~mask
    ...                                         out = sdpa(..., fill=fill_mask, fill_value=v)
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import Codemod, arg_text, fresh_local, kernel_name, matched_exprs, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, StatementEdit
from adopter.core.rules.sdpa_attention.site import (
    LOWEST,
    NotCovered,
    Scores,
    dropout_attrs,
    interpret,
    softmax_partials,
)
from adopter.core.structures import Match
from adopter.core.syntax import per_node, walk

KERNEL = "sdpa"


def find_expr(fn: ast.AST, span) -> ast.expr | None:
    """The expression of ``fn`` at ``span`` (its exact position)."""
    return _exprs_by_position(fn).get((span.line, span.col, span.end_line, span.end_col))


@per_node(256)
def _exprs_by_position(fn: ast.AST) -> dict[tuple, ast.expr]:
    """(line, col, end line, end col) -> the first expression of ``fn`` there (``walk`` order),
    indexed once per function: each candidate asks for two."""
    out: dict[tuple, ast.expr] = {}
    for node in walk(fn):
        if isinstance(node, ast.expr):
            out.setdefault((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset), node)
    return out


def _conditional(ctx: FileContext, term: ast.expr, test: ast.expr | None, bound: dict[int, str]) -> str:
    if id(term) in bound:  # (bound in its branch: None where the branch did not run)
        return bound[id(term)]
    text = arg_text(ctx, term)
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
            and ast.dump(test.left) == ast.dump(term)):
        return text  # ``if m is not None: s = s + m``: the kernel takes None as no mask
    return f"({text} if {arg_text(ctx, test)} else None)" if test is not None else text


def shape_text(ctx: FileContext, scores: Scores, kind: str, bare: bool = False) -> str:
    """What ``<scores>.shape[-2]`` ("rows"), ``.shape[-1]`` ("cols"), ``.shape[-2:]`` ("last2") or
    ``.device`` is, from the query and the key as the source wrote them: ``q @ kᵀ`` has the query's
    rows and the transposed key's columns; the einsum ``P i d, P j d -> P i j`` the query's and
    the key's second-last sizes. Assumed, not proven: no scale, mask or fill applied before the read
    broadcasts the scores to more rows or columns than the product's (a one-row query against a
    many-row mask would; the source's output would then have more rows than its query, which the
    reshape after an attention rejects; the kernel sees those terms, not this read).)"""
    q, key = arg_text(ctx, scores.q), scores.key
    if scores.einsum or _last_two_swapped(key):  # (the key itself: its second-last size)
        if not scores.einsum:
            key = key.func.value if isinstance(key, ast.Call) else key.value
        key_text, cols, last = arg_text(ctx, key), "[-2]", "[-2:-1]"
    else:  # (``k.transpose(2, 3)``: its last size, whatever the key's rank)
        key_text, cols, last = arg_text(ctx, key), "[-1]", "[-1:]"
    pair = f"{q}.shape[-2:-1] + {key_text}.shape{last}"
    return {
        "rows": f"{q}.shape[-2]",
        "cols": f"{key_text}.shape{cols}",
        "last2": pair if bare else f"({pair})",
        "device": f"{q}.device",
    }[kind]


def _last_two_swapped(key: ast.expr) -> bool:
    """``k.mT``, ``k.transpose(-2, -1)`` or ``k.transpose(-1, -2)`` (the region's key is one of these or
    ``k.transpose(2, 3)``): the key's last two dims swapped whatever its rank."""
    if isinstance(key, ast.Attribute):
        return key.attr == "mT"
    return isinstance(key, ast.Call) and {ast.unparse(a) for a in key.args} == {"-1", "-2"}


class SdpaAttentionCodemod(Codemod):
    rule = "sdpa_attention"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        first, last = exprs[0][1], exprs[-1][1]
        fn = ctx.enclosing_function(last)
        if fn is None or ctx.enclosing_function(first) is not fn:
            raise Skip("the attention's products are not in one function")
        owner = ctx.enclosing_class_name(fn)
        cls = ctx.classes.get(owner) if owner else None
        try:
            site = interpret(fn, first, last, dropout_attrs(cls).__contains__, softmax_partials(cls, ctx.tree))
        except NotCovered as e:
            raise Skip(e.reason) from None
        s = site.scores
        taken: set[str] = set()
        bound = {id(term): fresh_local(ctx, fn, "attn_bias" if term is s.mask else "fill_mask", taken)
                 for _, term in site.bound}
        args = [arg_text(ctx, s.q), arg_text(ctx, s.key), arg_text(ctx, site.v)]
        if s.scale is not None:
            kind, factor = s.scale
            args.append(f"{'scale' if kind == 'mul' else 'divisor'}={arg_text(ctx, factor)}")
        if s.mask is not None:
            args.append(f"mask={_conditional(ctx, s.mask, s.mask_test, bound)}")
        if s.fills:  # (one fill as itself, several as tuples in the source's order)
            masks = [_conditional(ctx, mask, test, bound) for mask, _, test in s.fills]
            values = [f'"{LOWEST}"' if value == LOWEST else arg_text(ctx, value) for _, value, _ in s.fills]
            if len(s.fills) == 1:
                args += [f"fill={masks[0]}", f"fill_value={values[0]}"]
            else:
                args += [f"fill=({', '.join(masks)})", f"fill_value=({', '.join(values)})"]
            if s.mask is not None and s.fill_first:
                args.append("fill_first=True")
        if site.upcast:  # softmax in float32, cast back (the kernel fuses only where both casts are identities)
            args.append("softmax_float32=True")
            method, target = site.cast_back
            args.append(f"{'probs_to' if method == 'to' else 'probs_type_as'}={arg_text(ctx, target)}")
        if site.dropout is not None:
            if site.dropout[0] == "module":
                args.append(f"dropout={arg_text(ctx, site.dropout[1])}")
            else:
                _, p, training = site.dropout
                args.append(f"dropout_p={arg_text(ctx, p) if p is not None else '0.5'}")
                args.append(f"dropout_training={arg_text(ctx, training) if training is not None else 'True'}")
        if s.einsum:
            args.append(f"einsum=({s.einsum!r}, {site.out_einsum!r})")
        spec, local = kernel_name(ctx, KERNEL)
        text = f"{local}({', '.join(args)})"
        whole = {id(st.value) for st in site.kept if isinstance(st, ast.Assign)} | {
            id(inner.value) for st in site.kept if isinstance(st, ast.If) for inner in st.body
            if isinstance(inner, ast.Assign)}  # (``i, j = <read>``: no parentheses needed)
        shape_edits = tuple(
            ExprEdit(ctx.char_span(read), shape_text(ctx, s, kind, bare=id(read) in whole))
            for read, kind in site.shape_reads)
        # (the kept statements are in the region's block: listed, so the shape reads are found in them)
        region = sorted((*site.consumed, *site.kept, site.last), key=lambda st: (st.lineno, st.col_offset))
        deleted = [*site.consumed, *site.inner_deleted]
        statement_edits = [StatementEdit(pos(ctx, update), f"{bound[id(term)]} = {arg_text(ctx, term)}")
                           for update, term in site.bound]
        if site.bound:  # (each bound name None until its branch runs: set where the scores' product was)
            if not site.consumed or site.consumed[0] is not region[0]:
                raise Skip("the scores' product is not a statement of its own before the branch")
            deleted.remove(region[0])
            statement_edits.append(StatementEdit(pos(ctx, region[0]), "\n".join(
                f"{bound[id(term)]} = None" for _, term in site.bound)))
        forward = ForwardEdit(
            statements=tuple(pos(ctx, st) for st in region),
            anchor=pos(ctx, site.last),
            expr_edits=(*shape_edits, ExprEdit(ctx.char_span(site.output), text)),
            statement_edits=tuple(statement_edits),
            delete=tuple(pos(ctx, st) for st in deleted),
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))
