# More spellings of written-out attention: one expression, k.mT, Tensor.matmul, in-place scale,
# a learned relative-position bias added to the scores (Swin-style, its gradient flows through the
# kernel), a padding fill under `if mask is not None:`, a bool mask *added* to the scores.
# expect: sdpa_attention OneLiner.forward
# expect: sdpa_attention MethodMatmul.forward
# expect: sdpa_attention RelativeBias.forward
# expect: sdpa_attention ConditionalFill.forward
# expect: sdpa_attention BoolAdded.forward
import math

import torch
import torch.nn.functional as F
from adopter.kernels import sdpa
from torch import nn


class OneLiner(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return (sdpa(q, k.mT, v, divisor=math.sqrt(q.shape[-1]))).transpose(1, 2).reshape(b, n, d)


class MethodMatmul(nn.Module):
    def __init__(self, dim, heads, p=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return sdpa(q, k.transpose(-2, -1), v, scale=self.scale, dropout=self.drop).transpose(1, 2).reshape(
            b, n, d
        )


class RelativeBias(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        n = window * window
        self.relative_position_bias_table = nn.Parameter(torch.randn(2 * n - 1, heads) * 0.02)
        index = torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1
        self.register_buffer("relative_position_index", index)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q = q * self.scale
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        bias = bias.permute(2, 0, 1).contiguous()
        return (sdpa(q, k.transpose(-2, -1), v, mask=bias.unsqueeze(0))).transpose(1, 2).reshape(b, n, d)


class ConditionalFill(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return sdpa(q, k.transpose(-1, -2), v, divisor=math.sqrt(d // self.heads), fill=(mask == 0 if mask is not None else None), fill_value=float("-inf")).transpose(1, 2).reshape(
            b, n, d
        )


class BoolAdded(nn.Module):
    """``scores + keep`` with a bool ``keep`` adds 1.0 where True: what the kernel computes too."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return (sdpa(q, k.transpose(-2, -1), v, scale=0.25, mask=keep)).transpose(1, 2).reshape(b, n, d)
