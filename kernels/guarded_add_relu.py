"""Guarded residual add + ReLU: ``activation(x + residual)`` in one pass over memory.

The end of a residual block (ResNet's bottleneck: ``out += identity; out = self.relu(out)``) reads
two tensors, writes their sum, reads it again and writes its ReLU (into a fresh tensor unless the
ReLU is in place). aten's ``_add_relu`` computes both in one pass; in place it writes no new
tensor either. It differs from ``relu(x + residual)`` in one thing: a NaN becomes 0 (``torch.relu``
keeps it). So the fused path runs only where both operands are *known* finite
(:mod:`adopter.kernels.ops.finite`: checked by a kernel, unchanged since), and the sum of two finite
tensors has no NaN; it never reads them to find out, which would cost what the fusion saves. The sum
can overflow, though, where ``_add_relu`` clamps it to the largest float (``relu`` gives ``inf``):
the bounds on the operands' magnitudes recorded with them must show it cannot (the result is then
recorded with their sum as its bound). An operand recorded without a bound costs one read: of the
result out of place (a clamped element sends the call to the original ops), of the operand in place.

The rewrite passes what the source did: ``out = add_relu(self.relu, out, identity, in_place=True)``
for ``out += identity; out = self.relu(out)``, ``in_place=False`` for ``self.relu(out + identity)``.
In place, the source leaves ``x`` holding the sum; when the activation writes a new tensor
(``nn.ReLU()``, ``F.relu``), the kernel may write the ReLU into ``x`` instead only when nothing
else can see ``x`` (no other reference to it, no view of its storage), which it asks CPython's
reference count; ``x`` must be passed as the caller's local name, as rewrites do.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .guard_checks import context_reason, record_fallback
from .guarded import IN_PLACE_RELUS, epilogue_activation
from .ops import finite
from .policy import policy_reason
from .telemetry import record

__all__ = ["add_relu"]

_DTYPES = (torch.float32, torch.float64)  # (aten's _add_relu asserts on half types)


def _probe(activation: Any, x: Any, residual: Any, in_place: bool = False) -> int:
    return sys.getrefcount(x)


def _probe_caller() -> int:
    x = object()
    return _probe(None, x, None, in_place=True)


# The reference count of ``x`` inside :func:`add_relu` when only the caller's local name holds it is
# measured by calling the probe the way rewrites call the kernel, at each call: it is not a constant
# of the interpreter (once torch.compile has run, dynamo's frame evaluation holds one more reference
# to every argument, in the probe's frame as in the kernel's).


def add_relu(activation: Any, x: Any, residual: Any, in_place: bool = False) -> Any:
    """``activation(x + residual)``; with ``in_place=True`` what ``x += residual; activation(x)``
    computes (``x`` then holds the sum). One pass (aten ``_add_relu``) when ``activation`` is a
    ReLU (``nn.ReLU`` without hooks, ``F.relu``, ``torch.relu``), both operands are float32/64 CPU
    tensors of one shape, dtype and dense layout, known finite, and no gradient is recorded;
    otherwise the original ops."""
    if torch.compiler.is_compiling():  # (before anything dynamo would not trace)
        reason, unshared = policy_reason("add_relu", x) or "torch.compile", False
    else:
        unshared = sys.getrefcount(x) == _probe_caller()  # (while no other local holds x)
        reason = context_reason(x, residual) or policy_reason("add_relu", x) or _operands_reason(x, residual)
    relu = "" if reason else epilogue_activation(activation)
    if not reason and not relu:
        reason = f"activation is {type(activation).__name__}, not a ReLU"
    # an in-place ReLU writes into the sum, as the fused in-place add does: nothing else to guard
    writes_new = not ((isinstance(activation, nn.ReLU) and activation.inplace)
                      or any(activation is f for f in IN_PLACE_RELUS))
    if not reason and in_place and writes_new and not (unshared and _storage_unshared(x)):
        reason = "the sum is read elsewhere (x is referenced or viewed)"
    if not reason and not (finite.known(x) and finite.known(residual)):
        reason = "operands not known finite (a NaN would become 0)"
    if not reason:
        # aten's _add_relu clamps a sum that overflows to the largest float (relu(x + residual) is inf
        # there): the operands' bounds must show it cannot, or (out of place) the result is read
        top = torch.finfo(x.dtype).max
        total = finite.bound(x) + finite.bound(residual)
        if in_place and not total <= top:  # (in place the operands are gone afterwards: read them first)
            total = finite.magnitude(x) + finite.magnitude(residual)
            if not total <= top:
                reason = "the sum could overflow (aten's _add_relu would clamp it to the largest float)"
    if reason:
        record_fallback("add_relu", reason)
        return _original(activation, x, residual, in_place)
    out = torch._add_relu_(x, residual) if in_place else torch._add_relu(x, residual)
    if total <= top:
        finite.mark(out, total * (1 + torch.finfo(x.dtype).eps))  # (|relu(x + r)| <= |x| + |r|, rounded)
    else:  # an operand recorded without a bound: no element of the result reached the clamp?
        peak = float(out.amax()) if out.numel() else 0.0
        if not peak < top:
            record_fallback("add_relu", "the sum overflowed (aten's _add_relu clamped it to the largest float)")
            return _original(activation, x, residual, in_place)
        finite.mark(out, peak)
    record("add_relu", "torch")
    return out


def _original(activation: Any, x: Any, residual: Any, in_place: bool) -> Any:
    if in_place:
        x += residual
        return _apply(activation, x)
    return _apply(activation, x + residual)


def _apply(activation: Any, t: Any) -> Any:
    """``activation(t)``; a tensor method handed as ``torch.Tensor.relu`` is called as the method
    (``t.relu()``), as the source wrote it: an fx proxy records it, the descriptor would refuse one."""
    if activation is torch.Tensor.relu:
        return t.relu()
    if activation is torch.Tensor.relu_:
        return t.relu_()
    return activation(t)


def _operands_reason(x: Any, residual: Any) -> str:
    if type(x) is not torch.Tensor or type(residual) is not torch.Tensor:
        return "operands are not plain tensors"
    if x.device.type != "cpu" or residual.device.type != "cpu":
        return "not on the CPU (aten's _add_relu is a CPU kernel)"
    if x.dtype not in _DTYPES or residual.dtype != x.dtype:
        return f"dtypes {x.dtype}/{residual.dtype} (float32 or float64, the same)"
    if x.shape != residual.shape or x.layout != torch.strided or residual.layout != torch.strided:
        return "operands differ in shape (broadcasting) or are not strided"
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return "x is not dense (contiguous or channels_last)"
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad):
        return "gradient recorded (aten's _add_relu has no backward)"
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return "a torch function or dispatch mode is active"
    return ""


def _storage_use_count(x: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(x.untyped_storage()._cdata)


try:  # (the count includes the storage object asked for it)
    _UNSHARED_STORAGE_COUNT = _storage_use_count(torch.empty(1))
except (AttributeError, RuntimeError):  # (a torch without the query: never in place)
    _UNSHARED_STORAGE_COUNT = -1


def _storage_unshared(x: torch.Tensor) -> bool:
    """No view of ``x`` and no other tensor on its storage."""
    if x._is_view():
        return False
    try:
        return _storage_use_count(x) == _UNSHARED_STORAGE_COUNT
    except (AttributeError, RuntimeError):
        return False
