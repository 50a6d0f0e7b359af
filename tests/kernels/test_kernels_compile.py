"""torch.compile over what rewritten code calls: no graph break from the kernels' own code, and the
compiled module computes what the eager one does.

CPU only, dynamo with the "eager" backend (inductor would need a C++ compiler): every entry point of
``adopter.kernels.guarded`` (fused and fallback paths), ``attention`` and ``softmax``, in train and
eval mode. The triton path cannot be traced on CPU (dynamo would trace into the interpreter), so its
Python part (backend choice, installation probes, the dropout seed draw) is traced with the
autograd Function replaced by a torch stand-in.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import backend
from torch import nn

from adopter import kernels


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)]


def _run(module, inputs, seed=0):
    """Outputs, then gradients of inputs and parameters (when anything needs one)."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    torch.manual_seed(seed)
    outs = _tensors(module.fn(*inputs) if isinstance(module, types.SimpleNamespace) else module(*inputs))
    wrt = [t for t in [*inputs, *module.parameters()] if t.requires_grad]
    if not wrt or not torch.is_grad_enabled():
        return outs, []
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    return outs, torch.autograd.grad(loss, wrt, allow_unused=True)


def check_compiles(module: nn.Module, *inputs: torch.Tensor, train: bool = True,
                   rtol: float = 1e-6) -> torch._dynamo.eval_frame.ExplainOutput:
    """No graph break (one graph), and compiled outputs and gradients equal eager ones (``rtol``:
    a kernel that compiles to its original math, kernels/policy.py COMPILE_POLICY, equals the
    eager fused result within rounding only)."""
    module.train(train)
    explanation = torch._dynamo.explain(module)(*inputs)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    expected, expected_grads = _run(module, inputs)
    got, got_grads = _run(compiled, inputs)
    # the compiled module shares the parameters: the eager gradients were taken on the same ones
    assert len(got) == len(expected) and len(got_grads) == len(expected_grads)
    for a, b in zip(got + list(got_grads), expected + list(expected_grads)):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-6, rtol=rtol)
    return explanation


def _rand(*shape, grad=True):
    return torch.randn(*shape, requires_grad=grad)


# ---------------------------------------------------------------- the guarded entry points
class DropoutAddLayerNorm(nn.Module):
    def __init__(self, cols=8, p=0.1):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.LayerNorm = nn.LayerNorm(cols)

    def forward(self, x, residual):
        return kernels.dropout_add_layer_norm(self.dropout, self.LayerNorm, x, residual)


class LinearGeLU(nn.Module):
    def __init__(self, act, *act_args, **act_kwargs):
        super().__init__()
        self.dense = nn.Linear(8, 12)
        self.act = act
        self.act_args, self.act_kwargs = act_args, act_kwargs

    def forward(self, x):
        return kernels.linear_gelu(self.dense, self.act, x, *self.act_args, **self.act_kwargs)


class QKV(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(8, 8, bias=bias) for _ in range(3))

    def forward(self, x):
        q, k, v = kernels.qkv(self.query, self.key, self.value, x)
        return q + 1, k * 2, v


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return kernels.conv_bn(self.conv, self.bn, x)


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return kernels.linear_bn(self.dense, self.bn, x)


def _with_running_stats(module):
    bn = module.bn
    with torch.no_grad():
        bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2.0), bn.weight.normal_(), bn.bias.normal_()
    return module


@pytest.mark.parametrize("train", [True, False])
def test_dropout_add_layer_norm(train):
    check_compiles(DropoutAddLayerNorm(), _rand(2, 3, 8), _rand(2, 3, 8), train=train)


@pytest.mark.parametrize("train", [True, False])
def test_dropout_add_layer_norm_half_x_fp32_residual(train):
    x = torch.randn(2, 3, 8).to(torch.bfloat16).requires_grad_()
    check_compiles(DropoutAddLayerNorm(), x, _rand(2, 3, 8), train=train)


