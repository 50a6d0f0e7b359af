"""Shape helpers shared by the kernels; no triton import here (auto mode on CPU must not load it)."""
from __future__ import annotations

import contextlib
import functools

from torch.fx import Proxy

# One row of a row-wise kernel must fit in one block (the triton layer-norm tutorial's limit).
MAX_FUSED_BYTES = 65536


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_block(n_cols: int, element_size: int = 4) -> int:
    """Block size for a row-wise kernel, or 0 when a row does not fit in one block."""
    block = next_power_of_2(n_cols)
    if block * element_size > MAX_FUSED_BYTES:
        return 0
    return block


def fx_leaf(fn):
    """Make a functional kernel a single ``call_function`` node under ``torch.fx`` symbolic tracing.

    Kernels branch on device, dtype and shape, which a symbolic ``Proxy`` cannot answer; like
    ``torch.fx.wrap`` (but wherever the function is called from), a call with a Proxy argument is
    recorded as one node instead of being traced through.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        proxy = _first_proxy(args, kwargs)
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _first_proxy(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Proxy):
            return value
        if isinstance(value, (tuple, list)):
            for item in value:
                if isinstance(item, Proxy):
                    return item
    return None


def is_proxy(value) -> bool:
    return isinstance(value, Proxy)


@contextlib.contextmanager
def outside_tracing():
    """Real tensors and no graph recording for a probe a kernel's guard runs (``torch.export``
    and ``make_fx`` trace Python with fake tensors: a probe's ops would land in the graph, and a
    data-dependent one such as ``torch.equal`` cannot run there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def fx_call(fn, args: tuple, kwargs: dict | None = None):
    """What a guarded kernel returns while ``torch.fx`` symbolically traces a call of it (a
    ``Proxy`` among its arguments): the call recorded as one ``call_function`` node of ``fn``,
    its modules as ``get_attr`` nodes, so the traced ``GraphModule`` runs ``fn`` itself, with its
    run-time checks, and computes what the eager model computes (a fold of BatchNorm in eval
    mode included). None when not tracing, or when an argument cannot be a graph argument (a
    function such as ``F.gelu``, a module outside the traced root): the caller then traces the
    original computation."""
    kwargs = kwargs or {}
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return None
    tracer = proxy.tracer
    if not all(_graph_argument(tracer, value) for value in kwargs.values()):
        return None
    functions = tuple(i for i, value in enumerate(args) if _function_reference(value) is not None)
    if functions:
        # a function argument (``F.gelu``, the source's ``rotate_half``) travels as its import
        # path: a graph holds no function values, but ``call_with_functions`` looks it up again
        args = tuple(_function_reference(a) if i in functions else a for i, a in enumerate(args))
        args, fn = (_function_reference(fn), functions, *args), call_with_functions
    if not all(_graph_argument(tracer, value) for value in args):
        return None
    return tracer.create_proxy("call_function", fn, args, kwargs)


def _function_reference(value) -> str | None:
    """``"module:qualname"`` of a function importable by that path (found there again), else None."""
    import sys
    import types

    if not isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return None
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or "<" in qualname:
        return None
    return f"{module}:{qualname}" if _resolve(f"{module}:{qualname}", sys.modules) is value else None


def _resolve(reference: str, modules) -> object:
    module, _, qualname = reference.partition(":")
    value = modules.get(module)
    for part in qualname.split("."):
        value = getattr(value, part, None)
    return value


def call_with_functions(kernel: str, functions: tuple, *args, **kwargs):
    """What an fx graph calls for a guarded kernel that took functions: ``kernel`` and the
    arguments at positions ``functions`` are ``"module:qualname"`` references (see ``fx_call``),
    looked up on each call (a few dict lookups; a reloaded module is found as it is now)."""
    import sys

    def resolved(reference: str):
        value = _resolve(reference, sys.modules)
        if value is None:
            raise LookupError(f"adopter: {reference} is not importable any more")
        return value

    args = tuple(resolved(a) if i in functions else a for i, a in enumerate(args))
    return resolved(kernel)(*args, **kwargs)


def _graph_argument(tracer, value) -> bool:
    """Whether ``tracer.create_arg`` can represent ``value`` without adding nodes it may not need."""
    import torch

    if value is None or isinstance(value, (Proxy, bool, int, float, str, torch.dtype, torch.device, torch.Tensor)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_graph_argument(tracer, item) for item in value)
    if isinstance(value, torch.nn.Module):
        root = getattr(tracer, "root", None)
        return isinstance(root, torch.nn.Module) and any(m is value for m in root.modules())
    return False


def rotary_function(rotate, name: str, doc: str) -> type:
    """An autograd Function applying the rotary embedding with ``rotate(x, cos, sin, transpose)``
    (the torch or the triton implementation): backward is the transposed rotation of the
    gradient, from ``cos``/``sin`` alone (``x`` is not saved; cos/sin are constants)."""
    import torch

    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin, transpose=False)

    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        dx = rotate(grad, cos, sin, transpose=True) if ctx.needs_input_grad[0] else None
        return dx, None, None

    return type(name, (torch.autograd.Function,), {
        "__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)})
