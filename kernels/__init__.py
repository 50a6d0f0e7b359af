"""Kernels that rewritten models call (``adopter.kernels``).

``guarded.py`` holds what rewrites emit: functions that take the user's own modules
(``linear_gelu(self.dense, self.act, x)``, ``dropout_add_layer_norm(self.dropout, self.LayerNorm,
x, residual)``, ``qkv(...)``, ``conv_bn(...)``, ``linear_bn(...)``), run the fused kernel when its
preconditions hold at run time and the original computation otherwise; ``attention`` and
``softmax`` are functional drop-ins. ``telemetry.py`` counts which path each call took.
``ops/`` holds the pure kernels (functional forms on tensors, autograd Functions, triton kernels
loaded lazily). The ``Fused*`` modules are the module form of the same kernels (kept for code
rewritten by earlier versions). Backend choice lives in ``backend.py``. Importing this package
needs neither triton, xformers nor a GPU.
"""
import torch as _torch

# The floor: torch.library.custom_op (torch 2.4) registers the fused LM-head loss at import.
# Features newer than the floor are detected at run time and take the original math without them.
TORCH_FLOOR = (2, 4)
if tuple(int(p) for p in _torch.__version__.split("+")[0].split(".")[:2] if p.isdigit()) < TORCH_FLOOR:
    raise ImportError(
        f"adopter.kernels needs torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}, found {_torch.__version__}: "
        f"pip install 'torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}'"
    )

from .backend import ENV_VAR as BACKEND_ENV_VAR
from .backend import KernelBackendError, select_backend
from .batch_norm import FusedConv2dBatchNorm2d, FusedLinearBatchNorm1d
from .frozen import freeze, is_frozen, unfreeze
from .guarded import conv_bn, dropout_add_layer_norm, gelu_mode, linear_bn, linear_gelu, qkv
from .guarded_sequential import GuardedSequential, run_sequential
from .layer_norm import FusedDropoutAddLayerNorm
from .linear_gelu_module import FusedLinearBiasGeLU
from .ops.attention import attention
from .ops.bias_gelu import bias_gelu, linear_bias_gelu
from .ops.softmax import softmax
from .qkv_module import FusedQKV
from .softmax_module import Softmax  # not "softmax.py": that name is the function
from .telemetry import KernelCall, count_kernel_calls, kernel_calls, reset_kernel_calls

# The LLM rule pack's guarded kernels (issue 12), one module each; loaded on first use so
# importing adopter.kernels stays cheap. name -> module under adopter.kernels.
_LAZY = {
    "add_relu": "guarded_add_relu",
    "rms_norm": "guarded_rms_norm",
    "scaled_l2_norm": "guarded_l2_norm",
    "gated_mlp": "guarded_gated_mlp",
    "gated_mlp_packed": "guarded_gated_mlp",
    "rotary": "guarded_rotary",
    "rotary_interleaved": "guarded_rotary",
    "rotary_pairs": "guarded_rotary",
    "rotary_complex": "guarded_rotary",
    "linear_cross_entropy": "guarded_linear_cross_entropy",
    "lm_head_cross_entropy": "guarded_linear_cross_entropy",
    # training with labels, the fused loss returns logits=None: keep them, or filter the warning
    "keep_logits": "guarded_linear_cross_entropy",
    "LogitsNotComputedWarning": "guarded_linear_cross_entropy",
    # written-out attention outside the HF namesake classes (issue 35)
    "sdpa": "guarded_sdpa",
}


# the guarded SDPA registers the op ``torch.ops.adopter.sdpa`` that an fx graph of a rewritten
# attention records: a TorchScript or exported graph saved with it loads after ``import
# adopter.kernels`` (registered here, not on first use; ~5 ms)
from . import guarded_sdpa as _guarded_sdpa  # noqa: E402,F401


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_ENV_VAR",
    "FusedConv2dBatchNorm2d",
    "FusedDropoutAddLayerNorm",
    "FusedLinearBatchNorm1d",
    "FusedLinearBiasGeLU",
    "FusedQKV",
    "GuardedSequential",
    "KernelBackendError",
    "KernelCall",
    "Softmax",
    "add_relu",
    "attention",
    "bias_gelu",
    "conv_bn",
    "count_kernel_calls",
    "dropout_add_layer_norm",
    "freeze",
    "gelu_mode",
    "is_frozen",
    "kernel_calls",
    "linear_bias_gelu",
    "linear_bn",
    "linear_gelu",
    "qkv",
    "reset_kernel_calls",
    "run_sequential",
    "sdpa",
    "select_backend",
    "softmax",
    "unfreeze",
]
