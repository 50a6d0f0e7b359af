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
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backend import requested_backend, select_backend
from ..telemetry import record
from .common import fx_leaf


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
    parts = [m[..., :k_len] if m.shape[-1] > k_len else m for m in (mask, bias) if m is not None]
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


def attention_eager(q, k, v, mask=None, bias=None, dropout_p=0.0, scale=None, is_causal=False):
    """matmul - softmax (fp32) - dropout - matmul; returns ``(out, weights)`` (weights after dropout,
    as HF's eager attention returns them)."""
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    combined = _combined_mask(q, k, mask, bias, is_causal, force_tensor=True)
    if combined is not None:
        scores = scores + _additive(combined, scores.dtype)
    weights = F.softmax(scores.float(), dim=-1).to(q.dtype)  # (no-op casts in fp32)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p, training=True)
    return torch.matmul(weights, v), weights


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q @ k^T * scale + mask + bias) @ v``; ``(out, weights)`` when ``need_weights``.

    ``dropout_p`` applies as given: callers pass ``p if module.training else 0.0``.
    """
    if need_weights:
        record("attention", "torch")
        return attention_eager(q, k, v, mask, bias, dropout_p, scale, is_causal)
    backend = select_backend(
        "attention", (q, k, v, mask, bias),
        # a learned bias (T5) needs a bias gradient, which not every xformers operator has: SDPA then
        has_xformers=lambda: (
            q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.dim() == 4
            and not any(t is not None and t.requires_grad for t in (mask, bias))
        ),
    )
    if backend == "xformers":
        try:
            out = attention_xformers(q, k, v, mask, bias, dropout_p, scale, is_causal)
            record("attention", "xformers")
            return out
        except (NotImplementedError, ValueError):
            # xformers refuses some shapes (no operator for them); auto mode then uses SDPA
            if requested_backend() == "xformers":
                raise
    if dropout_p > 0.0 and q.device.type == "cpu":
        # SDPA has no fused CPU kernel with dropout: it runs its math path (the same matmul-softmax-
        # dropout-matmul plus a masked-row-safe softmax), so the eager path is the faster equal
        record("attention", "torch")
        return attention_eager(q, k, v, mask, bias, dropout_p, scale, is_causal)[0]
    record("attention", "torch")
    return attention_sdpa(q, k, v, mask, bias, dropout_p, scale, is_causal)
