"""The checks every guarded kernel makes before its fused path, shared by the kernel modules.

A guarded kernel runs its fused path only for a module that behaves as the torch class it
replaces (:func:`plain_reason`: the class's own ``forward``, no hooks, no parametrization) and
outside contexts where the user's modules must run as written (:func:`context_reason`: fx tracing,
global module hooks); otherwise it takes the original path and records why
(:func:`record_fallback`).
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as _module_mod

from .ops.common import is_proxy
from .telemetry import ORIGINAL, record

__all__ = ["context_reason", "defines_own_forward", "global_hooks", "has_hooks", "hooks_reason", "is_parametrized",
           "plain_reason", "record_fallback"]

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks",
)


def global_hooks() -> bool:
    return any(getattr(_module_mod, name, None) for name in GLOBAL_HOOKS)


def plain_reason(module: Any, base: type, *methods: str) -> str:
    """"" when ``module`` behaves as ``base`` (an instance whose ``forward`` and ``methods`` are
    base's own, neither overridden by its class nor set on the instance, without hooks); otherwise
    why not."""
    if not isinstance(module, base):
        return f"{type(module).__name__} is not a {base.__name__}"
    cls = type(module)
    for name in ("forward", "__call__", *methods):  # (a __call__ of its own may skip forward)
        if getattr(cls, name) is not getattr(base, name):
            return f"{cls.__name__} overrides {name}"
    if is_parametrized(module):
        # (the guard would compute the weight again: spectral_norm in training steps its power
        # iteration once more, a parametrization's hooks fire twice)
        return f"this {cls.__name__} has a parametrized tensor"
    own = vars(module)
    for name in ("forward", *methods):
        if name in own:  # (set on the instance: accelerate's offload hooks wrap ``module.forward`` so)
            return f"this {cls.__name__} has its own {name}"
    if has_hooks(module):
        return f"{cls.__name__} has hooks"
    return ""


def is_parametrized(module: Any) -> bool:
    # (torch.nn.utils.parametrize.is_parametrized without its import)
    return isinstance(getattr(module, "parametrizations", None), nn.ModuleDict)


def has_hooks(module: Any) -> bool:
    return any(getattr(module, d, None) for d in HOOK_DICTS)


def hooks_reason() -> str:
    return "global module hooks (the fused path would skip them)" if global_hooks() else ""


def context_reason(*tensors: Any) -> str:
    """Why no kernel may run in this calling context: fx is tracing (Proxy inputs: the graph must
    show the user's modules) or global module hooks are installed (the fused path skips them)."""
    if any(is_proxy(t) for t in tensors) or global_hooks():
        return "tracing or global hooks"
    return ""


def record_fallback(kernel: str, reason: str) -> None:
    record(kernel, ORIGINAL, reason)


def defines_own_forward(cls: type, module_name: str) -> bool:
    """Whether ``cls`` itself defines ``forward`` in ``module_name`` (not replaced, e.g. by a hub
    kernel). Read from the class ``__dict__``, which dynamo cannot read while it traces (a
    transformers compiled generate failed with "mapping proxy affected by dictionary mutation"):
    under torch.compile the answer is taken once as a constant of the class."""
    forward = cls.__dict__.get("forward")
    return forward is not None and getattr(forward, "__module__", "") == module_name


# what torch.compiler.assume_constant_result sets, without the import of torch._dynamo it makes
# (importing adopter.kernels stays light: tests/kernels/test_kernels_torch.py)
defines_own_forward._dynamo_marked_constant = True  # type: ignore[attr-defined]
