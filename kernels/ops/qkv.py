"""Fused query/key/value projection: one matmul instead of three."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .common import fx_leaf


@fx_leaf
def qkv_projection(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], sizes: Sequence[int]
) -> Tuple[torch.Tensor, ...]:
    """``F.linear(x, weight, bias)`` split into ``len(sizes)`` projections along the last dim.

    With equal sizes it is one batched matmul ``(n, rows, in) x (n, in, out)`` so that each projection
    comes out contiguous (callers ``.view`` them freely, as they did the separate Linear outputs);
    unequal sizes (GQA) use one matmul and return last-dim slices.
    """
    sizes = tuple(sizes)
    n = len(sizes)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the projection expects {weight.shape[1]}")
    if len(set(sizes)) == 1 and x.dim() >= 1:
        out = sizes[0]
        rows = x.reshape(-1, x.shape[-1])
        w = weight.view(n, out, weight.shape[1]).transpose(1, 2)
        stacked_x = rows.unsqueeze(0).expand(n, -1, -1)
        if bias is None:
            y = torch.bmm(stacked_x, w)
        else:
            y = torch.baddbmm(bias.view(n, 1, out), stacked_x, w)
        return tuple(y[i].view(*x.shape[:-1], out) for i in range(n))
    return tuple(F.linear(x, weight, bias).split(list(sizes), dim=-1))
