"""Triton kernels for ``act(g) * u`` (forward and backward), ``act`` SiLU or GeLU (exact / tanh).

The forward reads ``g`` and ``u`` once and writes the product; the backward reads ``grad``, ``g``
and ``u`` once, recomputes ``act(g)`` and its derivative in registers and writes ``dg`` and
``du``. Math in fp32 whatever the storage dtype; results rounded once to the storage dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 1024
# compiled kernels may only read globals that are constexpr (the interpreter does not check this)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_COEF = tl.constexpr(0.044715)

# activation name -> the ACT constexpr the kernels branch on
_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _tanh(x):
    # tanh via sigmoid: available (and identical) on the GPU and in the interpreter
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * _SQRT1_2))
        a = g * cdf
        da = cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    else:
        t = _tanh((g + g * g * g * _TANH_COEF) * _SQRT_2_OVER_PI)
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + g * g * (3.0 * _TANH_COEF))
    return a, da


@triton.jit
def _gated_act_fwd(G, U, OUT, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=inside, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * _SQRT1_2))
    else:
        a = 0.5 * g * (1.0 + _tanh((g + g * g * g * _TANH_COEF) * _SQRT_2_OVER_PI))
    tl.store(OUT + offs, (a * u).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _gated_act_bwd(DOUT, G, U, DG, DU, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=inside, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offs, mask=inside, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(DG + offs, (dout * u * da).to(DG.dtype.element_ty), mask=inside)
    tl.store(DU + offs, (dout * a).to(DU.dtype.element_ty), mask=inside)


class GatedActTritonFunction(torch.autograd.Function):
    """``act(g) * u`` for ``g``, ``u`` of one shape and dtype; saves ``g`` and ``u`` only."""

    @staticmethod
    def forward(ctx, g, u, activation):
        g_c, u_c = g.contiguous(), u.contiguous()
        out = torch.empty_like(g_c)
        numel = g_c.numel()
        if numel:
            _gated_act_fwd[(triton.cdiv(numel, BLOCK_SIZE),)](
                g_c, u_c, out, numel, ACT=_ACT_CODES[activation], BLOCK=BLOCK_SIZE,
            )
        ctx.save_for_backward(g_c, u_c)
        ctx.activation = activation
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        g, u = ctx.saved_tensors
        dout = dout.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        numel = g.numel()
        if numel:
            _gated_act_bwd[(triton.cdiv(numel, BLOCK_SIZE),)](
                dout, g, u, dg, du, numel, ACT=_ACT_CODES[ctx.activation], BLOCK=BLOCK_SIZE,
            )
        return dg, du, None
