"""Folding an eval-mode BatchNorm into the preceding Conv/Linear weights."""
from __future__ import annotations

import math

import torch

from .common import fx_leaf


@fx_leaf
def fold_batch_norm(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of ``BN(layer(x))`` as one layer, for per-output-channel (dim 0) BN.

    ``w' = w * g / sqrt(var + eps)`` and ``b' = (b - mean) * g / sqrt(var + eps) + beta``, computed in
    fp64 (then cast back): folding changes the rounding of every output, and deep stacks
    (ResNet-50 has 53 Conv+BN pairs) compound fp32 fold error past an fp32 equivalence tolerance.
    Differentiable.
    """
    return fold_with(weight, bias, running_mean, running_var, bn_weight, bn_bias, eps,
                     device_type=weight.device.type, dtype=weight.dtype, ndim=weight.dim())


def fold_with(weight, bias, running_mean, running_var, bn_weight, bn_bias, eps: float, *, device_type: str,
              dtype: torch.dtype, ndim: int):
    """:func:`fold_batch_norm` with the facts it reads off ``weight`` given: the same ops on
    ``torch.fx`` proxies record the fold in a graph (a proxy cannot tell its device or rank)."""
    compute = torch.float64 if device_type != "mps" else torch.float32
    scale = torch.rsqrt(running_var.to(compute) + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.to(compute)
    shifted = -running_mean.to(compute) if bias is None else bias.to(compute) - running_mean.to(compute)
    folded_bias = shifted * scale
    if bn_bias is not None:
        folded_bias = folded_bias + bn_bias.to(compute)
    folded_weight = weight.to(compute) * scale.reshape(-1, *([1] * (ndim - 1)))
    return folded_weight.to(dtype), folded_bias.to(dtype)


def fold_range(weight, bias, running_mean, running_var, bn_weight, bn_bias, eps: float) -> tuple[float, float]:
    """``(P, Q)``: for an input with ``|x| <= B``, every value ``BN(layer(x))`` computes on the way
    (the layer's output, it less the mean, times ``1/sqrt(var + eps)``, times ``gamma``, plus
    ``beta``), and every value the folded layer computes, is at most ``B * P + Q`` in magnitude;
    NaN or inf when a tensor is not finite or ``var + eps`` is 0 in the BatchNorm's dtype.

    Per output channel ``c``: a row of the layer's weight maps ``|x| <= B`` to at most ``B * A_c``
    (``A_c`` its L1 norm), and every factor applied after it is at most ``G_c = max(1,
    1/sqrt(var_c + eps), |gamma_c|/sqrt(var_c + eps))``. So ``P = max_c A_c * G_c`` and ``Q = max_c
    (|b_c| + |mean_c|) * G_c + |beta_c|``. Where ``B * P + Q`` is far below the dtype's largest
    value neither order of the products can overflow: the fold changes rounding only, never where
    an inf or a NaN lands."""
    with torch.no_grad():
        f64 = torch.float64
        if weight.shape[0] == 0:
            return 0.0, 0.0
        native = torch.rsqrt(running_var.detach() + eps)  # (the BatchNorm's own dtype: it may overflow there)
        if not bool(torch.isfinite(native).all()):
            return math.inf, math.inf
        inv = torch.rsqrt(running_var.detach().to(f64) + eps)
        scale = inv if bn_weight is None else inv * bn_weight.detach().to(f64).abs()
        g = torch.maximum(torch.maximum(inv, scale), torch.ones_like(inv))
        rows = weight.detach().to(f64).abs().reshape(weight.shape[0], -1).sum(1)
        shift = running_mean.detach().to(f64).abs()
        if bias is not None:
            shift = shift + bias.detach().to(f64).abs()
        q = shift * g
        if bn_bias is not None:
            q = q + bn_bias.detach().to(f64).abs()
        return float((rows * g).max()), float(q.max())
