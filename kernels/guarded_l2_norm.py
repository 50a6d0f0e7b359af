"""Guarded scaled L2 norm (x-transformers' RMSNorm) for rewritten code.

The RMSNorm rule replaces a class's ``forward`` written ``F.normalize(x, dim=-1) * self.scale *
self.gamma`` by ``return scaled_l2_norm(x, self.scale, self.gamma)``: the factors are the source's
own expressions, in its order, read at every call (never a value of the analysed model), and the
keywords say what the source does around the normalization (``eps=`` when it gives one,
``upcast=True`` for ``F.normalize(x.float(), ...)``, ``cast_back=True`` for a ``.type_as(x)``; see
:class:`~adopter.kernels.ops.l2_norm.L2NormForm`). The fused path
(:class:`~adopter.kernels.ops.l2_norm.ScaledL2NormFunction`: the same ops, bitwise equal forward,
in place where it can, a backward from the input and one norm per row) runs when

* no execution mode, switch or measured cost says otherwise (:func:`adopter.kernels.policy.policy_reason`:
  torch.jit.trace, a torch.func transform, forward-mode AD, ``ADOPTER_KERNELS_OFF``, the CPU
  calibration where the fused path was measured slower, a half input normalized in its own dtype on
  a curve of its own: the kernel's float32 backward costs more there);
* ``x`` is a non-empty floating tensor in float32/float16/bfloat16 with a last dimension, not an
  fx ``Proxy`` (a trace must show the original ops);
* every factor is a Python number (not a bool) or a floating tensor of shape ``()``, ``(1,)`` or
  ``(x.shape[-1],)`` on ``x``'s device (so the product has ``x``'s shape, as the source's has);
* ``eps`` is a positive Python number;

and otherwise the source's own math runs (``F.normalize``, then the products in the source's order).
Each call is counted in :mod:`adopter.kernels.telemetry`.
"""
from __future__ import annotations

from typing import Any

import torch

from .ops.common import is_proxy
from .ops.l2_norm import DEFAULT_EPS, HALF, INPUT_DTYPES, L2NormForm, ScaledL2NormFunction, scaled_l2_norm_reference
from .policy import policy_reason
from .telemetry import ORIGINAL, record

__all__ = ["scaled_l2_norm"]

KERNEL = "scaled_l2_norm"


def _factor_reason(f: Any, x: torch.Tensor) -> str:
    if isinstance(f, bool):
        return "a factor is a bool"
    if isinstance(f, (int, float)):
        return ""
    if not isinstance(f, torch.Tensor) or not f.is_floating_point():
        return f"a factor is a {type(f).__name__}, not a number or a floating tensor"
    if tuple(f.shape) not in ((), (1,), (x.shape[-1],)):
        return f"a factor of shape {tuple(f.shape)} for rows of {x.shape[-1]}"
    if f.device != x.device:
        return "a factor and the input on different devices"
    return ""


def _reason(x: Any, factors: tuple, eps: Any) -> str:
    """Why the fused kernel may not compute this call ("" when it may)."""
    if is_proxy(x) or is_proxy(eps) or any(is_proxy(f) for f in factors):
        return "tracing"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return "input is not a floating tensor"
    if x.dtype not in INPUT_DTYPES:
        return f"input dtype {x.dtype} (the kernel takes float32, float16, bfloat16)"
    if x.dim() == 0 or x.numel() == 0:
        return "input has no last dimension or no elements"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        return f"eps {eps!r} is not a positive number"
    for f in factors:
        why = _factor_reason(f, x)
        if why:
            return why
    return ""


def _variant(x: Any, form: L2NormForm) -> str:
    """The calibration curve of this call: ``half`` for a float16/bfloat16 input normalized in its
    own dtype (no upcast; measured apart, benchmarks/results/scaled_l2_norm.json), else the default."""
    return "half" if isinstance(x, torch.Tensor) and x.dtype in HALF and not form.upcast else ""


def _saves_input(x: torch.Tensor, form: L2NormForm) -> bool:
    """Whether the source's graph keeps ``x`` itself (so that an in-place change of ``x`` before
    the backward is an error there too): when ``x`` requires grad and is normalized as it is
    (``F.normalize`` of ``x``, or of ``x.float()`` that is ``x``)."""
    return x.requires_grad and (not form.upcast or x.dtype == torch.float32)


def scaled_l2_norm(x: Any, *factors: Any, eps: Any = DEFAULT_EPS, upcast: bool = False,
                   cast_back: bool = False) -> Any:
    """``F.normalize(x[.float()], dim=-1, eps=eps) * factors[0] * factors[1] ...`` [cast back to
    ``x.dtype``], fused when the module doc's checks pass."""
    form = L2NormForm(upcast, cast_back)
    # the mode and policy first: under torch.jit.trace the checks' shape tests would be recorded
    # (a half input normalized in its own dtype is calibrated apart: the kernel's backward is float32)
    reason = policy_reason(KERNEL, x, variant=lambda: _variant(x, form)) or _reason(x, factors, eps)
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return scaled_l2_norm_reference(x, factors, eps, form)
    grads = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, *factors))
    if torch.is_grad_enabled() and grads and not _saves_input(x, form):
        # the kernel keeps x for the backward where the source keeps a copy (or only its
        # normalized value): a copy, so that x may change in place before the backward as there
        x = x.clone()
    out = ScaledL2NormFunction.apply(x, float(eps), form, *factors)
    record(KERNEL, "torch")
    return out
