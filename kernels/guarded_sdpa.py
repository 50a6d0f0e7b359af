"""Guarded written-out attention: ``softmax(q @ kᵀ * scale + mask) [dropout] @ v`` as one
``F.scaled_dot_product_attention`` where that is the same computation and pays, the source's own
ops otherwise.

The rewrite (rule ``sdpa_attention``) passes what the source wrote, evaluated where the call is:
the query, the key *as the source multiplies it* (``k.transpose(-2, -1)``; ``k`` itself for an
einsum, with both equations in ``einsum=``), the value, one scale (``scale=`` multiplied,
``divisor=`` divided), one additive ``mask``, the boolean fills (``masked_fill``):
``fill`` with its ``fill_value``, or tuples of them in the source's order (a fill ``None``: its
``if`` did not run; the value ``"lowest"``: the source's ``-torch.finfo(scores.dtype).max``),
``fill_first`` when the source fills before it adds, the softmax's dtype
(``softmax_float32=True`` when the source computes it in float32 — ``softmax(s.float())``,
``softmax(s, dtype=torch.float32)`` — and casts the probabilities back: ``probs_type_as=t`` for
``.type_as(t)``, ``probs_to=x`` for ``.to(x)``), and the dropout: the user's module
(``dropout=self.attn_drop``) or ``F.dropout``'s ``dropout_p``/``dropout_training``.

The fused path runs only when it provably computes what the source computes:

* query, key, value plain floating tensors of one dtype and device, rank 4, the key
  ``(B, H, D, S)`` as multiplied (``(B, H, S, D)`` for an einsum), equal batch and head sizes
  (grouped-query attention: the source repeats the keys itself, so they are equal);
* a mask that is a tensor of the query's dtype (or bool, added as 1.0 where True as ``s + m``
  adds it) of rank 2-4 broadcasting to the scores without changing their shape; a bool fill
  broadcasting likewise, whose value is ``-inf`` or the scores' ``-finfo.max`` (another
  finite value: the source's ops run); with ``-finfo.max`` no query row may have every key filled
  or masked with ``-inf`` (the source's softmax of it is uniform: read on the masks, source ops); a scale that is a Python number or a one-element tensor
  recording no gradient;
* a softmax the source computes in float32 and casts back only where both casts are identities:
  query/key/value float32 and the cast back to float32 on the query's device (in bfloat16 the
  source rounds a float32 softmax, which SDPA does not compute bitwise: the source's ops run);
* no random numbers drawn: SDPA's dropout does not draw the numbers ``nn.Dropout`` draws on the
  probabilities, so training with ``p > 0`` runs the source's ops with the user's dropout (the same
  numbers, seeded as the original); a dropout module runs fused only as a plain ``nn.Dropout``
  without hooks (:func:`~adopter.kernels.guard_checks.plain_reason`), in eval mode or at ``p == 0``;
* not under fx (Proxy inputs: the graph shows the source's ops and the user's dropout module), global
  module hooks, ``torch.jit.trace``, ``torch.func`` transforms or forward AD
  (:func:`~adopter.kernels.policy.policy_reason`), nor while torch.compile traces (inductor fuses the
  source's ops itself, and the check below needs the data); TorchScript compiles the source's
  statements the rewrite keeps under ``torch.jit.is_scripting()``;
* SDPA gives 0 where softmax makes NaN (a fully masked or NaN row): a query row of the fused output
  that sums to 0 or NaN sends the call to the source's ops (the check of ``ops/attention.py``), as
  does, in half precision, a row masked by a finite additive mask only;
* it pays: the calibrated cost model (``kernels/cost.py``, ``benchmarks/results/sdpa_cpu.json``)
  by the scores' size, grad mode and thread count.

Forward and backward go through :mod:`adopter.kernels.ops.attention`'s fused call (SDPA's own
backward; a double backward differentiates the eager ops).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .guard_checks import context_reason, plain_reason, record_fallback
from .ops.attention import _HALF, _finitely_masked_row, _run_fused, _suspect_row, attention_eager, attention_sdpa
from .policy import mode_reason, policy_reason
from .telemetry import record

__all__ = ["sdpa"]

KERNEL = "sdpa"


def _original(q, key, v, scale, divisor, mask, fill, fill_value, fill_first, dropout, dropout_p, dropout_training,
              einsum, softmax_float32, probs_to, probs_type_as):
    """What the source's statements compute, in its order."""
    s = torch.einsum(einsum[0], q, key) if einsum else torch.matmul(q, key)
    if scale is not None:
        s = s * scale
    if divisor is not None:
        s = s / divisor
    fills = _fills(fill, fill_value)
    if fill_first:
        for m, value in fills:
            s = s.masked_fill(m, torch.finfo(s.dtype).min if value == LOWEST else value)
    if mask is not None:
        s = s + mask
    if not fill_first:
        for m, value in fills:
            s = s.masked_fill(m, torch.finfo(s.dtype).min if value == LOWEST else value)
    if softmax_float32:  # the source's softmax in float32, cast back before the dropout
        p = F.softmax(s, dim=-1, dtype=torch.float32)
        p = p.type_as(probs_type_as) if probs_type_as is not None else p.to(probs_to)
    else:
        p = F.softmax(s, dim=-1)
    if dropout is not None:
        p = dropout(p)
    elif dropout_p is not None:
        p = F.dropout(p, dropout_p, dropout_training)
    return torch.einsum(einsum[1], p, v) if einsum else torch.matmul(p, v)


