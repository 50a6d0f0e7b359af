"""Triton kernel for the half-split rotary embedding (forward and backward are one kernel).

Forward ``out1 = x1*c1 - x2*s1, out2 = x2*c2 + x1*s2``; backward (the transposed rotation of the
gradient) ``dx1 = g1*c1 + g2*s2, dx2 = g2*c2 - g1*s1``. Each program loads a tile of rows, both
halves at once, and writes both output halves: no concatenation, no ``-x2`` temporary.

Inputs are read through their strides (padded to 4 dimensions): ``x`` may be the transposed
``(batch, heads, seq, dim)`` view attention code hands over, ``cos``/``sin`` broadcast views
(stride 0 where they broadcast, e.g. over heads), so nothing is copied or expanded in memory.
The result is contiguous. Arithmetic in fp32, one rounding to the output dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_power_of_2, rotary_function

ROWS_PER_PROGRAM = 16


@triton.jit
def _rotary_kernel(
    X, COS, SIN, OUT,
    n_rows, D1, D2, HALF,
    sx0, sx1, sx2, sx3,
    sc0, sc1, sc2, sc3,
    ss0, ss1, ss2, ss3,
    TRANSPOSE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    # row -> (i0, i1, i2) of the 4-d index (the last dimension is the rotated one)
    i2 = rows % D2
    i1 = (rows // D2) % D1
    i0 = rows // (D2 * D1)
    mask = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
    c = cols[None, :].to(tl.int64)
    x_row = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    c_row = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    s_row = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    x1 = tl.load(X + x_row + c * sx3, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_row + (c + HALF) * sx3, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + c_row + c * sc3, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + c_row + (c + HALF) * sc3, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + s_row + c * ss3, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + s_row + (c + HALF) * ss3, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    out_row = rows[:, None] * (2 * HALF)
    tl.store(OUT + out_row + c, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + out_row + c + HALF, o2.to(OUT.dtype.element_ty), mask=mask)


def _as_4d(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` broadcast to ``shape`` (a view: stride 0 where it broadcasts), with 1s prepended to 4-d."""
    t = t.expand(shape)
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    shape = x.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    x4, c4, s4 = _as_4d(x, shape), _as_4d(cos, shape), _as_4d(sin, shape)
    _, d1, d2, dim = x4.shape
    n_rows = x.numel() // dim
    half = dim // 2
    _rotary_kernel[(triton.cdiv(n_rows, ROWS_PER_PROGRAM),)](
        x4, c4, s4, out, n_rows, d1, d2, half, *x4.stride(), *c4.stride(), *s4.stride(),
        TRANSPOSE=transpose, ROWS=ROWS_PER_PROGRAM, BLOCK_H=next_power_of_2(half),
    )
    return out


TritonRotaryFunction = rotary_function(
    rotate, "TritonRotaryFunction",
    """:class:`adopter.kernels.ops.rotary.RotaryFunction` as one triton kernel each way.""",
)
