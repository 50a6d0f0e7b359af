"""Guarded rotary embeddings: what a rewritten RoPE site calls (rule ``rotary_embedding``).

One entry per way models write the rotation; each takes what the user's expression reads, so the
fallback is that expression, and runs the fused kernel (:mod:`adopter.kernels.ops.rotary`) only
when, at this call:

* no ``torch.fx`` trace is running (Proxy inputs: the graph must show the original ops);
* the tensors are floating (complex for :func:`rotary_complex`) of one dtype and device, ``cos``/
  ``sin`` (``freqs_cis``) broadcast to ``x``'s shape (the result has ``x``'s shape: with a single
  KV head ``k`` is ``(b, 1, s, d)`` and ``cos`` must not make it wider) and have the last dimension
  the layout reads;
* ``cos``/``sin`` (``freqs_cis``) need no gradient (the kernel does not produce one), and
  ``freqs_cis`` is no ``nn.Parameter`` (a learned complex weight is a spectral mix the static
  analysis could not rule out, not angles: it runs as written, in eval too);
* a rotation function handed over (``rotate_half``, ``rotate_every_two``) is still the rotation
  the analysis read in its source: the name is looked up when the line runs, so a function patched
  in later (a library's own RoPE patch) is probed once per function object and rank, on a small
  tensor of ``x``'s rank (``x[:, :, :, ::2]`` only means the last dimension of a 4-d tensor).

The entries:

``rotary(x, cos, sin, rotate_half=None)``
    ``x * cos + rotate_half(x) * sin``, half-split rotation. ``rotate_half`` the user's function,
    ``self.rotate_half`` or ``Cls.rotate_half``; ``None`` where the rewritten function wrote the
    rotation inline (``x1 = x[..., : d // 2]; x2 = x[..., d // 2 :]; rotated = torch.cat((-x2, x1),
    dim=-1)``) and the rewrite removed those statements: the fallback then computes them, op for
    op (:func:`rotate_half_reference`); or the rotated *tensor* itself where the user's statement computing it
    had to stay (``x * cos + rotated * sin``: one ``mul`` and one in-place ``addcmul_``, nothing to
    probe).
``rotary_interleaved(x, cos, sin, rotate_every_two)``
    ``x * cos + rotate_every_two(x) * sin``: pairs at even/odd positions (GPT-J, CodeGen, GLM,
    Cohere); ``cos``/``sin`` with ``x``'s last dimension (each angle repeated twice).
``rotary_pairs(x1, x2, cos, sin, join="stack")``
    ``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)`` (llama2.c, the real-number
    form of the complex rotation), or with ``join="cat"`` ``torch.cat((x1 * cos - x2 * sin, x2 *
    cos + x1 * sin), dim=-1)``. The computation is symmetric in ``(x1, x2)`` and ``(cos, sin)``
    (the product of two complex numbers), so whichever pair needs no gradient and broadcasts to the
    other's shape serves as the angles.
``rotary_complex(x, freqs_cis)``
    ``torch.view_as_real(x * freqs_cis)`` for ``x = torch.view_as_complex(...)`` (Meta-llama,
    torchtitan, mistral-inference): the same rotation in real numbers, on ``view_as_real(x)``
    (a view) with ``freqs_cis.real``/``.imag`` as ``cos``/``sin``: no complex temporaries. The
    operands come in source order (``freqs_cis * xq_`` too): the product commutes, and whichever
    needs no gradient and broadcasts to the other's shape serves as the angles.

Under ``torch.compile`` these checks are traced (shapes, dtypes and grad mode become guards of the
compiled code); the probe of a rotation function runs once while tracing, for a plain function or
a method of one (other callables run the original expression there).

Otherwise the original expression runs (type promotion, broadcasting and gradients exactly as
written). Each call is counted in :mod:`adopter.kernels.telemetry` under ``rotary``.
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .backend import _constant_under_compile
from .ops.common import is_proxy, outside_tracing
from .ops.rotary import (
    rotary_embedding,
    rotary_embedding_interleaved,
    rotary_embedding_pairs,
)
from .policy import policy_reason
from .telemetry import ORIGINAL, record, record_backend

__all__ = ["rotary", "rotary_complex", "rotary_interleaved", "rotary_pairs"]

KERNEL = "rotary"
# rotation functions already probed: the function object -> {(layout, rank): whether it is that rotation}
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the probe: a last dimension of 6 tells the half split (-3, -4, -5, 0, 1, 2) from the
# interleaved rotation (-1, 0, -3, 2, -5, 4), a flipped sign and a no-op
_PROBE_SIZE = 6
HALF_SPLIT = "half-split"
INTERLEAVED = "interleaved"


def rotate_half_reference(x: torch.Tensor) -> torch.Tensor:
    """The half-split rotation as rewritten functions write it inline: ``cat((-x2, x1), dim=-1)``
    with ``x1 = x[..., : d // 2]``, ``x2 = x[..., d // 2 :]`` (the fallback of ``rotary(x, cos,
    sin)``, op for op what the removed statements computed)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two_reference(x: torch.Tensor) -> torch.Tensor:
    """The interleaved rotation: ``stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


_REFERENCE = {HALF_SPLIT: rotate_half_reference, INTERLEAVED: rotate_every_two_reference}


def _probe_key(fn: Callable) -> Any:
    """What a probe's answer is cached under: a method's function (``self.rotate_half`` is a new
    bound method object at each attribute access; the analysis checked that it does not read
    ``self``), else the callable itself."""
    return fn.__func__ if isinstance(fn, types.MethodType) else fn


@_constant_under_compile
def is_rotation(fn: Callable, layout: str, ndim: int = 2, unbound: bool = False) -> bool:
    """Whether ``fn(x)`` computes the ``layout`` rotation (:func:`rotate_half_reference`
    or :func:`rotate_every_two_reference`) of an ``x`` of ``ndim`` dimensions, by one probe call per function
    object, layout and rank (the answer is cached). Under ``torch.compile`` it runs while the call
    is traced, not in the graph (the probe compares values, which a graph cannot branch on); the
    compiled code is guarded on the function object it was given, so another one patched in later
    is probed again. ``unbound``: ``fn`` is the function of a bound method, probed as ``fn(None,
    x)`` (see :func:`_rotation_checks`)."""
    key = _probe_key(fn)
    try:
        return _PROBED[key][(layout, ndim)]
    except (KeyError, TypeError):
        pass
    with outside_tracing():
        shape = (2, _PROBE_SIZE) if ndim >= 2 else (_PROBE_SIZE,)
        probe = torch.arange(2 * _PROBE_SIZE, dtype=torch.float32)[: _PROBE_SIZE * (2 if ndim >= 2 else 1)]
        probe = probe.reshape((1,) * max(ndim - 2, 0) + shape)
        want = _REFERENCE[layout](probe)
        try:
            got = fn(None, probe) if unbound else fn(probe)
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.equal(got, want))
        except Exception:  # noqa: BLE001  (a function that cannot take the probe is not one we can stand in for)
            ok = False
    try:
        _PROBED.setdefault(key, {})[(layout, ndim)] = ok
    except TypeError:  # not weak-referenceable (a builtin): probe again next time
        pass
    return ok


def is_half_split_rotation(fn: Callable, ndim: int = 2) -> bool:
    """Whether ``fn`` is ``rotate_half``'s half-split rotation (see :func:`is_rotation`)."""
    return is_rotation(fn, HALF_SPLIT, ndim)


