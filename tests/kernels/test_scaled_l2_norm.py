"""The scaled L2 norm kernel (x-transformers' RMSNorm, ``F.normalize(x, dim=-1) * scale * gamma``):
:class:`ScaledL2NormFunction` forward (bitwise the source's ops) and backward (torch's autograd of
``F.normalize`` and the products, the clamp region and an all-zero row included) against the
source's math, float32 and bfloat16, odd shapes; the guarded entry's checks and execution modes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls
from adopter.kernels.guarded_l2_norm import _reason, scaled_l2_norm
from adopter.kernels.ops.l2_norm import L2NormForm, ScaledL2NormFunction, scaled_l2_norm_reference

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
FORMS = [L2NormForm(), L2NormForm(upcast=True), L2NormForm(upcast=True, cast_back=True), L2NormForm(cast_back=True)]


def _input(shape, dtype):
    """Rows of every regime: an all-zero row, rows whose norm is below eps (divided by eps, no
    gradient through the norm), one at about eps, ordinary rows."""
    x = torch.randn(*shape, dtype=torch.float32)
    flat = x.view(-1, shape[-1])
    flat[0] = 0.0
    if flat.shape[0] > 2:
        flat[1] *= 1e-14
        flat[2] = flat[2] / flat[2].norm() * 1e-12
    return x.to(dtype).requires_grad_()


def _rowwise_close(a, b, dtype, magnitude=None):
    """Per row, relative to the row's largest value (the clamp region's gradients are ~1e12 times
    an ordinary row's) or to ``magnitude`` (per row: the size of the terms the gradient is a
    difference of, where they cancel), at least 1 (a row of one element has an exact gradient of
    0, which the source's ops round to ~1e-7 of the terms)."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    scale = torch.maximum(a.abs().amax(-1, keepdim=True), b.abs().amax(-1, keepdim=True)).clamp_min(1.0)
    if magnitude is not None:
        scale = torch.maximum(scale, magnitude.reshape(-1, 1))
    torch.testing.assert_close(a / scale, b / scale, **TOL[dtype])


def _terms(x, dy, factors, eps=1e-12):
    """Per row, |dy| * |factors| / max(||x||, eps): the size of the input gradient's two terms."""
    bound = 1.0
    for f in factors:
        bound *= float(f.abs().max()) if isinstance(f, torch.Tensor) else abs(f)
    return dy.float().abs().amax(-1) * bound / x.detach().float().norm(dim=-1).clamp_min(eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(3, 5, 37), (7, 1), (4, 129), (2, 3, 4, 16)])
def test_forward_bitwise_backward_close(dtype, form, shape):
    torch.manual_seed(0)
    x = _input(shape, dtype)
    gamma = torch.randn(shape[-1], requires_grad=True)  # a float32 weight: bf16 inputs promote
    factors = (shape[-1] ** 0.5, gamma)
    ref = scaled_l2_norm_reference(x, factors, 1e-12, form)
    out = ScaledL2NormFunction.apply(x, 1e-12, form, *factors)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    dy = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (x, gamma), dy)
    got = torch.autograd.grad(out, (x, gamma), dy)
    for a, b, magnitude in zip(want, got, (_terms(x, dy, factors), None)):
        assert a.dtype == b.dtype and a.shape == b.shape
        _rowwise_close(a, b, dtype, magnitude)
    zero = got[0].reshape(-1, shape[-1])[0]
    assert torch.isfinite(zero).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factor_orders_and_kinds(dtype):
    """The factors in the source's order (gamma first, a 0-d tensor, a bf16 gamma, no factor):
    the same values, and gradients for every tensor factor."""
    torch.manual_seed(1)
    x = _input((6, 24), dtype)
    g16 = torch.randn(24, dtype=torch.bfloat16, requires_grad=True)
    g32 = torch.randn(24, requires_grad=True)
    s0 = torch.tensor(3.0, requires_grad=True)
    for factors in [(), (4.0,), (g32, 4.0), (s0, g16), (g16, 3, g32)]:
        ref = scaled_l2_norm_reference(x, factors)
        out = ScaledL2NormFunction.apply(x, 1e-12, L2NormForm(), *factors)
        assert torch.equal(out, ref)
        leaves = [x] + [f for f in factors if isinstance(f, torch.Tensor)]
        dy = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad(ref, leaves, dy), torch.autograd.grad(out, leaves, dy)):
            _rowwise_close(a.reshape(1, -1) if a.dim() == 0 else a, b.reshape(1, -1) if b.dim() == 0 else b, dtype)


