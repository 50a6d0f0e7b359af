# Several boolean fills, each under its own `if` or not, filled with -inf or with the scores' most
# negative finite number (`-torch.finfo(sim.dtype).max`, inline or bound to a name first), before or
# after an additive bias; the softmax bound as a partial attribute.
# expect: sdpa_attention PaddingAndCausal.forward
# expect: sdpa_attention CosineCausal.forward
# expect: sdpa_attention FillsThenBias.forward
from functools import partial

import torch
import torch.nn.functional as F
from adopter.kernels import sdpa
from torch import nn


class PaddingAndCausal(nn.Module):
    def __init__(self, dim, heads, causal=True, p=0.1, max_len=16):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attend = partial(F.softmax, dim=-1)
        self.drop = nn.Dropout(p)
        self.register_buffer("future", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x, keep=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = sdpa(
            q,
            k,
            v,
            scale=self.scale,
            fill=((~keep[:, None, None, :] if keep is not None else None), (self.future[:n, :n] if self.causal else None)),
            fill_value=("lowest", "lowest"),
            dropout=self.drop,
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        return out.transpose(1, 2).reshape(b, n, d)


class CosineCausal(nn.Module):
    def __init__(self, dim, heads, causal=True, temperature=10.0, max_len=16):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.temperature = temperature
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_buffer("future", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return (sdpa(q, k.transpose(-2, -1), v, scale=self.temperature, fill=(self.future[:n, :n] if self.causal else None), fill_value="lowest")).transpose(1, 2).reshape(
            b, n, d
        )


class FillsThenBias(nn.Module):
    def __init__(self, dim, heads, max_len=16):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.zeros(heads, max_len, max_len))
        self.register_buffer("future", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x, pad):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return sdpa(q, k.transpose(-1, -2), v, divisor=(d // self.heads) ** 0.5, mask=self.bias[:, :n, :n], fill=(pad[:, None, None, :], self.future[:n, :n]), fill_value=(float("-inf"), float("-inf")), fill_first=True).transpose(1, 2).reshape(
            b, n, d
        )
