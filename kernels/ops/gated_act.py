"""``act(g) * u`` in one op (the middle of a gated MLP: SwiGLU, GeGLU), saving only ``g`` and ``u``.

Eager ``act(gate(x)) * up(x)`` keeps three tensors of the intermediate width alive for the
backward: ``g`` (the activation's input), ``act(g)`` and ``u`` (the product's operands). The
autograd Function here keeps ``g`` and ``u`` only and recomputes ``act(g)`` in the backward (one
elementwise op), so a training step holds one intermediate-width tensor less per MLP; the forward
also writes the product into the activation's buffer instead of allocating a second one.

The torch path runs the very ops eager runs, in the same order (``act(g)``, then ``* u``; in the
backward ``grad * u`` then the activation's own ``silu_backward``/``gelu_backward``), so it is
bitwise equal to eager; a double backward differentiates eager's expression itself. On CUDA a
triton kernel computes forward and backward in one pass each (``triton_gated_act.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import select_backend, triton_dtype_ok
from .common import fx_leaf

# The activations the kernel computes: SiLU (swish), exact GeLU, tanh-approximate GeLU.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def apply_activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g)`` as eager computes it (``F.silu``, ``F.gelu(..., approximate=...)``)."""
    if activation == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def activation_backward(grad: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    """``grad * act'(g)`` through the aten backward op eager's autograd uses for ``act``."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    return torch.ops.aten.gelu_backward(grad, g, approximate="tanh" if activation == "gelu_tanh" else "none")


class GatedActFunction(torch.autograd.Function):
    """``act(g) * u`` for ``g``, ``u`` of one shape and dtype; saves ``g`` and ``u``, not ``act(g)``."""

    @staticmethod
    def forward(ctx, g, u, activation):
        out = apply_activation(g, activation)
        out.mul_(u)  # into act(g)'s fresh buffer: same values as act(g) * u, one allocation less
        ctx.save_for_backward(g, u)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph (double backward): aten's silu_backward has no derivative; eager's own
            # ``act(g) * u``, differentiated by autograd here, takes its differentiable formulas
            wanted = [t for t, want in zip((g, u), ctx.needs_input_grad) if want]
            grads = iter(torch.autograd.grad(apply_activation(g, ctx.activation) * u, wanted, grad, create_graph=True))
            return tuple(next(grads) if want else None for want in ctx.needs_input_grad[:2]) + (None,)
        dg = du = None
        if ctx.needs_input_grad[1]:
            du = grad * apply_activation(g, ctx.activation)  # act(g) recomputed, not stored
        if ctx.needs_input_grad[0]:
            dg = activation_backward(grad * u, g, ctx.activation)
        return dg, du, None


@fx_leaf
def gated_act(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g) * u`` with ``act`` one of :data:`ACTIVATIONS`; one triton kernel each way on CUDA.

    Inputs of different shapes, dtypes or devices (a broadcast product, mixed precision) run the
    two eager ops, which is what the unfused expression computes for them."""
    check_activation(activation)
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        return apply_activation(g, activation) * u
    backend = select_backend("gated_act", (g, u), has_triton=lambda: triton_dtype_ok(g, u))
    if backend == "triton":
        from .triton_gated_act import GatedActTritonFunction

        return GatedActTritonFunction.apply(g, u, activation)
    if not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad):
        out = apply_activation(g, activation)
        return out.mul_(u)
    return GatedActFunction.apply(g, u, activation)
