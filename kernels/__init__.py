"""Kernels that rewritten models call (``adopter.kernels``).

``ops/`` holds the pure kernels (functional forms, autograd Functions, triton kernels loaded lazily);
the modules here are thin ``nn.Module`` wrappers whose constructors are what the rewrite
synthesizes (see ARCHITECTURE.md, "Kernel modules"). Backend choice lives in ``backend.py``.
Importing this package needs neither triton, xformers nor a GPU.
"""
from .backend import ENV_VAR as BACKEND_ENV_VAR
from .backend import KernelBackendError, select_backend
from .batch_norm import FusedConv2dBatchNorm2d, FusedLinearBatchNorm1d
from .layer_norm import FusedDropoutAddLayerNorm
from .linear_gelu import FusedLinearBiasGeLU
from .ops.attention import attention
from .ops.bias_gelu import bias_gelu, linear_bias_gelu
from .ops.dropout_add_layer_norm import dropout_add_layer_norm
from .ops.softmax import softmax
from .qkv import FusedQKV
from .softmax_module import Softmax  # not "softmax.py": that name is the function

__all__ = [
    "BACKEND_ENV_VAR",
    "FusedConv2dBatchNorm2d",
    "FusedDropoutAddLayerNorm",
    "FusedLinearBatchNorm1d",
    "FusedLinearBiasGeLU",
    "FusedQKV",
    "KernelBackendError",
    "Softmax",
    "attention",
    "bias_gelu",
    "dropout_add_layer_norm",
    "linear_bias_gelu",
    "select_backend",
    "softmax",
]
