"""BertSelfAttention: the eager attention of BERT's ``BertSelfAttention`` replaced by ``adopter.kernels.attention``."""

from __future__ import annotations

from adopter.core.match import MatchContext
from adopter.core.rule import Rule
from adopter.core.rules._attention import attention_dsl, namesake_facts, separate_projections_reason
from adopter.core.rules._attention_codemod import BertSelfAttentionCodemod

DSL = attention_dsl("BertSelfAttention")

DOC = """\
Replaces the eager attention computation of BERT's self-attention class by the
memory-efficient attention kernel (as the xformers/EPOI policy for
``BertSelfAttention`` does). A match is a class whose name ends with
``BertSelfAttention`` (``BertSelfAttention``, ``MegatronBertSelfAttention``...; the
kernel policy targets that class, so same-shaped attention in other models —
Roberta, ViT, Bart, CLIP — is not counted) whose ``forward`` computes, on one
control-flow path with its helpers inlined (``transpose_for_scores``, or
``eager_attention_forward`` through ``attention_interface(...)`` in transformers 5):
``scores = matmul(q, k.transpose(...))`` (``torch.matmul`` or ``@``), then only
element-wise score ops (``/ sqrt(d)`` or ``* scaling``, additive mask, casts),
``softmax``, then only dropout/casts/head-mask, then ``matmul(probs, v)``; where q, k
and v come — through view/reshape/transpose/permute and KV-cache concatenation — from
three distinct ``torch.nn.Linear`` projections (or cannot be traced statically; nothing
contradicting is allowed). One match per class; its lines are the core's and the
projections' — of the path a plain model runs when several reach the core
(``self.key(hidden_states)``, not ``self.key(encoder_hidden_states)`` under ``if
encoder_hidden_states is not None:``; see ``adopter.core.match.variant_rank``). Not a match: rotary embeddings or ``repeat_kv`` before the scores, a
position bias added to the scores, q/k/v split from one fused projection."""


def _is_bert_attention(ctx: MatchContext) -> str | None:
    facts = namesake_facts(ctx, "BertSelfAttention")
    if isinstance(facts, str):
        return facts
    reason = separate_projections_reason(facts)
    if reason:
        return reason
    if facts.position_bias_in_function:
        return "a position bias is added to the scores (T5Attention)"
    ctx.extra["extra_nodes"] = facts.projections()
    return None


RULE = Rule(
    name="BertSelfAttention",
    kernel="adopter.kernels.attention",
    doc=DOC,
    dsl=DSL,
    codemod=BertSelfAttentionCodemod(),
    fixtures="attention",
    preconditions=(_is_bert_attention,),
    dedup="class",
    rehome=False,
    veto_across_paths=False,
    hoisting=False,  # the attention codemod interprets the core's blocks itself
)
