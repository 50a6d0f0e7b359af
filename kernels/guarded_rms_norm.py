"""``rms_norm``: what a rewritten RMSNorm ``forward`` calls (rule ``RMSNorm``).

The rewrite replaces the written-out normalization of a class's ``forward`` by one call, e.g.
``return rms_norm(hidden_states, self.weight, self.variance_epsilon)`` (Llama) or
``return rms_norm(x, self.weight, self.eps, offset=1.0, weight_before_cast=True, weight_fp32=True)``
(Gemma): the keyword arguments say which form the source wrote (see
:class:`~adopter.kernels.ops.rms_norm.RMSNormForm`), never a fact of a configuration. At run time
the fused kernel (one saved float32 ``rstd`` per row; triton on CUDA) runs when

* ``x`` is a floating tensor in float32/float16/bfloat16 and not an fx ``Proxy`` (a trace must
  show the original ops), with a last dimension;
* ``weight`` is a floating tensor of shape ``(x.shape[-1],)`` on ``x``'s device;
* ``eps`` is a Python number (not a tensor, not a bool);
* ``dim`` (the dimension the source's mean of squares reduces: ``dim=self.dim`` where the source
  reads it from an attribute, as litgpt does) is the last one: ``-1``, ``x.dim() - 1`` or a
  one-element list/tuple of either;
* with ``upcast=False`` (the source normalizes in the input's own dtype), ``x`` is float32, where
  that form computes what the fused float32 kernel computes;

and otherwise the form's eager formula runs, exactly as the source wrote it (over ``dim``). Each
call is counted in :mod:`adopter.kernels.telemetry` (fused backend, or ``original`` with the reason).
"""
from __future__ import annotations

from typing import Any

import torch

from .backend import select_backend, triton_dtype_ok
from .ops.common import is_proxy, row_block
from .ops.rms_norm import INPUT_DTYPES, RMSNormForm, RMSNormFunction, rms_norm_reference
from .policy import policy_reason
from .telemetry import ORIGINAL, record, record_backend

__all__ = ["rms_norm"]

KERNEL = "rms_norm"


def _is_last(dim: Any, ndim: int) -> bool:
    """``dim`` names the last of ``ndim`` dimensions (an int, or a one-element list/tuple)."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, ndim - 1)


def _reason(x: Any, weight: Any, eps: Any, form: RMSNormForm, dim: Any = -1) -> str:
    """Why the fused kernel may not compute this call ("" when it may)."""
    if is_proxy(x) or is_proxy(weight) or is_proxy(eps) or is_proxy(dim):
        return "tracing"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return "input is not a floating tensor"
    if x.dtype not in INPUT_DTYPES:
        return f"input dtype {x.dtype} (the kernel takes float32, float16, bfloat16)"
    if x.dim() == 0:
        return "input has no last dimension"
    if not _is_last(dim, x.dim()):
        return f"the norm is over dim {dim!r}, not the last of {x.dim()}"
    if not form.upcast and x.dtype != torch.float32:
        return f"the source normalizes in the input dtype {x.dtype} (no upcast): fused for float32 only"
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return "weight is not a floating tensor"
    if tuple(weight.shape) != (x.shape[-1],):
        return f"weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}"
    if weight.device != x.device:
        return "weight and input on different devices"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps is a {type(eps).__name__}, not a number"
    return ""


def _saves_input(x: torch.Tensor, form: RMSNormForm) -> bool:
    """Whether the source's autograd graph keeps ``x`` itself for the backward (so that changing it
    in place before the backward is an error there too): it does when ``x`` requires grad and is
    an operand of a product, which it is in float32 (``x.to(torch.float32)`` is ``x``) and in T5's
    ``x * rstd``. A half input is normalized as ``x.float()``, a copy, and an input that requires
    no grad is saved by no op of the source."""
    return x.requires_grad and (x.dtype == torch.float32 or form.cast_to_half_weight)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float, form: RMSNormForm) -> torch.Tensor:
    """The fused kernel: triton (CUDA, a row that fits one block) or :class:`RMSNormFunction`."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) and not _saves_input(x, form):
        # The kernels keep x for the backward; where the source keeps a copy of it (or nothing),
        # x may be updated in place before the backward (a residual stream's ``add_``): they get a
        # copy as well, in x's own dtype (no larger than what the source keeps instead). Made here, under
        # autograd, the copy stays in x's graph, which a double backward differentiates through.
        x = x.clone()
    backend = select_backend(
        KERNEL, (x, weight), has_triton=lambda: triton_dtype_ok(x, weight) and row_block(x.shape[-1]) > 0,
    )
    if backend == "triton":
        from .ops.triton_rms_norm import TritonRMSNormFunction

        return TritonRMSNormFunction.apply(x, weight, eps, form)
    return RMSNormFunction.apply(x, weight, eps, form)


def rms_norm(
    x: Any,
    weight: Any,
    eps: Any,
    *,
    offset: float = 0.0,
    weight_before_cast: bool = False,
    weight_fp32: bool = False,
    cast_to_half_weight: bool = False,
    upcast: bool = True,
    dim: Any = -1,
) -> Any:
    """The RMSNorm form the keywords name, applied to ``x`` over ``dim``, fused when that is its
    last dimension (module doc)."""
    form = RMSNormForm(offset, weight_before_cast, weight_fp32, cast_to_half_weight, upcast)
    # the mode and policy first: under torch.jit.trace the checks' shape tests would be recorded
    # (and warned about) in a trace of the original computation
    reason = policy_reason(KERNEL, x) or _reason(x, weight, eps, form, dim)
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return rms_norm_reference(x, weight, eps, form, dim)
    out = rms_norm_fused(x, weight, float(eps), form)
    record_backend(KERNEL)
    return out
