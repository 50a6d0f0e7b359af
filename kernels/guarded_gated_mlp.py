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
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .guarded import _context_reason, _fallback, _has_hooks, _plain, gelu_mode
from .ops.gated_act import gated_act
from .telemetry import record_backend

__all__ = ["gated_activation", "gated_mlp"]

KERNEL = "gated_mlp"


def _transformers_activation(activation: Any, class_name: str) -> str:
    """"" when ``activation`` is transformers' ``class_name`` with its own ``forward`` (not
    replaced, e.g. by a hub kernel) and no hooks; otherwise why not."""
    cls = type(activation)
    if cls.__name__ != class_name or cls.__module__ != "transformers.activations":
        return f"activation is {cls.__name__}, not transformers' {class_name}"
    forward = cls.__dict__.get("forward")
    if forward is None or getattr(forward, "__module__", "") != "transformers.activations":
        return f"{class_name}.forward is replaced"
    if _has_hooks(activation):
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
        return _plain(activation, nn.SiLU) or ("nn.SiLU called with extra arguments" if args or kwargs else "")
    if type(activation).__name__ == "SiLUActivation":
        why = _transformers_activation(activation, "SiLUActivation")
        return why or ("SiLUActivation called with extra arguments" if args or kwargs else "")
    return None


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
    return ("gelu_tanh" if mode == "tanh" else "gelu"), ""


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
    reason = (_context_reason(x) or _plain(gate, nn.Linear) or _plain(up, nn.Linear) or _plain(down, nn.Linear))
    activation = None
    if not reason:
        reason = _projection_reason(gate, up)
    if not reason:
        activation, reason = gated_activation(act, act_args, act_kwargs)
    if reason:
        _fallback(KERNEL, reason)
        return down(act(gate(x), *act_args, **act_kwargs) * up(x))
    g = F.linear(x, gate.weight, gate.bias)
    u = F.linear(x, up.weight, up.bias)
    h = gated_act(g, u, activation)
    record_backend(KERNEL)  # the backend gated_act chose
    return F.linear(h, down.weight, down.bias)
