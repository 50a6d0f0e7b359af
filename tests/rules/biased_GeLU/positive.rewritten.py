# expect: biased_GeLU BertIntermediate.forward conditional:needs-config
# expect: biased_GeLU TorchGelu.forward
# expect: biased_GeLU FunctionalGelu.forward
# expect: biased_GeLU KnownKey.forward
# expect: biased_GeLU Mlp.forward
# expect: biased_GeLU FeedForwardOverridden.forward conditional:needs-config
import torch
from torch import nn
import torch.nn.functional as F

from transformers.activations import ACT2FN, NewGELUActivation
from adopter.kernels import linear_gelu


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        if isinstance(config.hidden_act, str):
            self.intermediate_act_fn = ACT2FN[config.hidden_act]
        else:
            self.intermediate_act_fn = config.hidden_act

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


class TorchGelu(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()

    def forward(self, x):
        return linear_gelu(self.fc, self.act, x)


class FunctionalGelu(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d, bias=True)

    def forward(self, x):
        h = linear_gelu(self.fc1, F.gelu, x)
        return h


class KnownKey(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = ACT2FN["gelu_new"]

    def forward(self, x):
        return linear_gelu(self.fc, self.act, x)


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.act = NewGELUActivation()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = linear_gelu(self.c_fc, self.act, x)
        return self.c_proj(x)


class FeedForwardOverridden(nn.Module):
    # the default is relu, but a caller passes its own activation: unknown statically, so a
    # conditional match (needs-config: a trace settles it)
    def __init__(self, d, activation: str = "relu"):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = ACT2FN[activation]

    def forward(self, x):
        return self.act(self.fc(x))


def build(config):
    return FeedForwardOverridden(8, activation=config.hidden_act)
