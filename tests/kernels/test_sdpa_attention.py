"""The guarded written-out attention (``adopter.kernels.sdpa``, rule sdpa_attention): fused
(SDPA) and fallback paths against the source's own ops, forward and backward, masks (additive, bool
added, bool fill, causal buffer), einsum, grouped-query heads, dropout seeded in training, dtypes,
odd shapes; and every execution mode: fx, torch.compile, torch.jit.trace, torch.func, forward AD."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls, sdpa
from torch import nn

from tests.kernels.test_kernels_compile import check_compiles


def _written(q, kt, v, scale=None, divisor=None, mask=None, fill=None, fill_first=False, dropout=None):
    """The written-out attention, spelled as research code spells it."""
    s = q @ kt
    if scale is not None:
        s = s * scale
    if divisor is not None:
        s = s / divisor
    if fill is not None and fill_first:
        s = s.masked_fill(fill, float("-inf"))
    if mask is not None:
        s = s + mask
    if fill is not None and not fill_first:
        s = s.masked_fill(fill, float("-inf"))
    p = s.softmax(dim=-1)
    if dropout is not None:
        p = dropout(p)
    return p @ v


def _qkv(b=2, h=3, q_len=5, k_len=7, d=4, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_(grad) for n in (q_len, k_len, k_len)]


def _paths(calls) -> set[str]:
    return {"fused" if c.fused else "original" for c in calls.calls if c.kernel == "sdpa"}


def _compare(kwargs, dtype=torch.float32, shape=(), expect="fused", atol=None):
    q, k, v = _qkv(*shape, dtype=dtype) if shape else _qkv(dtype=dtype)
    kt = k.transpose(-2, -1)
    expected = _written(q, kt, v, **kwargs)
    expected.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, fill_value=float("-inf") if "fill" in kwargs else None, **kwargs)
    assert _paths(calls) == {expect}
    got.sum().backward()
    tol = {} if atol is None else {"atol": atol, "rtol": atol}
    torch.testing.assert_close(got, expected, equal_nan=True, **tol)
    for a, b in zip((t.grad for t in (q, k, v)), grads):
        torch.testing.assert_close(a, b, equal_nan=True, **tol)


def _padding_fill(b=2, k_len=7):
    fill = torch.zeros(b, 1, 1, k_len, dtype=torch.bool)
    fill[1, ..., 4:] = True
    return fill


@pytest.mark.parametrize("kwargs", [
    {}, {"scale": 0.5}, {"divisor": math.sqrt(4)}, {"scale": torch.tensor(0.3)},
    {"mask": torch.randn(2, 1, 5, 7)}, {"mask": torch.randn(7)[None, :].expand(5, 7)},
    {"mask": torch.rand(2, 1, 1, 7) > 0.5},  # a bool mask *added*: 1.0 where True, as s + m does
    {"fill": _padding_fill()}, {"fill": _padding_fill(), "mask": torch.randn(1, 3, 5, 7)},
    {"fill": _padding_fill(), "mask": torch.randn(1, 3, 5, 7), "fill_first": True},
], ids=["plain", "scale", "divisor", "tensor-scale", "additive", "additive-2d", "bool-added", "fill", "fill-add",
        "add-fill"])
def test_fused_equals_written_out(kwargs):
    _compare(kwargs)


def test_causal_buffer_fill_odd_shapes():
    # nanoGPT: the tril buffer sliced to T and compared with 0; head_dim 7, one head, T = 9
    bias = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    _compare({"scale": 1 / math.sqrt(7), "fill": bias[:, :, :9, :9] == 0}, shape=(3, 1, 9, 9, 7))


@pytest.mark.parametrize("dtype,atol", [(torch.float64, None), (torch.bfloat16, 2e-2)])
def test_dtypes(dtype, atol):
    _compare({"scale": 0.25, "mask": torch.randn(2, 1, 5, 7, dtype=dtype)}, dtype=dtype, atol=atol)


def test_fully_masked_row_is_nan_as_the_source():
    fill = torch.zeros(2, 1, 5, 7, dtype=torch.bool)
    fill[0, 0, 2] = True  # every key of one query row
    q, k, v = _qkv(grad=False)
    with count_kernel_calls() as calls:
        got = sdpa(q, k.transpose(-2, -1), v, fill=fill, fill_value=float("-inf"))
    assert _paths(calls) == {"original"}
    torch.testing.assert_close(got, _written(q, k.transpose(-2, -1), v, fill=fill), equal_nan=True)
    assert got[0, :, 2].isnan().all()


@pytest.mark.parametrize("kwargs,why", [
    ({"fill": _padding_fill(), "fill_value": -1e9}, "fill value"),
    ({"mask": torch.randn(2, 1, 5, 7, dtype=torch.float64)}, "mask"),
    ({"scale": torch.tensor(0.5, requires_grad=True)}, "scale"),
    ({"fill": _padding_fill().float(), "fill_value": float("-inf")}, "fill mask"),
], ids=["finite-fill", "promoting-mask", "learned-scale", "float-fill"])
def test_fallback_computes_the_source(kwargs, why):
    q, k, v = _qkv()
    kt = k.transpose(-2, -1)

    def source():
        s = (q @ kt) * kwargs.get("scale", 1.0)
        if "mask" in kwargs:
            s = s + kwargs["mask"]
        if "fill" in kwargs:
            s = s.masked_fill(kwargs["fill"], kwargs["fill_value"])
        return s.softmax(-1) @ v

    with count_kernel_calls() as calls:
        try:
            got = sdpa(q, kt, v, **kwargs)
        except RuntimeError as e:  # the source's own ops raise where they raise
            got = e
    reasons = [c.reason for c in calls.calls if c.kernel == "sdpa"]
    assert reasons and why in reasons[0]
    if isinstance(got, RuntimeError):
        with pytest.raises(RuntimeError):
            source()
        return
    torch.testing.assert_close(got, source())


def test_einsum_form():
    q, k, v = _qkv()
    eqs = ("b h i d, b h j d -> b h i j", "b h i j, b h j d -> b h i d")
    expected = torch.einsum(eqs[1], (torch.einsum(eqs[0], q, k) * 0.5).softmax(-1), v)
    with count_kernel_calls() as calls:
        got = sdpa(q, k, v, scale=0.5, einsum=eqs)
    assert _paths(calls) == {"fused"}
    torch.testing.assert_close(got, expected)


def test_grouped_query_heads_repeated_by_the_source():
    q, _, _ = _qkv(h=4)
    k, v = (torch.randn(2, 2, 7, 4) for _ in range(2))
    k, v = k.repeat_interleave(2, dim=1), v[:, :, None].expand(2, 2, 2, 7, 4).reshape(2, 4, 7, 4)
    with count_kernel_calls() as calls:
        got = sdpa(q, k.transpose(2, 3), v, scale=0.5)
    assert _paths(calls) == {"fused"}
    torch.testing.assert_close(got, _written(q, k.transpose(2, 3), v, scale=0.5))


@pytest.mark.parametrize("form", ["module", "functional"])
def test_dropout_in_training_draws_what_the_source_draws(form):
    q, k, v = _qkv()
    kt = k.transpose(-2, -1)
    drop = nn.Dropout(0.3).train()
    torch.manual_seed(7)
    expected = _written(q, kt, v, scale=0.5, dropout=drop)
    kwargs = {"dropout": drop} if form == "module" else {"dropout_p": 0.3, "dropout_training": True}
    torch.manual_seed(7)
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, scale=0.5, **kwargs)
    assert _paths(calls) == {"original"}
    assert torch.equal(got, expected)
    # eval mode (or p == 0): nothing drawn, the fused path
    drop.eval()
    kwargs = {"dropout": drop} if form == "module" else {"dropout_p": 0.3, "dropout_training": False}
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, scale=0.5, **kwargs)
    assert _paths(calls) == {"fused"}
    torch.testing.assert_close(got, _written(q, kt, v, scale=0.5))


def test_plain_dropout_module_is_its_functional_call():
    """A plain nn.Dropout runs as F.dropout(p, module.p, module.training, module.inplace) (what its
    forward is, and what the graph's op runs): in training, in place or not, the numbers the module
    draws, seeded alike, forward and backward; a global hook sees the module called (the source's
    ops call it)."""
    q, k, v = _qkv()
    kt = k.transpose(-2, -1)
    drop = nn.Dropout(0.3).train()
    torch.manual_seed(11)
    expected, expected_grads = _grads_of(lambda: _written(q, kt, v, scale=0.5, dropout=drop), q, k, v)
    torch.manual_seed(11)
    with count_kernel_calls() as calls:
        got, got_grads = _grads_of(lambda: sdpa(q, kt, v, scale=0.5, dropout=drop), q, k, v)
    assert _paths(calls) == {"original"}
    assert torch.equal(got, expected) and all(torch.equal(a, b) for a, b in zip(got_grads, expected_grads))
    drop = nn.Dropout(0.3, inplace=True).train()  # (no backward: the source's in-place dropout on the
    with torch.no_grad():                          # softmax's output has none)
        torch.manual_seed(11)
        expected = _written(q, kt, v, scale=0.5, dropout=drop)
        torch.manual_seed(11)
        assert torch.equal(sdpa(q, kt, v, scale=0.5, dropout=drop), expected)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m)))
    try:
        with count_kernel_calls() as calls:
            sdpa(q, kt, v, scale=0.5, dropout=nn.Dropout(0.1).eval())
    finally:
        handle.remove()
    assert _paths(calls) == {"original"} and seen == [nn.Dropout]


def test_dropout_module_with_hooks_runs_the_source():
    q, k, v = _qkv(grad=False)
    drop = nn.Dropout(0.1).eval()
    seen = []
    drop.register_forward_hook(lambda m, i, o: seen.append(o))
    with count_kernel_calls() as calls:
        sdpa(q, k.transpose(-2, -1), v, dropout=drop)
    assert _paths(calls) == {"original"} and len(seen) == 1  # the hook saw the probabilities


def test_double_backward():
    q, k, v = (t.double() for t in _qkv())
    kt = k.transpose(-2, -1)
    assert torch.autograd.gradcheck(lambda q, kt, v: sdpa(q, kt, v, scale=0.5), (q, kt, v))
    assert torch.autograd.gradgradcheck(lambda q, kt, v: sdpa(q, kt, v, scale=0.5), (q, kt, v))


# ---------------------------------------------------------------- execution modes

class WrittenOut(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.attn_drop = nn.Dropout(p)
        # (sized to the inputs: fx cannot slice a buffer, a plain tensor, by a traced length)
        self.register_buffer("bias", torch.tril(torch.ones(6, 6)).view(1, 1, 6, 6))

    def forward(self, q, k, v):
        return sdpa(q, k.transpose(-2, -1), v, scale=q.shape[-1] ** -0.5, fill=self.bias == 0,
                              fill_value=float("-inf"), dropout=self.attn_drop)


# ---------------------------------------------------------------- fx: the graph makes the eager call

def _graph_targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _grads_of(fn, *tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    out.pow(2).sum().backward()
    return out, [t.grad.clone() for t in tensors]


def test_fx_records_the_op_and_the_graph_makes_the_eager_call():
    """timm's fx test compares eager with the traced graph: the graph holds one adopter::sdpa node
    (no softmax, no dropout module), which decides at run time as eager does: fused both, bitwise
    equal outputs and gradients (the source's ops in the graph differed by SDPA's rounding)."""
    module = WrittenOut().eval()
    gm = torch.fx.symbolic_trace(module)
    targets = _graph_targets(gm)
    assert targets.count("adopter.sdpa") == 1 and not any("softmax" in t or "attn_drop" == t for t in targets)
    q, k, v = _qkv(b=2, h=3, q_len=6, k_len=6, d=8)
    with count_kernel_calls() as calls:
        eager, eager_grads = _grads_of(lambda: module(q, k, v), q, k, v)
    assert _paths(calls) == {"fused"}
    with count_kernel_calls() as calls:
        graph, graph_grads = _grads_of(lambda: gm(q, k, v), q, k, v)
    assert _paths(calls) == {"fused"}
    assert torch.equal(graph, eager) and all(torch.equal(a, b) for a, b in zip(graph_grads, eager_grads))
    # the source's ops differ from SDPA by rounding: what the graph held before
    assert not torch.equal(_written(q, k.transpose(-2, -1), v, scale=8 ** -0.5, fill=module.bias == 0), eager)


class _FillArgument(nn.Module):
    def forward(self, q, k, v, fill):
        return sdpa(q, k.transpose(-2, -1), v, scale=0.5, fill=fill, fill_value=float("-inf"))


def test_fx_graph_decides_at_run_time():
    """The run-time checks run in the graph: a fully masked row (the source's NaN) takes the
    source's ops there as in eager, equal bitwise."""
    module = _FillArgument()
    gm = torch.fx.symbolic_trace(module)
    q, k, v = _qkv(q_len=6, k_len=6, grad=False)
    fill = torch.ones(6, 6, dtype=torch.bool).triu(1)
    with count_kernel_calls() as calls:
        assert torch.equal(gm(q, k, v, fill), module(q, k, v, fill))
    assert _paths(calls) == {"fused"}
    fill[3] = True  # query row 3 sees no key
    with count_kernel_calls() as calls:
        eager, graph = module(q, k, v, fill), gm(q, k, v, fill)
    assert _paths(calls) == {"original"}
    assert torch.equal(graph[:, :, :3], eager[:, :, :3]) and graph[:, :, 3].isnan().all()


def test_fx_graph_train_mode_draws_the_source_dropout():
    """The graph reads the dropout's training flag and p when it runs (get_attr): after train()
    it draws what the user's nn.Dropout draws, seeded alike, forward and backward."""
    module = WrittenOut(p=0.3).eval()
    gm = torch.fx.symbolic_trace(module)
    module.train()
    gm.train()
    q, k, v = _qkv(q_len=6, k_len=6)
    torch.manual_seed(5)
    expected, expected_grads = _grads_of(lambda: _written(q, k.transpose(-2, -1), v, scale=0.5,
                                                          fill=module.bias == 0, dropout=module.attn_drop), q, k, v)
    torch.manual_seed(5)
    with count_kernel_calls() as calls:
        got, got_grads = _grads_of(lambda: gm(q, k, v), q, k, v)
    assert _paths(calls) == {"original"}
    assert torch.equal(got, expected) and all(torch.equal(a, b) for a, b in zip(got_grads, expected_grads))
    gm.eval()  # and back: nothing drawn, fused
    with count_kernel_calls() as calls:
        gm(q, k, v)
    assert _paths(calls) == {"fused"}


def test_fx_then_torchscript_makes_the_eager_call():
    """timm's fx-then-TorchScript: the op is a TorchScript builtin; the scripted graph runs the
    same decision (fused here), bitwise equal to eager, with gradients."""
    module = WrittenOut().eval()
    scripted = torch.jit.script(torch.fx.symbolic_trace(module))
    q, k, v = _qkv(q_len=6, k_len=6)
    eager, eager_grads = _grads_of(lambda: module(q, k, v), q, k, v)
    with count_kernel_calls() as calls:
        got, got_grads = _grads_of(lambda: scripted(q, k, v), q, k, v)
    assert _paths(calls) == {"fused"}
    assert torch.equal(got, eager) and all(torch.equal(a, b) for a, b in zip(got_grads, eager_grads))


def test_fx_graph_under_torch_func_forward_ad_and_double_backward():
    """The op's kernel is CompositeImplicitAutograd: under torch.func (functional_call + grad) and
    forward AD the graph runs the source's ops, as eager does; a double backward of the fused
    path differentiates the eager ops."""
    module = WrittenOut().eval()
    gm = torch.fx.symbolic_trace(module)
    q, k, v = _qkv(q_len=6, k_len=6, grad=False)

    def ref(q):
        return _written(q, k.transpose(-2, -1), v, scale=0.5, fill=module.bias == 0).sum()

    params = dict(gm.named_buffers())
    with count_kernel_calls() as calls:
        got = torch.func.grad(lambda q: torch.func.functional_call(gm, params, (q, k, v)).sum())(q)
    assert _paths(calls) == {"original"}
    assert torch.equal(got, torch.func.grad(ref)(q))
    import torch.autograd.forward_ad as fwAD
    tangent_in = torch.randn_like(q)
    with fwAD.dual_level(), count_kernel_calls() as calls:
        tangent = fwAD.unpack_dual(gm(fwAD.make_dual(q, tangent_in), k, v)).tangent
    assert _paths(calls) == {"original"}
    _, expected_tangent = torch.func.jvp(lambda q: _written(q, k.transpose(-2, -1), v, scale=0.5,
                                                            fill=module.bias == 0), (q,), (tangent_in,))
    torch.testing.assert_close(tangent, expected_tangent)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    with count_kernel_calls() as calls:
        assert torch.autograd.gradcheck(lambda a, b, c: gm.double()(a, b, c), (qd, kd, vd))
        assert torch.autograd.gradgradcheck(lambda a, b, c: gm(a, b, c), (qd, kd, vd))
    assert "fused" in _paths(calls)


def test_fx_graph_exports_and_compiles():
    """torch.export keeps the op (its kernel runs when the exported program does: the same
    decision); torch.compile of the graph traces the op's source ops, equal within rounding."""
    module = WrittenOut().eval()
    gm = torch.fx.symbolic_trace(module)
    q, k, v = _qkv(q_len=6, k_len=6, grad=False)
    eager = module(q, k, v)
    exported = torch.export.export(gm, (q, k, v))
    assert "adopter.sdpa.default" in {str(n.target) for n in exported.graph.nodes}
    with count_kernel_calls() as calls:
        assert torch.equal(exported.module()(q, k, v), eager)
    assert _paths(calls) == {"fused"}
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager)


class _ScaleArgument(nn.Module):
    def forward(self, q, k, v, scale):
        return sdpa(q, k.transpose(-2, -1), v, scale=scale)


def test_fx_records_the_source_ops_where_the_op_has_no_place():
    """A dropout module that is not a plain nn.Dropout (here: with a hook) stays in the graph with the
    source's ops (the graph must call it); so does a scale whose run-time type the graph does not tell."""
    module = WrittenOut().eval()
    seen = []
    module.attn_drop.register_forward_hook(lambda m, i, o: seen.append(o))
    gm = torch.fx.symbolic_trace(module)
    targets = _graph_targets(gm)
    assert "attn_drop" in targets and "adopter.sdpa" not in targets and any("softmax" in t for t in targets)
    q, k, v = _qkv(q_len=6, k_len=6, grad=False)
    assert torch.equal(gm(q, k, v), module(q, k, v)) and len(seen) == 2  # (eager: the source's ops too)
    gm = torch.fx.symbolic_trace(_ScaleArgument())
    assert "adopter.sdpa" not in _graph_targets(gm)
    torch.testing.assert_close(gm(q, k, v, 0.5), _written(q, k.transpose(-2, -1), v, scale=0.5))


class _Spellings(nn.Module):
    """The other arguments in a graph: an additive mask, two fills (one None, -finfo.max), a
    scale tensor (learned or a buffer), divisor, an einsum and the float32 softmax cast back by
    ``probs_to=q.dtype``."""

    def __init__(self, learned: bool):
        super().__init__()
        if learned:
            self.temperature = nn.Parameter(torch.tensor(0.7))
        else:
            self.register_buffer("temperature", torch.tensor(0.7))
        self.register_buffer("future", torch.ones(6, 6, dtype=torch.bool).triu(1))

    def forward(self, q, k, v, mask):
        eqs = ("b h i d, b h j d -> b h i j", "b h i j, b h j d -> b h i d")
        return sdpa(q, k, v, scale=self.temperature, divisor=math.sqrt(q.shape[-1]), mask=mask,
                    fill=(None, self.future), fill_value=("lowest", "lowest"), einsum=eqs, softmax_float32=True,
                    probs_to=q.dtype)


@pytest.mark.parametrize("grad", [False, True])
def test_fx_graph_other_arguments(grad):
    """Every slot of the op from a graph, bitwise equal to eager: fused with a buffer's scale, the
    source's ops (and the gradient of the learned scale) with a parameter's."""
    module = _Spellings(learned=grad)
    gm = torch.fx.symbolic_trace(module)
    assert _graph_targets(gm).count("adopter.sdpa") == 1
    q, k, v = _qkv(q_len=6, k_len=6, grad=grad)
    mask = torch.randn(1, 3, 6, 6)
    with torch.set_grad_enabled(grad), count_kernel_calls() as calls:
        eager, graph = module(q, k, v, mask), gm(q, k, v, mask)
    assert _paths(calls) == {"original" if grad else "fused"}
    assert torch.equal(graph, eager)
    if grad:
        (g_graph,) = torch.autograd.grad(graph.sum(), module.temperature)
        (g_eager,) = torch.autograd.grad(eager.sum(), module.temperature)
        assert torch.equal(g_graph, g_eager)


@pytest.mark.parametrize("train", [True, False])
def test_compile(train):
    q, k, v = _qkv(q_len=6, k_len=6)
    check_compiles(WrittenOut(p=0.0 if train else 0.1), q, k, v, train=train)


def test_jit_trace_records_the_source():
    q, k, v = _qkv(q_len=6, k_len=6, grad=False)
    module = WrittenOut().eval()
    with count_kernel_calls() as calls:
        traced = torch.jit.trace(module, (q, k, v), check_trace=False)
    assert _paths(calls) == {"original"}
    torch.testing.assert_close(traced(q, k, v), module(q, k, v))


def test_torch_func_and_forward_ad():
    q, k, v = _qkv(q_len=6, k_len=6, grad=False)
    module = WrittenOut().eval()

    def f(q):
        return module(q, k, v).sum()

    def ref(q):
        return _written(q, k.transpose(-2, -1), v, scale=0.5, fill=module.bias == 0).sum()

    with count_kernel_calls() as calls:
        got = torch.func.grad(f)(q)
    assert _paths(calls) == {"original"}
    torch.testing.assert_close(got, torch.func.grad(ref)(q))
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), count_kernel_calls() as calls:
        out = module(fwAD.make_dual(q, torch.ones_like(q)), k, v)
        tangent = fwAD.unpack_dual(out).tangent
    assert _paths(calls) == {"original"} and tangent is not None


