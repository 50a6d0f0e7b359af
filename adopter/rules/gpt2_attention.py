"""GPT2Attention: GPT-2-style attention over a fused qkv projection replaced by ``adopter.kernels.attention``."""

from __future__ import annotations

from adopter.match import MatchContext, same_value
from adopter.rules import Rule
from adopter.rules._attention import analyse, attention_dsl, describe

DSL = attention_dsl("GPT2Attention")

DOC = """\
Replaces a GPT-2-style eager attention computation by the attention kernel. A match is
the attention core described for BertSelfAttention — ``matmul(q, kᵀ)``, element-wise
score ops (scaling, the causal ``torch.where(causal_mask, ...)``, additive mask, casts),
``softmax``, dropout/casts, ``matmul(probs, v)`` on one path of a class's ``forward`` with
helpers (``_split_heads``, ``_attn``, ``eager_attention_forward``) inlined — where key and
value come from one fused projection (``Conv1D``/``Linear`` ``c_attn``) split in parts
(``.split(self.split_size, dim=2)``), and the query from the same split or, for
cross-attention, from its own projection (``q_attn``). One match per class. Not a
match: separate q/k/v Linears (BertSelfAttention/T5Attention), position-biased scores,
rotary or ``repeat_kv`` operands."""


def _is_gpt2_attention(ctx: MatchContext) -> str | None:
    facts = analyse(ctx)
    if isinstance(facts, str):
        return facts
    if facts.rotary:
        return f"rotary embedding / repeat_kv code ({facts.rotary}) runs before the scores"
    if facts.k.kind != "split" or facts.v.kind != "split":
        return f"key/value come from {describe(facts.k)} / {describe(facts.v)}, not a split fused projection"
    if not same_value(facts.k.module, facts.v.module):
        return "key and value are not split from the same projection"
    if facts.q.kind not in ("split", "linear"):
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
