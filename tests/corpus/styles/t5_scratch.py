"""A minimal T5-style encoder (self-attention only) written for a paper reproduction.

RMS norm, bias-free projections, relative position bias shared from the first layer.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class T5LayerNorm(nn.Module):
    """Root-mean-square norm without mean subtraction or bias."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.type_as(self.weight)


class T5Attention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, d_kv=8, num_buckets=32, max_distance=128,
                 has_relative_attention_bias=False, dropout_rate=0.1):
        super().__init__()
        self.n_heads = n_heads
        self.d_kv = d_kv
        self.inner_dim = n_heads * d_kv
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.dropout = dropout_rate
        self.q = nn.Linear(d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, d_model, bias=False)
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        num_buckets //= 2
        ret = (relative_position > 0).long() * num_buckets
        n = torch.abs(relative_position)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact + 1e-6) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        return ret + torch.where(is_small, n, val_if_large)

    def compute_bias(self, qlen, klen, device):
        context_position = torch.arange(qlen, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        rp_bucket = self._relative_position_bucket(relative_position, self.num_buckets, self.max_distance)
        values = self.relative_attention_bias(rp_bucket)  # (qlen, klen, n_heads)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, n_heads, qlen, klen)

    def forward(self, x, position_bias=None):
        bs, qlen, _ = x.shape

        def shape(t):
            return t.view(bs, -1, self.n_heads, self.d_kv).transpose(1, 2)

        q = shape(self.q(x))
        k = shape(self.k(x))
        v = shape(self.v(x))
        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(qlen, qlen, x.device)
            else:
                position_bias = torch.zeros((1, self.n_heads, qlen, qlen), device=x.device, dtype=x.dtype)
        scores = scores + position_bias
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        out = torch.matmul(weights, v)
        out = out.transpose(1, 2).contiguous().view(bs, -1, self.inner_dim)
        return self.o(out), position_bias


class T5DenseReluDense(nn.Module):
    def __init__(self, d_model=32, d_ff=64, dropout_rate=0.1):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x):
        h = F.relu(self.wi(x))
        h = self.dropout(h)
        return self.wo(h)


class T5Block(nn.Module):
    def __init__(self, d_model=32, has_relative_attention_bias=False, dropout_rate=0.1):
        super().__init__()
        self.attn_norm = T5LayerNorm(d_model)
        self.attn = T5Attention(d_model, has_relative_attention_bias=has_relative_attention_bias)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.ff_norm = T5LayerNorm(d_model)
        self.ff = T5DenseReluDense(d_model)
        self.ff_dropout = nn.Dropout(dropout_rate)

    def forward(self, x, position_bias=None):
        h, position_bias = self.attn(self.attn_norm(x), position_bias)
        x = x + self.attn_dropout(h)
        x = x + self.ff_dropout(self.ff(self.ff_norm(x)))
        return x, position_bias


class T5Encoder(nn.Module):
    def __init__(self, vocab=100, d_model=32, n_layers=2, dropout_rate=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([T5Block(d_model, has_relative_attention_bias=(i == 0))
                                     for i in range(n_layers)])
        self.final_norm = T5LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, input_ids):
        x = self.dropout(self.embed(input_ids))
        position_bias = None
        for block in self.blocks:
            x, position_bias = block(x, position_bias)
        return self.dropout(self.final_norm(x))
