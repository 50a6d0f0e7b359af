# Linear + GeLU written outside HuggingFace: an nn.Sequential of an OrderedDict whose entries are
# built in a list under if/else, a GeLU through a same-class helper method, the MLP of an
# nn.ModuleDict called through a lambda bound in __init__ (minGPT) or by key.
# expect: biased_GeLU ProjectionHead.__init__
# expect: biased_GeLU HelperMethodMLP.forward
# expect: biased_GeLU InheritedHelperMLP.forward
# expect: biased_GeLU TanhHelperMLP.forward
# expect: biased_GeLU LambdaBlock.__init__
# expect: biased_GeLU KeyedBlock.forward
from collections import OrderedDict

import torch
import torch.nn.functional as F
from adopter.kernels import GuardedSequential, linear_gelu
from torch import nn


class ProjectionHead(nn.Module):
    def __init__(self, dim: int, hidden: int, norm: bool = False):
        super().__init__()
        if norm:
            layers = [("fc", nn.Linear(dim, hidden)), ("act", nn.GELU()), ("norm", nn.LayerNorm(hidden))]
        else:
            layers = [("fc", nn.Linear(dim, hidden)), ("act", nn.GELU())]
        layers.append(("out", nn.Linear(hidden, dim)))
        self.net = GuardedSequential(OrderedDict(layers))

    def forward(self, x):
        return self.net(x)


class HelperMethodMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def gelu(self, x):
        """the activation, overridable by subclasses"""
        return F.gelu(x)

    def forward(self, x):
        h = linear_gelu(self.fc1, (F.gelu if type(self).gelu is HelperMethodMLP.gelu else self.gelu), x)
        return self.fc2(h)


class QuickGeluMLP(HelperMethodMLP):
    """Overrides the helper: the rewritten parent forward must run this one."""

    def gelu(self, x):
        return x * torch.sigmoid(1.702 * x)


class InheritedHelperMLP(HelperMethodMLP):
    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden)
        self.up = nn.Linear(dim, hidden)

    def forward(self, x):
        return self.fc2(
            linear_gelu(self.up, (F.gelu if type(self).gelu is HelperMethodMLP.gelu else self.gelu), x)
        )


class TanhHelperMLP(nn.Module):
    """A tanh GeLU helper: matched, but the kernel would not recognize the method (left as is)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def act(self, x):
        return F.gelu(x, approximate="tanh")

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class LambdaBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(dim, 4 * dim), c_proj=nn.Linear(4 * dim, dim), act=nn.GELU()))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(linear_gelu(m.c_fc, m.act, x))

    def forward(self, x):
        return x + self.mlpf(self.ln(x))


class KeyedBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.ModuleDict({"fc": nn.Linear(dim, 4 * dim), "act": nn.GELU(approximate="tanh"),
                                  "proj": nn.Linear(4 * dim, dim)})

    def forward(self, x):
        return x + self.mlp["proj"](linear_gelu(self.mlp["fc"], self.mlp["act"], x))
