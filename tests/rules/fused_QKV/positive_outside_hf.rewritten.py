# q/k/v projections written outside HuggingFace: sizes read from an argument object (a dataclass of
# model arguments), grouped-query k/v narrower than q, and an ``init_weights``/``reset_parameters``
# method that re-initialises the projections' parameters (torchtitan, lit-style trainers). Such
# uses leave the three modules what the fused call reads, so they do not keep the match out.
# expect: fused_QKV GroupedQueryAttention.forward
# expect: fused_QKV ResetAttention.forward
# expect: fused_QKV WeightInitAttention.forward
# expect: sdpa_attention ResetAttention.forward
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from adopter.kernels import qkv
from torch import nn


@dataclass
class Args:
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2


class GroupedQueryAttention(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, std: float = 0.02):
        for proj in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(proj.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = qkv(self.wq, self.wk, self.wv, x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        xk = xk.repeat_interleave(rep, dim=1)
        xv = xv.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class ResetAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        self.to_q.reset_parameters()
        self.to_k.bias.data.zero_()
        self.to_v.weight.normal_(0.0, 0.02)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = qkv(self.to_q, self.to_k, self.to_v, x)
        q = q.view(b, n, self.heads, -1).transpose(1, 2)
        k = k.view(b, n, self.heads, -1).transpose(1, 2)
        v = v.view(b, n, self.heads, -1).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class WeightInitAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim // 2, bias=False)
        self.v_proj = nn.Linear(dim, dim // 2, bias=False)

    def _init_weights(self):
        with torch.no_grad():
            torch.nn.init.xavier_uniform_(self.q_proj.weight)
            torch.nn.init.xavier_uniform_(self.k_proj.weight, gain=0.5)
            self.v_proj.weight.data.uniform_(-0.1, 0.1)

    def forward(self, hidden):
        query, key, value = qkv(self.q_proj, self.k_proj, self.v_proj, hidden)
        return query, key, value
