"""Scaled dot-product attention on ``(batch, heads, seq, head_dim)`` tensors.

Backends: xformers ``memory_efficient_attention`` where xformers has an operator for the inputs
(probed once per device/dtype), else ``torch.nn.functional.scaled_dot_product_attention``; the eager
matmul-softmax-matmul path when the attention weights are asked for, and on CPU with dropout (where
SDPA itself falls back to that math).

Masks: ``mask`` is a padding/attention mask broadcastable to ``(batch, heads, q_len, k_len)``,
either additive float (0 keeps, large negative drops; what HF's BERT builds) or bool (True keeps,
the SDPA convention). ``bias`` is an extra additive score bias (T5's relative position bias, used
with ``scale=1.0``). ``is_causal`` masks key positions after the query position (top-left aligned,
as SDPA). Key/value with fewer heads than the query (GQA/MQA) are shared by consecutive query heads.

Rewrites pass ``additive=True``: the call replaces the written-out ops
``softmax(matmul(q, k.transpose(-1, -2)) * scale + mask + bias) @ v`` (with dropout), and it computes
what they compute: a mask is a summand whatever its dtype (a bool mask adds 1.0 where True, as
``scores + mask`` does; never a keep-mask), it broadcasts as the addition broadcasts it (not cut to the
keys), and inputs outside what the fused path takes as those ops take them (other ranks or head
counts, a mask that changes the scores' dtype or shape) run the ops themselves, raising where they
raise.

What the fused paths compute as the eager ops do, and where they would not, the eager ops run:

* a query row whose scores are all ``-inf`` (a fully masked row) or hold no number SDPA keeps
  (NaN), softmax makes NaN; SDPA (its masked-row-safe softmax, the CPU flash kernel also for a NaN
  query) and xformers give 0 (times the values: NaN where a value is infinite). Such a row sums to 0
  or NaN, which a row of the eager ops' output rarely does short of a NaN of their own (it takes
  values that cancel exactly): the fused output's row sums are read (4-8% of SDPA's time at
  BERT-base sizes on one CPU thread; a device sync on CUDA), and where one is 0 or NaN the eager ops
  recompute the call. (Scores that overflow in the eager ``q @ k^T`` but not in SDPA, which scales
  first, are not found so.) ``is_causal`` fills the scores it masks, as SDPA's causal kernels skip
  those keys (an infinite score there makes no NaN);
* the backward of SDPA's and xformers' fused ops has no derivative: with gradients recorded and no
  dropout, :class:`_Fused` runs the fused op and its own backward, and a backward that records a
  graph (``create_graph=True``: double backward) differentiates the eager ops instead (with dropout
  a recomputation would draw another mask: SDPA's backward then raises there, as it does); the
  Function and its nested backward cost 4-9% of SDPA's forward+backward at BERT-base sizes on CPU;
* under ``torch.jit.trace``, a ``torch.func`` transform, a forward-AD dual level
  (:func:`~adopter.kernels.policy.mode_reason`) and while torch.compile traces (the scan needs the
  data; inductor fuses the eager ops itself) the eager ops run.

Besides :func:`attention`, the pieces other guarded kernels build on (``guarded_sdpa.py``):
:data:`HALF_DTYPES`, :func:`attention_eager`, :func:`attention_sdpa`, :func:`run_fused` (the fused
call with its own backward and the eager ops' double backward), :func:`suspect_row` (the output
check for fully masked or NaN rows) and :func:`finitely_masked_row`.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..backend import requested_backend, select_backend
from ..policy import policy_reason
from ..telemetry import ORIGINAL, record
from .common import fx_leaf

__all__ = ["HALF_DTYPES", "attention", "attention_added", "attention_eager", "attention_sdpa", "attention_xformers",
           "finitely_masked_row", "run_fused", "suspect_row"]

# the dtypes whose softmax the fused paths compute in float32
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _causal_keep(q_len: int, k_len: int, device) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def _combined_mask(q, k, mask, bias, is_causal, *, force_tensor: bool) -> torch.Tensor | None:
    """One attn_mask (bool or additive in q's dtype) equivalent to mask + bias + causal."""
    k_len = k.shape[-2]
    # masks built for a longer (static) key cache are cut to the keys present, as HF's eager code does
    parts = [m[..., :k_len] if m.dim() and m.shape[-1] > k_len else m for m in (mask, bias) if m is not None]
    if is_causal and (parts or force_tensor):
        parts.append(_causal_keep(q.shape[-2], k_len, q.device))
    if not parts:
        return None
    if len(parts) == 1 and (parts[0].dtype == torch.bool or not force_tensor):
        only = parts[0]
        return only if only.dtype == torch.bool else only.to(q.dtype)
    if all(p.dtype == torch.bool for p in parts):
        out = parts[0]
        for p in parts[1:]:
            out = out & p
        return out
    out = _additive(parts[0], q.dtype)
    for p in parts[1:]:
        out = out + _additive(p, q.dtype)
    return out


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.shape[1] == q.shape[1]:
        return t
    if q.shape[1] % t.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({t.shape[1]})")
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the fused paths (and :func:`_softmax` without ``softmax_dtype``) compute the
    softmax of ``dtype`` scores in."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def _softmax(scores: torch.Tensor, softmax_dtype: torch.dtype | None = None) -> torch.Tensor:
    # half precision in float32 (T5's ``softmax(scores.float())``; torch's own half softmax
    # accumulates in float32 too), every other dtype in itself (float64 stays float64), unless the
    # source names the dtype (``softmax_dtype``: float64 scores upcast... to float32 by T5's
    # ``.float()``, llama's ``dtype=torch.float32``). Cast first, as T5 writes it, not ``dtype=``: the
    # same numbers, but TorchScript's autodiff (``jit.trace``) returns softmax(dtype=)'s gradient in
    # float32, which the half ``q @ k^T`` backward rejects
    dtype = _softmax_dtype(scores.dtype) if softmax_dtype is None else softmax_dtype
    return F.softmax(scores if scores.dtype == dtype else scores.to(dtype), dim=-1)


def attention_eager(q, k, v, mask=None, bias=None, dropout_p=0.0, scale=None, is_causal=False,
                    softmax_dtype=None):
    """matmul - softmax (in ``softmax_dtype`` when given) - dropout - matmul; returns ``(out, weights)``
    (weights after dropout, in q's dtype, as HF's eager attention returns them)."""
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    combined = _combined_mask(q, k, mask, bias, False, force_tensor=True)
    if combined is not None:
        # an additive mask is added as it is (in q's dtype: under autocast it promotes the
        # lower-precision scores, as ``scores + mask`` does); a keep-mask adds -inf in the scores' dtype
        scores = scores + (_additive(combined, scores.dtype) if combined.dtype == torch.bool else combined)
    if is_causal:  # (filled, as SDPA's causal kernels skip those keys: an infinite score there is no NaN)
        scores = scores.masked_fill(~_causal_keep(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    weights = _softmax(scores, softmax_dtype).to(q.dtype)
    if dropout_p != 0.0:  # (F.dropout rejects a probability outside [0, 1])
        weights = F.dropout(weights, dropout_p, training=True)
    return torch.matmul(weights, v), weights


def attention_added(q, k, v, mask=None, bias=None, dropout_p=0.0, scale=None, is_causal=False,
                    softmax_dtype=None):
    """The written-out ops a rewrite replaced (``additive=True``), as written: ``mask`` and ``bias``
    added to the scores as they are, the softmax in ``softmax_dtype`` when the source upcasts to it
    (its result cast back to the scores' dtype, as ``.type_as(scores)``/``.to(q.dtype)`` do);
    returns ``(out, weights)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    for term in (mask, bias):
        if term is not None:
            scores = scores + term
    if is_causal:
        scores = scores.masked_fill(~_causal_keep(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    weights = _softmax(scores, softmax_dtype).to(scores.dtype)
    if dropout_p != 0.0:
        weights = F.dropout(weights, dropout_p, training=True)
    return torch.matmul(weights, v), weights


def _added_reason(q, k, v, mask, bias) -> str:
    """Why the fused path would not compute what the written-out ops compute for these inputs
    ("" when it does)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not q.is_floating_point():
        return "query/key/value are not floating-point tensors"
    if not q.dim() == k.dim() == v.dim() == 4 or not q.dtype == k.dtype == v.dtype:
        return "query/key/value differ in rank or dtype, or are not (batch, heads, seq, head_dim)"
    b, h, q_len, d = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[1] not in (h, 1) or k.shape[-1] != d:
        return "key/value shapes the matmuls broadcast or reject"
    scores = (b, h, q_len, k.shape[-2])
    for term in (mask, bias):
        if term is None:
            continue
        if not isinstance(term, torch.Tensor) or term.device != q.device or not 2 <= term.dim() <= 4:
            return "a mask that is not a tensor of rank 2 to 4 on the query's device (SDPA's attn_mask)"
        if not all(m in (1, n) for m, n in zip(term.shape[::-1], scores[::-1])):  # (rank <= 4 above)
            return f"a mask of shape {tuple(term.shape)} does not broadcast to the scores {scores}"
        # (under autocast the matmuls cast whatever the addition makes; outside it a promoted
        # scores dtype reaches ``weights @ v``, which raises there)
        if torch.result_type(q, term) != q.dtype and not torch.is_autocast_enabled(q.device.type):
            return f"a {term.dtype} mask makes the {q.dtype} scores {torch.result_type(q, term)}"
    return ""


# a row of additive mask + bias whose every key is at most this: masked by a finite mask (HF's
# finfo.min, BERT's -1e4), where a half dtype's ulp is 1 or coarser
_MASKED_ROW = -1024.0


def finitely_masked_row(q: torch.Tensor, k: torch.Tensor, mask, bias) -> bool:
    """Whether, in half precision, some query row may have every key masked by a finite additive
    mask/bias: the eager ops then round ``scores + mask`` to the dtype (at ``finfo.min`` its ulp is
    32 in float16), and their softmax is over that rounding, where SDPA and xformers add in float32:
    another result altogether. An upper bound on each row's largest summand (the sum of the terms'
    row maxima) is read: the terms are (batch, 1|heads, 1|q_len, k_len), a small read next to SDPA."""
    k_len = k.shape[-2]
    top = None
    for term in (mask, bias):
        if term is None or term.dtype == torch.bool or term.dim() == 0 or term.numel() == 0:
            continue
        if term.shape[-1] > k_len:  # (cut as _combined_mask cuts it)
            term = term[..., :k_len]
        row = term.detach().amax(dim=-1, keepdim=True).float()
        top = row if top is None else top + row
    return top is not None and bool((top <= _MASKED_ROW).any())


def suspect_row(out: torch.Tensor) -> bool:
    """Whether a row of ``out`` (one query's output) may hold a NaN or nothing but zeros: its sum is NaN
    or 0 (one pass, no temporary of out's size; a row of other values that sums to exactly 0 only
    costs a recomputation)."""
    return out.numel() > 0 and not bool(out.detach().sum(-1).abs().gt(0).all())


class _Fused(torch.autograd.Function):
    """``fused(q, k, v, mask, bias)`` with the fused op's own backward for gradients, and the eager
    ops' (``eager``, same arguments) for a backward that records a graph (double backward)."""

    @staticmethod
    def forward(ctx, fused, eager, q, k, v, mask, bias):
        inner = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, mask, bias)]
        with torch.enable_grad():
            out = fused(*inner)
        ctx.eager = eager
        # ``out`` holds the fused op's graph: saved, it is freed with this node's saved tensors
        # (after a backward without retain_graph), as the fused op's own graph would be
        ctx.save_for_backward(q, k, v, mask, bias, out, *inner)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, bias, out, *inner = ctx.saved_tensors
        wanted = [i for i in range(5) if ctx.needs_input_grad[2 + i]]
        if torch.is_grad_enabled():  # create_graph: gradients that are differentiable themselves
            outer = (q, k, v, mask, bias)
            found = torch.autograd.grad(ctx.eager(*outer), [outer[i] for i in wanted], grad,
                                        create_graph=True, allow_unused=True)
        else:  # (retain_graph: this node may be run again; the graph goes with ``out``)
            found = torch.autograd.grad(out, [inner[i] for i in wanted], grad, retain_graph=True, allow_unused=True)
        grads = [None] * 5
        for i, g in zip(wanted, found):
            grads[i] = g
        return (None, None, *grads)


def attention_sdpa(q, k, v, mask=None, bias=None, dropout_p=0.0, scale=None, is_causal=False):
    attn_mask = _combined_mask(q, k, mask, bias, is_causal, force_tensor=False)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal and attn_mask is None, scale=scale, enable_gqa=gqa,
    )


