"""Guarded gated MLP (SwiGLU / GeGLU): what a rewritten ``down(act(gate(x)) * up(x))`` calls.

The rewrite hands over the user's own modules, ``gated_mlp(self.gate_proj, self.up_proj,
self.down_proj, self.act_fn, x)``, and this function decides at run time: three plain
``nn.Linear`` (no own ``forward``, no hooks) with one gate/up width, and an activation the kernel
computes — judged by what it computes, not by how it was spelled: ``nn.SiLU``, ``F.silu``,
transformers' ``SiLUActivation`` (``ACT2FN["silu"]``, ``ACT2FN["swish"]`` is ``nn.SiLU``), and the
GeLUs :func:`adopter.kernels.guarded.gelu_mode` recognizes (``nn.GELU``, ``F.gelu``, the
transformers GeLU classes, exact or tanh) — run the two projections, the fused ``act(g) * u``
(:func:`adopter.kernels.ops.gated_act.gated_act`, which keeps ``g`` and ``u`` for the backward
instead of ``g``, ``act(g)`` and ``u``) and the down projection. Anything else (``ACT2FN["relu"]``
from a config, a LoRA-wrapped or hooked projection, fx tracing) runs
``down(act(gate(x), ...) * up(x))`` exactly as the source wrote it. Each call is counted in
:mod:`adopter.kernels.telemetry`.

The packed form, one ``gate_up`` Linear split in two (Phi-3's ``gate, up = gate_up_proj(x).chunk(2,
dim=-1)``), is :func:`gated_mlp_packed`: it is handed the split as the source wrote it
(``chunks=``/``split=``, ``dim=``) and which half is the gate (``gate=0|1``), and fuses only when
the split gives two equal halves along the last dimension; otherwise it runs the source's split,
activation, product and down projection.

A projection qualifies when it computes ``F.linear``: a plain ``nn.Linear`` (no own ``forward``, no
hooks), or an ``nn.Linear`` subclass whose ``forward`` is, instruction for instruction,
``F.linear(x, self.weight.to(x.dtype), self.bias)``, or the same with the bias cast too
(``self.bias.to(x.dtype) if self.bias is not None else None``: a mixed-precision cast layer; ``F``
any name of ``torch.nn.functional`` in its module): the kernel then computes that very expression
(:func:`linear_form`). Any other subclass (LoRA, quantized, a forward that does more) runs the
original expression.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .guard_checks import context_reason, defines_own_forward, has_hooks, plain_reason, record_fallback
from .guarded import gelu_mode
from .ops.gated_act import gated_act
from .policy import policy_reason
from .telemetry import record_backend

__all__ = ["gated_activation", "gated_mlp", "gated_mlp_packed", "linear_form"]

KERNEL = "gated_mlp"


def _transformers_activation(activation: Any, class_name: str) -> str:
    """"" when ``activation`` is transformers' ``class_name`` with its own ``forward`` (not
    replaced, e.g. by a hub kernel) and no hooks; otherwise why not."""
    cls = type(activation)
    if cls.__name__ != class_name or cls.__module__ != "transformers.activations":
        return f"activation is {cls.__name__}, not transformers' {class_name}"
    if not defines_own_forward(cls, "transformers.activations"):
        return f"{class_name}.forward is replaced"
    if has_hooks(activation):
        return f"{class_name} has hooks"
    return ""


def _silu_call(activation: Any, args: tuple, kwargs: dict) -> str | None:
    """"" when ``activation(g, *args, **kwargs)`` computes SiLU; why not when it is a SiLU called
    in a way the kernel does not reproduce; None when it is no SiLU at all."""
    if activation is F.silu:
        # F.silu(input, inplace=False): in place or not, the product sees the same values
        if len(args) > 1 or set(kwargs) - {"inplace"} or (args and kwargs):
            return "F.silu with unexpected arguments"
        return ""
    if isinstance(activation, nn.SiLU):
        return plain_reason(activation, nn.SiLU) or ("nn.SiLU called with extra arguments" if args or kwargs else "")
    if type(activation).__name__ == "SiLUActivation":
        why = _transformers_activation(activation, "SiLUActivation")
        return why or ("SiLUActivation called with extra arguments" if args or kwargs else "")
    return None


def _activation_in_place(activation: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``activation(g, *args, **kwargs)`` modifies ``g`` in place: ``F.silu(g, True)`` /
    ``F.silu(g, inplace=True)``, an ``nn.SiLU(inplace=True)`` (any truthy ``inplace``, as torch reads it)."""
    if activation is F.silu:
        return bool(args[0] if args else kwargs.get("inplace", False))
    if isinstance(activation, nn.SiLU):
        return bool(getattr(activation, "inplace", False))
    return False