def test_bf16_fill_against_float64():
    q, k, v = _qkv(dtype=torch.float64, grad=False)
    fill = _padding_fill()
    exact = _written(q, k.transpose(-2, -1), v, scale=0.5, fill=fill)
    got = sdpa(*(t.bfloat16() for t in (q, k.transpose(-2, -1), v)), scale=0.5, fill=fill,
                         fill_value=float("-inf"))
    torch.testing.assert_close(got.double(), exact, atol=3e-2, rtol=3e-2)
    assert F.softmax is not None


@pytest.mark.shipped_policy
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grad", [False, True])
def test_shipped_calibration_sends_prototype_sizes_to_the_source(monkeypatch, grad, threads):
    """Applied only where it pays, on CPU too (no backend policy keeps sdpa off it): the shipped
    calibration (benchmarks/calibrate_kernels.py --kernels sdpa --threads 1,2) measured SDPA slower
    than the written-out ops at a prototype's 1x2x16x16 (1 thread: 0.77x training, 0.83x inference;
    2 threads: 0.89x, 0.78x), faster at 4x6x197x64 (1.21x, 1.21x; 1.12x, 1.01x); half precision is
    calibrated apart."""
    from adopter.kernels import cost

    monkeypatch.delenv(cost.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent")  # (no user calibration: the shipped one)
    cost.reload()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape, expect in (((1, 2, 16, 16), "original"), ((4, 6, 197, 64), "fused")):
            q, k, v = (torch.randn(*shape, requires_grad=grad) for _ in range(3))
            with torch.set_grad_enabled(grad), count_kernel_calls() as calls:
                sdpa(q, k.transpose(-2, -1), v, scale=0.125)
            assert _paths(calls) == {expect}, calls.calls
    finally:
        torch.set_num_threads(previous)
        cost.reload()


def _upcast_written(q, kt, v, mask, spelling, dropout=None):
    """The softmax in float32 cast back, as Llama (``softmax(s.float()).type_as(q)``) and HF
    (``softmax(s, dtype=torch.float32).to(q.dtype)``) spell it."""
    s = q @ kt / math.sqrt(q.shape[-1]) + mask
    if spelling == "type_as":
        p = F.softmax(s.float(), dim=-1).type_as(q)
    else:
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout is not None:
        p = dropout(p)
    return p @ v


@pytest.mark.parametrize("spelling", ["type_as", "to"])
@pytest.mark.parametrize("dtype,train", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                         (torch.bfloat16, True)])
def test_softmax_float32_cast_back(spelling, dtype, train):
    """Fused only where both casts are identities (float32, no dropout drawn); in bfloat16 the
    source rounds a float32 softmax, which SDPA does not compute bitwise: the source's ops, equal
    bitwise, forward and backward, with the user's dropout drawing the same numbers in training."""
    q, k, v = _qkv(q_len=6, k_len=6, dtype=dtype)
    kt = k.transpose(-2, -1)
    mask = torch.full((6, 6), float("-inf")).triu(1).to(dtype)
    drop = nn.Dropout(0.3).train(train)
    cast = {"probs_type_as": q} if spelling == "type_as" else {"probs_to": q.dtype}
    torch.manual_seed(3)
    expected = _upcast_written(q, kt, v, mask, spelling, drop)
    expected.pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(3)
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, divisor=math.sqrt(q.shape[-1]), mask=mask, softmax_float32=True, dropout=drop, **cast)
    got.pow(2).sum().backward()
    fused = dtype == torch.float32 and not train
    assert _paths(calls) == {"fused" if fused else "original"}
    if fused:
        torch.testing.assert_close(got, expected)
        for a, b in zip((t.grad for t in (q, k, v)), grads):
            torch.testing.assert_close(a, b)
    else:
        assert torch.equal(got, expected)
        assert all(torch.equal(a, b) for a, b in zip((t.grad for t in (q, k, v)), grads))


