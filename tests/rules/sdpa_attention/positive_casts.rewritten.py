# The softmax computed in float32 and cast back (Llama's `softmax(s.float()).type_as(q)`, the
# `softmax(s, dtype=torch.float32).to(q.dtype)` spelling), and the softmax bound once as a partial
# attribute (`self.attend = partial(F.softmax, dim=-1)`, x-transformers' style).
# expect: sdpa_attention UpcastTypeAs.forward
# expect: sdpa_attention SoftmaxDtypeTo.forward
# expect: sdpa_attention PartialSoftmax.forward
# expect: sdpa_attention PartialUpcast.forward
import functools
import math
from functools import partial

import torch
import torch.nn.functional as F
from adopter.kernels import sdpa
from torch import nn


class UpcastTypeAs(nn.Module):
    def __init__(self, dim, heads, max_len=16, p=0.1):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_dropout = nn.Dropout(p)
        causal = torch.full((1, 1, max_len, max_len), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x):
        bsz, seqlen, dim = x.shape
        xq, xk, xv = self.wqkv(x).view(bsz, seqlen, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        output = sdpa(
            xq,
            xk.transpose(2, 3),
            xv,
            divisor=math.sqrt(self.head_dim),
            mask=self.causal[:, :, :seqlen, :seqlen],
            softmax_float32=True,
            probs_type_as=xq,
            dropout=self.attn_dropout,
        )
        return output.transpose(1, 2).reshape(bsz, seqlen, dim)


class SoftmaxDtypeTo(nn.Module):
    def __init__(self, dim, heads, p=0.0):
        super().__init__()
        self.heads = heads
        self.scaling = (dim // heads) ** -0.5
        self.p = p
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, bias):
        b, n, d = x.shape
        query, key, value = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = sdpa(
            query,
            key.transpose(2, 3),
            value,
            scale=self.scaling,
            mask=bias,
            softmax_float32=True,
            probs_to=query.dtype,
            dropout_p=self.p,
            dropout_training=self.training,
        )
        return out.transpose(1, 2).reshape(b, n, d)


class PartialSoftmax(nn.Module):
    def __init__(self, dim, heads, p=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attend = partial(F.softmax, dim=-1)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = sdpa(
            q,
            k,
            v,
            scale=self.scale,
            dropout=self.drop,
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        return out.transpose(1, 2).reshape(b, n, d)


class PartialUpcast(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.normalize = functools.partial(torch.softmax, dtype=torch.float32)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return (sdpa(q, k.transpose(-2, -1), v, divisor=math.sqrt(q.shape[-1]), softmax_float32=True, probs_to=v)).transpose(1, 2).reshape(
            b, n, d
        )
