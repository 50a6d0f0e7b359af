"""``FusedLinearBiasGeLU``: ``gelu(x @ W.T + b)`` with the bias add fused into the GeLU kernel."""
from __future__ import annotations

import torch
from torch import nn

from .ops.bias_gelu import APPROXIMATIONS, linear_bias_gelu


class FusedLinearBiasGeLU(nn.Linear):
    """Replaces ``Linear`` followed by GeLU; keeps the Linear's attribute name and parameters.

    ``approximate`` must be the original activation's (``"none"`` = exact erf GeLU, ``"tanh"`` =
    the tanh approximation, i.e. HF's ``gelu_new``/``gelu_pytorch_tanh``); it is never switched.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, approximate: str = "none",
                 device=None, dtype=None) -> None:
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_bias_gelu(x, self.weight, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"
