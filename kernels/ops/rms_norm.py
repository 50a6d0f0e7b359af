"""RMSNorm over the last dimension, in the written-out forms model code uses (pure torch).

Every form normalizes in float32 — ``n = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)`` —
and differs in how it scales by the weight and where it casts back (facts of the source, which
the rewrite passes as keyword arguments, see :class:`RMSNormForm`):

* Llama, Mistral, Qwen (default form):  ``weight * n.to(x.dtype)``
* OLMo-2 (``weight_before_cast``):        ``(weight * n).to(x.dtype)``
* Helium, Moshi (``+ weight_fp32``):      ``(weight.float() * n).to(x.dtype)``
* Gemma (``+ offset=1.0``):               ``(n * (1.0 + weight.float())).to(x.dtype)``
* T5LayerNorm (``cast_to_half_weight``):  ``h = x * rstd``; ``h.to(weight.dtype)`` when the weight is
  fp16/bf16; ``weight * h``
* no upcast (``upcast=False``):           ``weight * (x * rsqrt(mean(x ** 2, -1) + eps))`` in the input's
  own dtype (research code); for a float32 input the upcast is the identity, so it is the Llama form
  there (or OLMo-2's with ``weight_before_cast``), and the guarded call fuses float32 inputs only

Meta-llama/torchtitan's ``self._norm(x.float()).type_as(x) * self.weight`` and litgpt's
``x_normed.to(dtype=dtype) * self.weight`` are the Llama form (a product is commutative, bit for bit);
litgpt's ``x_normed * (1 + self.weight)`` is it with ``offset=1.0`` (the sum in the weight's dtype).

:func:`rms_norm_reference` is each form written out exactly as the source writes it (what a
guarded call runs when the kernel may not). :class:`RMSNormFunction` computes the same values
but keeps only the input (alive anyway: the caller's residual stream; a copy in its dtype where the
source's graph would not keep it, see ``guarded_rms_norm.rms_norm_fused``) and one float32 ``rstd``
per row for the backward, which recomputes ``n`` from them; the eager code keeps the float32
copy, the normalized tensor and its cast for autograd. Under ``torch.compile`` it is traced like
any autograd Function (the fused normalization is the aten op, one node of the graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RMSNormForm:
    """How the source scales and casts around the float32 normalization (see the module doc).

    ``offset``: the scale is ``offset + weight`` (Gemma's ``1.0 + weight.float()``);
    ``weight_fp32``: the weight is cast to float32 before use (``weight.float()``);
    ``weight_before_cast``: the scale multiplies the float32 ``n`` and the product is cast back to
    the input dtype (OLMo-2, Gemma), instead of scaling ``n.to(x.dtype)`` (Llama);
    ``cast_to_half_weight``: T5LayerNorm's form (cast to the weight's dtype when it is half,
    never back to the input's); it takes no other option;
    ``upcast``: False when the source normalizes the input in its own dtype (no ``x.float()``):
    the same values as the upcast form for a float32 input, which is the only one the fused
    kernels take in that form."""

    offset: float = 0.0
    weight_before_cast: bool = False
    weight_fp32: bool = False
    cast_to_half_weight: bool = False
    upcast: bool = True

    def __post_init__(self):
        if self.cast_to_half_weight and (self.offset or self.weight_before_cast or self.weight_fp32
                                         or not self.upcast):
            raise ValueError("cast_to_half_weight (T5LayerNorm's form) takes no other option")

    def scale(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies the normalized value: ``weight``, ``weight.float()``, ``offset + ...``."""
        scale = weight.float() if self.weight_fp32 else weight
        return self.offset + scale if self.offset else scale


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps, form: RMSNormForm = RMSNormForm(),
                       dim=-1) -> torch.Tensor:
    """The form written out as model code writes it (dtype semantics included), the mean of
    squares over ``dim`` (litgpt's ``self.dim``; ``-1`` in every other form)."""
    if form.cast_to_half_weight:  # T5LayerNorm.forward
        variance = x.to(torch.float32).pow(2).mean(dim, keepdim=True)
        hidden_states = x * torch.rsqrt(variance + eps)
        if weight.dtype in HALF:
            hidden_states = hidden_states.to(weight.dtype)
        return weight * hidden_states
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32) if form.upcast else x
    variance = hidden_states.pow(2).mean(dim, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    scale = form.scale(weight)
    if form.weight_before_cast:
        return (hidden_states * scale).to(input_dtype)
    return scale * hidden_states.to(input_dtype)


def _fused_rms_norm_op():
    """``aten::_fused_rms_norm`` through ``torch.ops`` (None in a torch without it): the op
    overload, not the ``torch._fused_rms_norm`` binding, which dynamo skips (a graph break at every
    norm); through ``torch.ops`` it is one node of the compiled graph, with its meta kernel and
    decomposition, and eager runs the very same kernel."""
    try:
        return torch.ops.aten._fused_rms_norm.default
    except (AttributeError, RuntimeError):
        return None


_FUSED = _fused_rms_norm_op()


def _normalize(x32: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x32 * rstd, rstd)`` with ``rstd = rsqrt(mean(x32**2, -1, keepdim=True) + eps)``: one fused
    aten op where torch has it (on CPU bitwise equal to the written-out ops, 5x faster), else those ops."""
    if _FUSED is not None:
        try:
            return _FUSED(x32, [x32.shape[-1]], None, eps)
        except (NotImplementedError, RuntimeError):  # no kernel for this device
            pass
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rstd, rstd


def _output(x: torch.Tensor, n: torch.Tensor, weight: torch.Tensor, form: RMSNormForm) -> torch.Tensor:
    """The form's output from the float32 ``n`` (same ops, same dtypes as the reference)."""
    if form.cast_to_half_weight:
        # T5 multiplies the uncast input, ``x * rstd``: that is n for the input dtypes taken here
        h = n
        if weight.dtype in HALF:
            h = h.to(weight.dtype)
        return weight * h
    scale = form.scale(weight)
    if form.weight_before_cast:
        return (n * scale).to(x.dtype)
    return scale * n.to(x.dtype)


# Input dtypes the fused forms are exact for (T5's ``x * rstd`` is ``n`` only up to float32).
INPUT_DTYPES = HALF + (torch.float32,)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm of one :class:`RMSNormForm` for an input in :data:`INPUT_DTYPES`; saves ``x``,
    ``weight`` and a float32 ``rstd`` per row."""

    @staticmethod
    def forward(ctx, x, weight, eps, form):
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(f"RMSNormFunction takes {INPUT_DTYPES} inputs, got {x.dtype}")
        if not form.upcast and x.dtype != torch.float32:
            raise ValueError(f"the form without upcast is computed for float32 inputs only, got {x.dtype}")
        n, rstd = _normalize(x.to(torch.float32), eps)
        out = _output(x, n, weight, form)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps, ctx.form = eps, form
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        form = ctx.form
        x32 = x.to(torch.float32)
        if torch.is_grad_enabled():
            # create_graph (double backward): rstd must depend on x in the graph, so recompute it
            rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + ctx.eps)
        n = x32 * rstd
        # Through the casts each form makes (a cast's backward casts the gradient back): ``g`` is the
        # gradient at the product ``scale * rounded``, ``rounded`` the value of n the scale multiplied.
        scale = weight if form.cast_to_half_weight else form.scale(weight)
        g = dy.to(torch.promote_types(torch.float32, scale.dtype)) if form.weight_before_cast else dy
        dx = dweight = None
        if ctx.needs_input_grad[1]:
            if form.cast_to_half_weight:
                rounded = n.to(weight.dtype) if weight.dtype in HALF else n
            else:
                rounded = n if form.weight_before_cast else n.to(x.dtype)
            ds = g * rounded
            dweight = ds.reshape(-1, ds.shape[-1]).sum(0, dtype=torch.float32).to(weight.dtype).reshape(weight.shape)
        if ctx.needs_input_grad[0]:
            # dx = rstd * (dn - n * mean(dn * n)): the row dot product without a temporary, then one
            # fused multiply-add (fewer full-size passes than the eager graph's backward)
            dn = (g * scale).to(torch.float32)
            c = torch.linalg.vecdot(dn, n).unsqueeze(-1) * (rstd / n.shape[-1])
            dx = torch.addcmul(dn * rstd, n, c, value=-1).to(x.dtype)
        return dx, dweight, None, None
