"""Pure kernels: functional forms with their own autograd where they have their own backward.

``triton_*.py`` modules import triton and are loaded only when the triton backend is selected.
"""
from .attention import attention, attention_eager, attention_sdpa
from .batch_norm_fold import fold_batch_norm
from .bias_gelu import bias_gelu, linear_bias_gelu
from .dropout_add_layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_reference
from .qkv import qkv_projection
from .softmax import softmax

__all__ = [
    "attention",
    "attention_eager",
    "attention_sdpa",
    "bias_gelu",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_reference",
    "fold_batch_norm",
    "linear_bias_gelu",
    "qkv_projection",
    "softmax",
]