@pytest.mark.parametrize("cast", [{"probs_to": torch.float64}, {"probs_type_as": torch.zeros(1, dtype=torch.float64)},
                                  {"probs_to": torch.zeros(1, dtype=torch.float64)}])
def test_softmax_float32_cast_elsewhere_runs_the_source(cast):
    """A cast back to another dtype than the inputs' is no identity: the source's ops (odd shapes)."""
    q, k, v = _qkv(b=1, h=2, q_len=3, k_len=5, d=6, grad=False)
    with count_kernel_calls() as calls:
        got = sdpa(q.double(), k.double().transpose(-2, -1), v.double(), softmax_float32=True, **cast)
    assert _paths(calls) == {"original"}
    expected = F.softmax((q.double() @ k.double().transpose(-2, -1)).float(), dim=-1).double() @ v.double()
    assert torch.equal(got, expected)


def _filled_written(q, kt, v, fills, bias=None, fill_first=False):
    """Several fills in order, each value -inf or -torch.finfo(s.dtype).max, around an optional bias."""
    s = q @ kt
    if bias is not None and not fill_first:
        s = s + bias
    for m, value in fills:
        if m is not None:
            s = s.masked_fill(m, -torch.finfo(s.dtype).max if value == "lowest" else value)
    if bias is not None and fill_first:
        s = s + bias
    return s.softmax(dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill_first", [False, True])
@pytest.mark.parametrize("values", [("lowest", "lowest"), (float("-inf"), "lowest"), (float("-inf"),) * 2])
def test_several_fills(values, fill_first, dtype):
    """Fills in order (one None: its `if` did not run), -inf or the scores' -finfo.max, a bias added
    before or after: fused where no row is fully filled, against the written-out ops, odd shapes."""
    q, k, v = _qkv(b=2, h=3, q_len=5, k_len=6, d=5, dtype=dtype)
    kt = k.transpose(-2, -1)
    pad = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    pad[1, ..., 4:] = True
    future = torch.ones(5, 6, dtype=torch.bool).triu(2)
    bias = torch.randn(3, 5, 6).to(dtype)
    for fills in (((pad, values[0]), (future, values[1])), ((None, values[0]), (future, values[1]))):
        for t in (q, k, v):
            t.grad = None
        expected = _filled_written(q, kt, v, fills, bias, fill_first)
        expected.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        with count_kernel_calls() as calls:
            got = sdpa(q, kt, v, mask=bias, fill=tuple(m for m, _ in fills), fill_value=tuple(x for _, x in fills),
                       fill_first=fill_first)
        got.sum().backward()
        assert _paths(calls) == {"fused"}, calls.calls
        tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
        torch.testing.assert_close(got, expected, **tol)
        for a, b in zip((t.grad for t in (q, k, v)), grads):
            torch.testing.assert_close(a, b, **tol)


def test_a_row_fully_filled_with_finfo_max_runs_the_source():
    """A row whose every key is filled with -finfo.max is uniform in the source (SDPA's is not):
    read on the masks before SDPA runs; the source's ops, bitwise, forward and backward."""
    q, k, v = _qkv(b=2, h=2, q_len=4, k_len=5, d=3)
    kt = k.transpose(-2, -1)
    pad = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    pad[1] = True
    fills = ((pad, "lowest"), (None, "lowest"))
    expected = _filled_written(q, kt, v, fills)
    expected.pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, fill=(pad, None), fill_value=("lowest", "lowest"))
    got.pow(2).sum().backward()
    assert [c.reason for c in calls.calls if c.kernel == "sdpa"] == [
        "a query row has every key filled with -finfo.max (the source's softmax is uniform)"]
    assert not got.isnan().any() and torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip((t.grad for t in (q, k, v)), grads))


