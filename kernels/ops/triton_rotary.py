"""Triton kernel for the rotary embedding in every layout (forward and backward are one kernel).

One elementwise kernel over the pairs: ``o1 = x1*c1 - x2*s1, o2 = x2*c2 + x1*s2`` (backward, the
transposed rotation of the gradient: ``o1 = x1*c1 + x2*s2, o2 = x2*c2 - x1*s1``). Each of the eight
operands is a view read through its own strides (padded to 4 dimensions), so one kernel serves every
layout of :mod:`adopter.kernels.ops.rotary`: the halves of ``x`` (``x[..., :h]``/``x[..., h:]``), its
even/odd positions (``x[..., 0::2]``/``x[..., 1::2]``), two tensors given apart; ``cos``/``sin``
broadcast views (stride 0 where they broadcast, e.g. over heads), or one angle per pair read by both
parts. Nothing is copied or expanded in memory: ``x`` may be the transposed ``(batch, heads, seq,
dim)`` view attention code hands over. The output is contiguous. Arithmetic in fp32, one rounding
to the output dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_power_of_2, rotary_function
from .rotation_parts import _pair_function, parts

ROWS_PER_PROGRAM = 16


@triton.jit
def _load(P, i0, i1, i2, c, s0, s1, s2, s3, mask):
    row = (i0 * s0 + i1 * s1 + i2 * s2)[:, None]
    return tl.load(P + row + c * s3, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(P, value, i0, i1, i2, c, s0, s1, s2, s3, mask):
    row = (i0 * s0 + i1 * s1 + i2 * s2)[:, None]
    tl.store(P + row + c * s3, value.to(P.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    X1, X2, C1, C2, S1, S2, O1, O2,
    n_rows, D1, D2, H,
    x1s0, x1s1, x1s2, x1s3, x2s0, x2s1, x2s2, x2s3,
    c1s0, c1s1, c1s2, c1s3, c2s0, c2s1, c2s2, c2s3,
    s1s0, s1s1, s1s2, s1s3, s2s0, s2s1, s2s2, s2s3,
    o1s0, o1s1, o1s2, o1s3, o2s0, o2s1, o2s2, o2s3,
    TRANSPOSE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    # row -> (i0, i1, i2) of the 4-d index (the last dimension is the pair index)
    i2 = rows % D2
    i1 = (rows // D2) % D1
    i0 = rows // (D2 * D1)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    c = cols[None, :].to(tl.int64)
    x1 = _load(X1, i0, i1, i2, c, x1s0, x1s1, x1s2, x1s3, mask)
    x2 = _load(X2, i0, i1, i2, c, x2s0, x2s1, x2s2, x2s3, mask)
    k1 = _load(C1, i0, i1, i2, c, c1s0, c1s1, c1s2, c1s3, mask)
    k2 = _load(C2, i0, i1, i2, c, c2s0, c2s1, c2s2, c2s3, mask)
    n1 = _load(S1, i0, i1, i2, c, s1s0, s1s1, s1s2, s1s3, mask)
    n2 = _load(S2, i0, i1, i2, c, s2s0, s2s1, s2s2, s2s3, mask)
    if TRANSPOSE:
        o1 = x1 * k1 + x2 * n2
        o2 = x2 * k2 - x1 * n1
    else:
        o1 = x1 * k1 - x2 * n1
        o2 = x2 * k2 + x1 * n2
    _store(O1, o1, i0, i1, i2, c, o1s0, o1s1, o1s2, o1s3, mask)
    _store(O2, o2, i0, i1, i2, c, o2s0, o2s1, o2s2, o2s3, mask)


def _as_4d(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` broadcast to ``shape`` (a view: stride 0 where it broadcasts), with 1s prepended to 4-d."""
    t = t.expand(shape)
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def rotate_into(x1, x2, c1, c2, s1, s2, o1, o2, transpose: bool) -> None:
    """:func:`adopter.kernels.ops.rotary.rotate_into` as one triton launch (``o1``/``o2`` have the
    broadcast shape of all inputs, at most 4 dimensions)."""
    shape = o1.shape
    views = [_as_4d(t, shape) for t in (x1, x2, c1, c2, s1, s2, o1, o2)]
    _, d1, d2, half = views[0].shape
    n_rows = o1.numel() // half if half else 0
    if n_rows == 0:
        return
    strides = [s for v in views for s in v.stride()]
    _rotary_kernel[(triton.cdiv(n_rows, ROWS_PER_PROGRAM),)](
        *views, n_rows, d1, d2, half, *strides,
        TRANSPOSE=transpose, ROWS=ROWS_PER_PROGRAM, BLOCK_H=next_power_of_2(half),
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool,
           interleaved: bool = False) -> torch.Tensor:
    h = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rotate_into(*parts(x, h, interleaved), *parts(cos, h, interleaved), *parts(sin, h, interleaved),
                *parts(out, h, interleaved), transpose)
    return out


def _rotate_interleaved(x, cos, sin, transpose):
    return rotate(x, cos, sin, transpose, interleaved=True)


def _rotate_pairs(x1, x2, cos, sin, o1, o2, transpose):
    rotate_into(x1, x2, cos, cos, sin, sin, o1, o2, transpose)


TritonRotaryFunction = rotary_function(
    rotate, "TritonRotaryFunction",
    """:class:`adopter.kernels.ops.rotary.RotaryFunction` as one triton kernel each way.""",
)

TritonInterleavedRotaryFunction = rotary_function(
    _rotate_interleaved, "TritonInterleavedRotaryFunction",
    """:class:`adopter.kernels.ops.rotary.InterleavedRotaryFunction` as one triton kernel each way.""",
)

TritonPairRotaryFunction = _pair_function(
    "TritonPairRotaryFunction", _rotate_pairs,
    """:class:`adopter.kernels.ops.rotary.PairRotaryFunction` as one triton kernel each way.""",
)

__all__ = ["TritonInterleavedRotaryFunction", "TritonPairRotaryFunction", "TritonRotaryFunction", "rotate",
           "rotate_into"]
