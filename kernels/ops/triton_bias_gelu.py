"""Triton kernels for ``gelu(y + bias)`` (forward and backward), ``y`` being a bias-free matmul output.

Exact (erf) and tanh-approximate GeLU, matching ``F.gelu(..., approximate=...)``. The backward
recomputes ``y + bias`` from the saved ``y`` and writes ``dz``; ``dbias`` is its column sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 1024
# compiled kernels may only read globals that are constexpr (the interpreter does not check this);
# keep the tensor on the left of `*` (the interpreter's constexpr * tensor does not make a tensor)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_COEF = tl.constexpr(0.044715)


@triton.jit
def _tanh(x):
    # tanh via sigmoid: available (and identical) on the GPU and in the interpreter
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _bias_gelu_fwd(Y, B, OUT, numel, N, HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    z = tl.load(Y + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=inside, other=0.0).to(tl.float32)
    if APPROX_TANH:
        out = 0.5 * z * (1.0 + _tanh((z + z * z * z * _TANH_COEF) * _SQRT_2_OVER_PI))
    else:
        out = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _bias_gelu_bwd(DOUT, Y, B, DZ, numel, N, HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    z = tl.load(Y + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=inside, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offs, mask=inside, other=0.0).to(tl.float32)
    if APPROX_TANH:
        t = _tanh((z + z * z * z * _TANH_COEF) * _SQRT_2_OVER_PI)
        grad = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + z * z * (3.0 * _TANH_COEF))
    else:
        grad = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2)) + z * _INV_SQRT_2PI * tl.exp(-0.5 * z * z)
    tl.store(DZ + offs, (dout * grad).to(DZ.dtype.element_ty), mask=inside)


class BiasGeLUFunction(torch.autograd.Function):
    """``gelu(y + bias)`` with bias broadcast over the last dimension, output in ``out_dtype``."""

    @staticmethod
    def forward(ctx, y, bias, approximate, out_dtype):
        y_c = y.contiguous()
        n = y.shape[-1]
        out = torch.empty(y_c.shape, dtype=out_dtype, device=y_c.device)
        numel = y_c.numel()
        if numel:
            _bias_gelu_fwd[(triton.cdiv(numel, BLOCK_SIZE),)](
                y_c, bias if bias is not None else y_c, out, numel, n,
                HAS_BIAS=bias is not None, APPROX_TANH=approximate == "tanh", BLOCK=BLOCK_SIZE,
            )
        ctx.save_for_backward(y_c, bias)
        ctx.approximate = approximate
        return out

    @staticmethod
    def backward(ctx, dout):
        y, bias = ctx.saved_tensors
        dout = dout.contiguous()
        dz = torch.empty_like(y)
        numel = y.numel()
        if numel:
            _bias_gelu_bwd[(triton.cdiv(numel, BLOCK_SIZE),)](
                dout, y, bias if bias is not None else y, dz, numel, y.shape[-1],
                HAS_BIAS=bias is not None, APPROX_TANH=ctx.approximate == "tanh", BLOCK=BLOCK_SIZE,
            )
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dz.reshape(-1, y.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
        return dz, dbias, None, None
