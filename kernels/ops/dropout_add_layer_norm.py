"""Functional fused dropout + residual add + LayerNorm: ``layer_norm(dropout(x, p) + residual)``."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..backend import autocast_to_fp32, fresh_seed, select_backend, triton_dtype_ok
from .common import fx_leaf, row_block


def dropout_add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    p: float,
    training: bool,
) -> torch.Tensor:
    """The unfused computation, as the original model code wrote it."""
    return F.layer_norm(F.dropout(x, p, training) + residual, normalized_shape, weight, bias, eps)


def dropout_add_layer_norm_torch(x, residual, normalized_shape, weight, bias, eps, p, training):
    """Torch backend: the unfused ops, adding the residual in place into dropout's fresh output
    (one allocation less; ~10% faster fwd+bwd on CPU at BERT-base shapes, see benchmarks/results)."""
    if training and p > 0.0 and x.shape == residual.shape and x.dtype == residual.dtype:
        h = F.dropout(x, p, True).add_(residual)  # dropout's backward needs its mask, not its output
    else:
        h = F.dropout(x, p, training) + residual  # in eval dropout returns x itself: no in-place
    return F.layer_norm(h, normalized_shape, weight, bias, eps)


def _triton_supported(x, residual, weight, n_cols: int) -> bool:
    if not triton_dtype_ok(x, residual, weight) or x.dtype != residual.dtype or x.shape != residual.shape:
        return False
    return (
        row_block(n_cols, 4) > 0
        and x.numel() < 2**31  # Philox offsets are 32-bit
        and (weight is None or weight.dtype in (x.dtype, torch.float32))
    )


@fx_leaf
def dropout_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
    seed: int | None = None,
) -> torch.Tensor:
    """``F.layer_norm(F.dropout(x, p, training) + residual, normalized_shape, weight, bias, eps)``.

    On the triton backend one kernel does dropout (mask from ``seed`` via Philox, regenerated in the
    backward, never stored), the add and the normalization. ``seed`` defaults to a draw from torch's
    default generator.
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    p_eff = p if training else 0.0
    n_cols = math.prod(normalized_shape)
    backend = select_backend(
        "dropout_add_layer_norm", (x, residual, weight, bias),
        has_triton=lambda: (
            x.dim() >= len(normalized_shape)
            and tuple(x.shape[x.dim() - len(normalized_shape):]) == normalized_shape
            and _triton_supported(x, residual, weight, n_cols)
        ),
    )
    if backend != "triton":
        return dropout_add_layer_norm_torch(x, residual, normalized_shape, weight, bias, eps, p, training)
    from .triton_layer_norm import DropoutAddLayerNormFunction

    out_dtype = torch.float32 if autocast_to_fp32(x.device.type) else x.dtype  # as F.layer_norm
    if seed is None:
        seed = fresh_seed() if p_eff > 0 else 0
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    return DropoutAddLayerNormFunction.apply(x, residual, w, b, n_cols, eps, p_eff, seed, out_dtype)

