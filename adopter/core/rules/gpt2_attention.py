"""GPT2Attention: GPT-2's attention over a fused qkv projection replaced by ``adopter.kernels.attention``."""

from __future__ import annotations

from adopter.core.dsl import Layer
from adopter.core.match import MatchContext, same_value
from adopter.core.rule import Rule
from adopter.core.rules._attention import attention_dsl, describe, is_projection, namesake_facts
from adopter.core.rules._attention_codemod import GPT2AttentionCodemod

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
position-biased scores, rotary or ``repeat_kv`` operands.

Lines: the core's and the projections' (the split fused projection included). The same
core is reached on the self-attention path (``self.c_attn(hidden_states).split(...)``)
and on the ``if is_cross_attention:`` path (``self.q_attn(hidden_states)``,
``self.c_attn(encoder_hidden_states)``); the match reports the variant the class runs in
every configuration (``adopter.core.match.variant_rank``): ``q_attn`` is built in
``__init__`` only under ``if self.is_cross_attention:`` while ``c_attn`` is built on both
branches, and the cross path reads ``encoder_hidden_states``, an input that defaults to
``None``. So the reported lines are the ones a plain GPT-2 executes, which is what the
trace confirms."""


def _split_projections(ctx: MatchContext) -> list[Layer]:
    """Projections whose output is split (``self.c_attn(x).split(...)``) on the path before the core."""
    prod = ctx.producers()
    found: list[Layer] = []
    for n in ctx.path.nodes[: ctx.node_indices[0]]:
        if isinstance(n, Layer) and n.type in ("torch.Tensor.split", "torch.split", "torch.Tensor.chunk"):
            src = n.args[0].value if n.args else None
            p = prod.get((src.name, src.version)) if hasattr(src, "version") else None
            if p is not None and is_projection(p) and p not in found:
                found.append(p)
    return found


def _is_gpt2_attention(ctx: MatchContext) -> str | None:
    facts = namesake_facts(ctx, "GPT2Attention")
    if isinstance(facts, str):
        return facts
    kinds = (facts.k.kind, facts.v.kind)
    split_projections: list[Layer] = []
    if kinds == ("split", "split"):
        if not same_value(facts.k.module, facts.v.module):
            return "key and value are not split from the same projection"
    elif set(kinds) <= {"split", "input"}:
        split_projections = _split_projections(ctx)
        if not split_projections:
            return "key/value cannot be traced and no fused projection is split on the path"
    else:
        return f"key/value come from {describe(facts.k)} / {describe(facts.v)}, not a split fused projection"
    if facts.q.kind not in ("split", "linear", "input"):
        return f"query comes from {describe(facts.q)}"
    if facts.position_bias_in_function:
        return "a position bias is added to the scores (T5Attention)"
    ctx.extra["extra_nodes"] = facts.projections() + [p for p in split_projections if p not in facts.projections()]
    return None


RULE = Rule(
    name="GPT2Attention",
    kernel="adopter.kernels.attention",
    doc=DOC,
    dsl=DSL,
    codemod=GPT2AttentionCodemod(),
    fixtures="attention",
    preconditions=(_is_gpt2_attention,),
    dedup="class",
    rehome=False,
    veto_across_paths=False,
    hoisting=False,  # the attention codemod interprets the core's blocks itself
)
