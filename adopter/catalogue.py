"""What the kernels accept, as data: read by the rules (static analysis, which never imports torch)
and by the kernels (their run-time checks), so the two cannot drift apart.

Before this module four GeLU tables had (``kernels/guarded.py``, ``rules/biased_gelu.py``,
``rules/_activation_keys.py``, ``rules/gated_mlp.py``), and one named a class transformers never had.
"""
from __future__ import annotations

# transformers.activations classes computing the GeLU the kernels implement -> its approximation
# (the tanh-formula classes compute F.gelu(approximate="tanh"), up to rounding). PytorchGELUTanh is
# transformers 4.x's name of 5.x's GELUTanh.
TRANSFORMERS_GELUS: dict[str, str] = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}

# transformers.activations classes named like a GeLU that compute another function -> why not
NOT_KERNEL_GELUS: dict[str, str] = {
    "QuickGELUActivation": "QuickGELU (x*sigmoid(1.702x)) is not the GeLU the kernel implements",
    "ClippedGELUActivation": "clipped GeLU is not the GeLU the kernel implements",
}

# ACT2FN keys (config.hidden_act) that give one of TRANSFORMERS_GELUS or torch's GELU
GELU_CONFIG_KEYS = frozenset(
    {"gelu", "gelu_new", "gelu_fast", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate"}
)
