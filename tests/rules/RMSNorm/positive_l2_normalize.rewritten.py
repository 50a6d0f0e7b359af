# x-transformers' RMSNorm, F.normalize scaled back to an RMS: rewritten to the guarded scaled L2
# norm, which divides by max(||x||_2, eps) as F.normalize does and multiplies by the source's own
# factors, in its order, read at every call. Written for this fixture; the spellings vary the
# factors (none, scale only, gamma before scale, an offset gamma), the eps and the casts.
# expect: RMSNorm RMSNorm.forward
# expect: RMSNorm SimpleRMSNorm.forward
# expect: RMSNorm GammaFirstRMSNorm.forward
# expect: RMSNorm CastRMSNorm.forward
# expect: RMSNorm OffsetRMSNorm.forward
# expect: RMSNorm LeftScaledRMSNorm.forward
import torch
import torch.nn.functional as F
from adopter.kernels import scaled_l2_norm
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return scaled_l2_norm(x, self.scale, self.gamma)


class SimpleRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5

    def forward(self, x):
        return scaled_l2_norm(x, self.scale)


class GammaFirstRMSNorm(nn.Module):
    """The gamma multiplies first; the scale is not sqrt(d) here."""

    def __init__(self, dim, scale=4.0):
        super().__init__()
        self.scale = scale
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return scaled_l2_norm(x, self.g, self.scale)


class CastRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.scale = dim ** 0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return scaled_l2_norm(x, self.g, self.scale, eps=self.eps, upcast=True, cast_back=True)


class OffsetRMSNorm(nn.Module):
    """A zero-initialized gamma with a unit offset."""

    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return scaled_l2_norm(x, self.scale, (self.gamma + 1.0), eps=1e-6)


class LeftScaledRMSNorm(nn.Module):
    """Scale and gamma multiplied together first, then the normalized input."""

    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return scaled_l2_norm(x, (self.scale * self.gamma))
