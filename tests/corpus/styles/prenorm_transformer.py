"""Pre-norm encoder/decoder transformer, research style (explicit dropout modules per sub-layer)."""
import math
from typing import Optional

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 4, qkv_bias: bool = True, attn_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.out_proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = scores.softmax(dim=-1)
        attn = self.attn_drop(attn)
        out = (attn @ v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(out)


class CrossAttention(nn.Module):
    """Attends from ``x`` to ``context`` (falls back to self-attention without context)."""

    def __init__(self, dim: int, num_heads: int = 4, attn_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x, context=None):
        context = x if context is None else context
        B, T, C = x.shape
        S = context.shape[1]
        h = self.num_heads
        q = self.to_q(x).reshape(B, T, h, C // h).permute(0, 2, 1, 3)
        k = self.to_k(context).reshape(B, S, h, C // h).permute(0, 2, 1, 3)
        v = self.to_v(context).reshape(B, S, h, C // h).permute(0, 2, 1, 3)
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        attn = torch.softmax(sim, dim=-1)
        attn = self.attn_drop(attn)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim),
        )

    def forward(self, x):
        return self.net(x)


class EncoderLayer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.drop1 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, mlp_ratio * dim, dropout)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        x = x + self.drop1(self.attn(self.norm1(x), mask))
        x = x + self.drop2(self.ff(self.norm2(x)))
        return x


class DecoderLayer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.self_attn = SelfAttention(dim, heads)
        self.drop1 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = CrossAttention(dim, heads)
        self.drop2 = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, mlp_ratio * dim, dropout)
        self.drop3 = nn.Dropout(dropout)

    def forward(self, x, memory, self_mask=None):
        x = x + self.drop1(self.self_attn(self.norm1(x), self_mask))
        x = x + self.drop2(self.cross_attn(self.norm2(x), memory))
        x = x + self.drop3(self.ff(self.norm3(x)))
        return x


class Seq2SeqTransformer(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 4):
        super().__init__()
        self.encoder = nn.ModuleList([EncoderLayer(dim, heads) for _ in range(depth)])
        self.decoder = nn.ModuleList([DecoderLayer(dim, heads) for _ in range(depth)])
        self.enc_norm = nn.LayerNorm(dim)
        self.dec_norm = nn.LayerNorm(dim)

    def forward(self, src, tgt=None):
        tgt = src if tgt is None else tgt
        memory = src
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.enc_norm(memory)
        T = tgt.shape[1]
        causal = torch.tril(torch.ones(T, T, device=tgt.device, dtype=torch.bool))
        y = tgt
        for layer in self.decoder:
            y = layer(y, memory, causal)
        return self.dec_norm(y)
