"""Rotary position embeddings without the rotation's temporaries: every way models write RoPE is one
rotation of pairs ``(x1, x2)`` of the last dimension by angles given as ``cos``/``sin``,

    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2

and the layouts differ only in which elements pair up:

* half-split (``x * cos + rotate_half(x) * sin``, HF Llama, litgpt): ``x1``/``x2`` are the first
  and second half of the last dimension, ``c1``/``c2`` (``s1``/``s2``) the halves of ``cos`` (``sin``);
* interleaved (GPT-J's ``x * cos + rotate_every_two(x) * sin``, and the complex form
  ``view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs_cis)`` of Meta-llama, torchtitan,
  mistral-inference): ``x1``/``x2`` are the even and odd positions ``x[..., 0::2]``/``x[..., 1::2]``;
  ``cos``/``sin`` either have ``x``'s last dimension (GPT-J repeats each angle twice: ``c1``/``c2`` are
  its even/odd positions) or half of it (one angle per pair, the complex form: ``c1 == c2 == cos``);
* pairs given apart (``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)``, llama2.c;
  ``torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)``): ``x1``/``x2`` are any two
  tensors of one shape, the result stacks (interleaves) or concatenates the two outputs.

The eager expressions materialise every product, the sum and (for ``rotate_half``) ``-x2`` and the
concatenation; these write ``x1 * c1`` and ``x2 * c2`` into the output and add each part's rotated
term in place (``addcmul_``), so the output is the only tensor of ``x``'s size a call allocates.
``cos``/``sin`` may broadcast over ``x`` (``(batch, 1, seq, dim)`` against ``(batch, heads, seq,
dim)``) and nothing assumes ``c1 == c2``.

The backward is the transposed rotation of the incoming gradient,

    dx1 = g1 * c1 + g2 * s2
    dx2 = g2 * c2 - g1 * s1

so it needs ``cos``/``sin`` alone (not ``x``). ``cos``/``sin`` get no gradient: the guarded
entries (:mod:`adopter.kernels.guarded_rotary`) run the original code when they require one.
"""
from __future__ import annotations

import torch

from ..backend import select_backend, triton_dtype_ok
from .common import fx_leaf, rotary_function
from .rotation_parts import _halves, _pair_function, pair_outputs, parts  # noqa: F401 (re-exported)

# the triton kernel indexes up to 4 dimensions (batch, heads, seq, dim); more use the torch path
TRITON_MAX_DIMS = 4


def rotate_into(x1, x2, c1, c2, s1, s2, o1, o2, transpose: bool) -> None:
    """``o1 = x1*c1 - x2*s1, o2 = x2*c2 + x1*s2`` (``transpose``: ``o1 = x1*c1 + x2*s2, o2 = x2*c2
    - x1*s1``) into the given outputs, with torch ops: two ``mul(out=)``, two ``addcmul_``. Under
    torch.compile (which breaks the graph at an ``out=`` that is not contiguous: the parts of a stack
    or concatenation) the products are a copy and an in-place ``mul_``: the same single rounding."""
    if torch.compiler.is_compiling():
        o1.copy_(x1).mul_(c1)
        o2.copy_(x2).mul_(c2)
    else:
        torch.mul(x1, c1, out=o1)
        torch.mul(x2, c2, out=o2)
    if transpose:
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1)
    else:
        o1.addcmul_(x2, s1, value=-1)
        o2.addcmul_(x1, s2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool,
           interleaved: bool = False) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``interleaved``: ``rotate_every_two``; ``transpose``: the
    adjoint) as a new contiguous tensor: ``x * cos`` in one ``mul(out=)`` (per pair when ``cos`` has
    one angle per pair), then each part gets its rotated term added in place (``addcmul_``): no
    temporaries of ``x``'s size. The output is contiguous whatever ``x``'s strides (the transposed
    ``(b, h, s, d)`` view of attention code): CPU kernels on contiguous rows run about three times
    faster than on the strided halves of a transposed layout."""
    d = x.shape[-1]
    h = d // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if cos.shape[-1] == d:
        torch.mul(x, cos, out=out)
    else:  # one angle per pair (the complex form): cos of width h, read by both parts
        split, c = ((h, 2), cos.unsqueeze(-1)) if interleaved else ((2, h), cos.unsqueeze(-2))
        torch.mul(x.unflatten(-1, split), c, out=out.unflatten(-1, split))
    x1, x2 = parts(x, h, interleaved)
    s1, s2 = parts(sin, h, interleaved)
    o1, o2 = parts(out, h, interleaved)
    if transpose:
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1)
    else:
        o1.addcmul_(x2, s1, value=-1)
        o2.addcmul_(x1, s2)
    return out


def _rotate_interleaved(x, cos, sin, transpose):
    return rotate(x, cos, sin, transpose, interleaved=True)


RotaryFunction = rotary_function(
    rotate, "RotaryFunction",
    """``x * cos + rotate_half(x) * sin`` for ``x`` of the broadcast shape of all three, ``cos``
    and ``sin`` of ``x``'s dtype, constants for autograd; torch ops (any device).""",
)

InterleavedRotaryFunction = rotary_function(
    _rotate_interleaved, "InterleavedRotaryFunction",
    """``x * cos + rotate_every_two(x) * sin`` (pairs at even/odd positions) for ``x`` of the
    broadcast shape of all three; ``cos``/``sin`` of ``x``'s dtype with ``x``'s last dimension or
    half of it (one angle per pair), constants for autograd; torch ops (any device).""",
)


def _torch_rotate_pairs(x1, x2, cos, sin, o1, o2, transpose):
    rotate_into(x1, x2, cos, cos, sin, sin, o1, o2, transpose)


PairRotaryFunction = _pair_function(
    "PairRotaryFunction", _torch_rotate_pairs,
    """``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)`` (``stacked``) or
    ``torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)``, for ``x1``/``x2`` of one
    shape and dtype, ``cos``/``sin`` of that dtype broadcasting to it, constants for autograd; torch
    ops (any device).""",
)


def _triton_supports(x: torch.Tensor, *others: torch.Tensor) -> bool:
    return triton_dtype_ok(x, *others) and x.dim() <= TRITON_MAX_DIMS and x.numel() > 0


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


@fx_leaf
def rotary_embedding_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_every_two(x) * sin``: pairs at even/odd positions (GPT-J, the complex
    form as real numbers). The caller guarantees what :func:`rotary_embedding` needs, except that
    ``cos``/``sin`` may have half of ``x``'s last dimension (one angle per pair)."""
    backend = select_backend("rotary", (x, cos, sin), has_triton=lambda: _triton_supports(x, cos, sin))
    if backend == "triton":
        from .triton_rotary import TritonInterleavedRotaryFunction

        return TritonInterleavedRotaryFunction.apply(x, cos, sin)
    return InterleavedRotaryFunction.apply(x, cos, sin)


@fx_leaf
def rotary_embedding_pairs(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           stacked: bool = True) -> torch.Tensor:
    """``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)`` (``stacked``), else
    ``torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)``. The caller guarantees:
    floating ``x1``/``x2`` of one shape, dtype and device; ``cos``/``sin`` of that dtype and device,
    broadcasting to that shape; no gradient for ``cos``/``sin``."""
    backend = select_backend("rotary", (x1, x2, cos, sin),
                             has_triton=lambda: _triton_supports(x1, x2, cos, sin))
    if backend == "triton":
        from .triton_rotary import TritonPairRotaryFunction

        return TritonPairRotaryFunction.apply(x1, x2, cos, sin, stacked)
    return PairRotaryFunction.apply(x1, x2, cos, sin, stacked)
