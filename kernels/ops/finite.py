"""Which tensors are known to hold only finite values: what lets a fused ReLU stay exact.

``torch.relu`` keeps a NaN (``relu(nan) == nan``); oneDNN's ReLU post-op and aten's fused
``_add_relu`` give 0 for it. A kernel that applies one of them therefore computes what the original
computed only where its operands are finite: a NaN or an infinity in the data must reach the
output as the original's ``relu`` would pass it on.

Checking costs one read of a tensor (``t.sum()`` is finite only when every element is: a NaN or an
infinity propagates through the sum; a sum that overflows only sends the call to the original
ops). Most checks are avoided by *provenance*: a kernel that computed a tensor from finite operands
and finite weights records it (:func:`mark`), and a later kernel reading that tensor, unchanged
since (its version counter), skips the check (:func:`known`). A residual block's tensors then derive
from its input through the kernels, so a network checks its data once where it enters them.

The assumption is the one every fused float kernel makes: finite operands give a finite result up
to overflow, which is rounding (aten and oneDNN accumulate in different orders). Inference tensors
(``torch.inference_mode``) have no version counter, so a later write cannot be told: they are never
recorded and are checked at every use. A write through ``.data`` bypasses the version counter; no
forward writes so.
"""
from __future__ import annotations

import weakref

import torch

# id(tensor) -> (weak reference, version counter when recorded); bounded (a forward's live tensors)
_KNOWN: dict[int, tuple[weakref.ReferenceType, int]] = {}
_LIMIT = 1024


def known(t: torch.Tensor) -> bool:
    """``t`` was recorded finite by :func:`mark` and has not been written since."""
    entry = _KNOWN.get(id(t))
    if entry is None or entry[0]() is not t:
        return False
    try:
        return t._version == entry[1]
    except RuntimeError:  # (an inference tensor: no version counter)
        return False


def mark(t: torch.Tensor) -> None:
    """Record that ``t`` holds only finite values (computed so from finite operands)."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: a later write could not be told
        return
    if len(_KNOWN) >= _LIMIT:
        for key in [k for k, (ref, _) in _KNOWN.items() if ref() is None]:
            del _KNOWN[key]
        if len(_KNOWN) >= _LIMIT:
            _KNOWN.clear()
    _KNOWN[id(t)] = (weakref.ref(t), version)


def check(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: known by provenance, else read once (and then
    recorded)."""
    if known(t):
        return True
    if t.numel() == 0:
        return True
    finite = bool(torch.isfinite(t.sum()))
    if finite:
        mark(t)
    return finite


def forget() -> None:
    """Drop every record (tests)."""
    _KNOWN.clear()


__all__ = ["check", "forget", "known", "mark"]