# ``fill_value`` of a fill the source writes ``-torch.finfo(<scores>.dtype).max``: the most negative
# finite number of the scores' dtype (the scores are not computed where the call is).
LOWEST = "lowest"


def _fills(fill, fill_value) -> list[tuple[Any, Any]]:
    """The source's fills in order as (mask, value): ``fill``/``fill_value`` one each or tuples of
    as many; a mask None is a fill whose ``if`` did not run (left out)."""
    if isinstance(fill, tuple):
        values = fill_value if isinstance(fill_value, tuple) else (fill_value,) * len(fill)
        return [(m, value) for m, value in zip(fill, values, strict=True) if m is not None]
    return [] if fill is None else [(fill, fill_value)]


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and not (
            value.requires_grad and torch.is_grad_enabled()) and type(value) is torch.Tensor:
        return float(value)
    return None


def _dropout_reason(dropout, dropout_p, dropout_training) -> str:
    if dropout is not None:
        why = plain_reason(dropout, nn.Dropout)
        if why:
            return f"the dropout module: {why}"
        if dropout.training and dropout.p != 0:
            return "training with dropout: SDPA would draw other random numbers than the user's nn.Dropout"
        return ""
    if dropout_p is None or not dropout_training:
        return ""
    p = _number(dropout_p)
    if p is None or p != 0:
        return "training with dropout: SDPA would draw other random numbers than F.dropout"
    return ""


def _broadcasts(term: torch.Tensor, scores: tuple[int, ...]) -> bool:
    return 2 <= term.dim() <= 4 and all(m in (1, n) for m, n in zip(term.shape[::-1], scores[::-1]))


def _operands_reason(q, key, v, mask, fill, fill_value, einsum) -> str:
    if not all(type(t) is torch.Tensor for t in (q, key, v)) or not q.is_floating_point():
        return "query/key/value are not plain floating-point tensors"
    if not q.dim() == key.dim() == v.dim() == 4 or not q.dtype == key.dtype == v.dtype:
        return "query/key/value differ in rank or dtype, or are not (batch, heads, seq, head_dim)"
    if not q.device == key.device == v.device:
        return "query/key/value on different devices"
    if q.device.type == "meta":  # (no data: the output check below reads it)
        return "meta tensors"
    b, h, q_len, d = q.shape
    k_shape = key.shape if einsum else (*key.shape[:2], key.shape[3], key.shape[2])
    if tuple(k_shape[:2]) != (b, h) or k_shape[3] != d or tuple(v.shape[:3]) != (b, h, k_shape[2]):
        return "key/value shapes the products broadcast or reject"
    scores = (b, h, q_len, k_shape[2])
    if mask is not None:
        if type(mask) is not torch.Tensor or mask.device != q.device or not _broadcasts(mask, scores):
            return "a mask that is not a tensor broadcasting to the scores on the query's device"
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            return f"a {mask.dtype} mask added to {q.dtype} scores"
    lowest = torch.finfo(q.dtype).min
    for m, value in _fills(fill, fill_value):
        if type(m) is not torch.Tensor or m.dtype != torch.bool or m.device != q.device \
                or not _broadcasts(m, scores):
            return "a fill mask that is not a bool tensor broadcasting to the scores"
        # -inf, or the scores' most negative finite number (-finfo.max): exp of it less a row's
        # maximum is 0 wherever the row keeps a finite score; a fully masked row is checked apart
        if not (value == LOWEST or isinstance(value, float) and value in (-math.inf, lowest)):
            return "a fill value other than -inf or the scores' -finfo(dtype).max (a masked score's softmax differs)"
    return ""


