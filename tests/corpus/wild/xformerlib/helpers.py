"""Small helpers and the feed-forward builders of the library."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def l2norm(t, dim=-1):
    return F.normalize(t, dim=dim)


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


def FeedForward(dim, dim_out=None, mult=4, glu=False, dropout=0.0):
    inner_dim = int(dim * mult)
    dim_out = default(dim_out, dim)
    project_in = nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU()) if not glu else GEGLU(dim, inner_dim)
    return nn.Sequential(
        project_in,
        nn.Dropout(dropout),
        nn.Linear(inner_dim, dim_out),
    )


class SwiGLUFeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        inner_dim = int(dim * mult * 2 / 3)
        self.proj_in = nn.Linear(dim, inner_dim * 2, bias=False)
        self.proj_out = nn.Linear(inner_dim, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.dropout(self.proj_out(x * F.silu(gate)))
