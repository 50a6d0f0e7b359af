"""Look-alikes of the rules' sites in the styles of this corpus (written for this corpus), with a
few positive controls beside them: softmax over the slot axis, attention whose probabilities are
returned, stored or mixed across heads, linear attention, norms that are not RMSNorms, dropout
and LayerNorm without a residual, gated MLPs whose halves read different tensors, a flipped
rotation, transformed logits, memory cross-attention."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import einsum, nn


class SlotAssign(nn.Module):
    """Slots compete for tokens: the assignment softmax runs over the token axis (dim 1 of a 3-D
    tensor); the per-token distribution over the slots runs over the last axis (dim 2)."""

    def __init__(self, dim, num_slots=4):
        super().__init__()
        self.slots = nn.Parameter(torch.randn(num_slots, dim) * 0.02)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.scale = dim ** -0.5

    def forward(self, x):
        k = self.to_k(x)
        logits = einsum("bnd,kd->bnk", k, self.slots) * self.scale
        assign = torch.softmax(logits, dim=1)
        slots = einsum("bnk,bnd->bkd", assign, x)
        per_token = torch.softmax(logits, dim=2)
        return x + einsum("bnk,bkd->bnd", per_token, slots)


class AttendWithIntermediates(nn.Module):
    """The post-softmax attention map is returned to the caller (for visualisation)."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.attn_fn = partial(F.softmax, dim=-1)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        sim = (q @ k.transpose(-2, -1)) * self.scale
        attn = self.attn_fn(sim)
        out = attn @ v
        out = out.transpose(1, 2).reshape(b, n, d)
        return self.to_out(out), attn


class AttentionKeepsMap(nn.Module):
    """Keeps the last attention map on the module for a hook to read."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.last_attn_map = None

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        self.last_attn_map = attn.detach()
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class TalkingHeadsAttention(nn.Module):
    """Heads are mixed by a Linear after the softmax, before the product with v."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj_l = nn.Linear(heads, heads)
        self.proj_w = nn.Linear(heads, heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = q @ k.transpose(-2, -1) * self.scale
        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        attn = attn.softmax(dim=-1)
        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class LinearAttention(nn.Module):
    """Efficient attention: softmax of q over features and of k over positions, no score matrix."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        q = q.softmax(dim=-1)
        k = k.softmax(dim=-2)
        context = einsum("bhnd,bhne->bhde", k, v)
        out = einsum("bhnd,bhde->bhne", q, context)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class MemoryCrossAttention(nn.Module):
    """Queries from the tokens, keys and values from a learned memory: always cross-attention."""

    def __init__(self, dim, num_memory=6, heads=4):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.memory = nn.Parameter(torch.randn(num_memory, dim) * 0.02)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        mem = self.memory.unsqueeze(0).expand(b, -1, -1)
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.k(mem).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
        v = self.v(mem).view(b, -1, self.heads, d // self.heads).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        probs = F.softmax(scores, dim=-1)
        probs = self.drop(probs)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, d)
        return self.out(ctx)


class EpsOutsideRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)
        return self.weight * h.type_as(x)


class GatedByContextMLP(nn.Module):
    """Gate reads the context, up reads the tokens: not one input."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, context):
        return self.down(F.silu(self.gate(context)) * self.up(x))


class ActOfProductMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x) * self.w3(x)))


class PostNormFFN(nn.Module):
    """Positive controls: Linear + GELU, and dropout + residual + LayerNorm (post-norm)."""

    def __init__(self, dim, hidden, dropout=0.1):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = self.norm(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))
        return x


class NormLookalikes(nn.Module):
    """Dropout straight into a norm, layer scale between dropout and add, dropout before GELU."""

    def __init__(self, dim, hidden, dropout=0.1):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden)
        self.act_drop = nn.Dropout(dropout)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(hidden, dim, bias=False)
        self.out_act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.norm_a = nn.LayerNorm(dim)
        self.norm_b = nn.LayerNorm(dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        h = self.fc_out(self.act(self.act_drop(self.fc_in(x))))
        h = self.out_act(h)
        y = self.norm_a(self.drop(h))
        return self.norm_b(x + self.gamma * self.drop(y))


def rotate_half_flipped(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


class FlippedRotary(nn.Module):
    """Rotates by -theta (the sign of the half rotation is flipped)."""

    def __init__(self, dim, max_len=64):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        n = x.shape[-2]
        cos, sin = self.cos[:n], self.sin[:n]
        return (x * cos) + (rotate_half_flipped(x) * sin)


class TemperatureLM(nn.Module):
    """Logits divided by a temperature before the loss, and a z-loss that reads them again."""

    def __init__(self, vocab=64, dim=32, temperature=0.7, z_loss=1e-4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.zhead = nn.Linear(dim, vocab, bias=False)
        self.temperature = temperature
        self.z_loss = z_loss

    def forward(self, idx, targets=None):
        h = torch.tanh(self.body(self.emb(idx)))
        logits = self.head(h) / self.temperature
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        zlogits = self.zhead(h)
        zloss = F.cross_entropy(zlogits.view(-1, zlogits.size(-1)), targets.view(-1))
        zloss = zloss + self.z_loss * zlogits.logsumexp(-1).pow(2).mean()
        return logits, loss + zloss


class ResidualReLUs(nn.Module):
    """One add + ReLU (positive control) and two that are not: a dropout between, inplace kwarg."""

    def __init__(self, dim):
        super().__init__()
        self.fc_a = nn.Linear(dim, dim)
        self.fc_b = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        y = F.relu(self.fc_a(x) + x)
        z = self.relu(self.drop(self.fc_b(y) + y))
        return F.relu(z + x, inplace=True)


class LookalikeZoo(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.slot = SlotAssign(dim)
        self.inter = AttendWithIntermediates(dim)
        self.keep = AttentionKeepsMap(dim)
        self.talk = TalkingHeadsAttention(dim)
        self.linear_attn = LinearAttention(dim)
        self.memory = MemoryCrossAttention(dim)
        self.eps_norm = EpsOutsideRMSNorm(dim)
        self.ctx_mlp = GatedByContextMLP(dim, 2 * dim)
        self.act_mlp = ActOfProductMLP(dim, 2 * dim)
        self.post = PostNormFFN(dim, 2 * dim)
        self.norms = NormLookalikes(dim, 2 * dim)
        self.rot = FlippedRotary(dim)
        self.relus = ResidualReLUs(dim)

    def forward(self, x):
        x = self.slot(x)
        out, _attn = self.inter(x)
        x = x + out
        x = x + self.keep(x) + self.talk(x) + self.linear_attn(x) + self.memory(x)
        x = self.eps_norm(x)
        x = x + self.ctx_mlp(x, x.flip(1)) + self.act_mlp(x)
        x = self.post(x)
        x = self.norms(x)
        x = self.rot(x)
        return self.relus(x)
