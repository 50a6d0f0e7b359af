"""Attention layers and the language-model wrapper: einops throughout, RMSNorm through
F.normalize, rotary embeddings with an einops rotate_half, the softmax bound with partial."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import einsum, nn

from .helpers import FeedForward, SwiGLUFeedForward, default, exists, l2norm


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device).type_as(self.inv_freq)
        freqs = einsum("i , j -> i j", t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return rearrange(freqs, "n d -> 1 1 n d")


def rotate_half(x):
    x = rearrange(x, "... (j d) -> ... j d", j=2)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos()) + (rotate_half(t) * freqs.sin())
    return torch.cat((t, t_pass), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=False, dropout=0.0):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.attn_fn = partial(F.softmax, dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context=None, mask=None, rotary_pos_emb=None):
        h = self.heads
        kv_input = default(context, x)
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=h), (q, k, v))

        if exists(rotary_pos_emb):
            q, k = map(lambda t: apply_rotary_pos_emb(t, rotary_pos_emb), (q, k))

        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        mask_value = -torch.finfo(sim.dtype).max

        if exists(mask):
            sim = sim.masked_fill(~rearrange(mask, "b j -> b 1 1 j"), mask_value)

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, mask_value)

        attn = self.attn_fn(sim)
        attn = self.dropout(attn)

        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class CosineSimAttention(nn.Module):
    """Self-attention over l2-normalized queries and keys with a fixed temperature."""

    def __init__(self, dim, dim_head=16, heads=4, causal=False, dropout=0.0, qk_norm_scale=10.0):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qk_norm_scale = qk_norm_scale
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, mask=None, rotary_pos_emb=None):
        q = self.to_q(x)
        k = self.to_k(x)
        v = self.to_v(x)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (q, k, v))
        q, k = map(l2norm, (q, k))
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.qk_norm_scale
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class PreNorm(nn.Module):
    def __init__(self, dim, fn, norm_class=RMSNorm):
        super().__init__()
        self.norm = norm_class(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs) + x


class PostNormBranch(nn.Module):
    def __init__(self, dim, fn, dropout=0.0):
        super().__init__()
        self.fn = fn
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        out = self.fn(x, **kwargs)
        return self.norm(x + self.dropout(out))


class FFBranch(nn.Module):
    """Lets a feed-forward take (and ignore) the attention keyword arguments."""

    def __init__(self, ff):
        super().__init__()
        self.ff = ff

    def forward(self, x, **kwargs):
        return self.ff(x)


class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads=4, dim_head=16, causal=True, rotary_pos_emb=True, pre_norm=True,
                 attn_kind="standard", ff_kind="gelu", attn_dropout=0.0, ff_dropout=0.0, layer_dropout=0.1):
        super().__init__()
        self.rotary_pos_emb = RotaryEmbedding(max(dim_head // 2, 8)) if rotary_pos_emb else None
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            if attn_kind == "cosine":
                attn = CosineSimAttention(dim, dim_head=dim_head, heads=heads, causal=causal, dropout=attn_dropout)
            else:
                attn = Attention(dim, dim_head=dim_head, heads=heads, causal=causal, dropout=attn_dropout)
            if ff_kind == "swiglu":
                ff = SwiGLUFeedForward(dim, dropout=ff_dropout)
            else:
                ff = FeedForward(dim, glu=ff_kind == "geglu", dropout=ff_dropout)
            ff = FFBranch(ff)
            if pre_norm:
                self.layers.append(nn.ModuleList([PreNorm(dim, attn), PreNorm(dim, ff)]))
            else:
                self.layers.append(nn.ModuleList([PostNormBranch(dim, attn, layer_dropout),
                                                  PostNormBranch(dim, ff, layer_dropout)]))

    def forward(self, x, mask=None):
        rotary = self.rotary_pos_emb(x.shape[1], x.device) if exists(self.rotary_pos_emb) else None
        for attn, ff in self.layers:
            x = attn(x, mask=mask, rotary_pos_emb=rotary)
            x = ff(x)
        return x


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens=128, max_seq_len=32, dim=64, depth=2, ignore_index=-100, emb_dropout=0.0,
                 **layer_kwargs):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.ignore_index = ignore_index
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.attn_layers = AttentionLayers(dim, depth, **layer_kwargs)
        self.norm = RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, return_loss=False, mask=None):
        if return_loss:
            x, target = x[:, :-1], x[:, 1:]
            mask = mask[:, :-1] if exists(mask) else None
        x = self.token_emb(x)
        x = self.emb_dropout(x)
        x = self.attn_layers(x, mask=mask)
        x = self.norm(x)
        logits = self.to_logits(x)
        if not return_loss:
            return logits
        loss = F.cross_entropy(rearrange(logits, "b n c -> b c n"), target, ignore_index=self.ignore_index)
        return loss


def tiny_lm():
    return TransformerWrapper()


def tiny_postnorm_lm():
    return TransformerWrapper(pre_norm=False, attn_kind="cosine")


def tiny_geglu_lm():
    return TransformerWrapper(ff_kind="geglu")


def tiny_swiglu_lm():
    return TransformerWrapper(ff_kind="swiglu", attn_kind="cosine")
