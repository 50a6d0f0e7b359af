"""Look-alikes: linear layers followed by activations that are not a provable GeLU, TorchScript
helpers, and softmaxes over a non-last dimension."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_act(name: str) -> nn.Module:
    """Activation module by its torch.nn class name ("GELU", "SiLU", ...)."""
    return getattr(nn, name)()


ACT2FN = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "swish": nn.SiLU}


class EncoderConfig:
    def __init__(self, hidden_size=16, intermediate_size=32, hidden_act="silu"):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act


@torch.jit.script
def bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


@torch.jit.script
def masked_softmax(scores, mask):
    scores = scores.masked_fill(mask, -10000.0)
    return torch.softmax(scores, dim=-1)


class NamedActMLP(nn.Module):
    def __init__(self, dim, hidden, act_name: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = get_act(act_name)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ConfigActMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACT2FN[cfg.hidden_act]()
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        h = self.up(x)
        h = self.act(h)
        return self.down(h)


class ReluMlp(nn.Module):
    def __init__(self, in_features, hidden_features, act_layer=nn.ReLU, drop=0.):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop(x)
        x = self.fc2(x)
        return x


class MegatronStyleMLP(nn.Module):
    """Bias kept outside the Linear and fused with GeLU by a TorchScript helper."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(dim, hidden, bias=False)
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.dense_4h_to_h = nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.dense_h_to_4h(x)
        h = bias_gelu(self.bias, h)
        return self.dense_4h_to_h(h)


class GeGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


class ScriptedMaskAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qk = nn.Linear(dim, 2 * dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-2, -1) * self.scale
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        probs = masked_softmax(scores, mask)
        return probs @ x


class LinearAttention(nn.Module):
    """Softmax-kernel linear attention: queries normalised over features, keys over positions."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q = q.reshape(b, n, h, d // h).transpose(1, 2)
        k = k.reshape(b, n, h, d // h).transpose(1, 2)
        v = v.reshape(b, n, h, d // h).transpose(1, 2)
        q = q.softmax(dim=-1)
        k = k.softmax(dim=-2)
        context = k.transpose(-2, -1) @ v
        out = q @ context
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class LookalikeActsNet(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.a = NamedActMLP(dim, 32, "SiLU")
        self.b = ConfigActMLP(EncoderConfig(hidden_size=dim))
        self.c = ReluMlp(dim, 32)
        self.d = MegatronStyleMLP(dim, 32)
        self.e = GeGLU(dim, 32)
        self.f = ScriptedMaskAttention(dim)
        self.g = LinearAttention(dim)

    def forward(self, x):
        x = self.d(self.c(self.b(self.a(x))))
        x = self.e(x)
        x = self.f(x)
        return self.g(x)
