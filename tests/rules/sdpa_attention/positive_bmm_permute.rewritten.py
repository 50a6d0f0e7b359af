# Written-out attention with heads folded into the batch (fairseq, diffusers, Megatron: rank-3
# tensors, scores by torch.bmm / torch.baddbmm) and with the key transposed by permute (SAM's
# two-way attention inline, whisper's key permuted before the product).
# expect: sdpa_attention FoldedHeads.forward
# expect: sdpa_attention ZeroBetaBaddbmm.forward
# expect: sdpa_attention FoldedBias.forward
# expect: sdpa_attention PermutedKey.forward
# expect: sdpa_attention PrePermutedKey.forward
# expect: fused_QKV ZeroBetaBaddbmm.forward
# expect: fused_QKV PermutedKey.forward
# expect: fused_QKV PrePermutedKey.forward
import math

import torch
from adopter.kernels import sdpa
from torch import nn


class FoldedHeads(nn.Module):
    """fairseq-style: (B*H, T, d) tensors, q @ kᵀ by torch.bmm, the probabilities by bmm with v."""

    def __init__(self, dim, heads, p=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).reshape(3, b * self.heads, n, -1)
        out = sdpa(q, k.transpose(1, 2), v, scale=self.scale, dropout=self.drop)
        return out.view(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, d)


class ZeroBetaBaddbmm(nn.Module):
    """diffusers-style: baddbmm over an uninitialised tensor with beta=0, the scale as alpha."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)

    def fold(self, t):
        b, n, d = t.shape
        return t.reshape(b, n, self.heads, d // self.heads).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def forward(self, x):
        b, n, d = x.shape
        query, key, value = self.fold(self.to_q(x)), self.fold(self.to_k(x)), self.fold(self.to_v(x))
        empty = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype, device=query.device)
        out = sdpa(query, key.transpose(-1, -2), value, scale=self.scale)
        return out.reshape(b, self.heads, n, -1).permute(0, 2, 1, 3).reshape(b, n, d)


class FoldedBias(nn.Module):
    """bmm scores, scaled, plus an additive bias of shape (B*H, 1, S)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.inv_norm = 1.0 / math.sqrt(dim // heads)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).reshape(3, b * self.heads, n, -1)
        return sdpa(q, k.transpose(1, 2), v, scale=self.inv_norm, mask=bias).view(b, self.heads, n, -1).transpose(1, 2).reshape(
            b, n, d
        )


class PermutedKey(nn.Module):
    """SAM-style: q @ k.permute(0, 1, 3, 2) of rank-4 heads, / sqrt(d)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)

    def separate(self, t):
        b, n, c = t.shape
        return t.reshape(b, n, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.separate(self.q_proj(x)), self.separate(self.k_proj(x)), self.separate(self.v_proj(x))
        _, _, _, c_per_head = q.shape
        out = sdpa(q, k.permute(0, 1, 3, 2), v, divisor=math.sqrt(c_per_head))
        return out.transpose(1, 2).reshape(b, n, d)


class PrePermutedKey(nn.Module):
    """whisper-style: the key permuted (b, S, h, E) -> (b, h, E, S) before the product, then q @ k."""

    def __init__(self, dim, heads, p=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q = self.query(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3)
        k = self.key(x).view(b, n, self.heads, -1)
        k = k.permute(0, 2, 3, 1)
        v = self.value(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3)
        return (sdpa(q, k, v, scale=self.scale, mask=(mask[:n, :n] if mask is not None else None), dropout=self.drop)).permute(0, 2, 1, 3).flatten(
            start_dim=2
        )
