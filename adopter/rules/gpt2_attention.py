"""GPT2Attention: GPT-2's attention over a fused qkv projection replaced by ``adopter.kernels.attention``."""

from __future__ import annotations

from adopter.dsl import Layer
from adopter.match import MatchContext, same_value
from adopter.rules import Rule
from adopter.rules._attention import analyse, attention_dsl, describe, is_projection, namesake

DSL = attention_dsl("GPT2Attention")

DOC = """\
Replaces the eager attention of GPT-2's attention class by the attention kernel. A
match is a class whose name ends with ``GPT2Attention`` (``GPT2Attention``,
``DecisionTransformerGPT2Attention``...; other decoder attentions are not counted)
whose ``forward`` computes, on one path with helpers inlined (``_split_heads`` and
``_attn`` in 2023 code, ``eager_attention_forward`` through ``attention_interface(...)``
in transformers 5), the attention core described for BertSelfAttention —
``matmul(q, kᵀ)``, element-wise score ops (scaling, the causal
``torch.where(causal_mask, ...)``, additive mask, casts), ``softmax``, dropout/casts,
``matmul(probs, v)`` — where key and value come from one fused projection
(``Conv1D``/``Linear`` ``c_attn``) split in parts (``.split(self.split_size, dim=2)``;
when tuple unpacking hides the link, the path must contain such a split of a
projection), and the query from the same split or its own projection (``q_attn``,
cross-attention). One match per class. Not a match: three separate q/k/v Linears,
position-biased scores, rotary or ``repeat_kv`` operands."""


def _has_split_projection(ctx: MatchContext) -> bool:
    prod = ctx.producers()
    for n in ctx.path.nodes[: ctx.node_indices[0]]:
        if isinstance(n, Layer) and n.type in ("torch.Tensor.split", "torch.split", "torch.Tensor.chunk"):
            src = n.args[0].value if n.args else None
            p = prod.get((src.name, src.version)) if hasattr(src, "version") else None
            if p is not None and is_projection(p):
                return True
    return False


def _is_gpt2_attention(ctx: MatchContext) -> str | None:
    reason = namesake(ctx, "GPT2Attention")
    if reason:
        return reason
    facts = analyse(ctx)
    if isinstance(facts, str):
        return facts
    if facts.rotary:
        return f"rotary embedding / repeat_kv code ({facts.rotary}) runs before the scores"
    kinds = (facts.k.kind, facts.v.kind)
    if kinds == ("split", "split"):
        if not same_value(facts.k.module, facts.v.module):
            return "key and value are not split from the same projection"
    elif set(kinds) <= {"split", "input"}:
        if not _has_split_projection(ctx):
            return "key/value cannot be traced and no fused projection is split on the path"
    else:
        return f"key/value come from {describe(facts.k)} / {describe(facts.v)}, not a split fused projection"
    if facts.q.kind not in ("split", "linear", "input"):
        return f"query comes from {describe(facts.q)}"
    if facts.position_bias_in_function:
        return "a position bias is added to the scores (T5Attention)"
    ctx.extra["extra_nodes"] = facts.projections()
    return None


RULE = Rule(
    name="GPT2Attention",
    kernel="adopter.kernels.attention",
    doc=DOC,
    dsl=DSL,
    preconditions=(_is_gpt2_attention,),
    dedup="class",
    rehome=False,
    veto_across_paths=False,
)
