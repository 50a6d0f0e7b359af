# Gated MLPs (SwiGLU / GeGLU) in the spellings LLM code uses. ACT2FN[config.hidden_act] without a
# sibling configuration_*.py cannot be settled from the source: conditional (needs-config).
# expect: gated_MLP LlamaLikeMLP.forward conditional:needs-config
# expect: gated_MLP UpFirstMLP.forward
# expect: gated_MLP SplitStatementsMLP.forward
# expect: gated_MLP GateUpThenActMLP.forward
# expect: gated_MLP FunctionalSiLU.forward
# expect: gated_MLP FunctionalGeLUTanh.forward
# expect: gated_MLP ModuleGeLU.forward
# expect: gated_MLP TransformersSiLU.forward
# expect: gated_MLP LiteralSiLUKey.forward
# expect: gated_MLP InlineLookup.forward conditional:needs-config
# The biased Linear + nn.GELU inside ModuleGeLU is the gate of its gated MLP: no biased_GeLU match
# (the gated MLP supersedes it).
import torch.nn.functional as F
from adopter.kernels import gated_mlp
from torch import nn
from transformers.activations import ACT2FN, SiLUActivation


class LlamaLikeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class UpFirstMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act, x)


class SplitStatementsMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)
        self.w3 = nn.Linear(d, h)
        self.act = nn.SiLU()

    def forward(self, hidden_states):
        return gated_mlp(self.w1, self.w3, self.w2, self.act, hidden_states)


class GateUpThenActMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return gated_mlp(self.gate, self.up, self.down, F.silu, x)


class FunctionalSiLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)

    def forward(self, x):
        return gated_mlp(self.w1, self.w3, self.w2, F.silu, x)


class FunctionalGeLUTanh(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.wi_0 = nn.Linear(d, h, bias=False)
        self.wi_1 = nn.Linear(d, h, bias=False)
        self.wo = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return gated_mlp(self.wi_0, self.wi_1, self.wo, F.gelu, x, approximate="tanh")


class ModuleGeLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h)
        self.up_proj = nn.Linear(d, h)
        self.down_proj = nn.Linear(h, d)
        self.act = nn.GELU()

    def forward(self, x):
        return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act, x)


class TransformersSiLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act = SiLUActivation()

    def forward(self, x):
        return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act, x)


class LiteralSiLUKey(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act = ACT2FN["silu"]

    def forward(self, x):
        return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act, x)


class InlineLookup(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(ACT2FN[self.config.hidden_act](self.gate_proj(x)) * self.up_proj(x))
