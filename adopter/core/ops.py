"""How DSL nodes show up in a traced graph: operator symbols and function/method names
(the last component of a DSL layer type) -> the graph op names they produce. Used to find
the graph nodes of a matched source node."""

from __future__ import annotations

# DSL operator -> graph op names.
TENSOR_OP_NAMES = {
    "+": {"add", "add_", "iadd"},
    "-": {"sub", "sub_", "rsub", "isub"},
    "*": {"mul", "mul_", "imul"},
    "/": {"div", "div_", "truediv", "itruediv"},
    "//": {"floor_divide", "floordiv"},
    "%": {"remainder", "fmod", "mod"},
    "**": {"pow", "pow_"},
    "@": {"matmul", "mm", "bmm", "linear"},
    "u-": {"neg"},
    "u~": {"bitwise_not", "invert"},
}

# Last component of a DSL layer type -> graph op names (functional calls, tensor methods).
FUNCTION_OP_NAMES = {
    "softmax": {"softmax", "_softmax", "_safe_softmax"},
    "log_softmax": {"log_softmax", "_log_softmax"},
    "gelu": {"gelu"},
    "relu": {"relu", "relu_"},
    "silu": {"silu"},
    "tanh": {"tanh"},
    "dropout": {"dropout", "native_dropout", "feature_dropout"},
    "layer_norm": {"layer_norm", "native_layer_norm"},
    "batch_norm": {"batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit"},
    "linear": {"linear", "addmm", "mm"},
    "conv2d": {"conv2d", "convolution"},
    "matmul": {"matmul", "mm", "bmm"},
    "bmm": {"bmm"},
    "baddbmm": {"baddbmm"},
    "scaled_dot_product_attention": {"scaled_dot_product_attention"},
    "view": {"view", "_unsafe_view", "reshape"},
    "reshape": {"reshape", "view", "_unsafe_view"},
    "transpose": {"transpose", "permute"},
    "permute": {"permute"},
    "contiguous": {"contiguous", "clone"},
    "masked_fill": {"masked_fill", "masked_fill_", "where"},
}