@pytest.mark.parametrize(
    "act,args,kwargs",
    # (no F.gelu(h, "none"): approximate is keyword-only, F.gelu raises, and so does the kernel)
    [(nn.GELU(), (), {}), (nn.GELU(approximate="tanh"), (), {}), (F.gelu, (), {"approximate": "tanh"}),
     (nn.ReLU(), (), {})],  # ReLU: the original computation
    ids=["GELU", "GELU-tanh", "F.gelu-kw", "ReLU-fallback"],
)
@pytest.mark.parametrize("train", [True, False])
def test_linear_gelu(act, args, kwargs, train):
    check_compiles(LinearGeLU(act, *args, **kwargs), _rand(2, 5, 8), train=train)


@pytest.fixture(params=[False, True], ids=["cpu-policy", "fused"])
def qkv_fused(request, monkeypatch):
    from adopter.kernels import guarded

    monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", request.param)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("train", [True, False])
def test_qkv(bias, train, qkv_fused):
    check_compiles(QKV(bias), _rand(2, 5, 8), train=train)


def test_qkv_eval_no_grad(qkv_fused):  # eager caches the concatenated weights; compiled code builds them
    module = QKV().eval()
    with torch.no_grad():
        check_compiles(module, _rand(2, 5, 8, grad=False), train=False)


@pytest.mark.parametrize("train", [True, False])  # train: BatchNorm uses batch statistics, no folding
def test_conv_bn(train):
    # eval: compiled, the unfolded conv + BatchNorm (COMPILE_POLICY) against the eager fold
    check_compiles(_with_running_stats(ConvBN()), _rand(2, 3, 5, 5), train=train, rtol=1e-5)


@pytest.mark.parametrize("train", [True, False])
def test_linear_bn(train):
    check_compiles(_with_running_stats(LinearBN()), _rand(4, 8), train=train, rtol=1e-5)


def test_linear_bn_and_conv_bn_eval_no_grad():
    with torch.no_grad():
        check_compiles(_with_running_stats(LinearBN()), _rand(4, 8, grad=False), train=False, rtol=1e-5)
        torch._dynamo.reset()
        check_compiles(_with_running_stats(ConvBN()), _rand(2, 3, 5, 5, grad=False), train=False, rtol=1e-5)


class _HookedDropout(nn.Dropout):
    def forward(self, x):  # overrides forward: the guard must call the original computation
        return super().forward(x) * 1.0


def test_fallbacks_do_not_break_the_graph():
    module = DropoutAddLayerNorm()
    module.dropout = _HookedDropout(0.1)
    check_compiles(module, _rand(2, 3, 8), _rand(2, 3, 8))
    torch._dynamo.reset()
    module = LinearGeLU(nn.GELU())
    module.dense.register_forward_hook(lambda mod, args, out: out * 2)
    check_compiles(module, _rand(2, 5, 8))
    torch._dynamo.reset()
    check_compiles(DropoutAddLayerNorm(), _rand(2, 3, 8), _rand(2, 3, 1))  # residual broadcast


def test_forced_torch_backend(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    check_compiles(DropoutAddLayerNorm(), _rand(2, 3, 8), _rand(2, 3, 8))
    torch._dynamo.reset()
    check_compiles(Softmax(-1, None), _rand(2, 3, 8))


# ---------------------------------------------------------------- attention and softmax
class Attention(nn.Module):
    def __init__(self, p=0.0, **kwargs):
        super().__init__()
        self.p, self.kwargs = p, kwargs

    def forward(self, q, k, v, *masks):
        mask = masks[0] if masks else None
        return kernels.attention(q, k, v, mask, dropout_p=self.p if self.training else 0.0, **self.kwargs)


class Softmax(nn.Module):
    def __init__(self, dim, dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, x):
        return kernels.softmax(x, self.dim, dtype=self.dtype)


def _padding_mask():
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 3:] = False
    return keep[:, None, None, :]


