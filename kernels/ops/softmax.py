"""Functional softmax: a triton row kernel for last-dim rows on CUDA, ``F.softmax`` otherwise.

``F.softmax`` itself runs whatever the kernel would not compute as it does: a 0-dim or empty input,
a ``dim`` that is not an int in range (torch raises, or picks the legacy implicit dim for None), and
under ``torch.jit.trace``, a ``torch.func`` transform or a forward-AD dual level
(:func:`~adopter.kernels.policy.mode_reason`: the triton Function has no vmap or jvp rule).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import autocast_to_fp32, requested_backend, select_backend, triton_dtype_ok
from ..policy import policy_reason
from ..telemetry import ORIGINAL, record
from .common import fx_leaf, row_block


def _traced_softmax(input: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    return F.softmax(input, dim, dtype=dtype)


@fx_leaf(traced=_traced_softmax)
def softmax(input: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.softmax(input, dim, dtype=dtype)``."""
    n = input.dim()
    if n == 0 or type(dim) is not int or not -n <= dim < n or input.numel() == 0:
        record("softmax", "torch")
        return F.softmax(input, dim, dtype=dtype)
    # (dynamo traces F.softmax or the Function; policy_reason: the execution mode, kernels_off, the cost model)
    reason = "" if torch.compiler.is_compiling() else policy_reason("softmax", input)
    if reason:
        record("softmax", ORIGINAL, reason)
        return F.softmax(input, dim, dtype=dtype)
    dim = dim % n
    last = dim == input.dim() - 1

    def triton_fits() -> bool:
        out_ok = dtype is None or dtype in (torch.float32, torch.float16, torch.bfloat16)
        fits = out_ok and triton_dtype_ok(input) and row_block(input.shape[dim], 4) > 0
        # auto mode: only rows that are already last-dim contiguous; forced mode also moves `dim`
        return fits and ((last and input.is_contiguous()) or requested_backend() == "triton")

    backend = select_backend("softmax", (input,), has_triton=triton_fits)
    record("softmax", backend)
    if backend != "triton":
        return F.softmax(input, dim, dtype=dtype)
    from .triton_softmax import SoftmaxFunction

    if dtype is not None:
        out_dtype = dtype
    elif autocast_to_fp32(input.device.type):
        out_dtype = torch.float32  # as F.softmax under CUDA autocast
    else:
        out_dtype = input.dtype
    if last:
        return SoftmaxFunction.apply(input, out_dtype)
    return SoftmaxFunction.apply(input.movedim(dim, -1), out_dtype).movedim(-1, dim)
