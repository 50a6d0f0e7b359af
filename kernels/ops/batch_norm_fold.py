"""Folding an eval-mode BatchNorm into the preceding Conv/Linear weights."""
from __future__ import annotations

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