def _packed_in_place_reason(activation: Any, args: tuple, kwargs: dict) -> str:
    """Why the packed form must run as written: an in-place activation of a half of ``split``/``chunk``
    (views of one multi-output op) raises in eager while autograd records ("Output 0 of Split is a view
    and is being modified inplace"); the kernel, which never writes ``g``, would return instead."""
    if _activation_in_place(activation, args, kwargs) and torch.is_grad_enabled():
        return "in-place activation of a split/chunk half with grad mode on (the original raises)"
    return ""


def gated_activation(activation: Any, args: tuple = (), kwargs: dict | None = None) -> tuple[str | None, str]:
    """``(name, "")`` with ``name`` one of ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` when
    ``activation(g, *args, **kwargs)`` computes that function, else ``(None, why not)``."""
    kwargs = kwargs or {}
    why = _silu_call(activation, args, kwargs)
    if why is not None:
        return (None, why) if why else ("silu", "")
    mode, why = gelu_mode(activation, args, kwargs)
    if mode is None:
        gelu_like = activation is F.gelu or isinstance(activation, nn.GELU) or (
            type(activation).__module__ == "transformers.activations" and "GELU" in type(activation).__name__)
        if not gelu_like:
            why = f"activation is {getattr(activation, '__name__', type(activation).__name__)}, not a SiLU or GeLU"
        return None, why
    cls = type(activation)
    if cls.__module__ == "transformers.activations" and cls.__name__ in _WRITTEN_OUT_GELUS:
        return None, f"{cls.__name__} writes the tanh formula out (its x**3 overflows where aten's GeLU does not)"
    return ("gelu_tanh" if mode == "tanh" else "gelu"), ""


# transformers' GeLU classes whose ``forward`` writes the tanh formula out in torch ops
# (``torch.pow``, ``torch.tanh``): the same function as the fused GeLU up to rounding, but where
# ``x**3`` overflows their gradient has NaN (``0 * inf``) that aten's ``gelu_backward`` has not.
# Running their ops inside the kernel (with autograd in its backward) ran 1.3-1.8x slower than the
# original expression: the original runs.
_WRITTEN_OUT_GELUS = ("NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation")


# The cast layers' forwards, by what they compute: ``cast`` casts the weight to the input's dtype;
# ``cast_all`` the bias too, under the ``is None`` test an optional bias needs (many training repos'
# ``CastedLinear``); the test's two orders compile differently.
_CAST_SOURCES = {
    "cast": ("return F.linear(input, self.weight.to(input.dtype), self.bias)",),
    "cast_all": tuple(
        f"return F.linear(input, self.weight.to(input.dtype), {bias})"
        for bias in ("self.bias.to(input.dtype) if self.bias is not None else None",
                     "None if self.bias is None else self.bias.to(input.dtype)")
    ),
}


def _reference_codes() -> dict[str, tuple[types.CodeType, ...]]:
    """Each cast form's code as this interpreter compiles it, in a module that imports ``F`` (the
    compiler then loads ``F.linear`` as a module attribute) and in one that does not (a method
    lookup): the two ways a user's file can compile the same line. Compiled, never run."""
    codes: dict[str, tuple[types.CodeType, ...]] = {}
    for form, lines in _CAST_SOURCES.items():
        found = []
        for line in lines:
            for prefix in ("import torch.nn.functional as F\n", ""):
                text = f"{prefix}def forward(self, input):\n    {line}\n"
                module = compile(text, "<adopter cast-linear reference>", "exec", dont_inherit=True)
                found.append(next(c for c in module.co_consts if isinstance(c, types.CodeType)))
        codes[form] = tuple(found)
    return codes


