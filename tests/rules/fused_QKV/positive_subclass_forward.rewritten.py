"""fused_QKV: a subclass overrides forward (an SDPA path) over the projections its base builds; each
method calls the three once on one input, so each is a site, and neither keeps the other out."""
# expect: fused_QKV EagerSelfAttention.forward
# expect: fused_QKV SdpaSelfAttention.forward
# expect: sdpa_attention EagerSelfAttention.forward
import math

import torch
import torch.nn.functional as F
from adopter.kernels import qkv
from torch import nn


class EagerSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def split(self, t):
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, hidden_states):
        query_output, key_output, value_output = qkv(
            self.query, self.key, self.value, hidden_states
        )
        q = self.split(query_output)
        k = self.split(key_output)
        v = self.split(value_output)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).flatten(2)


class SdpaSelfAttention(EagerSelfAttention):
    def forward(self, hidden_states):
        query_output, key_output, value_output = qkv(
            self.query, self.key, self.value, hidden_states
        )
        q = self.split(query_output)
        k = self.split(key_output)
        v = self.split(value_output)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