def is_interleaved_rotation(fn: Callable, ndim: int = 2) -> bool:
    """Whether ``fn`` is GPT-J's ``rotate_every_two`` (see :func:`is_rotation`)."""
    return is_rotation(fn, INTERLEAVED, ndim)


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _probe_able(fn: Any) -> bool:
    """Under torch.compile only a plain function (or a method of one) is probed: a constant of
    the compiled code, guarded on."""
    return isinstance(fn, types.FunctionType) or (
        isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType))


def _tensor_checks(x: Any, cos: Any, sin: Any, widths: tuple[int, ...] | None = None) -> str:
    """"" when ``x`` is floating, ``cos``/``sin`` tensors of its dtype and device whose last
    dimension is one of ``widths`` (default: ``x``'s), broadcasting to ``x``'s shape and needing
    no gradient; otherwise why not."""
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
    wanted = widths or (x.shape[-1],)
    if cos.dim() == 0 or sin.dim() == 0 or cos.shape[-1] not in wanted or sin.shape[-1] not in wanted:
        if widths is None:
            return f"cos/sin's last dimension is not x's ({x.shape[-1]})"
        return f"cos/sin's last dimension is not {' or '.join(map(str, widths))}"
    try:
        shape = torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1], sin.shape[:-1])
    except RuntimeError:
        return "cos/sin do not broadcast to x"
    if shape != x.shape[:-1]:
        return f"cos/sin broadcast x {tuple(x.shape)} to {(*shape, x.shape[-1])}"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin require grad"
    return ""


def _rotation_checks(fn: Any, layout: str, ndim: int) -> str:
    if not callable(fn):
        return f"{type(fn).__name__} is not a rotation function"
    if torch.compiler.is_compiling() and not _probe_able(fn):
        return f"{type(fn).__name__} rotation under torch.compile (only functions are probed)"
    if torch.compiler.is_compiling() and isinstance(fn, types.MethodType):
        # a bound method (``self.rotate_half``) is no constant torch.compile can hand to the probe (its
        # self is the module): its function is, probed with self=None, which the analysis checked the
        # method does not read (one patched in later that does fails the probe: the original runs)
        ok = is_rotation(fn.__func__, layout, ndim, True)
    else:
        ok = is_rotation(fn, layout, ndim)
    if not ok:
        return f"{_name(fn)} is not the {layout} rotation"
    return ""