_CAST_CODES = _reference_codes()
# what a code object does (varargs, generator, coroutine...), not the __future__ imports of its
# module nor whether it was defined inside another function
_CODE_FLAGS = 0x3FF & ~0x10


def _consts(function: Any) -> tuple:
    consts = function.__code__.co_consts
    # a docstring (where the interpreter keeps it: the first constant, else None) is no computation
    if function.__doc__ is not None and consts and consts[0] == function.__doc__:
        return (None, *consts[1:])
    return consts


def _cast_form(forward: Any) -> str | None:
    """``"cast"`` when ``forward`` is ``def forward(self, x): return F.linear(x, self.weight.to(x.dtype),
    self.bias)``, ``"cast_all"`` when its bias is ``self.bias.to(x.dtype) if self.bias is not None
    else None`` (or a spelling of it: :data:`_CAST_SOURCES`), else None. Any parameter names, a
    docstring and annotations allowed, ``F`` any global bound to ``torch.nn.functional``: the
    bytecode of a reference, the same names but the module's."""
    code = getattr(forward, "__code__", None)
    if code is None or getattr(forward, "__closure__", None) or getattr(forward, "__defaults__", None):
        return None
    if getattr(forward, "__kwdefaults__", None) or code.co_kwonlyargcount or code.co_posonlyargcount:
        return None
    form = next((form for form, refs in _CAST_CODES.items() for ref in refs
                 if code.co_code == ref.co_code and code.co_argcount == ref.co_argcount
                 and code.co_flags & _CODE_FLAGS == ref.co_flags & _CODE_FLAGS
                 and code.co_names[1:] == ref.co_names[1:] and _consts(forward) == ref.co_consts), None)
    if form is None or getattr(forward, "__globals__", {}).get(code.co_names[0]) is not F:
        return None
    return form


def linear_form(module: Any) -> tuple[str | None, str]:
    """``("plain", "")`` when ``module`` computes ``F.linear(x, weight, bias)`` as ``nn.Linear``
    does, ``("cast", "")`` when it is an ``nn.Linear`` subclass whose forward is exactly
    ``F.linear(x, self.weight.to(x.dtype), self.bias)``, ``("cast_all", "")`` when that forward
    casts the bias as well (:func:`_cast_form`); else ``(None, why not)``."""
    why = plain_reason(module, nn.Linear)
    if not why:
        return "plain", ""
    cls = type(module)
    if isinstance(module, nn.Linear) and why == f"{cls.__name__} overrides forward" and not has_hooks(module):
        form = _cast_form(cls.forward)
        if form is not None:
            return form, ""
    return None, why


def _linear(module: nn.Linear, form: str, x: torch.Tensor) -> torch.Tensor:
    """What ``module(x)`` computes, for a module of :func:`linear_form` ``form``."""
    if form == "plain":
        return F.linear(x, module.weight, module.bias)
    bias = module.bias
    if form == "cast_all" and bias is not None:
        bias = bias.to(x.dtype)
    return F.linear(x, module.weight.to(x.dtype), bias)


def _projection_reason(gate: nn.Linear, up: nn.Linear) -> str:
    if gate.weight.shape != up.weight.shape:
        return "gate and up projections differ in shape"
    if gate.weight.dtype != up.weight.dtype or gate.weight.device != up.weight.device:
        return "gate and up projections differ in dtype or device"
    return ""


