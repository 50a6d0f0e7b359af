"""A transformer encoder layer in the style of fairseq: ``normalize_before`` switches between
post-norm (default) and pre-norm, dropout is functional, the activation is chosen by name."""
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_activation_fn(activation: str) -> Callable:
    """Returns the activation function corresponding to `activation`"""
    if activation == "relu":
        return F.relu
    elif activation == "gelu":
        return F.gelu
    elif activation == "tanh":
        return torch.tanh
    elif activation == "linear":
        return lambda x: x
    else:
        raise RuntimeError("--activation-fn {} not supported".format(activation))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim: int = 32, ffn_embed_dim: int = 64, num_heads: int = 4,
                 dropout: float = 0.1, activation_dropout: float = 0.0, activation_fn: str = "gelu",
                 normalize_before: bool = False):
        super().__init__()
        self.embed_dim = embed_dim
        self.self_attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.dropout = dropout
        self.activation_fn = get_activation_fn(activation_fn)
        self.activation_dropout = activation_dropout
        self.normalize_before = normalize_before
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor, encoder_padding_mask: Optional[torch.Tensor] = None):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(x, x, x, key_padding_mask=encoder_padding_mask, need_weights=False)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = F.dropout(x, p=float(self.activation_dropout), training=self.training)
        x = self.fc2(x)
        x = nn.functional.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


class TransformerEncoder(nn.Module):
    def __init__(self, vocab: int = 100, embed_dim: int = 32, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, embed_dim, padding_idx=1)
        self.dropout = dropout
        self.layers = nn.ModuleList([TransformerEncoderLayer(embed_dim) for _ in range(layers)])
        self.layer_norm = None  # only with --encoder-normalize-before

    def forward(self, src_tokens):
        x = self.embed_tokens(src_tokens) * self.embed_tokens.embedding_dim ** 0.5
        x = F.dropout(x, p=self.dropout, training=self.training)
        padding_mask = src_tokens.eq(1)
        for layer in self.layers:
            x = layer(x, padding_mask)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x
