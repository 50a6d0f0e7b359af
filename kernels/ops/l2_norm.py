"""A scaled L2 normalization over the last dimension (x-transformers' RMSNorm), pure torch.

The source writes ``F.normalize(x, dim=-1) * self.scale * self.gamma``: each row divided by
``max(||x||_2, eps)`` (``eps`` 1e-12 unless given), then multiplied, left to right, by the factors
the source names (``scale`` = sqrt(d) there, but whatever it multiplies by; ``gamma`` a weight of
the row size; none, one or several, in the source's order — a product rounds by its order).
:class:`L2NormForm` says what the source does around it: ``upcast`` (it normalizes
``x.float()``) and ``cast_back`` (the product is cast back to the input dtype, ``.type_as(x)``).

:func:`scaled_l2_norm_reference` is that written out as the source writes it (what a guarded call
runs when the kernel may not). :class:`ScaledL2NormFunction` computes the same values with the same
ops in the same order (bitwise equal forward), but multiplies in place where the dtype allows and
keeps only the input and one norm per row for the backward (the source's graph keeps the
normalized tensor and every partial product), which recomputes what it needs: the gradient of
``F.normalize`` including its clamp (a row whose norm is below ``eps`` is divided by ``eps``, and
no gradient flows through its norm) and an all-zero row (zero norm: the norm's gradient is 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)
INPUT_DTYPES = HALF + (torch.float32,)
DEFAULT_EPS = 1e-12  # F.normalize's


@dataclass(frozen=True)
class L2NormForm:
    """``upcast``: the source normalizes ``x.float()``; ``cast_back``: it casts the scaled result
    back to the input's dtype."""

    upcast: bool = False
    cast_back: bool = False


def scaled_l2_norm_reference(x: torch.Tensor, factors: tuple, eps=DEFAULT_EPS,
                             form: L2NormForm = L2NormForm()) -> torch.Tensor:
    """The source's own math: ``F.normalize(x[.float()], dim=-1, eps=eps) * f1 * f2 ...``
    [``.to(x.dtype)``]."""
    h = x.to(torch.float32) if form.upcast else x
    y = F.normalize(h, p=2.0, dim=-1, eps=eps)
    for f in factors:
        y = y * f
    return y.to(x.dtype) if form.cast_back else y


def _denominator(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``max(||h||_2, eps)`` per row, by the ops ``F.normalize`` uses (same rounding)."""
    return h.norm(2, -1, keepdim=True).clamp_min(eps)


def _scaled(n: torch.Tensor, factors: tuple, inplace: bool) -> torch.Tensor:
    """``n * f1 * f2 ...`` left to right; in place on ``n`` where the product keeps its dtype."""
    y = n
    for f in factors:
        # (a number keeps a floating tensor's dtype; a tensor factor when the types promote to y's,
        # or a 0-d one may keep it anyway, which the out-of-place product computes alike)
        keeps = not isinstance(f, torch.Tensor) or torch.promote_types(y.dtype, f.dtype) == y.dtype
        if inplace and keeps:
            y = y.mul_(f)
        else:
            y = y * f
        inplace = True  # every later y is a temporary of this function
    return y


class ScaledL2NormFunction(torch.autograd.Function):
    """``scaled_l2_norm_reference`` for an input in :data:`INPUT_DTYPES` and factors that are Python
    numbers or floating tensors broadcasting over the last dimension (the guarded entry checks);
    saves ``x``, the per-row norm and the tensor factors."""

    @staticmethod
    def forward(ctx, x, eps, form, *factors):
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(f"ScaledL2NormFunction takes {INPUT_DTYPES} inputs, got {x.dtype}")
        h = x.to(torch.float32) if form.upcast else x
        norm = h.norm(2, -1, keepdim=True)
        y = _scaled(h / norm.clamp_min(eps), factors, inplace=True)
        out = y.to(x.dtype) if form.cast_back else y
        ctx.save_for_backward(x, norm, *(f for f in factors if isinstance(f, torch.Tensor)))
        ctx.eps, ctx.form, ctx.out_dtype = eps, form, y.dtype
        ctx.numbers = tuple(None if isinstance(f, torch.Tensor) else f for f in factors)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, norm, *tensors = ctx.saved_tensors
        form, eps = ctx.form, ctx.eps
        it = iter(tensors)
        factors = [next(it) if number is None else number for number in ctx.numbers]
        h = x.to(torch.float32) if form.upcast else x
        if torch.is_grad_enabled():  # create_graph (double backward): the norm must depend on x
            norm = h.norm(2, -1, keepdim=True)
        denom = norm.clamp_min(eps)
        # the partial products n, n * f1, ... as the forward rounded them (a factor's gradient is
        # the product before it; the gradient flowing back is cast to each product's dtype)
        partial = [h / denom]
        for f in factors[:-1]:
            partial.append(partial[-1] * f)
        g = dy.to(ctx.out_dtype) if form.cast_back else dy
        grads: list[torch.Tensor | None] = [None] * len(factors)
        for i in range(len(factors) - 1, -1, -1):
            f, before = factors[i], partial[i]
            if isinstance(f, torch.Tensor) and ctx.needs_input_grad[3 + i]:
                grads[i] = (g * before).sum_to_size(f.shape).to(f.dtype)
            g = (g * f).to(before.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            # n = h / D, D = max(r, eps), r = ||h||: dh = g / D + h * dr / r with
            # dr = -sum(g * h) / D ** 2 where r >= eps (clamp_min passes its gradient there; then
            # D = r), 0 elsewhere and for an all-zero row (the norm's gradient at 0). Where r >= eps
            # that is (g - n * sum(g * n)) / D, in float32: no cancellation of two ~1/D terms
            # (a row of one element gets an exact 0, as the gradient of its sign is)
            g32, h32, d32 = g.to(torch.float32), h.to(torch.float32), denom.to(torch.float32)
            n32 = h32 / d32
            # (r >= eps as clamp_min's backward tests it: eps rounded to the norm's dtype, as denom has it)
            c = torch.where((norm >= denom) & (norm > 0), torch.linalg.vecdot(g32, n32).unsqueeze(-1), 0.0)
            dx = torch.addcmul(g32, n32, c, value=-1).div_(d32).to(x.dtype)
        return (dx, None, None, *grads)
