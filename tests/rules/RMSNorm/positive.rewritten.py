# RMSNorm forms the library writes, each recognized and rewritten with the keywords naming it.
# expect: RMSNorm LlamaRMSNorm.forward
# expect: RMSNorm TypeAsRMSNorm.forward
# expect: RMSNorm SpelledRMSNorm.forward
# expect: RMSNorm Olmo2RMSNorm.forward
# expect: RMSNorm HeliumRMSNorm.forward
# expect: RMSNorm GemmaRMSNorm.forward
# expect: RMSNorm Llama4TextRMSNorm.forward
# expect: RMSNorm T5LayerNorm.forward
import torch
from adopter.kernels import rms_norm
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class TypeAsRMSNorm(nn.Module):
    """Llama's form with the cast back spelled ``type_as`` and the operands swapped."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.scale, self.eps)


class SpelledRMSNorm(nn.Module):
    """``** 2``, ``torch.mean(..., dim=-1)`` and a literal eps."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, 1e-6)


class Olmo2RMSNorm(nn.Module):
    """The weight multiplies the float32 value, then the product is cast back."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return rms_norm(
            hidden_states, self.weight, self.variance_epsilon, weight_before_cast=True
        )


class HeliumRMSNorm(nn.Module):
    """OLMo-2's order with the weight cast to float32 first."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return rms_norm(
            hidden_states,
            self.weight,
            self.variance_epsilon,
            weight_fp32=True,
            weight_before_cast=True,
        )


class GemmaRMSNorm(nn.Module):
    """Gemma: ``(1 + weight)`` in float32, the normalization in a helper."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
        return rms_norm(
            x,
            self.weight,
            self.eps,
            offset=1.0,
            weight_fp32=True,
            weight_before_cast=True,
        )


class Llama4TextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        # T5 uses a layer_norm which only scales and doesn't shift
        # convert into half-precision if necessary
        return rms_norm(
            hidden_states, self.weight, self.variance_epsilon, cast_to_half_weight=True
        )
