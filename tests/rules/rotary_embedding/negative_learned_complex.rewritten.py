"""Complex products that are no rotary embedding: the factor multiplying the complex view is a
learned weight (a spectral / complex-valued channel mix), not unit-modulus angles built from the
positions. Not a match, whatever the product looks like; the position-built factor next to them
(a buffer, an argument) still is."""
import torch
import torch.nn as nn
from adopter.kernels import rotary_complex
from torch.nn import Parameter


class ComplexChannelMix(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim // 2, dtype=torch.cfloat))

    def forward(self, x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.weight).flatten(-2)


class RealPairsWeight(nn.Module):
    """The weight stored as real pairs and viewed as complex at the product."""

    def __init__(self, dim=16):
        super().__init__()
        self.filt = Parameter(torch.randn(dim // 2, 2))

    def forward(self, x):
        w = torch.view_as_complex(self.filt)
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(w * xc).flatten(-2)


class RegisteredParameter(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.register_parameter("gain", nn.Parameter(torch.ones(dim // 2, dtype=torch.cfloat)))

    def forward(self, x):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.gain[None]).flatten(-2)


# expect: rotary_embedding PositionsBuffer.forward
class PositionsBuffer(nn.Module):
    """The rotation: unit-modulus factors built from the positions, kept in a buffer."""

    def __init__(self, dim=16, max_len=32):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return rotary_complex(xc, self.freqs_cis[: x.shape[1]]).flatten(-2).type_as(x)