def _blocked_row(fills, mask, q_len: int, k_len: int) -> bool:
    """Whether some query row has every key filled or masked with -inf: the source's softmax of a
    row filled with -finfo.max is uniform over it, SDPA's is not (a -inf fill alone is caught by
    the output check, the source giving NaN). Read on the masks, broadcast over (…, q_len, k_len)."""
    blocked = None
    for m, _ in fills:
        blocked = m if blocked is None else blocked | m
    if mask is not None and mask.dtype != torch.bool:
        inf = mask == -math.inf
        blocked = inf if blocked is None else blocked | inf
    if blocked is None:
        return False
    return bool(blocked.expand(*blocked.shape[:-2], q_len, k_len).all(-1).any())


def _casts_reason(q, softmax_float32, probs_to, probs_type_as) -> str:
    """The source's float32 softmax cast back is SDPA's softmax only where both casts are identities:
    the scores float32 already (query/key/value float32: their dtype is checked one) and the cast
    back to float32 on the query's device."""
    if not softmax_float32:
        return ""
    if q.dtype != torch.float32:
        return "the source computes the softmax in float32 and rounds it back: in another dtype SDPA differs"
    target = probs_type_as if probs_type_as is not None else probs_to
    if type(target) is torch.Tensor:
        if target.dtype != torch.float32 or target.device != q.device:
            return "the probabilities are cast to another dtype or device than the query's"
        return ""
    if target is not torch.float32:
        return "the probabilities are cast to something other than torch.float32"
    return ""


def sdpa(q: Any, key: Any, v: Any, *, scale: Any = None, divisor: Any = None, mask: Any = None,
                   fill: Any = None, fill_value: Any = None, fill_first: bool = False, dropout: Any = None,
                   dropout_p: Any = None, dropout_training: Any = True, einsum: tuple[str, str] | None = None,
                   softmax_float32: bool = False, probs_to: Any = None, probs_type_as: Any = None) -> Any:
    """The written-out attention the source computed (module doc), fused where provably equal."""
    args = (q, key, v, scale, divisor, mask, fill, fill_value, fill_first, dropout, dropout_p, dropout_training,
            einsum, softmax_float32, probs_to, probs_type_as)
    if torch.compiler.is_compiling():  # (before anything dynamo would not trace)
        return _original(*args)
    reason = (context_reason(q, key, v, mask, *(fill if isinstance(fill, tuple) else (fill,)))
              or mode_reason()  # (before any read of the data)
              or _operands_reason(q, key, v, mask, fill, fill_value, einsum)
              or _casts_reason(q, softmax_float32, probs_to, probs_type_as)
              or _dropout_reason(dropout, dropout_p, dropout_training))
    factor = 1.0
    if not reason:
        for value, invert in ((scale, False), (divisor, True)):
            if value is None:
                continue
            number = _number(value)
            if number is None or not math.isfinite(number) or (invert and number == 0):
                reason = "a scale that is not a finite number (a tensor recording a gradient, say)"
                break
            factor = factor / number if invert else factor * number
    if not reason:
        k_len = key.shape[-2] if einsum else key.shape[-1]
        # (half precision calibrated apart: the written-out bf16 matmuls are slow on CPU, where SDPA
        # pays from far smaller sizes than in float32)
        reason = policy_reason(KERNEL, q, size=lambda: q.shape[0] * q.shape[1] * q.shape[2] * k_len,
                               variant=lambda: "half" if q.dtype in _HALF else "")
    if reason:
        record_fallback(KERNEL, reason)
        return _original(*args)
    k = key if einsum else key.transpose(-2, -1)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.to(q.dtype)  # (``s + m`` adds 1.0 where True: a summand, never a keep-mask)
    fills = _fills(fill, fill_value)
    if any(value != -math.inf for _, value in fills) and _blocked_row(fills, mask, q.shape[2], k.shape[2]):
        record_fallback(KERNEL, "a query row has every key filled with -finfo.max (the source's softmax is uniform)")
        return _original(*args)
    filled = None
    for m, _ in fills:
        filled = m if filled is None else filled | m
    if filled is not None:  # one mask: -inf where filled, the additive mask elsewhere (bool keep-mask alone)
        attn_mask = ~filled if mask is None else torch.where(filled, -math.inf, mask)
    else:
        attn_mask = mask
    if q.dtype in _HALF and mask is not None and _finitely_masked_row(q, k, mask, None):
        record_fallback(KERNEL, "a query row is masked by a finite mask in half precision")
        return _original(*args)
    out = _run_fused(attention_sdpa, attention_eager, q, k, v, attn_mask, None, 0.0, factor, False)
    if _suspect_row(out):
        record_fallback(KERNEL, "a query row came out NaN or zero: maybe a fully masked (all -inf) or NaN row, "
                                "which softmax makes NaN")
        return _original(*args)
    record(KERNEL, "torch")
    return out
