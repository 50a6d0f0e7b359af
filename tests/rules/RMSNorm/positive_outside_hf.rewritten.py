# RMSNorm as written outside HuggingFace (issue 24): litgpt's ``x * x`` with a ``dim`` attribute and
# a unit-offset branch, Meta-llama/torchtitan's ``_norm`` helper, same-file hierarchies, the cast
# back spelled ``.to(x.dtype)``, and norms that keep the input dtype (no float32 upcast).
# expect: RMSNorm LitGPTRMSNorm.forward
# expect: RMSNorm LitGPTScaleRMSNorm.forward
# expect: RMSNorm AssignedOffsetRMSNorm.forward
# expect: RMSNorm MetaLlamaRMSNorm.forward
# expect: RMSNorm HelperInBaseRMSNorm.forward
# expect: RMSNorm OwnForwardRMSNorm.forward
# expect: RMSNorm ToDtypeRMSNorm.forward
# expect: RMSNorm NegatedBranchRMSNorm.forward
# expect: RMSNorm NoUpcastRMSNorm.forward
# expect: RMSNorm NoUpcastSquareRMSNorm.forward
import torch
import torch.nn as nn
from adopter.kernels import rms_norm


class LitGPTRMSNorm(torch.nn.Module):
    """litgpt's form: the square as ``x * x``, the dim an attribute, Gemma's unit offset behind a flag."""

    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim
        self.add_unit_offset = add_unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x, self.weight, self.eps, offset=1.0 if self.add_unit_offset else 0.0, dim=self.dim
        )

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)


class LitGPTScaleRMSNorm(torch.nn.Module):
    """litgpt's later form: the scale chosen by a conditional expression, multiplied in float32
    before the cast back."""

    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim
        self.add_unit_offset = add_unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x,
            self.weight,
            self.eps,
            offset=1.0 if self.add_unit_offset else 0.0,
            weight_before_cast=True,
            weight_fp32=False if self.add_unit_offset else True,
            dim=self.dim,
        )

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)


class AssignedOffsetRMSNorm(nn.Module):
    """The unit offset assigned under the flag, the cast back after the scale."""

    def __init__(self, size, dim=-1, eps=1e-6, add_unit_offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim
        self.add_unit_offset = add_unit_offset

    def forward(self, x):
        return rms_norm(
            x,
            self.weight,
            self.eps,
            offset=1.0 if self.add_unit_offset else 0.0,
            weight_before_cast=True,
            weight_fp32=False if self.add_unit_offset else True,
            dim=self.dim,
        )


class MetaLlamaRMSNorm(torch.nn.Module):
    """Meta-llama / torchtitan: the normalization in ``_norm``, the weight after the cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)


class InheritedRMSNorm(MetaLlamaRMSNorm):
    """A same-file subclass with its own defaults: runs the rewritten forward it inherits."""

    def __init__(self, dim: int):
        super().__init__(dim, eps=1e-5)


class NormHelpers(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class HelperInBaseRMSNorm(NormHelpers):
    """The forward calls a helper its same-file base defines."""

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class OwnForwardRMSNorm(MetaLlamaRMSNorm):
    """A subclass with a forward of its own (OLMo-2's order), the helper inherited."""

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, weight_before_cast=True)


class ToDtypeRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class NegatedBranchRMSNorm(nn.Module):
    """The unit offset behind ``if not``, with an ``else``."""

    def __init__(self, dim, eps=1e-6, plain=True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.plain = plain

    def forward(self, x):
        return rms_norm(
            x,
            self.weight,
            self.eps,
            offset=0.0 if self.plain else 1.0,
            weight_before_cast=True,
            weight_fp32=True,
        )


class NoUpcastRMSNorm(nn.Module):
    """Keeps the input dtype: no float32 copy (fused for float32 inputs, where that is the same)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, upcast=False)


class NoUpcastSquareRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.scale, self.eps, upcast=False)
