"""T5Attention: T5's attention with an additive position bias replaced by ``adopter.kernels.attention(bias=...)``."""

from __future__ import annotations

from adopter.core.match import MatchContext
from adopter.core.rule import Rule
from adopter.core.rules._attention import attention_dsl, namesake_facts, separate_projections_reason
from adopter.core.rules._attention_codemod import T5AttentionCodemod

DSL = attention_dsl("T5Attention")

DOC = """\
Replaces the eager attention of T5's attention class (relative position bias added
to the unscaled scores) by the attention kernel with ``bias=``. A match is a class
whose name ends with ``T5Attention`` (``T5Attention``, ``MT5Attention``,
``LongT5Attention``, ``UMT5Attention``...; other relative-position attentions — Swin,
MPNet, Data2VecVision — are not counted) whose ``forward`` computes, on one path with
helpers inlined (the 2023 ``shape``/``project`` closures, or ``eager_attention_forward``
through ``attention_interface(...)``), the attention core described for
BertSelfAttention — ``matmul(q, kᵀ)``, element-wise score ops, ``softmax``,
dropout/casts, ``matmul(probs, v)`` — where a score op adds a position bias (a variable
named ``position_bias``, ``position_bias_masked``, ``pos_bias`` or
``relative_position_bias``, on some path of ``forward``), and q, k, v come from three
distinct ``torch.nn.Linear`` projections (``self.q/k/v``) or cannot be traced. One match
per class; its lines are the core's, the position-bias add's (``attn_weights +
position_bias``, on the path that takes ``if position_bias is not None:``) and the
projections'. Not a match: rotary or ``repeat_kv`` operands, fused qkv projections."""


def _is_t5_attention(ctx: MatchContext) -> str | None:
    facts = namesake_facts(ctx, "T5Attention")
    if isinstance(facts, str):
        return facts
    reason = separate_projections_reason(facts)
    if reason:
        return reason
    if not facts.position_bias_in_function:
        return "no position bias is added to the scores"
    # The bias add is part of what the kernel computes (``bias=``): report it with the core
    # when this path takes it; the matcher prefers such a path (adopter.core.match.variant_rank).
    ctx.extra["extra_nodes"] = facts.projections() + facts.bias_adds()
    return None


RULE = Rule(
    name="T5Attention",
    kernel="adopter.kernels.attention",
    doc=DOC,
    dsl=DSL,
    codemod=T5AttentionCodemod(),
    fixtures="attention",
    preconditions=(_is_t5_attention,),
    dedup="class",
    rehome=False,
    veto_across_paths=False,
    hoisting=False,  # the attention codemod interprets the core's blocks itself
)
