"""rotary_embedding: a rotation applied inside an ``if`` block, each line with its comment above it;
the inline halves' statements go, every comment stays where it was."""
import torch
from adopter.kernels import rotary
from torch import nn


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, use_rotary=True):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.use_rotary = use_rotary

# expect: rotary_embedding Attention.forward
# expect: rotary_embedding Attention.forward
# expect: sdpa_attention Attention.forward
    def forward(self, x, cos, sin):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.use_rotary:
            # split the keys into halves
            # rotate the keys
            k = rotary(k, cos, sin)
            # rotate the queries
            q = rotary(q, cos, sin, rotate_half)  # (b, s, d)
        return (q @ k.transpose(-1, -2)).softmax(dim=-1) @ v
