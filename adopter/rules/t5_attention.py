"""T5Attention: T5-style attention with an additive position bias replaced by ``adopter.kernels.attention(bias=...)``."""

from __future__ import annotations

from adopter.match import MatchContext, same_value
from adopter.rules import Rule
from adopter.rules._attention import analyse, attention_dsl, describe

DSL = attention_dsl("T5Attention")

DOC = """\
Replaces a T5-style eager attention computation (relative position bias added to the
scores) by the attention kernel with ``bias=``. A match is the attention core described
for BertSelfAttention — ``matmul(q, kᵀ)``, element-wise score ops, ``softmax``,
dropout/casts, ``matmul(probs, v)`` on one path of a class's ``forward`` with its helpers
(``shape``/``project`` closures, ``eager_attention_forward``) inlined — where q, k and v
come from three distinct ``torch.nn.Linear`` projections (``self.q/k/v``) and one of the
score ops adds a position bias (a variable named ``position_bias``,
``position_bias_masked``, ``pos_bias`` or ``relative_position_bias``). One match per class.
Not a match: attention without such a bias (BertSelfAttention), rotary or ``repeat_kv``
operands, fused qkv projections."""


def _is_t5_attention(ctx: MatchContext) -> str | None:
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
    if not facts.position_bias_in_function:
        return "no position bias is added to the scores"
    ctx.extra["extra_nodes"] = facts.projections()
    return None


RULE = Rule(
    name="T5Attention",
    kernel="adopter.kernels.attention",
    doc=DOC,
    dsl=DSL,
    preconditions=(_is_t5_attention,),
    dedup="class",
    rehome=False,
    veto_across_paths=False,
)