def _autocast_reason(x: Any) -> str:
    """Why the original must run under autocast: for ``x``'s device type it raises ("Unexpected
    floating ScalarType in at::autocast::prioritize") in ``torch.cat``/``torch.stack`` (the
    rotation's join) of a half-precision ``x`` other than autocast's dtype (float16 under CPU
    autocast's bfloat16, bfloat16 under CUDA's float16); the kernel joins nothing, it would return."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in (torch.float32, torch.float64):
        return ""
    device = x.device.type
    try:
        if not torch.is_autocast_enabled(device) or x.dtype == torch.get_autocast_dtype(device):
            return ""
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        return ""
    return f"{x.dtype} under {device} autocast to {torch.get_autocast_dtype(device)} (the original's join raises)"


# ---------------------------------------------------------------- x * cos + rotate_half(x) * sin


def _why_not_fused(x: Any, cos: Any, sin: Any, rotate_half: Callable) -> str:
    """"" when the fused kernel computes ``x * cos + rotate_half(x) * sin`` for these arguments."""
    return _tensor_checks(x, cos, sin) or _rotation_checks(rotate_half, HALF_SPLIT, x.dim())


def _why_not_fused_given(x: Any, cos: Any, sin: Any, rotated: torch.Tensor) -> str:
    """"" when ``x * cos`` with ``rotated * sin`` added in place computes the original."""
    if any(is_proxy(t) for t in (x, cos, sin, rotated)):
        return "tracing"
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return "x, cos and sin are not all tensors"
    if not x.is_floating_point() or len({x.dtype, cos.dtype, sin.dtype, rotated.dtype}) != 1:
        return f"x, cos, sin, rotated are {x.dtype}, {cos.dtype}, {sin.dtype}, {rotated.dtype} (the original promotes)"
    if len({t.device for t in (x, cos, sin, rotated)}) != 1:
        return "x, cos, sin, rotated are not on one device"
    try:
        first = torch.broadcast_shapes(x.shape, cos.shape)
        whole = torch.broadcast_shapes(first, rotated.shape, sin.shape)
    except RuntimeError:
        return "x, cos, sin, rotated do not broadcast together"
    if whole != first:
        return f"rotated * sin widens x * cos {tuple(first)} to {tuple(whole)}"
    return ""


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotate_half: Callable | torch.Tensor | None = None) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``rotate_half`` None: the rotation the rewrite removed,
    :func:`rotate_half_reference`; a tensor: ``x * cos + rotate_half * sin``); fused when the checks of the
    module doc hold, else exactly that expression."""
    if isinstance(rotate_half, torch.Tensor) or is_proxy(rotate_half):
        rotated = rotate_half
        reason = policy_reason(KERNEL, x) or _why_not_fused_given(x, cos, sin, rotated)
        if reason:
            record(KERNEL, ORIGINAL, reason)
            return (x * cos) + (rotated * sin)
        out = (x * cos).addcmul_(rotated, sin)
        record(KERNEL, "torch")
        return out
    rotation = rotate_half_reference if rotate_half is None else rotate_half
    # the mode and policy first: their answer needs no probe of the rotation (user code), and under
    # torch.jit.trace or a torch.func transform the checks would be recorded or warned about
    reason = policy_reason(KERNEL, x) or _why_not_fused(x, cos, sin, rotation) or _autocast_reason(x)
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return (x * cos) + (rotation(x) * sin)
    out = rotary_embedding(x, cos, sin)
    record_backend(KERNEL)
    return out


# ---------------------------------------------------------------- x * cos + rotate_every_two(x) * sin


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotate_every_two: Callable) -> torch.Tensor:
    """``x * cos + rotate_every_two(x) * sin`` (pairs at even/odd positions); fused when the checks
    of the module doc hold, else exactly that expression."""
    reason = (policy_reason(KERNEL, x) or _tensor_checks(x, cos, sin)
              or _rotation_checks(rotate_every_two, INTERLEAVED, x.dim()) or _autocast_reason(x))
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return (x * cos) + (rotate_every_two(x) * sin)
    out = rotary_embedding_interleaved(x, cos, sin)
    record_backend(KERNEL)
    return out


# ---------------------------------------------------------------- pairs given apart


