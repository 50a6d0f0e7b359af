"""Triton kernels for fused dropout + residual add + LayerNorm (forward and backward one kernel each).

The dropout mask is never stored: it is regenerated in the backward from ``(seed, element index)``
with the same Philox stream (``tl.rand``); the seed is a one-element int64 tensor the kernels load
(drawn on the device, never synced to the host). ``x`` and ``residual`` may differ in dtype (half
``x``, float32 ``residual`` under autocast): dropout is rounded in ``x``'s dtype, the sum
``h = dropout(x) + residual`` in their promoted dtype, exactly as the unfused reference
materializes it, and ``h`` is stored in that dtype for the backward. With ``prenorm`` the stored
``h`` is also an output (the sum a pre-norm block keeps as its next residual): the backward adds
its incoming gradient to the normalization's, in ``h``'s dtype as autograd sums the two uses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import seed_tensor as _seed_tensor
from .triton_utils import as_rows, reduction_programs, row_block, row_num_warps


@triton.jit
def _dropout_add_layer_norm_fwd(
    X, R, W, B, Y, H, Mean, Rstd,
    N, eps, p, scale, Seed,
    HAS_DROPOUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    base = row.to(tl.int64) * N
    x = tl.load(X + base + cols, mask=in_row, other=0.0)
    r = tl.load(R + base + cols, mask=in_row, other=0.0)
    if HAS_DROPOUT:
        keep = tl.rand(tl.load(Seed), row * N + cols) >= p
        # round like the unfused reference: dropout output in x's dtype, then the add in h's dtype
        x = tl.where(keep, x.to(tl.float32) * scale, 0.0).to(X.dtype.element_ty)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty).to(tl.float32)
    if STORE_H:
        tl.store(H + base + cols, h.to(H.dtype.element_ty), mask=in_row)
    mean = tl.sum(h, axis=0) / N
    centered = tl.where(in_row, h - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(Y + base + cols, y.to(Y.dtype.element_ty), mask=in_row)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _dropout_add_layer_norm_bwd(
    DY, H, DHO, W, Mean, Rstd, DX, DR, DW, DB,
    M, N, p, scale, Seed, rows_per_program,
    HAS_DROPOUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DR: tl.constexpr, HAS_DHO: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    # walk row pointers (64-bit offsets) instead of recomputing row * N in 32 bits
    offset = row_start.to(tl.int64) * N
    DY += offset
    H += offset
    DHO += offset
    DX += offset
    DR += offset
    for row in range(row_start, row_end):
        dy = tl.load(DY + cols, mask=in_row, other=0.0).to(tl.float32)
        h = tl.load(H + cols, mask=in_row, other=0.0).to(tl.float32)
        mean = tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        xhat = tl.where(in_row, (h - mean) * rstd, 0.0)
        if HAS_WEIGHT:
            wdy = dy * w
            dw_acc += dy * xhat
        else:
            wdy = dy
        if HAS_BIAS:
            db_acc += dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dh = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DHO:
            # the sum is also an output: autograd adds both gradients in h's dtype
            dho = tl.load(DHO + cols, mask=in_row, other=0.0).to(tl.float32)
            dh = (dh.to(H.dtype.element_ty).to(tl.float32) + dho).to(H.dtype.element_ty).to(tl.float32)
        if NEED_DR:
            tl.store(DR + cols, dh.to(DR.dtype.element_ty), mask=in_row)
        if NEED_DX:
            if HAS_DROPOUT:
                # as the unfused backward: the add hands dropout dh rounded to x's dtype
                keep = tl.rand(seed, row * N + cols) >= p
                dh = tl.where(keep, dh.to(DX.dtype.element_ty).to(tl.float32) * scale, 0.0)
            tl.store(DX + cols, dh.to(DX.dtype.element_ty), mask=in_row)
        DY += N
        H += N
        DHO += N
        DX += N
        DR += N
    if HAS_WEIGHT:
        tl.store(DW + pid * N + cols, dw_acc, mask=in_row)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db_acc, mask=in_row)


class DropoutAddLayerNormFunction(torch.autograd.Function):
    """``layer_norm(dropout(x, p) + residual)`` over the last ``N`` elements of each row; with
    ``prenorm`` the pair ``(h, layer_norm(h))`` of the sum ``h = dropout(x, p) + residual`` and its
    normalization.

    ``seed``: a one-element int64 tensor on ``x``'s device (or an int), read only when ``p > 0``;
    saved for the backward, which regenerates the mask from it.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, n_cols, eps, p, seed, out_dtype, prenorm=False):
        x2 = as_rows(x, n_cols)
        r2 = as_rows(residual, n_cols)
        rows = x2.shape[0]
        h_dtype = torch.promote_types(x.dtype, residual.dtype)
        y = torch.empty((rows, n_cols), dtype=out_dtype, device=x.device)
        need_grad = any(ctx.needs_input_grad[:4])
        # without grad (and not returned) h is not stored: H only tells the kernel h's dtype
        h_out = None
        if need_grad or prenorm:
            # allocated in x's shape: the prenorm output is this tensor itself, not a view made here
            h_out = torch.empty(x.shape, dtype=h_dtype, device=x.device)
            h = h_out.view(rows, n_cols)
        else:
            h = next((t for t in (r2, x2, y) if t.dtype == h_dtype), None)
            if h is None:
                h = torch.empty(0, dtype=h_dtype, device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = row_block(n_cols, 4)
        has_dropout = p > 0.0
        scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
        seed_t = _seed_tensor(seed, x.device) if has_dropout else None
        if rows > 0:
            _dropout_add_layer_norm_fwd[(rows,)](
                x2, r2, weight if weight is not None else x2, bias if bias is not None else x2,
                y, h, mean, rstd,
                n_cols, eps, p, scale, seed_t if seed_t is not None else mean,
                HAS_DROPOUT=has_dropout, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                STORE_H=need_grad or prenorm, BLOCK_N=block, num_warps=row_num_warps(block),
            )
        ctx.save_for_backward(h_out if need_grad else None, weight, bias, mean, rstd, seed_t)
        ctx.meta = (n_cols, p, scale, has_dropout, x.dtype, residual.dtype, x.shape, out_dtype)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros to read)
        if prenorm:
            return h_out, y.view(x.shape)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, *grads):
        h, weight, bias, mean, rstd, seed = ctx.saved_tensors
        n_cols, p, scale, has_dropout, x_dtype, r_dtype, shape, out_dtype = ctx.meta
        need_dx, need_dr, need_dw, need_db = ctx.needs_input_grad[:4]
        # prenorm: grads = (d sum, d normalized), either None when that output is not used further
        dh_out, dy = grads if len(grads) == 2 else (None, grads[0])
        if dy is None and dh_out is None:
            return (None,) * 10
        if dy is None:
            dy = torch.zeros(shape, dtype=out_dtype, device=h.device)
        h = as_rows(h, n_cols)
        dy2 = as_rows(dy, n_cols)
        dho2 = as_rows(dh_out, n_cols) if dh_out is not None else None
        rows = dy2.shape[0]
        dev = dy.device
        dx = torch.empty((rows, n_cols), dtype=x_dtype, device=dev) if need_dx else None
        dr = torch.empty((rows, n_cols), dtype=r_dtype, device=dev) if need_dr else None
        programs = reduction_programs(dev, rows)
        dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=dev) if weight is not None else None
        db_part = torch.empty((programs, n_cols), dtype=torch.float32, device=dev) if bias is not None else None
        block = row_block(n_cols, 4)
        if rows > 0:
            _dropout_add_layer_norm_bwd[(programs,)](
                dy2, h, dho2 if dho2 is not None else dy2, weight if weight is not None else dy2, mean, rstd,
                dx if dx is not None else dy2, dr if dr is not None else dy2,
                dw_part if dw_part is not None else mean, db_part if db_part is not None else mean,
                rows, n_cols, p, scale, seed if seed is not None else mean, triton.cdiv(rows, programs),
                HAS_DROPOUT=has_dropout, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                NEED_DX=bool(need_dx), NEED_DR=bool(need_dr), HAS_DHO=dho2 is not None, BLOCK_N=block,
                num_warps=row_num_warps(block),
            )
        dw = dw_part.sum(0).to(weight.dtype).view(weight.shape) if need_dw else None
        db = db_part.sum(0).to(bias.dtype).view(bias.shape) if need_db else None
        return (
            dx.view(shape) if dx is not None else None,
            dr.view(shape) if dr is not None else None,
            dw, db, None, None, None, None, None, None,
        )
