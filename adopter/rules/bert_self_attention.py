"""BertSelfAttention: BERT-style eager self-attention core replaced by ``adopter.kernels.attention``."""

from __future__ import annotations

from adopter.dsl import Var
from adopter.match import MatchContext, same_value
from adopter.rules import Rule
from adopter.rules._attention import AttentionFacts, analyse, attention_dsl, describe

DSL = attention_dsl("BertSelfAttention")

DOC = """\
Replaces a BERT-style eager attention computation by the memory-efficient attention
kernel. A match is, on one control-flow path of a class's ``forward`` (helpers such as
``transpose_for_scores``, ``_attn`` and ``eager_attention_forward`` reached through
``attention_interface(...)`` are inlined): ``scores = matmul(q, k.transpose(...))``
(``torch.matmul`` or ``@``), then only element-wise score ops (scaling ``/ sqrt(d)`` or
``* scaling``, additive mask, casts), ``softmax``, then only dropout/casts/head-mask, then
``matmul(probs, v)``; where q, k and v each come — through view/reshape/transpose/permute,
``transpose_for_scores``-style helpers and KV-cache concatenation only — from three distinct
``torch.nn.Linear`` projections (old ``self.query/key/value`` or new
``.view(*hidden_shape).transpose(1, 2)`` styles; cross-attention k/v from the encoder
states count). One match per class. Not a match: rotary embeddings or ``repeat_kv``
between projection and scores (Llama-style), a position bias added to the scores
(that is T5Attention), a fused qkv projection split in three (GPT2Attention), a
module-level attention function analysed without its projections."""


def _is_bert_attention(ctx: MatchContext) -> str | None:
    facts = analyse(ctx)
    if isinstance(facts, str):
        return facts
    if facts.rotary:
        return f"rotary embedding / repeat_kv code ({facts.rotary}) runs before the scores"
    for role, src in (("query", facts.q), ("key", facts.k), ("value", facts.v)):
        if src.kind != "linear":
            return f"{role} comes from {describe(src)}, not a Linear projection"
    mods = [facts.q.module, facts.k.module, facts.v.module]
    if any(same_value(a, b) for i, a in enumerate(mods) for b in mods[i + 1:]):
        return "q, k and v do not come from three distinct projections"
    if facts.position_bias_in_function:
        return "a position bias is added to the scores (T5Attention)"
    ctx.extra["extra_nodes"] = facts.projections()
    return None


RULE = Rule(
    name="BertSelfAttention",
    kernel="adopter.kernels.attention",
    doc=DOC,
    dsl=DSL,
    preconditions=(_is_bert_attention,),
    dedup="class",
    rehome=False,
    veto_across_paths=False,
)