@pytest.mark.parametrize(
    "kwargs,mask",
    [({}, None), ({"is_causal": True}, None), ({}, "bool"), ({}, "additive"),
     ({"need_weights": True}, "bool"), ({"scale": 0.5, "is_causal": True}, "additive")],
    ids=["plain", "causal", "bool-mask", "additive-mask", "weights", "scale-causal"],
)
@pytest.mark.parametrize("train", [True, False])  # train: dropout (the eager path on CPU)
def test_attention(kwargs, mask, train):
    q, k, v = (_rand(2, 3, 5, 4) for _ in range(3))
    masks = []
    if mask == "bool":
        masks = [_padding_mask()]
    elif mask == "additive":
        masks = [(~_padding_mask()).float() * -1e4]
    check_compiles(Attention(p=0.1, **kwargs), q, k, v, *masks, train=train)


def test_attention_grouped_query_heads():
    check_compiles(Attention(), _rand(2, 4, 5, 4), _rand(2, 2, 5, 4), _rand(2, 2, 5, 4), train=False)


@pytest.mark.parametrize("dim,dtype", [(-1, None), (1, None), (-1, torch.float32), (0, torch.float64)])
def test_softmax(dim, dtype):
    check_compiles(Softmax(dim, dtype), _rand(3, 4, 6))


def test_softmax_scalar_and_half():
    check_compiles(Softmax(0, None), _rand(()))
    torch._dynamo.reset()
    check_compiles(Softmax(-1, torch.float32), torch.randn(3, 6).to(torch.bfloat16).requires_grad_())


# ---------------------------------------------------------------- the triton path's Python part
def test_backend_probes_are_constant_under_compile():
    """Installation probes (import, xformers operator) run once eagerly; traced code sees a constant."""
    def probe(x):
        return x + int(backend.triton_installed()) + int(backend.xformers_supports("cuda", torch.float16))

    x = torch.randn(3)
    explanation = torch._dynamo.explain(probe)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(probe, backend="eager", fullgraph=True)(x), probe(x))


def _stub(monkeypatch, module_name, function_name, apply):
    """Replace the autograd Function of a triton module by a torch stand-in (the interpreter cannot
    be traced); the module itself is imported, as the kernel entry points import it."""
    pytest.importorskip("triton")
    import importlib

    module = importlib.import_module(f"adopter.kernels.ops.{module_name}")
    monkeypatch.setattr(module, function_name, types.SimpleNamespace(apply=apply))


@pytest.fixture
def forced_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton may run CPU tensors (the interpreter)
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    return monkeypatch


@pytest.mark.parametrize("train", [True, False])
def test_triton_dropout_add_layer_norm_draws_its_seed_in_graph(forced_triton, train):
    calls = []

    def apply(x, residual, weight, bias, n_cols, eps, p, seed, out_dtype):
        calls.append(seed is not None and isinstance(seed, torch.Tensor))
        out = F.layer_norm((x + residual).to(out_dtype), (n_cols,), weight, bias, eps)
        return out if seed is None else out + 0.0 * seed.to(out_dtype)  # the seed is a graph input

    _stub(forced_triton, "triton_layer_norm", "DropoutAddLayerNormFunction", apply)
    explanation = check_compiles(DropoutAddLayerNorm(p=0.2), _rand(2, 3, 8), _rand(2, 3, 8), train=train)
    assert calls and set(calls) == {train}  # a seed tensor exactly when dropout runs
    drew = any("randint" in str(node.target) for g in explanation.graphs for node in g.graph.nodes)
    assert drew == train


def test_triton_linear_gelu_and_softmax(forced_triton):
    _stub(forced_triton, "triton_bias_gelu", "BiasGeLUFunction",
          lambda y, bias, approximate, out_dtype: F.gelu(y + bias, approximate=approximate).to(out_dtype))
    _stub(forced_triton, "triton_softmax", "SoftmaxFunction", lambda x, out_dtype: F.softmax(x, -1).to(out_dtype))
    check_compiles(LinearGeLU(nn.GELU(approximate="tanh")), _rand(2, 5, 8))
    torch._dynamo.reset()
    check_compiles(Softmax(-1, None), _rand(2, 3, 8))
    torch._dynamo.reset()
    check_compiles(Softmax(1, torch.float32), _rand(2, 3, 8))
