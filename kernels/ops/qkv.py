"""Fused query/key/value projection: one matmul instead of three."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .common import fx_leaf


@fx_leaf
def qkv_projection(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weight, bias)`` split into ``len(sizes)`` projections along the last dim.

    The projections are last-dim slices of one output (as GPT-2's ``c_attn(x).split(...)``): the
    usual ``.view(*x.shape[:-1], heads, head_dim)`` / ``.view(batch * seq, features)`` work on them;
    only a view that merges the feature dim with another needs ``.reshape``. Measured on CPU at
    BERT-base shapes, one matmul + split beat both three Linears (~0.6x) and a batched matmul that
    yields contiguous outputs (~0.8x), see benchmarks/results/kernels_cpu.md.
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the projection expects {weight.shape[1]}")
    return tuple(F.linear(x, weight, bias).split(list(sizes), dim=-1))
