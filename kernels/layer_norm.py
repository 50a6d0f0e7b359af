"""``FusedDropoutAddLayerNorm``: ``LayerNorm(Dropout(x) + residual)`` in one kernel each way on CUDA."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .ops.dropout_add_layer_norm import dropout_add_layer_norm


class FusedDropoutAddLayerNorm(nn.LayerNorm):
    """Replaces a ``Dropout(p)`` + residual add + ``LayerNorm`` triple; keeps the LayerNorm's
    attribute name and parameters (``weight``, ``bias``), so its state dict is the LayerNorm's.

    Dropout follows ``self.training`` at call time (none in eval).
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        p: float = 0.5,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.p = float(p)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return dropout_add_layer_norm(
            x, residual, self.normalized_shape, self.weight, self.bias, self.eps, self.p, self.training
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, p={self.p}"