@pytest.mark.parametrize("value", [-1e9, -torch.finfo(torch.bfloat16).max])
def test_another_finite_fill_value_runs_the_source(value):
    """-1e9 (or another dtype's -finfo.max) is not the scores' lowest number: the source's ops."""
    q, k, v = _qkv(grad=False)
    fill = _padding_fill()
    with count_kernel_calls() as calls:
        got = sdpa(q, k.transpose(-2, -1), v, fill=fill, fill_value=value)
    assert _paths(calls) == {"original"}
    assert torch.equal(got, (q @ k.transpose(-2, -1)).masked_fill(fill, value).softmax(-1) @ v)


class _FilledUpcast(nn.Module):
    """The new arguments together: two fills (one None), the scores' -finfo.max, a float32
    softmax cast back to the query's dtype, a dropout module."""

    def __init__(self, p):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.register_buffer("future", torch.ones(6, 6, dtype=torch.bool).triu(1))

    def forward(self, q, k, v):
        return sdpa(q, k.transpose(-2, -1), v, scale=0.5, fill=(None, self.future), fill_value=("lowest", "lowest"),
                    softmax_float32=True, probs_to=q.dtype, dropout=self.drop)


@pytest.mark.parametrize("train", [True, False])
def test_compile_fills_and_casts(train):
    """torch.compile traces the source's ops (fills with the scores' lowest number, the casts) in
    one graph, equal to eager."""
    q, k, v = _qkv(q_len=6, k_len=6)
    check_compiles(_FilledUpcast(p=0.0 if train else 0.1), q, k, v, train=train)


