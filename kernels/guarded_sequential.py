"""``GuardedSequential``: what a rewrite puts where an ``nn.Sequential`` with fusable
consecutive entries is built (``nn.Sequential(conv, bn, relu)`` ->
``GuardedSequential(conv, bn, relu)``).

It *is* an ``nn.Sequential`` built from the same entries: same children, same names
(``0``, ``1``... or the ``OrderedDict`` keys), same state dict, indexing, ``len`` and iteration,
so checkpoints of the original load and what it saves loads into the original. Only ``forward``
differs: consecutive children that form a pair a guarded kernel handles run through it —
``(Conv2d, BatchNorm2d)`` -> :func:`conv_bn` (with a ``ReLU`` after them, the ReLU too), ``(Linear, BatchNorm1d)`` -> :func:`linear_bn`,
``(Linear, a GeLU)`` -> :func:`linear_gelu` — decided from the children it holds *at run time*
(not from what the analysis saw), and each kernel checks its own preconditions again (exact
forward, hooks, eval mode...) and otherwise calls the two children as ``nn.Sequential`` does.
Kernel calls are counted under the function that built the Sequential. It prints as
``Sequential`` (``print(model)`` shows the user's structure); ``type(m) is nn.Sequential`` is
the one thing that tells it apart. ``torch.jit.script`` compiles ``nn.Sequential``'s loop, and
``torch.fx`` records a fused pair's fold as ops on its parameters, so traced and eager models
agree.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from .guard_checks import global_hooks, has_hooks
from .guarded import conv_bn, epilogue_activation, gelu_mode, linear_bn, linear_gelu
from .ops.common import is_proxy
from .telemetry import calls_made_at, record, source_file

__all__ = ["GuardedSequential", "run_sequential"]


def _pair_kernel(first: nn.Module, second: nn.Module) -> Callable | None:
    if isinstance(first, nn.Conv2d) and isinstance(second, nn.BatchNorm2d):
        return conv_bn
    if isinstance(first, nn.Linear):
        if isinstance(second, nn.BatchNorm1d):
            return linear_bn
        if gelu_mode(second)[0] is not None:
            return linear_gelu
    return None


class GuardedSequential(nn.Sequential):
    """``nn.Sequential`` whose fusable consecutive children run through adopter's guarded kernels."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        caller = sys._getframe(1).f_code
        # where the user's source builds it: kernel calls are counted there
        self._adopter_site = (source_file(caller.co_filename), getattr(caller, "co_qualname", caller.co_name))

    def _get_name(self) -> str:
        # ``print(model)`` shows the structure the user wrote
        return "Sequential"

    def forward(self, input):  # noqa: A002 - nn.Sequential's parameter name
        if torch.jit.is_scripting():
            # TorchScript compiles nn.Sequential's own loop (the branch below is never compiled)
            for module in self:
                input = module(input)
            return input
        else:
            return self._guarded_forward(input)

    @torch.jit.unused
    def _guarded_forward(self, input: Any, site: tuple[str, str] | None = None) -> Any:  # noqa: A002
        children = list(self._modules.values())
        with calls_made_at(site or getattr(self, "_adopter_site", None)):
            i, n = 0, len(children)
            while i < n:
                module = children[i]
                if i + 1 < n:
                    kernel = _pair_kernel(module, children[i + 1])
                    if kernel is conv_bn and i + 2 < n and epilogue_activation(children[i + 2]):
                        # (Conv2d, BatchNorm2d, ReLU): the ReLU in the conv's epilogue
                        input = conv_bn(module, children[i + 1], input, children[i + 2])
                        i += 3
                        continue
                    if kernel is not None:
                        input = kernel(module, children[i + 1], input)
                        i += 2
                        continue
                input = module(input)
                i += 1
        return input


def _runs_sequential_loop(module: Any) -> bool:
    """``module(x)`` is ``nn.Sequential``'s loop over its children (``_modules`` in order)."""
    cls = type(module)
    if cls is nn.Sequential or cls is GuardedSequential:
        return True
    return (isinstance(module, nn.Sequential) and cls.forward is nn.Sequential.forward
            and cls.__call__ is nn.Module.__call__ and cls.__iter__ is nn.Sequential.__iter__
            and cls._call_impl is nn.Module._call_impl)


def run_sequential(sequential: Any, input: Any) -> Any:  # noqa: A002 - nn.Sequential's parameter name
    """``sequential(input)`` for an ``nn.Sequential`` the user's source calls but another file built
    (a helper of another module or of an installed package: ``self.mlp = make_mlp(dim)``, which a
    rewrite of the calling file cannot reach): when, at this call, it is an ``nn.Sequential`` running
    ``nn.Sequential``'s own loop (a subclass that only fills itself in ``__init__``, as torchvision's
    ``Conv2dNormActivation``; or a :class:`GuardedSequential`) without hooks, forward of its own or
    global hooks, its children run as :class:`GuardedSequential` runs them (each fusable pair through
    its guarded kernel, which checks its own preconditions again), counted at the calling site;
    otherwise, and while fx traces, it is called as before."""
    if (not _runs_sequential_loop(sequential) or has_hooks(sequential)
            or "forward" in vars(sequential) or global_hooks() or is_proxy(input)):
        record("run_sequential", "original", "not a plain nn.Sequential at this call (or hooks, or fx tracing)")
        return sequential(input)
    caller = sys._getframe(1).f_code
    site = (source_file(caller.co_filename), getattr(caller, "co_qualname", caller.co_name))
    return GuardedSequential._guarded_forward(sequential, input, site)
