# Masks built inside an `if` from the scores' shape and device (x-transformers' causal mask:
# `i, j = sim.shape[-2:]`, `torch.ones((i, j), ...).triu(j - i + 1)`), then filled or added under
# that same `if`: the mask-building statements stay, reading the query's and key's sizes; the kernel
# gets the mask when the branch ran and None when it did not.
# expect: sdpa_attention FlagCausal.forward
# expect: sdpa_attention CausalWithMemory.forward
# expect: sdpa_attention LengthsMask.forward
# expect: sdpa_attention AlibiThenCausal.forward
from functools import partial

import torch
import torch.nn.functional as F
from adopter.kernels import sdpa
from torch import nn


class FlagCausal(nn.Module):
    """A config flag gates the causal mask; a key-padding fill before it under its own `if`."""

    def __init__(self, dim, heads, causal=True, p=0.1):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attend = partial(F.softmax, dim=-1)
        self.drop = nn.Dropout(p)

    def forward(self, x, keep=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.causal:
            i, j = q.shape[-2:-1] + k.shape[-2:-1]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=q.device).triu(j - i + 1)
        out = sdpa(
            q,
            k,
            v,
            scale=self.scale,
            fill=((~keep[:, None, None, :] if keep is not None else None), (causal_mask if self.causal else None)),
            fill_value=("lowest", "lowest"),
            dropout=self.drop,
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        return out.transpose(1, 2).reshape(b, n, d)


class CausalWithMemory(nn.Module):
    """Keys and values of remembered tokens before the query's own (a cache): more keys than
    queries, the causal mask aligned to the last key (`triu(j - i + 1)`), not the first."""

    def __init__(self, dim, heads, causal=True, p=0.1):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.drop = nn.Dropout(p)

    def forward(self, x, memory=None):
        b, n, d = x.shape
        context = x if memory is None else torch.cat((memory, x), dim=1)
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.causal:
            i, j = q.shape[-2], k.shape[-2]
            future = torch.ones(i, j, dtype=torch.bool, device=q.device).triu(j - i + 1)
        return sdpa(q, k.transpose(-2, -1), v, divisor=(d // self.heads) ** 0.5, fill=(future if self.causal else None), fill_value=float("-inf"), dropout=self.drop).transpose(1, 2).reshape(
            b, n, d
        )


class LengthsMask(nn.Module):
    """`if lengths is not None`: the key-padding mask built from the keys' count and the lengths."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, lengths=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if lengths is not None:
            keys = k.shape[-2]
            keep = torch.arange(keys, device=q.device)[None, :] < lengths[:, None]
        return (sdpa(q, k.mT, v, scale=(d // self.heads) ** -0.5, fill=(~keep[:, None, None, :] if lengths is not None else None), fill_value=float("-inf"))).transpose(1, 2).reshape(
            b, n, d
        )


class AlibiThenCausal(nn.Module):
    """A distance bias added under one flag, a causal fill by `arange` comparison under another, the
    sizes read once before both branches."""

    def __init__(self, dim, heads, alibi=True, causal=True):
        super().__init__()
        self.heads = heads
        self.alibi = alibi
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32).view(heads, 1, 1))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i, j = q.shape[-2:-1] + k.shape[-2:-1]
        if self.alibi:
            distance = torch.arange(j, device=x.device)[None, :] - torch.arange(i, device=x.device)[:, None] - (j - i)
            bias = -self.slopes * distance.abs()
        if self.causal:
            rows = torch.arange(i, device=q.device)[:, None]
            cols = torch.arange(j, device=q.device)[None, :]
        return sdpa(q, k.transpose(-1, -2), v, scale=(d // self.heads) ** -0.5, mask=(bias if self.alibi else None), fill=(cols > rows + (j - i) if self.causal else None), fill_value="lowest").transpose(1, 2).reshape(
            b, n, d
        )
