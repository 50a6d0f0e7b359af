"""``freeze(model)``: the user's promise that a model's parameters and buffers no longer change,
under which kernels may keep what they derive from them (a BatchNorm folded into the conv before
it, the fold packed for oneDNN, concatenated Q/K/V weights) from one call to the next.

Without the promise every derived weight is computed from the live tensors on each call. Nothing
in PyTorch can tell a cache that a tensor changed: ``torch.optim.AdamW(fused=True)`` steps,
writes through ``.data`` (EMA updates, manual init), BatchNorm's running statistics in a
train-mode forward and parametrizations recomputing into reused storage all leave ``_version``,
``data_ptr`` and identity as they were (a cached fold then gave outputs off by 0.9 after one fused
AdamW step). This is the contract of ``torch.jit.freeze`` and inductor's freezing: the model is put
in eval mode and its parameters become constants (``requires_grad`` off).

The promise is dropped, per module, as soon as it is seen broken: a kernel called on a module in
training mode, with a parameter that requires grad, or with a parameter or buffer that is not the
object frozen (``load_state_dict(assign=True)``, a re-registered parameter, ``.to()``).
``unfreeze(model)`` drops it and gives the parameters their ``requires_grad`` back. A change the
kernels cannot see (a ``.data`` write, a fused optimizer step on a frozen model) breaks the promise
silently, as it does for ``torch.jit.freeze``: call ``unfreeze`` before changing weights.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, TypeVar

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["freeze", "frozen_tensors", "is_frozen", "release", "release_if_training", "unfreeze"]

M = TypeVar("M", bound=nn.Module)

# module -> (the freeze call's token, the ids of its own parameters and buffers when frozen: their
# objects must stay). A fresh token per freeze() call: what was kept under an earlier promise
# (freeze, unfreeze, train, freeze again) is never served under a later one.
_FROZEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENS = itertools.count(1)
# parameter -> requires_grad before freeze (unfreeze gives it back); keyed by identity (a tensor's
# == is elementwise)
_REQUIRES_GRAD = WeakIdKeyDictionary()


def _own_tensors(module: nn.Module) -> dict[str, int]:
    return {name: id(t) for name, t in (*module._parameters.items(), *module._buffers.items()) if t is not None}


def freeze(model: M) -> M:
    """Promise that ``model``'s parameters and buffers no longer change: eval mode, parameters
    without ``requires_grad``, and kernels keep derived weights between calls. Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze() takes an nn.Module, got {type(model).__name__}")
    model.eval()
    for p in model.parameters():
        if p not in _REQUIRES_GRAD:
            _REQUIRES_GRAD[p] = p.requires_grad
        p.requires_grad_(False)
    token = next(_TOKENS)
    for module in model.modules():
        _FROZEN[module] = (token, _own_tensors(module))
    return model


def unfreeze(model: M) -> M:
    """Drop :func:`freeze`'s promise for ``model`` and give its parameters their ``requires_grad``
    back (the mode is left as it is). Returns ``model``."""
    for module in model.modules():
        _FROZEN.pop(module, None)
    for p in model.parameters():
        previous = _REQUIRES_GRAD.pop(p, None)
        if previous is not None:
            p.requires_grad_(previous)
    return model


def is_frozen(module: nn.Module) -> bool:
    """Whether ``module`` is under :func:`freeze`'s promise (and it was not seen broken)."""
    return module in _FROZEN


def frozen_tensors(modules: tuple[nn.Module, ...], tensors: tuple[Any, ...]) -> tuple[int, ...]:
    """The freeze tokens of ``modules`` when derived weights of ``tensors`` (their parameters and
    buffers) may be kept between calls, else ``()``: every module frozen, none in training mode,
    its parameters and buffers the objects frozen, and no tensor requiring grad. A cache keys what
    it keeps on the tokens (a later ``freeze`` gives new ones). A module seen breaking the promise
    is dropped from it (a later ``freeze`` renews it)."""
    tokens = []
    for module in modules:
        recorded = _FROZEN.get(module)
        if recorded is None:
            return ()
        if module.training or _own_tensors(module) != recorded[1]:
            del _FROZEN[module]
            return ()
        tokens.append(recorded[0])
    if any(t is not None and t.requires_grad for t in tensors):
        for module in modules:
            _FROZEN.pop(module, None)
        return ()
    return tuple(tokens)


def release_if_training(*modules: nn.Module) -> None:
    """Drop the promise of ``modules`` when one of them is in training mode: a kernel that takes
    its original path because a BatchNorm trains calls this, since that forward moves the running
    statistics without a version change a cache could see."""
    for m in modules:
        if m.training:
            for module in modules:
                _FROZEN.pop(module, None)
            return


def release(*modules: nn.Module) -> None:
    """Drop the promise of ``modules``: a kernel that sees it broken in a way ``frozen_tensors``
    does not check (a parametrization put on a layer: its weight is computed on every access)."""
    for module in modules:
        _FROZEN.pop(module, None)
