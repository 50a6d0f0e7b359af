# Written-out attention outside HF, in the spellings research code uses: each class's
# softmax(q @ kᵀ * scale [+ mask]) [dropout] @ v becomes one sdpa_attention call.
# expect: fused_QKV EinsumAttention.forward
# expect: fused_QKV GroupedQueryAttention.forward
# expect: fused_QKV MaskedAttention.forward
# expect: sdpa_attention CausalSelfAttention.forward
# expect: sdpa_attention EinsumAttention.forward
# expect: sdpa_attention GroupedQueryAttention.forward
# expect: sdpa_attention MaskedAttention.forward
# expect: sdpa_attention PaddingMaskAttention.forward
# expect: sdpa_attention VitAttention.forward
import math

import torch
import torch.nn.functional as F
from adopter.kernels import sdpa
from torch import nn


class VitAttention(nn.Module):
    """ViT-collection style: one qkv Linear, ``(q @ k.transpose(-2, -1)) * self.scale``."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]

        x = (sdpa(q, k.transpose(-2, -1), v, scale=self.scale, dropout=self.attn_drop)).transpose(1, 2).reshape(
            B, N, C
        )
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class CausalSelfAttention(nn.Module):
    """nanoGPT's non-flash branch: a causal tril buffer filled with -inf, F.softmax, dropout."""

    def __init__(self, n_embd, n_head, block_size, dropout=0.0, bias=True):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = sdpa(
            q,
            k.transpose(-2, -1),
            v,
            scale=1.0 / math.sqrt(k.size(-1)),
            fill=self.bias[:, :, :T, :T] == 0,
            fill_value=float('-inf'),
            dropout=self.attn_dropout,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class EinsumAttention(nn.Module):
    """x-former style: einsum for both products, scale multiplied, functional dropout."""

    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.dropout = dropout
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q = self.to_q(x).view(b, n, h, -1).transpose(1, 2)
        k = self.to_k(x).view(b, n, h, -1).transpose(1, 2)
        v = self.to_v(x).view(b, n, h, -1).transpose(1, 2)
        out = sdpa(
            q,
            k,
            v,
            scale=self.scale,
            dropout_p=self.dropout,
            dropout_training=self.training,
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class MaskedAttention(nn.Module):
    """torch.matmul, scale as a division by sqrt(d), an optional additive mask."""

    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        out = sdpa(q, k.transpose(-1, -2), v, divisor=math.sqrt(self.head_dim), mask=mask, dropout=self.dropout)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class PaddingMaskAttention(nn.Module):
    """A boolean padding mask (True = keep) applied by masked_fill(~mask, -inf)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.out(
            (sdpa(q, k.transpose(-2, -1), v, divisor=math.sqrt(q.size(-1)), fill=~keep[:, None, None, :], fill_value=float("-inf"))).transpose(1, 2).reshape(b, n, d),
        )


class GroupedQueryAttention(nn.Module):
    """GQA: fewer key/value heads, repeated with repeat_interleave / expand before the products."""

    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
        out = sdpa(q, k.transpose(2, 3), v, scale=self.head_dim ** -0.5)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))