def test_eps_given_and_double_backward():
    torch.manual_seed(2)
    x = (torch.randn(5, 8, dtype=torch.float64) * 1e-3).float().requires_grad_()
    gamma = torch.randn(8, requires_grad=True)
    ref = scaled_l2_norm_reference(x, (2.0, gamma), 1e-2)
    out = ScaledL2NormFunction.apply(x, 1e-2, L2NormForm(), 2.0, gamma)
    assert torch.equal(out, ref)  # every row below eps: all divided by eps
    (ga,) = torch.autograd.grad(ref.square().sum(), x, create_graph=True)
    (gb,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    torch.testing.assert_close(ga, gb)
    torch.testing.assert_close(torch.autograd.grad(ga.sum(), gamma)[0], torch.autograd.grad(gb.sum(), gamma)[0])


def test_guarded_entry_fuses_and_falls_back_with_reasons():
    x = torch.randn(4, 16, requires_grad=True)
    gamma = torch.ones(16, requires_grad=True)
    with count_kernel_calls() as calls:
        out = scaled_l2_norm(x, 4.0, gamma)
    assert out.grad_fn is not None and "ScaledL2Norm" in type(out.grad_fn).__name__
    assert [(c.kernel, c.backend) for c in calls.calls] == [("scaled_l2_norm", "torch")]
    assert _reason(x, (4.0, torch.ones(15)), 1e-12).startswith("a factor of shape (15,)")
    assert _reason(x, (True,), 1e-12) == "a factor is a bool"
    assert _reason(x, (torch.ones(16, dtype=torch.int64),), 1e-12).startswith("a factor is a Tensor")
    assert _reason(x, (), 0.0).startswith("eps 0.0")
    assert _reason(x.double(), (), 1e-12).startswith("input dtype")
    assert _reason(torch.empty(0, 16), (), 1e-12).startswith("input has no")
    with count_kernel_calls() as calls:
        torch.testing.assert_close(scaled_l2_norm(x, 4.0, torch.ones(1, 16)),
                                   F.normalize(x, dim=-1) * 4.0 * torch.ones(1, 16))
    assert [(c.backend, c.reason) for c in calls.calls] == [("original", "a factor of shape (1, 16) for rows of 16")]


def test_modes_run_the_source_math():
    """torch.func, forward AD, jit.trace and fx see F.normalize and the products."""
    x = torch.randn(3, 8)
    gamma = torch.randn(8)

    def source(t):
        return F.normalize(t, dim=-1) * 2.0 * gamma

    def rewritten(t):
        return scaled_l2_norm(t, 2.0, gamma)

    torch.testing.assert_close(torch.func.grad(lambda t: rewritten(t).sum())(x),
                               torch.func.grad(lambda t: source(t).sum())(x))
    torch.testing.assert_close(torch.func.vmap(rewritten)(x), source(x))
    import torch.autograd.forward_ad as fwAD

    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        a = fwAD.unpack_dual(rewritten(fwAD.make_dual(x, tangent))).tangent
        b = fwAD.unpack_dual(source(fwAD.make_dual(x, tangent))).tangent
    torch.testing.assert_close(a, b)
    traced = torch.jit.trace(rewritten, (x,), check_trace=False)
    torch.testing.assert_close(traced(x * 3), source(x * 3))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = torch.nn.Parameter(gamma.clone())

        def forward(self, t):
            return scaled_l2_norm(t, 2.0, self.gamma)

    graph = torch.fx.symbolic_trace(M())
    assert any(n.target == F.normalize for n in graph.graph.nodes)
    torch.testing.assert_close(graph(x), source(x))


def test_input_changed_in_place_before_backward_errors_as_the_source_does():
    """An upcast half input: the source keeps only its float32 copy, so the caller may change the
    input in place before the backward; the fused path keeps a copy too."""
    x = torch.randn(4, 16).bfloat16().requires_grad_()
    h = x * 1  # a non-leaf the caller owns
    gamma = torch.ones(16, requires_grad=True)
    out = scaled_l2_norm(h, 4.0, gamma, upcast=True, cast_back=True)
    with torch.no_grad():
        h.add_(1)
    out.float().sum().backward()  # no version-counter error
    assert gamma.grad is not None


def test_the_cost_model_decides_per_size_and_half_variant(tmp_path, monkeypatch):
    """A float32 call takes the ``scaled_l2_norm`` curve, a bfloat16 one normalized in bfloat16
    the ``scaled_l2_norm@half`` curve (its float32 backward costs more), an upcast bfloat16 one
    the float32 curve (it computes in float32)."""
    import json

    from adopter.kernels import cost

    threads = str(torch.get_num_threads())
    losing, paying = [{"size": 16, "ratio": 0.5, "low": 0.4, "high": 0.6}], [{"size": 16, "ratio": 1.5, "low": 1.4, "high": 1.6}]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": cost.FORMAT, "device": "cpu", "threads": {threads: {
        "scaled_l2_norm": {"train": paying}, "scaled_l2_norm@half": {"train": losing}}}}))
    monkeypatch.setenv(cost.ENV, str(path))
    monkeypatch.setattr(cost, "ENABLED", True)
    cost.reload()
    try:
        gamma = torch.ones(16, requires_grad=True)
        with count_kernel_calls() as calls:
            scaled_l2_norm(torch.randn(4, 16, requires_grad=True), 4.0, gamma)
            scaled_l2_norm(torch.randn(4, 16).bfloat16().requires_grad_(), 4.0, gamma)
            scaled_l2_norm(torch.randn(4, 16).bfloat16().requires_grad_(), 4.0, gamma, upcast=True, cast_back=True)
        got = sorted((c.backend, "does not pay" in c.reason, c.count) for c in calls.calls)
        assert got == [("original", True, 1), ("torch", False, 2)], got
    finally:
        cost.reload()
