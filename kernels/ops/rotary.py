"""Rotary position embedding, ``x * cos + rotate_half(x) * sin``, without the rotation's temporaries.

``rotate_half(x) = cat((-x2, x1), dim=-1)`` (``x1``/``x2`` the first/second half of the last
dimension), so with ``h = x.shape[-1] // 2`` and ``c1, c2, s1, s2`` the halves of ``cos``/``sin``:

    out[..., :h] = x1 * c1 - x2 * s1
    out[..., h:] = x2 * c2 + x1 * s2

The eager expression materialises ``-x2``, the concatenation, both products and the sum (three
times ``x`` live at its peak); this writes ``x * cos`` into the output and adds each half's rotated
term in place (``addcmul_``), so the output is the only tensor of ``x``'s size a call allocates. ``cos``/``sin``
may broadcast over ``x`` (``(batch, 1, seq, dim)`` against ``(batch, heads, seq, dim)``) and need
not repeat their halves: nothing assumes ``c1 == c2``.

The backward is the transposed rotation of the incoming gradient,

    dx[..., :h] = g1 * c1 + g2 * s2
    dx[..., h:] = g2 * c2 - g1 * s1

so it needs ``cos``/``sin`` alone (not ``x``). ``cos``/``sin`` get no gradient: the guarded
entry (:func:`adopter.kernels.guarded_rotary.rotary`) runs the original code when they require one.
"""
from __future__ import annotations

import torch

from ..backend import select_backend, triton_dtype_ok
from .common import fx_leaf, rotary_function

# the triton kernel indexes up to 4 dimensions (batch, heads, seq, dim); more use the torch path
TRITON_MAX_DIMS = 4


def _halves(t: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    return t[..., :h], t[..., h:]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``transpose``: its adjoint, ``x * cos +
    rotate_half^T(x * sin)``) as a new contiguous tensor: one full-width ``mul(out=)``, then each
    half gets its rotated term added in place (``addcmul_``): no temporaries of ``x``'s size.
    The output is contiguous whatever ``x``'s strides (the transposed ``(b, h, s, d)`` view of
    attention code): CPU kernels on contiguous rows run about three times faster than on the
    strided halves of a transposed layout."""
    h = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x, cos, out=out)
    x1, x2 = _halves(x, h)
    s1, s2 = _halves(sin, h)
    o1, o2 = _halves(out, h)
    if transpose:
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1)
    else:
        o1.addcmul_(x2, s1, value=-1)
        o2.addcmul_(x1, s2)
    return out


RotaryFunction = rotary_function(
    rotate, "RotaryFunction",
    """``x * cos + rotate_half(x) * sin`` for ``x`` of the broadcast shape of all three, ``cos``
    and ``sin`` of ``x``'s dtype, constants for autograd; torch ops (any device).""",
)


def _triton_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return triton_dtype_ok(x, cos, sin) and x.dim() <= TRITON_MAX_DIMS and x.numel() > 0


@fx_leaf
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (half-split rotation). The caller guarantees: floating
    ``x``; ``cos``/``sin`` of ``x``'s dtype and device, broadcastable to ``x`` (the result has
    ``x``'s shape) with ``x``'s last dimension, which is even; no gradient for ``cos``/``sin``.
    One triton kernel each way on CUDA; the in-place torch form elsewhere."""
    backend = select_backend("rotary", (x, cos, sin), has_triton=lambda: _triton_supports(x, cos, sin))
    if backend == "triton":
        from .triton_rotary import TritonRotaryFunction

        return TritonRotaryFunction.apply(x, cos, sin)
    return RotaryFunction.apply(x, cos, sin)
