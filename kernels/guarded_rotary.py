"""Guarded rotary embedding: what a rewritten ``x * cos + rotate_half(x) * sin`` calls.

The rewrite (rule ``rotary_embedding``) turns ``q_embed = (q * cos) + (rotate_half(q) * sin)`` into
``q_embed = rotary(q, cos, sin, rotate_half)``: the user's own ``rotate_half`` is handed over, so
the fallback is exactly the original expression. The fused kernel
(:func:`adopter.kernels.ops.rotary.rotary_embedding`) runs only when, at this call:

* no ``torch.fx`` trace is running (Proxy inputs: the graph must show the original ops);
* ``rotate_half`` is the half-split rotation ``cat((-x2, x1), dim=-1)``: the analysis checked its
  source, but the name is looked up when the line runs, so a function patched in later (an
  interleaved GPT-J rotation, a library's own RoPE patch) is probed once on a small tensor;
* ``x`` is a floating tensor whose last dimension is even; ``cos``/``sin`` are tensors of ``x``'s
  dtype and device, with ``x``'s last dimension, broadcasting to ``x``'s shape (so the result has
  ``x``'s shape: with a single KV head ``k`` is ``(b, 1, s, d)`` and ``cos`` must not make it
  wider; partial rotary passes ``q[..., :rotary_dim]`` and ``cos`` of ``rotary_dim``);
* ``cos``/``sin`` need no gradient (the kernel does not produce one).

Under ``torch.compile`` these checks are traced (shapes, dtypes and grad mode become guards of the
compiled code); the probe of ``rotate_half`` runs once while tracing, for a plain function (other
callables run the original expression there).

Otherwise the original ``x * cos + rotate_half(x) * sin`` runs (type promotion, broadcasting and
gradients exactly as written). Each call is counted in :mod:`adopter.kernels.telemetry`.
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .backend import _constant_under_compile
from .ops.common import is_proxy, outside_tracing
from .ops.rotary import rotary_embedding
from .telemetry import ORIGINAL, record, record_backend

__all__ = ["rotary"]

KERNEL = "rotary"
# rotate_half functions already probed (the function object -> whether it is the half-split one)
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the probe: a last dimension of 6 tells the half split (-3, -4, -5, 0, 1, 2) from the
# interleaved rotation (-1, 0, -3, 2, -5, 4), a flipped sign and a no-op
_PROBE_SIZE = 6


@_constant_under_compile
def is_half_split_rotation(rotate_half: Callable) -> bool:
    """Whether ``rotate_half(x)`` is ``cat((-x[..., h:], x[..., :h]), dim=-1)``, by one probe call
    per function object (the answer is cached). Under ``torch.compile`` it runs while the call is
    traced, not in the graph (the probe compares values, which a graph cannot branch on); the
    compiled code is guarded on the function object it was given, so another ``rotate_half``
    patched in later is probed again."""
    try:
        return _PROBED[rotate_half]
    except (KeyError, TypeError):
        pass
    with outside_tracing():
        probe = torch.arange(2 * _PROBE_SIZE, dtype=torch.float32).reshape(2, _PROBE_SIZE)
        h = _PROBE_SIZE // 2
        want = torch.cat((-probe[..., h:], probe[..., :h]), dim=-1)
        try:
            got = rotate_half(probe)
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.equal(got, want))
        except Exception:  # noqa: BLE001  (a function that cannot take the probe is not one we can stand in for)
            ok = False
    try:
        _PROBED[rotate_half] = ok
    except TypeError:  # not weak-referenceable (a builtin): probe again next time
        pass
    return ok


def _why_not_fused(x: Any, cos: Any, sin: Any, rotate_half: Callable) -> str:
    """"" when the fused kernel computes ``x * cos + rotate_half(x) * sin`` for these arguments."""
    if any(is_proxy(t) for t in (x, cos, sin)):
        return "tracing"
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return "x, cos and sin are not all tensors"
    if not x.is_floating_point():
        return f"x is {x.dtype}, not floating point"
    if x.dim() == 0 or x.shape[-1] % 2:
        return f"x's last dimension ({x.shape[-1] if x.dim() else 'none'}) is not even"
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return f"cos/sin are {cos.dtype}/{sin.dtype}, x is {x.dtype} (the original promotes)"
    if cos.device != x.device or sin.device != x.device:
        return "cos/sin are on another device than x"
    if cos.dim() == 0 or sin.dim() == 0 or cos.shape[-1] != x.shape[-1] or sin.shape[-1] != x.shape[-1]:
        return f"cos/sin's last dimension is not x's ({x.shape[-1]})"
    try:
        shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    except RuntimeError:
        return "cos/sin do not broadcast to x"
    if shape != x.shape:
        return f"cos/sin broadcast x {tuple(x.shape)} to {tuple(shape)}"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin require grad"
    if torch.compiler.is_compiling() and not isinstance(rotate_half, types.FunctionType):
        # probed at trace time only for a plain function (a constant of the compiled code)
        return f"{type(rotate_half).__name__} rotate_half under torch.compile (only functions are probed)"
    if not is_half_split_rotation(rotate_half):
        return f"{getattr(rotate_half, '__name__', type(rotate_half).__name__)} is not the half-split rotation"
    return ""


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_half: Callable) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``; fused (no ``rotate_half`` temporaries) when the checks
    above hold, else exactly that expression."""
    reason = _why_not_fused(x, cos, sin, rotate_half)
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return (x * cos) + (rotate_half(x) * sin)
    out = rotary_embedding(x, cos, sin)
    record_backend(KERNEL)
    return out