def gated_mlp(gate: nn.Module, up: nn.Module, down: nn.Module, act: Any, x: torch.Tensor,
              *act_args: Any, **act_kwargs: Any) -> Any:
    """``down(act(gate(x), *act_args, **act_kwargs) * up(x))``; with plain ``nn.Linear``
    projections and a SiLU/GeLU activation, ``act(g) * u`` runs as one op that recomputes
    ``act(g)`` in the backward instead of storing it."""
    reason = context_reason(x) or policy_reason(KERNEL, x)
    activation = forms = None
    if not reason:
        forms = [linear_form(m) for m in (gate, up, down)]
        reason = next((why for form, why in forms if form is None), "")
    if not reason:
        reason = _projection_reason(gate, up)
    if not reason:
        activation, reason = gated_activation(act, act_args, act_kwargs)
    if reason:
        record_fallback(KERNEL, reason)
        return down(act(gate(x), *act_args, **act_kwargs) * up(x))
    (gate_form, _), (up_form, _), (down_form, _) = forms
    g = _linear(gate, gate_form, x)
    u = _linear(up, up_form, x)
    h = gated_act(g, u, activation)
    record_backend(KERNEL)  # the backend gated_act chose
    return _linear(down, down_form, h)


# ---------------------------------------------------------------- packed gate_up projection


def _halves_reason(gate_up: nn.Linear, x: torch.Tensor, chunks: Any, split: Any, dim: Any) -> str:
    """"" when the split as written gives two equal halves of ``gate_up``'s output along its last
    dimension; otherwise why not."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return f"split dim {dim!r} is not an int"
    ndim = x.dim()
    if ndim == 0 or dim not in (-1, ndim - 1):
        return f"split dim={dim} is not the last dimension"
    n = gate_up.weight.shape[0]
    if split is None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            return f"chunks={chunks!r} is not a positive int"
        size = -(-n // chunks)
        if 2 * size != n:
            return f"chunk({chunks}) of {n} features does not give two equal halves"
        return ""
    sizes = [split, split] if isinstance(split, int) and not isinstance(split, bool) else split
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in sizes)
            and sizes[0] == sizes[1] and 2 * sizes[0] == n):
        return f"split({split!r}) of {n} features does not give two equal halves"
    return ""


def _split(y: torch.Tensor, chunks: Any, split: Any, dim: Any, gate: int) -> tuple[Any, Any]:
    """(gate half, up half) of ``y`` split as the source splits it."""
    first, second = y.chunk(chunks, dim) if split is None else y.split(split, dim)
    return (first, second) if gate == 0 else (second, first)


def gated_mlp_packed(gate_up: nn.Module, down: nn.Module, act: Any, x: torch.Tensor, *act_args: Any,
                     chunks: Any = None, split: Any = None, dim: Any = 0, gate: int = 0, **act_kwargs: Any) -> Any:
    """``down(act(g, *act_args, **act_kwargs) * u)`` where ``g`` (half ``gate``) and ``u`` (the other
    half) are ``gate_up(x).chunk(chunks, dim)`` (or ``.split(split, dim)``), unpacked in order.

    With ``gate_up``/``down`` computing ``F.linear`` (:func:`linear_form`), a split into two equal
    halves along the last dimension and a SiLU/GeLU activation, ``act(g) * u`` runs as one op that
    recomputes ``act(g)`` in the backward (the halves stay views of the projection's output);
    otherwise the original computation runs."""
    if (chunks is None) == (split is None) or gate not in (0, 1):
        raise TypeError("gated_mlp_packed takes one of chunks= and split=, and gate=0 or gate=1")
    reason = context_reason(x) or policy_reason(KERNEL, x)
    activation = gate_up_form = down_form = None
    if not reason:
        gate_up_form, reason = linear_form(gate_up)
    if not reason:
        down_form, reason = linear_form(down)
    if not reason:
        reason = _halves_reason(gate_up, x, chunks, split, dim)
    if not reason:
        activation, reason = gated_activation(act, act_args, act_kwargs)
    if not reason:
        reason = _packed_in_place_reason(act, act_args, act_kwargs)
    if reason:
        record_fallback(KERNEL, reason)
        g, u = _split(gate_up(x), chunks, split, dim, gate)
        return down(act(g, *act_args, **act_kwargs) * u)
    g, u = _split(_linear(gate_up, gate_up_form, x), chunks, split, dim, gate)
    h = gated_act(g, u, activation)
    record_backend(KERNEL)
    return _linear(down, down_form, h)
