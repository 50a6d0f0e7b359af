"""The triton kernels, run on CPU by the triton interpreter (small odd shapes: it is slow).

TRITON_INTERPRET must be set before triton is first imported. If something in this pytest process
imported triton earlier, these tests re-run in a fresh process instead of being skipped.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_TRITON_PRELOADED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
from adopter.kernels import backend
from torch import nn

from adopter import kernels

pytest.importorskip("triton")

if _TRITON_PRELOADED:
    def test_interpreter_tests_in_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]



@pytest.fixture(autouse=True)
def _only_fresh_process_run_when_triton_preloaded(request):
    if _TRITON_PRELOADED and request.node.name != "test_interpreter_tests_in_fresh_process":
        pytest.skip("triton was imported without TRITON_INTERPRET=1: covered by the fresh-process run")

from adopter.kernels.ops.triton_bias_gelu import BiasGeLUFunction
from adopter.kernels.ops.triton_layer_norm import DropoutAddLayerNormFunction
from adopter.kernels.ops.triton_softmax import SoftmaxFunction

# (forward/backward) tolerances per dtype, against the fp32 reference computed from the same inputs
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = list(TOL)
SHAPE = (3, 5, 17)


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "triton")


def fp32_grads(fn, inputs, g):
    """Reference: the unfused op in fp32 on fp32 copies of the inputs."""
    ref_inputs = [t.detach().float().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*ref_inputs)
    gs = torch.autograd.grad(out, [t for t in ref_inputs if t is not None], g.float())
    return out, gs


def check(out, gs, ref_out, ref_gs, dtype):
    tol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out, **tol)
    for a, b in zip(gs, ref_gs):
        torch.testing.assert_close(a.float(), b, **tol)


def _inputs(*shapes, dtype, scale=1.0):
    return [(torch.randn(s) * scale).to(dtype).requires_grad_() for s in shapes]


# ---------------------------------------------------------------- dropout + add + LayerNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
def test_dropout_add_layer_norm_p0(dtype, affine):
    torch.manual_seed(0)
    x, r = _inputs(SHAPE, SHAPE, dtype=dtype)
    w = torch.randn(17).to(dtype).requires_grad_() if affine != "none" else None
    b = torch.randn(17).to(dtype).requires_grad_() if affine == "weight_bias" else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    out = DropoutAddLayerNormFunction.apply(x, r, w, b, 17, 1e-5, 0.0, 0, dtype)
    g = torch.randn(SHAPE).to(dtype)
    gs = torch.autograd.grad(out, inputs, g)
    ref_out, ref_gs = fp32_grads(lambda x, r, w, b: F.layer_norm(x + r, (17,), w, b, 1e-5), [x, r, w, b], g)
    check(out, gs, ref_out, ref_gs, dtype)


def test_dropout_add_layer_norm_p0_exactly_add_layer_norm_fp32(triton_backend):
    x, r = torch.randn(SHAPE), torch.randn(SHAPE)
    m = kernels.FusedDropoutAddLayerNorm(17, p=0.0)
    torch.testing.assert_close(m(x, r), F.layer_norm(x + r, (17,), m.weight, m.bias, m.eps), atol=1e-6, rtol=0)


def test_dropout_mask_rate_and_backward_use_the_same_mask(triton_backend):
    p, rows, cols = 0.3, 48, 33
    torch.manual_seed(0)
    m = kernels.FusedDropoutAddLayerNorm(cols, p=p)
    with torch.no_grad():
        m.weight.normal_(), m.bias.normal_()
    x = torch.randn(rows, cols, requires_grad=True)
    r = torch.randn(rows, cols, requires_grad=True)
    g = torch.randn(rows, cols)
    out = m(x, r)
    gx, gr, gw, gb = torch.autograd.grad(out, [x, r, m.weight, m.bias], g)
    keep = gx != 0  # dx is zero exactly where the mask dropped
    rate = 1 - keep.float().mean().item()
    sigma = (p * (1 - p) / keep.numel()) ** 0.5
    assert abs(rate - p) < 5 * sigma, rate
    # the unfused computation with that mask reproduces output and every gradient
    mask = keep.float() / (1 - p)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (x, r, m.weight, m.bias)]
    ref = F.layer_norm(ref_inputs[0] * mask + ref_inputs[1], (cols,), ref_inputs[2], ref_inputs[3], m.eps)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip((gx, gr, gw, gb), torch.autograd.grad(ref, ref_inputs, g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # seeded: same seed same mask, another seed another mask; eval: no dropout
    from adopter.kernels.ops.dropout_add_layer_norm import dropout_add_layer_norm as f
    a1 = f(x, r, cols, m.weight, m.bias, m.eps, p, True, seed=7)
    assert torch.equal(a1, f(x, r, cols, m.weight, m.bias, m.eps, p, True, seed=7))
    assert not torch.equal(a1, f(x, r, cols, m.weight, m.bias, m.eps, p, True, seed=8))
    m.eval()
    torch.testing.assert_close(m(x, r), F.layer_norm(x + r, (cols,), m.weight, m.bias, m.eps), atol=1e-5, rtol=0)


def test_dropout_add_layer_norm_fp16_dropout_rounding_matches_unfused():
    # with the mask fixed, the fp16 kernel rounds like dropout-then-add in fp16
    torch.manual_seed(0)
    x, r = _inputs((4, 19), (4, 19), dtype=torch.float16)
    out = DropoutAddLayerNormFunction.apply(x, r, None, None, 19, 1e-5, 0.5, 3, torch.float16)
    keep = torch.autograd.grad(out, [x], torch.randn_like(out))[0] != 0
    ref = F.layer_norm((x * keep * 2.0 + r).float(), (19,), eps=1e-5)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float16])


# half x with a float32 residual (autocast): the fused path computes what the unfused code does
def _amp_inputs(cols, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, cols).to(dtype).requires_grad_()
    r = torch.randn(3, 5, cols, requires_grad=True)  # float32
    norm = nn.LayerNorm(cols)  # float32 parameters, as under autocast
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    return x, r, norm, torch.randn(3, 5, cols)


def _grads(out, x, r, norm, g):
    return torch.autograd.grad(out, [x, r, norm.weight, norm.bias], g)


def _check_amp(out, gs, ref, ref_gs, dtype, tol=None):
    """Output and residual gradient in float32, x's gradient in x's dtype; ``tol`` None: bitwise."""
    assert out.dtype == torch.float32 and gs[0].dtype == dtype and gs[1].dtype == torch.float32
    if tol is None:  # the torch path runs the unfused ops themselves
        assert torch.equal(out, ref)
        assert all(torch.equal(a, b) for a, b in zip(gs, ref_gs))
        return
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(gs[0], ref_gs[0], **TOL[dtype])  # x's gradient, in x's dtype
    for a, b in zip(gs[1:], ref_gs[1:]):
        torch.testing.assert_close(a, b, **tol)


FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("cols", [17, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dropout_add_layer_norm_half_x_fp32_residual_p0(monkeypatch, path, cols, dtype):
    monkeypatch.setenv(backend.ENV_VAR, path)
    x, r, norm, g = _amp_inputs(cols, dtype)
    drop = nn.Dropout(0.0)
    out = kernels.dropout_add_layer_norm(drop, norm, x, r)
    assert backend.last_backend() == path  # the fused path ran (no fallback to the original modules)
    ref = norm(F.dropout(x, 0.0, True) + r)
    tol = None if path == "torch" else FP32_TOL  # no rounding in x's dtype without dropout
    _check_amp(out, _grads(out, x, r, norm, g), ref, _grads(ref, x, r, norm, g), dtype, tol)
    with torch.no_grad():  # without grad the kernel does not store the sum
        torch.testing.assert_close(kernels.dropout_add_layer_norm(drop, norm, x, r), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("cols", [17, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dropout_add_layer_norm_half_x_fp32_residual_dropout(monkeypatch, path, cols, dtype):
    monkeypatch.setenv(backend.ENV_VAR, path)
    p = 0.3
    x, r, norm, g = _amp_inputs(cols, dtype)
    drop = nn.Dropout(p)
    torch.manual_seed(1)
    out = kernels.dropout_add_layer_norm(drop, norm, x, r)
    assert backend.last_backend() == path
    gs = _grads(out, x, r, norm, g)
    if path == "torch":  # same generator draws as nn.Dropout: the unfused result exactly
        torch.manual_seed(1)
        ref = norm(drop(x) + r)
        _check_amp(out, gs, ref, _grads(ref, x, r, norm, g), dtype)
        return
    keep = gs[0] != 0  # the kernel's mask, from the backward: dx is zero exactly where it dropped
    assert keep.any() and not keep.all()
    # dropout rounded in x's dtype (x * mask * scale, as F.dropout), then the float32 add
    ref = norm(x * keep.to(dtype) * (1.0 / (1.0 - p)) + r)
    # fp16: the same rounding as torch; bf16: the interpreter truncates float32 -> bfloat16 (the GPU
    # rounds to nearest), so one dropped-out value may differ by an ulp
    tol = FP32_TOL if dtype == torch.float16 else TOL[dtype]
    _check_amp(out, gs, ref, _grads(ref, x, r, norm, g), dtype, tol)


# ---------------------------------------------------------------- dropout seed: a device tensor, no .item()
def test_dropout_seed_is_a_device_tensor_reproduced_by_manual_seed(triton_backend):
    from adopter.kernels.ops.dropout_add_layer_norm import dropout_add_layer_norm as f

    torch.manual_seed(0)
    s1 = backend.fresh_seed(torch.device("cpu"))
    torch.manual_seed(0)
    assert s1.dtype == torch.int64 and s1.shape == (1,) and torch.equal(s1, backend.fresh_seed("cpu"))

    cols, p = 23, 0.4
    x = torch.randn(3, 5, cols, requires_grad=True)
    r = torch.randn(3, 5, cols, requires_grad=True)
    w, b = torch.randn(cols, requires_grad=True), torch.randn(cols, requires_grad=True)
    g = torch.randn(3, 5, cols)
    torch.manual_seed(5)
    a = f(x, r, cols, w, b, 1e-5, p, True)
    torch.manual_seed(5)
    a2 = f(x, r, cols, w, b, 1e-5, p, True)
    assert torch.equal(a, a2)
    assert not torch.equal(a, f(x, r, cols, w, b, 1e-5, p, True))  # the generator moved on
    torch.rand(100)  # draws between forward and backward do not change the mask the backward uses
    gx, gr, gw, gb = torch.autograd.grad(a, [x, r, w, b], g)
    keep = gx != 0
    ref_in = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    ref = F.layer_norm(ref_in[0] * keep / (1 - p) + ref_in[1], (cols,), ref_in[2], ref_in[3], 1e-5)
    torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip((gx, gr, gw, gb), torch.autograd.grad(ref, ref_in, g)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # an explicit seed, as an int or a tensor, gives the same mask
    assert torch.equal(f(x, r, cols, w, b, 1e-5, p, True, seed=11),
                       f(x, r, cols, w, b, 1e-5, p, True, seed=torch.tensor([11])))


def test_dropout_seed_is_never_read_back_to_the_host(triton_backend, monkeypatch):
    from adopter.kernels.ops import dropout_add_layer_norm as dal
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # every aten op run in the block (a host read is _local_scalar_dense)
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    drawn = []
    monkeypatch.setattr(dal, "fresh_seed", lambda device: drawn.append(backend.fresh_seed(device)) or drawn[-1])
    m = kernels.FusedDropoutAddLayerNorm(19, p=0.2)
    x = torch.randn(4, 19, requires_grad=True)
    with Ops() as mode:
        m(x, torch.randn(4, 19)).sum().backward()
    assert "aten.randint" in mode.ops and "aten._local_scalar_dense" not in mode.ops, sorted(mode.ops)
    assert len(drawn) == 1 and drawn[0].device == x.device and drawn[0].dtype == torch.int64


# ---------------------------------------------------------------- bias + GeLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(dtype, approximate, with_bias):
    torch.manual_seed(0)
    y, b = _inputs(SHAPE, (17,), dtype=dtype, scale=2.0)
    b = b if with_bias else None
    out = BiasGeLUFunction.apply(y, b, approximate, dtype)
    g = torch.randn(SHAPE).to(dtype)
    gs = torch.autograd.grad(out, [t for t in (y, b) if t is not None], g)
    ref_out, ref_gs = fp32_grads(
        lambda y, b: F.gelu(y if b is None else y + b, approximate=approximate), [y, b], g)
    check(out, gs, ref_out, ref_gs, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fused_linear_bias_gelu_module(triton_backend, approximate):
    torch.manual_seed(0)
    ref = nn.Linear(13, 17)
    fused = kernels.FusedLinearBiasGeLU(13, 17, approximate=approximate)
    fused.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 5, 13, requires_grad=True)
    g = torch.randn(3, 5, 17)
    out_f, out_r = fused(x), F.gelu(ref(x), approximate=approximate)
    torch.testing.assert_close(out_f, out_r, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out_f, [x, fused.weight, fused.bias], g),
                    torch.autograd.grad(out_r, [x, ref.weight, ref.bias], g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- softmax
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(dtype):
    torch.manual_seed(0)
    (x,) = _inputs(SHAPE, dtype=dtype, scale=3.0)
    with torch.no_grad():
        x[0, 0, 3:] = float("-inf")  # masked row tail, as attention scores have
    out = SoftmaxFunction.apply(x, dtype)
    g = torch.randn(SHAPE).to(dtype)
    gs = torch.autograd.grad(out, [x], g)
    ref_out, ref_gs = fp32_grads(lambda x: F.softmax(x, -1), [x], g)
    check(out, gs, ref_out, ref_gs, dtype)


def test_softmax_functional_dim_and_dtype(triton_backend):
    x = torch.randn(SHAPE, dtype=torch.float16, requires_grad=True)
    out = kernels.softmax(x, 1, dtype=torch.float32)  # forced triton moves dim 1 last
    ref = F.softmax(x, 1, dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(SHAPE)
    (gx,) = torch.autograd.grad(out, [x], g)
    (gr,) = torch.autograd.grad(ref, [x], g)
    assert gx.dtype == torch.float16
    torch.testing.assert_close(gx, gr, **TOL[torch.float16])
    torch.testing.assert_close(kernels.Softmax(-1)(x.detach().float()), F.softmax(x.detach().float(), -1))


def test_forced_triton_backend_is_what_runs(triton_backend):
    x = torch.randn(SHAPE)
    assert backend.select_backend("softmax", [x], has_triton=True) == "triton"
    # an op the triton backend cannot take (float64) falls back to torch, numerically identical
    x64 = torch.randn(SHAPE, dtype=torch.float64)
    assert torch.equal(kernels.softmax(x64), F.softmax(x64, -1))


def test_dropout_add_layer_norm_module_multi_dim_shape_bf16(triton_backend):
    torch.manual_seed(0)
    ref = nn.LayerNorm((4, 6)).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    fused = kernels.FusedDropoutAddLayerNorm((4, 6), p=0.0).to(torch.bfloat16)
    fused.load_state_dict(ref.state_dict(), strict=True)
    x, r = _inputs((3, 4, 6), (3, 4, 6), dtype=torch.bfloat16)
    g = torch.randn(3, 4, 6).to(torch.bfloat16)
    out = fused(x, r)
    gs = torch.autograd.grad(out, [x, r, fused.weight, fused.bias], g)
    ref_out, ref_gs = fp32_grads(lambda x, r, w, b: F.layer_norm(x + r, (4, 6), w, b, 1e-5),
                                 [x, r, ref.weight, ref.bias], g)
    check(out, gs, ref_out, ref_gs, torch.bfloat16)


@pytest.mark.slow
def test_kernels_compile_for_cuda_without_a_gpu():
    """Lower every kernel specialization to PTX for sm_90 through triton's real compiler (the
    interpreter misses compile-only errors). Runs in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "adopter.kernels.ops.triton_compile_check", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 failure(s)" in done.stdout
