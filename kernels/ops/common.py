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


def fx_leaf(fn=None, *, traced=None):
    """Make a functional kernel a single ``call_function`` node under ``torch.fx`` symbolic tracing.

    Kernels branch on device, dtype and shape, which a symbolic ``Proxy`` cannot answer; like
    ``torch.fx.wrap`` (but wherever the function is called from), a call with a Proxy argument is
    recorded as one node instead of being traced through. With ``traced`` (a function of the same
    arguments in plain torch ops: what the kernel computes on the torch backend) that function is
    traced instead, so the graph holds torch ops, which TorchScript compiles.
    """
    if fn is None:
        return functools.partial(fx_leaf, traced=traced)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        proxy = _first_proxy(args, kwargs)
        if proxy is not None:
            if traced is not None:
                return traced(*args, **kwargs)
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


def rotary_function(rotate, name: str, doc: str) -> type:
    """An autograd Function applying the rotary embedding with ``rotate(x, cos, sin, transpose)``
    (the torch or the triton implementation): backward is the transposed rotation of the
    gradient, from ``cos``/``sin`` alone (``x`` is not saved; cos/sin are constants).
    ``apply(x, cos, sin, transpose=False)``: the transposed rotation itself is what a double
    backward runs (see ``backward``)."""
    import torch

    def forward(ctx, x, cos, sin, transpose=False):
        ctx.save_for_backward(cos, sin)
        ctx.transpose = transpose
        return rotate(x, cos, sin, transpose=transpose)

    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if torch.is_grad_enabled():
            # create_graph (double backward): the backward is linear in the gradient, so it is this
            # Function transposed, whose own backward is the rotation again (rotate writes into
            # fresh tensors with ``out=``/in-place ops, which autograd cannot differentiate)
            return function.apply(grad, cos, sin, not ctx.transpose), None, None, None
        return rotate(grad, cos, sin, transpose=not ctx.transpose), None, None, None

    function = type(name, (torch.autograd.Function,), {
        "__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)})
    return function
