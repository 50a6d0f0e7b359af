"""softmax bound with functools.partial: in __init__ (nested: keywords merged), at module level,
as a parameter's default, made inside a lambda; the rewrite makes the partial's function the
kernel where the partial is made."""
import functools
from functools import partial

import torch
import torch.nn.functional as F
from adopter.kernels import softmax
from torch import nn

attend = partial(softmax, dim=-1)
attend_fp32 = functools.partial(attend, dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.attn_fn = partial(partial(softmax, dim=-1), dtype=torch.float32)

# expect: softmax Attention.forward
# expect: sdpa_attention Attention.forward refused:probs-dtype
    def forward(self, x):
        sim = self.proj(x) @ x.transpose(-1, -2)
        return self.attn_fn(sim).type(sim.dtype) @ x


class Gate(nn.Module):
    def __init__(self, dim, normalize=partial(softmax, dim=-1)):  # noqa: B008 (the form under test)
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.normalize = normalize

# expect: softmax Gate.forward
    def forward(self, x):
        return x * self.normalize(self.proj(x))


class Pool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

# expect: softmax Pool.forward
# expect: softmax Pool.forward
    def forward(self, x):
        return attend(self.proj(x)) + attend_fp32(x)


class LambdaAttend(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
# expect: softmax LambdaAttend.__init__
        self.attend = lambda t: partial(softmax, dim=-1)(t)

    def forward(self, x):
        return self.attend(self.proj(x))