def attention_xformers(q, k, v, mask=None, bias=None, dropout_p=0.0, scale=None, is_causal=False):
    import xformers.ops as xops

    k, v = _expand_kv(q, k), _expand_kv(q, v)
    b, h, q_len, _ = q.shape
    k_len = k.shape[-2]
    attn_bias = None
    if mask is not None or bias is not None:
        combined = _combined_mask(q, k, mask, bias, is_causal, force_tensor=True)
        # xformers wants a (B, H, Mq, Mk) tensor whose rows start 8-element aligned: pad, then slice
        padded = torch.empty(b, h, q_len, (k_len + 7) // 8 * 8, dtype=q.dtype, device=q.device)
        attn_bias = padded[..., :k_len]
        attn_bias.copy_(_additive(combined, q.dtype).expand(b, h, q_len, k_len))
    elif is_causal:
        attn_bias = xops.LowerTriangularMask()
    out = xops.memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_bias=attn_bias, p=dropout_p, scale=scale,
    )
    return out.transpose(1, 2)


@fx_leaf
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    is_causal: bool = False,
    need_weights: bool = False,
    additive: bool = False,
    softmax_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q @ k^T * scale + mask + bias) @ v``; ``(out, weights)`` when ``need_weights``.

    ``dropout_p`` applies as given: callers pass ``p if module.training else 0.0``. ``additive``:
    ``mask`` and ``bias`` are summands of the scores as written out (module doc). ``softmax_dtype``:
    the dtype the source computes the softmax in (``softmax(scores.float())``,
    ``softmax(scores, dtype=torch.float32)``), its result cast back to the inputs' dtype. The fused
    paths compute half precision in float32 and float32/float64 in themselves; where that is not
    ``softmax_dtype`` (float64 inputs with a float32 softmax: a float64 score beyond float32's range
    is inf there, NaN rows) the eager ops run with the softmax in ``softmax_dtype``.
    """
    eager = attention_added if additive else attention_eager
    if softmax_dtype is not None:
        eager = functools.partial(eager, softmax_dtype=softmax_dtype)
    args = (q, k, v, mask, bias, dropout_p, scale, is_causal)
    if torch.compiler.is_compiling():  # (before anything dynamo would not trace)
        reason = "torch.compile: the scan for fully masked rows needs the data; inductor fuses the eager ops"
    else:
        reason = (_added_reason(q, k, v, mask, bias) if additive else "") or policy_reason("attention", q)
    if reason:
        record("attention", ORIGINAL, reason)
        out, weights = eager(*args)
        return (out, weights) if need_weights else out
    if (softmax_dtype is not None and isinstance(q, torch.Tensor)
            and softmax_dtype != _softmax_dtype(q.dtype)):
        record("attention", ORIGINAL, f"the source computes the softmax of {q.dtype} scores in {softmax_dtype}")
        out, weights = eager(*args)
        return (out, weights) if need_weights else out
    if need_weights or not 0.0 <= dropout_p < 1.0:
        # (F.dropout raises for a probability outside [0, 1] and zeroes everything at 1)
        record("attention", "torch")
        out, weights = eager(*args)
        return (out, weights) if need_weights else out
    if additive:  # the summands in the scores' dtype: a bool mask as 1.0 where True, never a keep-mask
        mask, bias = (t if t is None or t.dtype == q.dtype else t.to(q.dtype) for t in (mask, bias))
    if q.dtype in HALF_DTYPES and finitely_masked_row(q, k, mask, bias):
        record("attention", ORIGINAL, "a query row is masked by a finite mask in half precision: the "
                                      "eager ops' softmax is over the rounding of scores + mask")
        return eager(*args)[0]
    backend = select_backend(
        "attention", (q, k, v, mask, bias),
        # a learned bias (T5) needs a bias gradient, which not every xformers operator has: SDPA then
        has_xformers=lambda: (
            q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.dim() == 4
            and not any(t is not None and t.requires_grad for t in (mask, bias))
        ),
    )
    out = None
    if backend == "xformers":
        try:
            out = run_fused(attention_xformers, eager, q, k, v, mask, bias, dropout_p, scale, is_causal)
            backend_used = "xformers"
        except (NotImplementedError, ValueError):
            # xformers refuses some shapes (no operator for them); auto mode then uses SDPA
            if requested_backend() == "xformers":
                raise
    if out is None and dropout_p > 0.0 and q.device.type == "cpu":
        # SDPA has no fused CPU kernel with dropout: it runs its math path (the same matmul-softmax-
        # dropout-matmul plus a masked-row-safe softmax), so the eager path is the faster equal
        record("attention", "torch")
        return eager(*args)[0]
    if out is None:
        out = run_fused(attention_sdpa, eager, q, k, v, mask, bias, dropout_p, scale, is_causal)
        backend_used = "torch"
    if suspect_row(out):
        record("attention", ORIGINAL, "a query row came out NaN or zero: maybe a fully masked (all -inf) "
                                      "or NaN row, which softmax makes NaN")
        return eager(*args)[0]
    record("attention", backend_used)
    return out


def run_fused(fused, eager, q, k, v, mask, bias, dropout_p, scale, is_causal) -> torch.Tensor:
    """``fused`` (SDPA or xformers) on the call's arguments; through :class:`_Fused` when a gradient
    is recorded and no dropout is drawn (a double backward then differentiates ``eager``)."""
    def run(q, k, v, mask, bias):
        return fused(q, k, v, mask, bias, dropout_p, scale, is_causal)

    tensors = (q, k, v, mask, bias)
    if dropout_p == 0.0 and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _Fused.apply(run, lambda *t: eager(*t, 0.0, scale, is_causal)[0], *tensors)
    return run(*tensors)