def _pair_checks(x1: Any, x2: Any, cos: Any, sin: Any, join: str) -> str:
    if join not in ("stack", "cat"):
        return f"join={join!r} is not 'stack' or 'cat'"
    if any(is_proxy(t) for t in (x1, x2, cos, sin)):
        return "tracing"
    if not all(isinstance(t, torch.Tensor) for t in (x1, x2, cos, sin)):
        return "x1, x2, cos and sin are not all tensors"
    if x1.shape != x2.shape or x1.dtype != x2.dtype or x1.device != x2.device:
        return "x1 and x2 differ in shape, dtype or device"
    if not x1.is_floating_point() or x1.dim() == 0:
        return f"x1 is a {x1.dtype} {'scalar' if x1.dim() == 0 else 'tensor'}"
    if cos.dtype != x1.dtype or sin.dtype != x1.dtype:
        return f"cos/sin are {cos.dtype}/{sin.dtype}, x1 is {x1.dtype} (the original promotes)"
    if cos.device != x1.device or sin.device != x1.device:
        return "cos/sin are on another device than x1"
    try:
        shape = torch.broadcast_shapes(x1.shape, cos.shape, sin.shape)
    except RuntimeError:
        return "cos/sin do not broadcast to x1"
    if shape != x1.shape:
        return f"cos/sin broadcast x1 {tuple(x1.shape)} to {tuple(shape)}"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin require grad"
    return ""


def _pairs_original(x1, x2, cos, sin, join):
    if join == "cat":
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rotary_pairs(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 join: str = "stack") -> torch.Tensor:
    """``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)`` (``join="stack"``) or
    ``torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)`` (``join="cat"``); fused when
    the checks of the module doc hold for ``(x1, x2)`` rotated by ``(cos, sin)`` or, the
    computation being symmetric, for ``(cos, sin)`` rotated by ``(x1, x2)``; else exactly that
    expression."""
    reason = policy_reason(KERNEL, x1)
    if not reason:
        reason = _pair_checks(x1, x2, cos, sin, join)
        if reason and reason != "tracing" and not _pair_checks(cos, sin, x1, x2, join):
            x1, x2, cos, sin, reason = cos, sin, x1, x2, ""
        # (the join's operands are products of same-dtype tensors: x1's dtype, the pairs' swapped or not)
        reason = reason or _autocast_reason(x1)
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return _pairs_original(x1, x2, cos, sin, join)
    out = rotary_embedding_pairs(x1, x2, cos, sin, join == "stack")
    record_backend(KERNEL)
    return out


# ---------------------------------------------------------------- view_as_real(x * freqs_cis)

_COMPLEX = (torch.complex64, torch.complex128)


def _complex_checks(x: Any, freqs: Any) -> str:
    if is_proxy(x) or is_proxy(freqs):
        return "tracing"
    if not isinstance(x, torch.Tensor) or not isinstance(freqs, torch.Tensor):
        return "x and freqs_cis are not both tensors"
    if x.dtype not in _COMPLEX or freqs.dtype != x.dtype:
        return f"x and freqs_cis are {x.dtype}/{freqs.dtype}, not one complex dtype (the original promotes)"
    if x.device != freqs.device:
        return "freqs_cis is on another device than x"
    if x.dim() == 0:
        return "x is a scalar"
    try:
        shape = torch.broadcast_shapes(x.shape, freqs.shape)
    except RuntimeError:
        return "freqs_cis does not broadcast to x"
    if shape != x.shape:
        return f"freqs_cis broadcasts x {tuple(x.shape)} to {tuple(shape)}"
    if torch.is_grad_enabled() and freqs.requires_grad:
        return "freqs_cis requires grad"
    if isinstance(freqs, torch.nn.Parameter):
        return "freqs_cis is a learned parameter (a complex weight, not rotation angles)"
    return ""


def rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``torch.view_as_real(x * freqs_cis)`` (``x``, ``freqs_cis`` complex: the pairs of the last
    dimension of the real tensor ``x`` views, rotated by the angles of ``freqs_cis``); in real
    numbers when the checks of the module doc hold, else exactly that expression."""
    reason = policy_reason(KERNEL, x)
    if not reason:
        reason = _complex_checks(x, freqs_cis)
        if reason and reason != "tracing" and not _complex_checks(freqs_cis, x):
            x, freqs_cis, reason = freqs_cis, x, ""  # freqs_cis * x in the source: the product commutes
    if reason:
        record(KERNEL, ORIGINAL, reason)
        return torch.view_as_real(x * freqs_cis)
    # resolve_conj: a lazily conjugated tensor (``freqs_cis.conj()``) as values (else it is itself)
    freqs = freqs_cis.resolve_conj().expand(x.shape)
    real = torch.view_as_real(x.resolve_conj()).flatten(-2)  # a view: complex numbers are pairs of reals
    out = rotary_embedding_interleaved(real, torch.real(freqs), torch.imag(freqs))
    record_backend(KERNEL)
    return out.unflatten(-1, (-1, 2))
