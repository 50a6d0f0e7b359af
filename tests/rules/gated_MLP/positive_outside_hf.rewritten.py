# Gated MLPs as written outside HuggingFace (issue 24): Meta-llama's FeedForward, litgpt's LLaMAMLP,
# Phi-3's packed gate_up projection split by .chunk, GeGLU code that unpacks the gate second,
# xformers-style .split / torch.chunk / torch.split, Linears built by same-file factories (one that
# may return a LoRA layer: conditional), a same-file Linear subclass that only fixes __init__.
# expect: gated_MLP FeedForward.forward
# expect: gated_MLP LLaMAMLP.forward
# expect: gated_MLP Phi3MLP.forward
# expect: gated_MLP GeGLUFeedForward.forward
# expect: gated_MLP SwiGLUSplit.forward
# expect: gated_MLP TorchChunkSwiGLU.forward
# expect: gated_MLP TorchSplitGeGLU.forward
# expect: gated_MLP FactoryMLP.forward
# expect: gated_MLP LoRAFactoryMLP.forward conditional:needs-config
# expect: gated_MLP NoBiasLinearMLP.forward
# expect: gated_MLP BiasedGeGLU.forward
# The gate of BiasedGeGLU is a biased Linear + GeLU: no biased_GeLU match there (the gated MLP fuses
# it). In GateKeptGeGLU the activated gate is returned too, so there is no gated MLP, and the
# Linear + GeLU is biased_GeLU's again.
# expect: biased_GeLU GateKeptGeGLU.forward
import torch
import torch.nn.functional as F
from adopter.kernels import gated_mlp, gated_mlp_packed
from torch import nn


class FeedForward(nn.Module):
    """Meta-llama (llama/model.py) with plain nn.Linear in place of the fairscale parallel layers."""

    def __init__(self, dim: int, hidden_dim: int, multiple_of: int = 16):
        super().__init__()
        hidden_dim = multiple_of * ((int(2 * hidden_dim / 3) + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return gated_mlp(self.w1, self.w3, self.w2, F.silu, x)


class LLaMAMLP(nn.Module):
    """litgpt's LLaMAMLP: two statements for the projections, the product on its own line."""

    def __init__(self, n_embd: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.fc_1 = nn.Linear(n_embd, intermediate_size, bias=bias)
        self.fc_2 = nn.Linear(n_embd, intermediate_size, bias=bias)
        self.proj = nn.Linear(intermediate_size, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.fc_1, self.fc_2, self.proj, torch.nn.functional.silu, x)


class Phi3MLP(nn.Module):
    """Phi-3: one gate_up projection, chunked; the up half is named like the projection's output."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_mlp_packed(
            self.gate_up_proj,
            self.down_proj,
            self.activation_fn,
            hidden_states,
            chunks=2,
            dim=-1,
            gate=0,
        )


class GeGLUFeedForward(nn.Module):
    """x-transformers / diffusers GeGLU: the gate is the *second* half."""

    def __init__(self, dim: int, inner_dim: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, inner_dim * 2)
        self.proj_out = nn.Linear(inner_dim, dim)

    def forward(self, x):
        return gated_mlp_packed(
            self.proj_in, self.proj_out, F.gelu, x, chunks=2, dim=-1, gate=1, approximate="tanh"
        )


class SwiGLUSplit(nn.Module):
    """xformers-style SwiGLU: .split with the hidden width."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.w12 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return gated_mlp_packed(self.w12, self.w3, F.silu, x, split=self.hidden, dim=-1, gate=0)


class TorchChunkSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return gated_mlp_packed(self.w12, self.w3, F.silu, x, chunks=2, dim=-1, gate=0)


class TorchSplitGeGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.wi = nn.Linear(dim, 2 * hidden)
        self.wo = nn.Linear(hidden, dim)
        self.act = nn.GELU()

    def forward(self, x):
        return gated_mlp_packed(
            self.wi, self.wo, self.act, x, split=[self.hidden, self.hidden], dim=-1, gate=1
        )


class LoRALinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, r: int = 4, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_a = nn.Parameter(torch.zeros(r, in_features))
        self.lora_b = nn.Parameter(torch.zeros(out_features, r))

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def make_linear(in_features: int, out_features: int, lora: bool = False):
    return LoRALinear(in_features, out_features) if lora else nn.Linear(in_features, out_features, bias=False)


def linear(in_features: int, out_features: int):
    return nn.Linear(in_features, out_features, bias=False)


class FactoryMLP(nn.Module):
    """Linears from a factory that always returns nn.Linear."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = linear(dim, hidden)
        self.w2 = linear(hidden, dim)
        self.w3 = linear(dim, hidden)

    def forward(self, x):
        return gated_mlp(self.w1, self.w3, self.w2, F.silu, x)


class LoRAFactoryMLP(nn.Module):
    """Linears from a factory that returns a LoRA layer under a flag: conditional, a trace settles it."""

    def __init__(self, dim: int, hidden: int, lora: bool = False):
        super().__init__()
        self.w1 = make_linear(dim, hidden, lora)
        self.w2 = make_linear(hidden, dim, lora)
        self.w3 = make_linear(dim, hidden, lora)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class NoBiasLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)


class NoBiasLinearMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = NoBiasLinear(dim, hidden)
        self.up = NoBiasLinear(dim, hidden)
        self.down = NoBiasLinear(hidden, dim)

    def forward(self, x):
        return gated_mlp(self.gate, self.up, self.down, F.silu, x)


class BiasedGeGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.wi_0 = nn.Linear(dim, hidden)
        self.wi_1 = nn.Linear(dim, hidden)
        self.wo = nn.Linear(hidden, dim)

    def forward(self, x):
        return gated_mlp(self.wi_0, self.wi_1, self.wo, F.gelu, x)


class GateKeptGeGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.wi_0 = nn.Linear(dim, hidden)
        self.wi_1 = nn.Linear(dim, hidden)
        self.wo = nn.Linear(hidden, dim)

    def forward(self, x):
        hidden_gelu = F.gelu(self.wi_0(x))
        out = self.wo(hidden_gelu * self.wi_1(x))
        return out, hidden_gelu