def test_meta_tensors_take_the_source_ops():
    """A model built on the meta device (timm's default-cfg tests) has no data to check: the source's
    ops give the shapes (the fused path's output check would call .item() on meta tensors)."""
    q, k, v = (torch.empty(2, 3, 5, 8, device="meta") for _ in range(3))
    out = sdpa(q, k.transpose(-2, -1), v, scale=8 ** -0.5)
    assert out.device.type == "meta" and out.shape == (2, 3, 5, 8)


def test_importing_adopter_kernels_registers_the_op_a_saved_graph_calls():
    # a TorchScript or exported graph of a rewritten attention calls torch.ops.adopter.sdpa: loading
    # it after a plain `import adopter.kernels` must find the op (no first use of the kernel needed)
    import subprocess
    import sys

    code = "import torch, adopter.kernels; torch.ops.adopter.sdpa.default; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("kwargs", [
    {}, {"scale": 0.5}, {"mask": torch.randn(6, 5, 7)}, {"mask": torch.randn(5, 7)},
    {"fill": torch.zeros(6, 1, 7, dtype=torch.bool).index_fill_(2, torch.tensor([5, 6]), True)},
    {"fill": torch.ones(5, 7, dtype=torch.bool).triu(1), "mask": torch.randn(1, 5, 7)},
], ids=["plain", "scale", "mask-3d", "mask-2d", "padding-fill", "causal-fill-mask"])
def test_heads_folded_into_the_batch_run_fused_as_one_head(kwargs):
    # fairseq / diffusers: (batch * heads, L, E) operands multiplied by torch.bmm; the kernel views
    # them (and rank-3 masks) with one head, and gives the rank-3 output back
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, n, 4, generator=g).requires_grad_() for n in (5, 7, 7))
    kt = k.transpose(1, 2)
    expected = _written(q, kt, v, **kwargs)
    expected.pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, fill_value=float("-inf") if "fill" in kwargs else None, **kwargs)
    assert _paths(calls) == {"fused"}, calls.calls
    assert got.shape == expected.shape == (6, 5, 4)
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip((t.grad for t in (q, k, v)), grads):
        torch.testing.assert_close(a, b)


def test_heads_folded_into_the_batch_with_a_blocked_row_run_the_source_on_the_tensors_given():
    q, k, v = (torch.randn(6, n, 4) for n in (5, 7, 7))
    fill = torch.zeros(6, 5, 7, dtype=torch.bool)
    fill[2, 3] = True  # one query row of one (batch, head) masks every key
    kt = k.transpose(1, 2)
    with count_kernel_calls() as calls:
        got = sdpa(q, kt, v, fill=fill, fill_value="lowest")
    assert _paths(calls) == {"original"}
    expected = (q @ kt).masked_fill(fill, -torch.finfo(q.dtype).max).softmax(-1) @ v
    assert torch.equal(got, expected)
