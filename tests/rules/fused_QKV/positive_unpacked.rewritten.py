"""fused_QKV: the three projections unpacked from one tuple, in any order, with comments around."""
import torch
from adopter.kernels import qkv
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)

# expect: fused_QKV Attention.forward
# expect: softmax Attention.forward
    def forward(self, x):
        # queries, keys and values in one go
        q, k, v = qkv(self.to_q, self.to_k, self.to_v, x)  # (b, n, d) each
        return torch.einsum("b i d, b j d -> b i j", q, k).softmax(dim=-1) @ v


class ValueFirst(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

# expect: fused_QKV ValueFirst.forward
    def forward(self, hidden):
        if hidden.dim() == 3:
            # the value first: unpacked by position, not by name
            queries, keys, values = qkv(self.query, self.key, self.value, hidden)
            return queries + keys + values
        return hidden
