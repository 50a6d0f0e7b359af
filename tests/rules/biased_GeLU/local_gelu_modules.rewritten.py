# Same-file modules whose forward is a GeLU of their input (LXMERT's GeLU, BLOOM's BloomGelu).
# expect: biased_GeLU AnswerHead.__init__
# expect: biased_GeLU BloomLikeMLP.forward
# expect: biased_GeLU ErfFormulaMLP.forward
# expect: biased_GeLU TanhFunctionalMLP.forward
# expect: biased_GeLU EsmLikeIntermediate.forward
import math

import torch
from adopter.kernels import GuardedSequential
from torch import nn

from transformers.activations import gelu


class GeLU(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return gelu(x)


class AnswerHead(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.logit_fc = GuardedSequential(
            nn.Linear(d, d * 2), GeLU(), nn.LayerNorm(d * 2), nn.Linear(d * 2, n)
        )

    def forward(self, hidden_states):
        return self.logit_fc(hidden_states)


def tanh_gelu_forward(x):
    """tanh approximation, constants as in Megatron."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def tanh_gelu_back(g, x):
    x = x[0]
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return tanh_gelu_forward(input)

    @staticmethod
    def backward(ctx, grad_output):
        input = ctx.saved_tensors
        tmp = tanh_gelu_back(grad_output, input)
        return tmp


class BloomLikeGelu(nn.Module):
    """Partly copied from Megatron-DeepSpeed."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return GeLUFunction.apply(x)


class BloomLikeMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(d, 4 * d)
        self.gelu_impl = BloomLikeGelu()
        self.dense_4h_to_h = nn.Linear(4 * d, d)

    def forward(self, hidden_states):
        hidden_states = self.gelu_impl(self.dense_h_to_4h(hidden_states))
        return self.dense_4h_to_h(hidden_states)


class ErfGelu(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class ErfFormulaMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = ErfGelu()

    def forward(self, x):
        return self.act(self.fc(x))


class TanhGelu(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(x, approximate="tanh")


class TanhFunctionalMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = TanhGelu()

    def forward(self, x):
        h = self.fc(x)
        return self.act(h)


def erf_gelu(x):
    """ESM's gelu: the exact GeLU written out."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class EsmLikeIntermediate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.dense = nn.Linear(d, 4 * d)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = erf_gelu(hidden_states)
        return hidden_states
