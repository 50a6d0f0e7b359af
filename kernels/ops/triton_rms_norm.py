"""Triton kernels for RMSNorm in the forms of :class:`~adopter.kernels.ops.rms_norm.RMSNormForm`
(forward one program per row, backward one program per block of rows).

The forward stores the output and one float32 ``rstd`` per row; the backward reloads ``x``,
recomputes ``n = x * rstd`` and writes ``dx`` into a fresh buffer (never into ``dy``: two norms
reading one residual hand their backward the same incoming gradient tensor, whose values the other
still needs). The scale's gradient is summed per program in float32 and the partial sums are added
by torch. Rounding follows the eager code: ``n`` is rounded to the dtype the source casts it to
before the scale multiplies it, and a product is rounded once to the output dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rms_norm import HALF, RMSNormForm
from .triton_utils import as_rows, reduction_programs, row_block, row_num_warps

# where the normalized value is rounded before scaling: not at all (weight_before_cast), to the
# input's dtype (Llama), to the weight's dtype (T5 with a half weight)
_ROUND_NONE, _ROUND_INPUT, _ROUND_WEIGHT = 0, 1, 2


@triton.jit
def _scale(W, cols, in_row, offset, HAS_OFFSET: tl.constexpr, ROUND_SCALE: tl.constexpr):
    """``offset + weight`` (or ``weight``) in float32; rounded to the weight's dtype when the source
    adds the offset in that dtype (``(1.0 + weight).float()``)."""
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        w = w + offset
        if ROUND_SCALE:
            w = w.to(W.dtype.element_ty).to(tl.float32)
    return w


@triton.jit
def _rms_norm_fwd(X, W, Y, Rstd, N, eps, offset,
                  HAS_OFFSET: tl.constexpr, ROUND_SCALE: tl.constexpr, ROUND_N: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    base = row.to(tl.int64) * N
    x = tl.load(X + base + cols, mask=in_row, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    n = x * rstd
    if ROUND_N == 1:
        n = n.to(X.dtype.element_ty).to(tl.float32)
    if ROUND_N == 2:
        n = n.to(W.dtype.element_ty).to(tl.float32)
    y = n * _scale(W, cols, in_row, offset, HAS_OFFSET, ROUND_SCALE)
    tl.store(Y + base + cols, y.to(Y.dtype.element_ty), mask=in_row)
    tl.store(Rstd + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, X, W, Rstd, DX, DS, M, N, offset, rows_per_program,
                  HAS_OFFSET: tl.constexpr, ROUND_SCALE: tl.constexpr, ROUND_N: tl.constexpr,
                  NEED_DX: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    s = _scale(W, cols, in_row, offset, HAS_OFFSET, ROUND_SCALE)
    ds_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    offset_rows = row_start.to(tl.int64) * N
    DY += offset_rows
    X += offset_rows
    DX += offset_rows
    for row in range(row_start, row_end):
        dy = tl.load(DY + cols, mask=in_row, other=0.0).to(tl.float32)
        x = tl.load(X + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        n = x * rstd
        # the scale multiplied n as rounded by the forward: its gradient sees that value
        scaled = n
        if ROUND_N == 1:
            scaled = n.to(X.dtype.element_ty).to(tl.float32)
        if ROUND_N == 2:
            scaled = n.to(W.dtype.element_ty).to(tl.float32)
        ds_acc += dy * scaled
        if NEED_DX:
            dn = dy * s
            if ROUND_N != 0:
                # eager multiplies in the output dtype; the cast's backward hands that rounded value on
                dn = dn.to(DY.dtype.element_ty).to(tl.float32)
            c = tl.sum(dn * n, axis=0) / N
            dx = (dn - n * c) * rstd
            tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=in_row)
        DY += N
        X += N
        DX += N
    tl.store(DS + pid * N + cols, ds_acc, mask=in_row)


def _round_n(x: torch.Tensor, weight: torch.Tensor, form: RMSNormForm) -> int:
    if form.cast_to_half_weight:
        return _ROUND_WEIGHT if weight.dtype in HALF else _ROUND_NONE
    return _ROUND_NONE if form.weight_before_cast else _ROUND_INPUT


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, form: RMSNormForm) -> torch.dtype:
    """The dtype the eager form returns."""
    if form.cast_to_half_weight:
        return weight.dtype if weight.dtype in HALF else torch.promote_types(weight.dtype, torch.float32)
    if form.weight_before_cast:
        return x.dtype
    scale_dtype = torch.float32 if form.weight_fp32 else weight.dtype
    return torch.promote_types(scale_dtype, x.dtype)


class TritonRMSNormFunction(torch.autograd.Function):
    """RMSNorm of one form over the last dimension; saves ``x``, ``weight``, ``rstd`` (float32, per row)."""

    @staticmethod
    def forward(ctx, x, weight, eps, form):
        if not form.upcast and x.dtype != torch.float32:
            # the form without upcast computes in the input's dtype: the kernel's float32 math is it
            # for a float32 input only (the guarded call sends no other)
            raise ValueError(f"the form without upcast is computed for float32 inputs only, got {x.dtype}")
        n_cols = x.shape[-1]
        x2 = as_rows(x, n_cols)
        rows = x2.shape[0]
        w = weight.contiguous()
        y = torch.empty((rows, n_cols), dtype=_out_dtype(x, weight, form), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = row_block(n_cols, 4)
        flags = dict(HAS_OFFSET=bool(form.offset), ROUND_SCALE=not form.weight_fp32,
                     ROUND_N=_round_n(x, weight, form), BLOCK_N=block)
        if rows > 0:
            _rms_norm_fwd[(rows,)](x2, w, y, rstd, n_cols, eps, float(form.offset), **flags,
                                   num_warps=row_num_warps(block))
        ctx.save_for_backward(x2, w, rstd)
        ctx.meta = (x.shape, x.dtype, float(form.offset), flags)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        shape, x_dtype, offset, flags = ctx.meta
        rows, n_cols = x2.shape
        dy2 = as_rows(dy, n_cols)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx = torch.empty((rows, n_cols), dtype=x_dtype, device=dy.device) if need_dx else None
        programs = reduction_programs(dy.device, rows)
        ds_part = torch.zeros((programs, n_cols), dtype=torch.float32, device=dy.device)
        if rows > 0:
            _rms_norm_bwd[(programs,)](
                dy2, x2, w, rstd, dx if dx is not None else dy2, ds_part, rows, n_cols, offset,
                triton.cdiv(rows, programs),
                NEED_DX=bool(need_dx), **flags, num_warps=row_num_warps(flags["BLOCK_N"]),
            )
        dw = ds_part.sum(0).to(w.dtype).view(w.shape) if need_dw else None
        return (dx.view(shape) if dx is not None else None), dw, None, None
