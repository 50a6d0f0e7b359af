"""Triton row-wise softmax (forward and backward), one program per row, after the triton tutorial."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import row_block, row_num_warps


@triton.jit
def _softmax_fwd(X, Y, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    x = tl.load(X + row * N + cols, mask=in_row, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    y = e / tl.sum(e, axis=0)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=in_row)


@triton.jit
def _softmax_bwd(DY, Y, DX, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    dy = tl.load(DY + row * N + cols, mask=in_row, other=0.0).to(tl.float32)
    y = tl.load(Y + row * N + cols, mask=in_row, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=in_row)


class SoftmaxFunction(torch.autograd.Function):
    """Softmax over the last dimension of a non-empty tensor, output in ``out_dtype`` (the fused
    cast of ``F.softmax(x, dtype=...)``)."""

    @staticmethod
    def forward(ctx, x, out_dtype):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        block = row_block(n, 4)
        if x2.numel():
            _softmax_fwd[(x2.shape[0],)](x2, y, n, BLOCK_N=block, num_warps=row_num_warps(block))
        out = y.view(x.shape)
        # the output itself is saved (not ``y``): in a double backward it carries this node, so the
        # gradient's dependence on x through y is differentiated
        ctx.save_for_backward(out)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        (out,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph (double backward): the same formula in torch ops, which record a graph
            y, g = out.float(), dy.float()
            return (y * (g - (g * y).sum(-1, keepdim=True))).to(ctx.x_dtype), None
        n = out.shape[-1]
        y = out.reshape(-1, n)
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty(y.shape, dtype=ctx.x_dtype, device=y.device)
        block = row_block(n, 4)
        if y.numel():
            _softmax_bwd[(y.shape[0],)](dy2, y, dx, n, BLOCK_N=block, num_warps=row_num_warps(block))
        return dx.view(dy.shape), None
