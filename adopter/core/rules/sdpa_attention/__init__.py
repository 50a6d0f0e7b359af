"""sdpa_attention: written-out attention (``softmax(q @ kᵀ * scale + mask) @ v``) anywhere, replaced by
``adopter.kernels.sdpa``, which runs ``F.scaled_dot_product_attention`` where it computes
the same and pays, and the source's own ops otherwise.

Rewrite (the codemod in :mod:`.codemod`), forward only — ``__init__`` and the modules stay:
    attn = (q @ k.transpose(-2, -1)) * self.scale
    attn = attn.softmax(dim=-1)
    attn = self.attn_drop(attn)
    x = (attn @ v).transpose(1, 2).reshape(B, N, C)
 => x = (sdpa(q, k.transpose(-2, -1), v, scale=self.scale, dropout=self.attn_drop)).transpose(...)

The source's region is read by :mod:`.site` (scale, additive mask, boolean ``masked_fill``,
dropout, einsum spellings); the same reading decides the precondition (with its refusal codes)
and writes the call, so the two cannot disagree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.match import MatchContext
from adopter.core.match.context import NotACandidate, Refusal
from adopter.core.match.source import parse_file
from adopter.core.rule import Rule
from adopter.core.rules.sdpa_attention.codemod import SdpaAttentionCodemod, find_expr
from adopter.core.rules.sdpa_attention.site import NotCovered, dropout_attrs, interpret, softmax_partials
from adopter.core.syntax import per_node

MATMULS = "torch.matmul|torch.Tensor.matmul|torch.bmm|torch.Tensor.bmm"
SOFTMAXES = "torch.nn.functional.softmax|torch.softmax|torch.Tensor.softmax|torch.special.softmax"
# (``torch.baddbmm(input, q, kᵀ, beta=, alpha=)``: heads folded into the batch, diffusers/Megatron)
_FIRST = (f"{MATMULS}($q, $kt) -> $scores", "$q @ $kt -> $scores", "torch.einsum() -> $scores",
          "torch.baddbmm|torch.Tensor.baddbmm() -> $scores")
_LAST = (f"{MATMULS}($probs, $v) -> $out", "$probs @ $v -> $out", "torch.einsum() -> $out")
DSL = "\n".join(
    f"rule sdpa_attention\nforward:\n    {first};\n    {SOFTMAXES}($logits) -> $weights;\n    {last}\n"
    for first in _FIRST for last in _LAST
)

# The HF classes the three namesake attention rules own (their kernel policy names them).
NAMESAKES = ("BertSelfAttention", "T5Attention", "GPT2Attention")

DOC = """\
Replaces a written-out attention — the scores ``q @ k.transpose(-2, -1)`` (``torch.matmul``,
``@``, ``x.matmul``, ``k.mT``, or ``torch.einsum('b h i d, b h j d -> b h i j', q, k)``; the key
also transposed by a ``permute`` that brings its last two dims in reversed order, inline — SAM's
``q @ k.permute(0, 1, 3, 2)`` — or bound to a name earlier in the block — whisper's ``k =
k.permute(0, 2, 3, 1)``, then ``q @ k`` —; heads folded into the batch: ``torch.bmm(q,
k.transpose(1, 2))``, ``torch.baddbmm(input, q, kᵀ, beta=0, alpha=scale)`` — the input ignored,
as torch ignores it, even NaN —, and ``torch.bmm(p, v)``), at most
one scale (``* c`` or ``/ c``, ``c`` any expression: ``self.scale``, ``1 / math.sqrt(d)``,
``d ** -0.5``), at most one additive mask (``+ mask``, also ``if mask is not None: s = s + mask``)
and boolean fills in order, all before or all after it, each optionally under its own
one-statement ``if`` (``s.masked_fill(b, float('-inf'))``: nanoGPT's causal
``self.bias[:, :, :T, :T] == 0``, a padding ``~keep``; the value ``-inf`` or the scores'
``-torch.finfo(s.dtype).max``, inline or bound to a name in the region: x-transformers'
``mask_value``); the fill or added mask may come last in an ``if`` (no ``else``) whose statements
before it build the mask as assignments to names reading the scores only through their last two
sizes or their device (x-transformers' ``if self.causal: i, j = sim.shape[-2:]; causal_mask =
torch.ones((i, j), dtype=torch.bool, device=...).triu(j - i + 1)``, an ``arange`` comparison,
``if lengths is not None:`` a padding mask from the keys' count): those statements stay, the sizes
read from the query and key, and the mask goes to the call as ``(m if <test> else None)``, the
source's own mask (a key length above the query length keeps the source's alignment, never SDPA's
top-left ``is_causal``); where ``<test>`` could not be evaluated again at the call (it calls a
function: x-transformers' ``if exists(mask):``; the branch rebinds a name it reads: ``mask =
rearrange(mask, 'b j -> b 1 1 j')``) the branch stays and its update becomes ``fill_mask = ~mask``
(a fresh name, bound to None where the scores' product was), which the call reads: the condition
runs once, where the source runs it; ``softmax(..., dim=-1)`` (also through
an attribute bound as ``partial(F.softmax, dim=-1)``; also computed in float32 and cast back:
Llama's ``softmax(s.float(), dim=-1).type_as(q)``, ``softmax(s, dim=-1,
dtype=torch.float32).to(q.dtype)``), at most one dropout of the probabilities (an ``nn.Dropout`` bound in ``__init__``, or ``F.dropout``), and the
output product with the values (``@``, ``torch.matmul``, the matching einsum) — in one expression
or over statements, in any class or function outside the three HF namesake classes (ViT
collections, nanoGPT's non-flash branch, x-former libraries; grouped-query attention whose keys
and values the source repeats with ``repeat_interleave``/``expand``) — by one call of
``adopter.kernels.sdpa`` given the query, the key as the source wrote it, the value,
and the scale, mask, fill, fill value and dropout as expressions evaluated where the call is
(nothing of the analysed model is written into the source). Refused: the scores or
probabilities read besides the output product (``probs-read``: returned as attention weights —
transformers' ``eager_attention_forward`` —, stored, printed), a cast or ``dtype=`` around the
softmax other than float32 cast back right after it (``probs-dtype``: another math than
SDPA's), a softmax not over ``dim=-1`` (``dim-not-last``), a branch inside the attention that is
none of the above (``branch-straddle``: a mask built from the scores' values — top-k —, a branch
that keeps something of the scores, binds the fill value — the call reads it whether the branch ran
or not —, an ``else``, or a query or key written in the product as more than a name, an attribute
or its transpose: reading their sizes would run it again). Not covered (no report): a ``baddbmm``
whose ``beta`` is not a literal 0 (Megatron/BLOOM's alibi: ``alpha * (q @ kᵀ) + input`` rounds once
there, twice as the separate ops the kernel's fallback runs), or whose ignored input is a call the
rewrite would not run (other than ``torch.empty``/``zeros``/``ones`` of plain sizes). Not a
match: anything else inside the region (a head mask, a
talking-heads projection, a relative-position gather, fills on both sides of the additive mask, a scale after the mask), an
``nn.Softmax`` module; a softmax paired with a later product its probabilities do not feed
directly (they feed another product first) is no candidate. A helper function that callers
inline (transformers' ``eager_attention_forward``) is reported and rewritten once, under the
helper. The kernel runs SDPA only where it is provably the same computation —
query/key/value plain floating tensors of rank 4 with equal batch and head sizes (the rank-3
tensors of ``bmm`` attentions are viewed as one head of a batch of batch * heads), a float mask
of the query's dtype broadcasting to the scores, bool fills, fill values of ``-inf`` or the scores' ``-finfo.max`` (the latter only where no query
row has every key filled or masked: the source's softmax of it is uniform), a scale
that is a number (or a one-element tensor without gradient), a float32 softmax cast back only
where both casts are identities (query/key/value float32, the cast back to float32: in bfloat16
the source rounds a float32 softmax), no dropout drawn (eval mode or
``p == 0``: training with dropout runs the source's ops with the user's dropout, so the random
numbers are those the original draws), no fully-masked or NaN row (checked on the output) — and
where it pays (the calibrated cost model: ``benchmarks/results/sdpa_cpu.json``);
otherwise it runs the source's own ops."""


@per_node(8)
def _functions(tree: ast.AST) -> tuple[tuple[str, int, int, ast.AST, ast.ClassDef | None], ...]:
    """Every function of a file, with its lines and the class around it, in one walk per file
    (the precondition asks once per candidate: walking the tree each time doubled the scan)."""
    found = []
    # (definitions are statements: only statement lists are walked, never expressions)
    stack: list[tuple[ast.AST, ast.ClassDef | None]] = [(tree, None)]
    while stack:
        node, owner = stack.pop()
        for name in _STATEMENT_LISTS:
            for child in getattr(node, name, ()):
                if isinstance(child, ast.ClassDef):
                    stack.append((child, child))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((child.name, child.lineno, child.end_lineno or child.lineno, child, owner))
                    stack.append((child, owner))
                elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                    stack.append((child, owner))
    return tuple(found)


_STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


@per_node(8)
def _functions_by_name(tree: ast.AST) -> dict[str, list[tuple[int, int, ast.AST, ast.ClassDef | None]]]:
    """:func:`_functions` by name, in its order."""
    out: dict[str, list[tuple[int, int, ast.AST, ast.ClassDef | None]]] = {}
    for fname, start, end, fn, cls in _functions(tree):
        out.setdefault(fname, []).append((start, end, fn, cls))
    return out


def _enclosing(tree: ast.AST, name: str, line: int) -> tuple[ast.AST | None, ast.ClassDef | None]:
    """The innermost function called ``name`` whose lines hold ``line``, and the class around it."""
    holding = [(start, -end, fn, cls) for start, end, fn, cls in _functions_by_name(tree).get(name, ())
               if start <= line <= end]
    if not holding:
        return None, None
    _, _, fn, cls = max(holding, key=lambda h: (h[0], h[1]))
    return fn, cls


def _written_out_attention(ctx: MatchContext) -> str | None:
    nodes = [mn.node for mn in ctx.match.nodes]
    spans = [n.span for n in nodes]
    if ctx.source is None or any(s is None for s in spans):
        return "the attention's source positions are unknown"
    first, last = spans[0], spans[-1]
    # the class whose method holds the products (a module-level helper such as transformers'
    # eager_attention_forward, inlined into every caller, belongs to none: reported once, under it)
    owner = (first.function or "").rpartition(".")[0] if first.function else (ctx.match.class_name or "")
    if any(owner.endswith(n) for n in NAMESAKES):
        return NotACandidate(f"class {owner} is the {next(n for n in NAMESAKES if owner.endswith(n))} rule's")
    if first.function != last.function or getattr(first, "inlined_at", ()) != getattr(last, "inlined_at", ()):
        return NotACandidate("the two products lie in different functions")
    tree = parse_file(ctx.source)
    fn, cls = _enclosing(tree, (first.function or ctx.match.function).rsplit(".", 1)[-1], first.line) \
        if tree is not None else (None, None)
    if fn is None:
        return "the function holding the attention is not found in the source"
    first_expr, last_expr = find_expr(fn, first), find_expr(fn, last)
    if first_expr is None or last_expr is None:
        return "the attention's products are not found in the source"
    try:
        _interpret_once(fn, cls, tree, first_expr, last_expr)
    except NotCovered as e:
        if not e.candidate:
            return NotACandidate(e.reason)
        return Refusal(e.code, e.reason) if e.code else e.reason
    return None


@per_node(256)
def _verdicts(fn: ast.AST) -> dict[tuple[int, int], NotCovered | None]:
    """(id of the scores product, id of the output product) -> what :func:`interpret` said of the
    region of ``fn`` between them (nodes of ``fn``, held with it)."""
    return {}


def _interpret_once(fn: ast.AST, cls: ast.ClassDef | None, tree: ast.AST, first_expr: ast.expr,
                    last_expr: ast.expr) -> None:
    """:func:`interpret` of one region, once: a helper inlined into many callers
    (transformers' ``eager_attention_forward``) is one site, asked about by each caller's match
    (``cls`` and ``tree`` are those around ``fn``)."""
    verdicts = _verdicts(fn)
    key = (id(first_expr), id(last_expr))
    if key not in verdicts:
        try:
            interpret(fn, first_expr, last_expr, dropout_attrs(cls).__contains__, softmax_partials(cls, tree))
            verdicts[key] = None
        except NotCovered as e:
            verdicts[key] = e.with_traceback(None)
    if verdicts[key] is not None:
        raise verdicts[key]


@dataclass(frozen=True)
class _SdpaRule(Rule):
    # Matches of these rules lying wholly inside a written-out attention match are not reported (the
    # match driver reads ``supersedes`` with getattr): one SDPA call computes the softmax too.
    supersedes: tuple[str, ...] = ()


RULE = _SdpaRule(
    name="sdpa_attention",
    kernel="adopter.kernels.sdpa",
    doc=DOC,
    dsl=DSL,
    codemod=SdpaAttentionCodemod(),
    fixtures="sdpa_attention",
    preconditions=(_written_out_attention,),
    # a match wholly inside an inlined helper (transformers' eager_attention_forward) is reported and
    # rewritten once, under the helper: the rewrite is in the function holding the products
    hoisting=False,  # the codemod reads the region's statements itself
    supersedes=("softmax",),
)
