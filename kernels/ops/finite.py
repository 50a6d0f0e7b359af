"""Which tensors are known to hold only finite values: what lets a fused ReLU stay exact.

``torch.relu`` keeps a NaN (``relu(nan) == nan``); oneDNN's ReLU post-op and aten's fused
``_add_relu`` give 0 for it. A kernel that applies one of them therefore computes what the original
computed only where its operands are finite: a NaN or an infinity in the data must reach the
output as the original's ``relu`` would pass it on.

Checking costs one read of a tensor (``sum(t * t)`` is finite only when every element is: a NaN or
an infinity propagates through it; a sum that overflows only sends the call to the original ops),
which also gives a bound on its magnitude (``max|t| <= sqrt(sum(t * t))``). Checks are shared by
*provenance*: a tensor checked once is recorded with its bound (:func:`check`), and a later kernel
reading it, unchanged since (its version counter), skips the check (:func:`known`, :func:`bound`).

Finite operands do not make a finite result: an add, a matmul or a conv of finite values can
overflow to ``±inf`` (``3e38 + 3e38``), an infinity meeting its opposite gives a NaN (which a fused
ReLU would then turn into 0), and aten's ``_add_relu`` even clamps an overflowed sum to the largest
float. So a tensor is recorded only when checked, when an op that cannot overflow (a ReLU, a copy)
computed it from recorded tensors (:func:`mark`), or when the bounds of its operands show the op
could not overflow (``add_relu`` records ``bound(x) + bound(residual)``); a kernel whose result may
have overflowed records it through :func:`check` (a read of its output: a few percent of a conv).
A record made without a bound is read once where a bound is needed (:func:`magnitude`).
Inference tensors (``torch.inference_mode``) have no version counter, so a later write cannot be
told: they are never recorded and are checked at every use. A write through ``.data`` bypasses the
version counter; no forward writes so.
"""
from __future__ import annotations

import math
import weakref

import torch

# id(tensor) -> (weak reference, version counter when recorded, upper bound on |t| (inf: recorded
# without one)); bounded (a forward's live tensors)
_KNOWN: dict[int, tuple[weakref.ReferenceType, int, float]] = {}
_LIMIT = 1024


def _entry(t: torch.Tensor) -> tuple[weakref.ReferenceType, int, float] | None:
    entry = _KNOWN.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    try:
        return entry if t._version == entry[1] else None
    except RuntimeError:  # (an inference tensor: no version counter)
        return None


def known(t: torch.Tensor) -> bool:
    """``t`` was recorded finite by :func:`mark` and has not been written since."""
    return _entry(t) is not None


def bound(t: torch.Tensor) -> float | None:
    """The upper bound on ``|t|`` recorded with ``t`` (``inf`` when it was recorded without one), or
    None when ``t`` is not known finite."""
    entry = _entry(t)
    return None if entry is None else entry[2]


def mark(t: torch.Tensor, bound: float = math.inf) -> None:
    """Record that ``t`` holds only finite values, unread, with ``bound`` (when known) an upper bound
    on their magnitude: only for a tensor an op that cannot overflow (a ReLU, a copy) computed from
    recorded tensors, or one whose bound says it did not; anything else goes through :func:`check`."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: a later write could not be told
        return
    if len(_KNOWN) >= _LIMIT:
        for key in [k for k, (ref, _, _) in _KNOWN.items() if ref() is None]:
            del _KNOWN[key]
        if len(_KNOWN) >= _LIMIT:
            _KNOWN.clear()
    _KNOWN[id(t)] = (weakref.ref(t), version, bound)


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or (
        t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _read_bound(t: torch.Tensor) -> float:
    """An upper bound on ``|t|`` from one read of it: NaN or inf when an element is not finite (or,
    rarely, the bound overflows)."""
    if t.numel() == 0:
        return 0.0
    t = t.detach()
    if t.dtype in (torch.float32, torch.float64) and _dense(t):
        # sum(t * t) in one BLAS pass (as fast as t.sum(), half of |t|.amax()'s time): a NaN or an
        # infinity propagates, and max|t| <= sqrt(sum): a rounded sum of non-negative terms is at
        # least its largest rounded term; the slack covers that term's rounding and its underflow
        flat = t.as_strided((t.numel(),), (1,))
        squares = float(torch.dot(flat, flat))
        return math.sqrt(squares) * (1 + 2**-20) + math.sqrt(torch.finfo(t.dtype).tiny)
    if t.dtype == torch.bool:
        return 1.0
    return float(t.abs().amax())


def check(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: known by provenance, else read once (and then
    recorded, with a bound on its magnitude)."""
    if known(t):
        return True
    magnitude = _read_bound(t)
    if not math.isfinite(magnitude):
        return False
    mark(t, magnitude)
    return True


def magnitude(t: torch.Tensor) -> float:
    """An upper bound on ``|t|`` for a tensor known finite: the one recorded, else read once (and
    recorded); NaN or inf when the read finds it is not finite after all."""
    recorded = bound(t)
    if recorded is not None and math.isfinite(recorded):
        return recorded
    found = _read_bound(t)
    if math.isfinite(found):
        mark(t, found)
    return found


def read_magnitude(t: torch.Tensor) -> float:
    """An upper bound on ``|t|`` read from ``t`` itself now (tighter than one a kernel derived from
    its operands' bounds, which compound through a deep stack), recorded in its place; NaN or inf
    when ``t`` is not finite."""
    found = _read_bound(t)
    if math.isfinite(found):
        mark(t, found)
    return found


# A sum of products bounded by this share of its dtype's largest value cannot overflow in any
# order (aten, oneDNN and a fused kernel accumulate in different orders; rounding grows a bound by
# far less than 16x): the range guards of the BatchNorm fold and the fused LM-head loss.
RANGE_SHARE = 1 / 16


def forget() -> None:
    """Drop every record (tests)."""
    _KNOWN.clear()


__all__ = ["RANGE_SHARE", "bound", "check", "forget", "known", "magnitude", "mark", "read_magnitude"]
