# q/k/v projections of one tensor, each module used only at its call: fusable.
# expect: fused_QKV SelfAttention.forward
# expect: fused_QKV GuardedAttention.forward
import torch
from adopter.kernels import qkv
from torch import nn


def is_fast_path_available():
    return False


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        # self.key in a comment does not count as a use
        q, k, v = qkv(self.query, self.key, self.value, hidden_states)
        return self.out(q * k + v)

    def extra_repr(self):
        return f"heads={self.num_heads}"


if is_fast_path_available():
    GuardedAttention = None
else:

    class GuardedAttention(nn.Module):
        """Defined inside an ``if``/``else`` at module level (xLSTM style)."""

        def __init__(self, d):
            super().__init__()
            self.q = nn.Linear(d, d)
            self.k = nn.Linear(d, d)
            self.v = nn.Linear(d, d)

        def forward(self, x):
            q_output, k_output, v_output = qkv(self.q, self.k, self.v, x)
            return torch.cat([q_output, k_output, v_output], dim=-1)
