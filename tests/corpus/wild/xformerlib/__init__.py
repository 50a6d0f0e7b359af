"""A small transformer library built on einops (written for this corpus, in the style of
x-transformers / lucidrains repositories): helpers and feed-forwards in one module, attention,
norms, rotary embeddings and the wrappers in another."""
from .transformer import AttentionLayers, TransformerWrapper, tiny_geglu_lm, tiny_lm, tiny_postnorm_lm, tiny_swiglu_lm

__all__ = ["AttentionLayers", "TransformerWrapper", "tiny_lm", "tiny_postnorm_lm", "tiny_geglu_lm", "tiny_swiglu_lm"]
