"""Recurrent LMs without attention, as mamba-minimal / RWKV-LM write them: Mamba's ``RMSNorm``
without an upcast, a gated ``RMSNormGated``, ``MambaBlock`` (packed ``in_proj`` split into x and
z, depthwise ``Conv1d``, ``x_proj``/``dt_proj``, a sequential selective scan, ``y * F.silu(z)``
into ``out_proj``), RWKV-4 time-mix (token shift, key/value/receptance of three different mixes,
a WKV loop) and channel-mix (squared ReLU, sigmoid receptance), and both LMs with a tied or
untied head and a cross entropy."""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MambaArgs:
    d_model: int = 32
    n_layer: int = 2
    vocab_size: int = 96
    d_state: int = 8
    expand: int = 2
    d_conv: int = 4

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.d_model / 16)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RMSNormGated(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x, z):
        dtype = x.dtype
        x = x.to(torch.float32) * F.silu(z.to(torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MambaBlock(nn.Module):
    def __init__(self, args: MambaArgs, gated_norm: bool = False):
        super().__init__()
        self.args = args
        self.in_proj = nn.Linear(args.d_model, args.d_inner * 2, bias=False)
        self.conv1d = nn.Conv1d(args.d_inner, args.d_inner, kernel_size=args.d_conv, groups=args.d_inner,
                                padding=args.d_conv - 1)
        self.x_proj = nn.Linear(args.d_inner, args.dt_rank + args.d_state * 2, bias=False)
        self.dt_proj = nn.Linear(args.dt_rank, args.d_inner, bias=True)
        A = torch.arange(1, args.d_state + 1).repeat(args.d_inner, 1).float()
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(args.d_inner))
        self.out_proj = nn.Linear(args.d_inner, args.d_model, bias=False)
        self.norm = RMSNormGated(args.d_inner) if gated_norm else None

    def forward(self, x):
        b, l, d = x.shape
        x_and_res = self.in_proj(x)
        x, res = x_and_res.split(split_size=[self.args.d_inner, self.args.d_inner], dim=-1)
        x = x.transpose(1, 2)
        x = self.conv1d(x)[:, :, :l]
        x = x.transpose(1, 2)
        x = F.silu(x)
        y = self.ssm(x)
        if self.norm is not None:
            return self.out_proj(self.norm(y, res))
        y = y * F.silu(res)
        return self.out_proj(y)

    def ssm(self, x):
        d_in, n = self.A_log.shape
        A = -torch.exp(self.A_log.float())
        x_dbl = self.x_proj(x)
        delta, B, C = x_dbl.split(split_size=[self.args.dt_rank, n, n], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        return self.selective_scan(x, delta, A, B, C, self.D.float())

    def selective_scan(self, u, delta, A, B, C, D):
        b, l, d_in = u.shape
        deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
        state = torch.zeros((b, d_in, A.shape[1]), device=deltaA.device)
        ys = []
        for i in range(l):
            state = deltaA[:, i] * state + deltaB_u[:, i]
            ys.append(torch.einsum("bdn,bn->bd", state, C[:, i, :]))
        y = torch.stack(ys, dim=1)
        return y + u * D


class ResidualBlock(nn.Module):
    def __init__(self, args: MambaArgs, gated_norm: bool = False):
        super().__init__()
        self.mixer = MambaBlock(args, gated_norm)
        self.norm = RMSNorm(args.d_model)

    def forward(self, x):
        return self.mixer(self.norm(x)) + x


class Mamba(nn.Module):
    def __init__(self, args: Optional[MambaArgs] = None):
        super().__init__()
        self.args = args = args or MambaArgs()
        self.embedding = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = nn.ModuleList([ResidualBlock(args, gated_norm=i % 2 == 1) for i in range(args.n_layer)])
        self.norm_f = RMSNorm(args.d_model)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, input_ids, labels: Optional[torch.Tensor] = None):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm_f(x)
        logits = self.lm_head(x)
        if labels is None:
            return logits
        shift_logits = logits[:, :-1, :].contiguous()
        shift_labels = labels[:, 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return logits, loss


class RWKVTimeMix(nn.Module):
    def __init__(self, n_embd: int, layer_id: int, n_layer: int):
        super().__init__()
        ratio = 1.0 - layer_id / n_layer
        x = torch.arange(n_embd).float()[None, None, :] / n_embd
        self.time_decay = nn.Parameter(-5 + 8 * (torch.arange(n_embd) / max(n_embd - 1, 1)) ** 0.7)
        self.time_first = nn.Parameter(torch.ones(n_embd) * math.log(0.3))
        self.time_mix_k = nn.Parameter(torch.pow(x, ratio))
        self.time_mix_v = nn.Parameter(torch.pow(x, ratio) + 0.3 * ratio)
        self.time_mix_r = nn.Parameter(torch.pow(x, 0.5 * ratio))
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.output = nn.Linear(n_embd, n_embd, bias=False)

    def wkv(self, w, u, k, v):
        b, t, c = k.shape
        aa = torch.zeros(b, c, device=k.device)
        bb = torch.zeros(b, c, device=k.device)
        pp = torch.full((b, c), -1e38, device=k.device)
        out = []
        for i in range(t):
            kk, vv = k[:, i], v[:, i]
            ww = u + kk
            p = torch.maximum(pp, ww)
            e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
            out.append((e1 * aa + e2 * vv) / (e1 * bb + e2))
            ww = pp - torch.exp(w)
            p = torch.maximum(ww, kk)
            e1, e2 = torch.exp(ww - p), torch.exp(kk - p)
            aa, bb, pp = e1 * aa + e2 * vv, e1 * bb + e2, p
        return torch.stack(out, dim=1)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xv = x * self.time_mix_v + xx * (1 - self.time_mix_v)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = self.key(xk)
        v = self.value(xv)
        r = self.receptance(xr)
        sr = torch.sigmoid(r)
        rwkv = sr * self.wkv(self.time_decay, self.time_first, k, v)
        return self.output(rwkv)


class RWKVChannelMix(nn.Module):
    def __init__(self, n_embd: int, layer_id: int, n_layer: int):
        super().__init__()
        ratio = 1.0 - layer_id / n_layer
        x = torch.arange(n_embd).float()[None, None, :] / n_embd
        self.time_mix_k = nn.Parameter(torch.pow(x, ratio))
        self.time_mix_r = nn.Parameter(torch.pow(x, ratio))
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        hidden = 4 * n_embd
        self.key = nn.Linear(n_embd, hidden, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = self.key(xk)
        k = torch.square(torch.relu(k))
        kv = self.value(k)
        return torch.sigmoid(self.receptance(xr)) * kv


class RWKVBlock(nn.Module):
    def __init__(self, n_embd: int, layer_id: int, n_layer: int, dropout: float = 0.0):
        super().__init__()
        self.layer_id = layer_id
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(n_embd)
        self.att = RWKVTimeMix(n_embd, layer_id, n_layer)
        self.ffn = RWKVChannelMix(n_embd, layer_id, n_layer)
        self.drop0 = nn.Dropout(dropout)
        self.drop1 = nn.Dropout(dropout)

    def forward(self, x):
        if self.layer_id == 0:
            x = self.ln0(x)
        x = self.drop0(x + self.att(self.ln1(x)))
        x = self.drop1(x + self.ffn(self.ln2(x)))
        return x


class RWKV(nn.Module):
    def __init__(self, vocab_size: int = 96, n_embd: int = 32, n_layer: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.Sequential(*[RWKVBlock(n_embd, i, n_layer) for i in range(n_layer)])
        self.ln_out = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets: Optional[torch.Tensor] = None):
        x = self.emb(idx)
        x = self.blocks(x)
        x = self.ln_out(x)
        x = self.head(x)
        if targets is None:
            return x
        loss = F.cross_entropy(x.view(-1, x.size(-1)), targets.view(-1))
        return x, loss
