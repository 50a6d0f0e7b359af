"""Functional fused bias + GeLU after a bias-free matmul, and the linear layer built on it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import select_backend, triton_dtype_ok
from .common import fx_leaf

APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")


@fx_leaf
def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(y + bias, approximate=approximate)``; one triton kernel each way on CUDA."""
    _check_approximate(approximate)
    backend = select_backend(
        "bias_gelu", (y, bias),
        has_triton=lambda: triton_dtype_ok(y, bias) and (bias is None or bias.shape == y.shape[-1:]),
    )
    if backend != "triton":
        return F.gelu(y if bias is None else y + bias, approximate=approximate)
    from .triton_bias_gelu import BiasGeLUFunction

    out_dtype = y.dtype if bias is None else torch.promote_types(y.dtype, bias.dtype)  # as `y + bias`
    return BiasGeLUFunction.apply(y, bias.contiguous() if bias is not None else None, approximate, out_dtype)


@fx_leaf
def linear_bias_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias), approximate)``: matmul without bias, then fused bias+GeLU.

    The torch backend keeps ``F.linear`` with its bias (addmm), which is the fastest unfused form on CPU.
    """
    _check_approximate(approximate)
    backend = select_backend(
        "bias_gelu", (x, weight, bias),
        has_triton=lambda: triton_dtype_ok(x, weight, bias),
    )
    if backend != "triton":
        return F.gelu(F.linear(x, weight, bias), approximate=approximate)
    from .triton_bias_gelu import BiasGeLUFunction

    y = F.linear(x, weight)  # under autocast this is the low-precision matmul, as in F.linear(x, w, b)
    return BiasGeLUFunction.apply(y, bias.contiguous() if bias is not None else None, approximate, y.dtype)
