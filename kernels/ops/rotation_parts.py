"""The parts a rotary embedding pairs up, and the autograd Function for pairs given apart: shared
by the torch ops (:mod:`.rotary`) and the triton ones (:mod:`.triton_rotary`), which must not
import each other (the torch module picks the triton one at run time)."""

from __future__ import annotations

import torch


def _halves(t: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    return t[..., :h], t[..., h:]


def _even_odd(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t[..., 0::2], t[..., 1::2]


def parts(t: torch.Tensor, h: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two parts of ``t``'s last dimension that pair up (views): halves, or even/odd positions.
    A ``t`` whose last dimension is not ``2 * h`` (``cos``/``sin`` of one angle per pair) is both."""
    if t.shape[-1] != 2 * h:
        return t, t
    return _even_odd(t) if interleaved else _halves(t, h)


def pair_outputs(shape: torch.Size, like: torch.Tensor, stacked: bool):
    """(output, o1, o2): a new tensor for two rotated parts of ``shape``, stacked on a new last
    dimension (interleaved) or concatenated along the last one, and the views of its two parts."""
    if stacked:
        out = torch.empty((*shape, 2), dtype=like.dtype, device=like.device)
        return out, out[..., 0], out[..., 1]
    n = shape[-1] if len(shape) else 1
    out = torch.empty((*shape[:-1], 2 * n), dtype=like.dtype, device=like.device)
    return (out, *_halves(out, n))


def _pair_function(name: str, rotate_pairs, doc: str) -> type:
    """An autograd Function for the pairs given apart, rotating with ``rotate_pairs(x1, x2, cos,
    sin, o1, o2, transpose)`` (torch or triton): ``(x1, x2, cos, sin, stacked) -> stack/cat of the
    rotated parts``; the backward reads the incoming gradient's two parts and ``cos``/``sin``."""

    def forward(ctx, x1, x2, cos, sin, stacked):
        ctx.save_for_backward(cos, sin)
        ctx.stacked = stacked
        out, o1, o2 = pair_outputs(x1.shape, x1, stacked)
        rotate_pairs(x1, x2, cos, sin, o1, o2, False)
        return out

    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, None, None, None
        if ctx.stacked:
            g1, g2 = grad[..., 0], grad[..., 1]
        else:
            g1, g2 = _halves(grad, grad.shape[-1] // 2)
        if torch.is_grad_enabled():
            # create_graph (double backward): the transposed rotation in ops autograd differentiates
            # (rotate_pairs writes into the outputs it is given)
            dx1 = g1 * cos + g2 * sin if ctx.needs_input_grad[0] else None
            dx2 = g2 * cos - g1 * sin if ctx.needs_input_grad[1] else None
            return dx1, dx2, None, None, None
        dx1 = torch.empty(g1.shape, dtype=grad.dtype, device=grad.device)
        dx2 = torch.empty(g2.shape, dtype=grad.dtype, device=grad.device)
        rotate_pairs(g1, g2, cos, sin, dx1, dx2, True)
        return (dx1 if ctx.needs_input_grad[0] else None), (dx2 if ctx.needs_input_grad[1] else None), None, None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
