"""``Softmax`` module over the functional :func:`adopter.kernels.ops.softmax.softmax`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops.softmax import softmax


class Softmax(nn.Softmax):
    """Drop-in for ``nn.Softmax(dim)`` (default ``dim=-1``)."""

    def __init__(self, dim: int | None = -1) -> None:
        super().__init__(dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles nn.Softmax's computation
            return F.softmax(input, self.dim, _stacklevel=5)
        else:
            return self._forward(input)

    @torch.jit.unused
    def _forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.dim is None:  # legacy implicit dim: keep torch's behaviour (and its warning)
            return F.softmax(input, self.dim, _stacklevel=5)
        return softmax(input, self.dim)
