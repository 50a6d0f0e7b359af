# Masks whose `if` could not be evaluated a second time at the kernel call: the condition calls a
# function (`if exists(mask):`, x-transformers' helper) or the branch rebinds the name it reads
# (`mask = rearrange(mask, "b j -> b 1 1 j")`). The branch stays, its update of the scores becomes
# the binding of a fresh name (None until the branch runs), and the kernel reads that name: the
# condition runs once, where the source runs it.
# expect: sdpa_attention ExistsRearranged.forward
# expect: sdpa_attention NoneCheckIndexed.forward
# expect: sdpa_attention PaddingThenCausal.forward
# expect: sdpa_attention CountedCondition.forward
# expect: sdpa_attention ExistsOneStatement.forward
# expect: sdpa_attention KeepSliced.forward
# expect: sdpa_attention ExistsSliced.forward
# expect: sdpa_attention SelfThenCross.forward
# expect: sdpa_attention SelfThenCross.forward
import torch
from adopter.kernels import sdpa
from einops import rearrange
from torch import nn


def exists(val):
    return val is not None


class ExistsRearranged(nn.Module):
    """`if exists(mask):` the key-padding mask reshaped by einops, then filled with the scores'
    `-finfo.max` bound before the branch."""

    def __init__(self, dim, heads, p=0.0):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.dropout = nn.Dropout(p)

    def forward(self, x, mask=None):
        q, k, v = rearrange(self.to_qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        fill_mask = None
        if exists(mask):
            mask = rearrange(mask, "b j -> b 1 1 j")
            fill_mask = ~mask
        out = sdpa(
            q,
            k,
            v,
            scale=self.scale,
            fill=fill_mask,
            fill_value="lowest",
            dropout=self.dropout,
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        return rearrange(out, "b h n d -> b n (h d)")


class NoneCheckIndexed(nn.Module):
    """`if mask is not None:` the mask rebound to its broadcast view, then added (a float bias)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn_bias = None
        if mask is not None:
            mask = mask[:, None, None, :]
            attn_bias = mask
        return (sdpa(q, k.transpose(-2, -1), v, divisor=(d // self.heads) ** 0.5, mask=attn_bias)).transpose(1, 2).reshape(
            b, n, d
        )


class PaddingThenCausal(nn.Module):
    """Two branches in sequence: the padding mask under `exists()`, rebound, then a causal mask
    built from the scores' sizes under a flag; both fill `-finfo.max`."""

    def __init__(self, dim, heads, causal=True, p=0.1):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.attn_dropout = nn.Dropout(p)

    def forward(self, x, mask=None):
        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=self.heads)
        k, v = rearrange(self.to_kv(x), "b n (two h d) -> two b h n d", two=2, h=self.heads)
        fill_mask = None
        if exists(mask):
            mask = rearrange(mask, "b j -> b 1 1 j")
            fill_mask = ~mask
        if self.causal:
            i, j = q.shape[-2:-1] + k.shape[-2:-1]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
        out = sdpa(
            q,
            k,
            v,
            scale=self.scale,
            fill=(fill_mask, (causal_mask if self.causal else None)),
            fill_value=("lowest", "lowest"),
            dropout=self.attn_dropout,
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        return rearrange(out, "b h n d -> b n (h d)")


class CountedCondition(nn.Module):
    """The condition is a method with a side effect (it counts its calls): run once by the source,
    once by the rewrite (the branch stays: it builds the padding mask)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.checks = 0

    def use_mask(self, mask):
        self.checks += 1
        return mask is not None

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        fill_mask = None
        if self.use_mask(mask):
            pad = ~mask[:, None, None, :]
            fill_mask = pad
        return (sdpa(q, k.mT, v, scale=(d // self.heads) ** -0.5, fill=fill_mask, fill_value=float("-inf"))).transpose(1, 2).reshape(
            b, n, d
        )


class ExistsOneStatement(nn.Module):
    """`if exists(keep):` around the fill alone: the branch stays, binding the mask, so the
    condition runs where the source runs it."""

    def forward(self, q, k, v, keep=None):
        fill_mask = None
        if exists(keep):
            fill_mask = ~keep[:, None, None, :]
        return sdpa(q, k.transpose(-2, -1), v, fill=fill_mask, fill_value=float("-inf"))


class KeepSliced(nn.Module):
    """The rebinding reads the scores' key count (taken from the key in the rewrite)."""

    def forward(self, q, k, v, keep=None):
        fill_mask = None
        if keep is not None:
            keep = keep[:, None, None, : k.shape[-2]]
            fill_mask = ~keep
        return sdpa(q, k.transpose(-2, -1), v, fill=fill_mask, fill_value=float("-inf"))


class ExistsSliced(nn.Module):
    """`exists()` gates a padding mask built from the scores' key count under a name of its own."""

    def forward(self, q, k, v, keep=None):
        fill_mask = None
        if exists(keep):
            j = k.shape[-2]
            pad = ~keep[:, None, None, :j]
            fill_mask = pad
        return sdpa(q, k.transpose(-2, -1), v, fill=fill_mask, fill_value=float("-inf"))


class SelfThenCross(nn.Module):
    """Two attentions in one forward (a decoder block's self and cross attention), each with its
    padding mask under `exists()`: each call reads the mask its own branch bound."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.self_qkv = nn.Linear(dim, 3 * dim)
        self.cross_q = nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(dim, 2 * dim)

    def forward(self, x, context, mask=None, context_mask=None):
        q, k, v = rearrange(self.self_qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        fill_mask = None
        if exists(mask):
            mask = rearrange(mask, "b j -> b 1 1 j")
            fill_mask = ~mask
        out = sdpa(
            q,
            k,
            v,
            fill=fill_mask,
            fill_value=float("-inf"),
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        x = x + rearrange(out, "b h n d -> b n (h d)")
        q = rearrange(self.cross_q(x), "b n (h d) -> b h n d", h=self.heads)
        k, v = rearrange(self.cross_kv(context), "b n (two h d) -> two b h n d", two=2, h=self.heads)
        fill_mask = None
        if exists(context_mask):
            context_mask = rearrange(context_mask, "b j -> b 1 1 j")
            fill_mask = ~context_mask
        out = sdpa(
            q,
            k,
            v,
            fill=fill_mask,
            fill_value=float("-inf"),
            einsum=('b h i d, b h j d -> b h i j', 'b h i j, b h j d -> b h i d'),
        )
        return x + rearrange(out, "b h n d -> b n (h d)")
