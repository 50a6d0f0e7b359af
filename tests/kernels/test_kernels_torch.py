"""adopter.kernels on the torch backend (CPU, fp32): fused modules vs the unfused PyTorch layers,
forward and backward, plus backend selection."""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import backend
from adopter.kernels.ops.attention import attention, attention_eager
from torch import nn

from adopter import kernels

ATOL = 1e-5


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)


def grads(outputs, inputs, grad_out):
    return torch.autograd.grad(outputs, inputs, grad_out, allow_unused=True)


def assert_close_all(a, b, atol=ATOL, rtol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- dropout + add + LayerNorm
@pytest.mark.parametrize("shape,normalized", [((3, 5, 17), (17,)), ((2, 3, 4, 6), (4, 6)), ((7, 33), (33,))])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_dropout_add_layer_norm_matches_unfused(shape, normalized, affine, bias):
    torch.manual_seed(0)
    fused = kernels.FusedDropoutAddLayerNorm(normalized, p=0.1, eps=1e-6, elementwise_affine=affine, bias=bias)
    ref = nn.LayerNorm(normalized, eps=1e-6, elementwise_affine=affine, bias=bias)
    if affine:
        with torch.no_grad():
            ref.weight.normal_()
            if bias:
                ref.bias.normal_()
    fused.load_state_dict(ref.state_dict(), strict=True)
    drop = nn.Dropout(0.1)
    x = torch.randn(shape, requires_grad=True)
    r = torch.randn(shape, requires_grad=True)
    g = torch.randn(shape)
    params_f = [x, r] + list(fused.parameters())
    params_r = [x, r] + list(ref.parameters())
    for training in (False, True):
        fused.train(training), drop.train(training)
        torch.manual_seed(1)
        out_f = fused(x, r)
        torch.manual_seed(1)
        out_r = ref(drop(x) + r)
        torch.testing.assert_close(out_f, out_r, atol=ATOL, rtol=1e-5)
        assert_close_all(grads(out_f, params_f, g), grads(out_r, params_r, g))


def test_dropout_add_layer_norm_p0_exact_and_eval_has_no_dropout():
    x, r = torch.randn(4, 9), torch.randn(4, 9)
    m = kernels.FusedDropoutAddLayerNorm(9, p=0.0)
    assert torch.equal(m(x, r), F.layer_norm(x + r, (9,), m.weight, m.bias, m.eps))
    m = kernels.FusedDropoutAddLayerNorm(9, p=0.9).eval()
    assert torch.equal(m(x, r), F.layer_norm(x + r, (9,), m.weight, m.bias, m.eps))
    with pytest.raises(ValueError):
        kernels.FusedDropoutAddLayerNorm(9, p=1.5)


# ---------------------------------------------------------------- bias + GeLU
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_bias_gelu_matches_unfused(approximate, bias):
    torch.manual_seed(0)
    ref = nn.Linear(17, 23, bias=bias)
    fused = kernels.FusedLinearBiasGeLU(17, 23, bias=bias, approximate=approximate)
    fused.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 5, 17, requires_grad=True)
    g = torch.randn(3, 5, 23)
    out_f = fused(x)
    out_r = F.gelu(ref(x), approximate=approximate)
    torch.testing.assert_close(out_f, out_r, atol=ATOL, rtol=1e-5)
    assert_close_all(grads(out_f, [x, *fused.parameters()], g), grads(out_r, [x, *ref.parameters()], g))


def test_bias_gelu_functional_and_approximation_is_never_switched():
    y, b = torch.randn(5, 7, requires_grad=True), torch.randn(7, requires_grad=True)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(kernels.bias_gelu(y, b, approximate), F.gelu(y + b, approximate=approximate))
    assert not torch.allclose(kernels.bias_gelu(y, b, "none"), kernels.bias_gelu(y, b, "tanh"), atol=1e-6)
    with pytest.raises(ValueError):
        kernels.FusedLinearBiasGeLU(3, 4, approximate="fast")


# ---------------------------------------------------------------- QKV
class ThreeLinears(nn.Module):
    def __init__(self, hidden=16, kv=None, bias=True, names=("query", "key", "value")):
        super().__init__()
        kv = hidden if kv is None else kv
        self.names = names
        for name, out in zip(names, (hidden, kv, kv)):
            setattr(self, name, nn.Linear(hidden, out, bias=bias))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return tuple(getattr(self, n)(x) for n in self.names)


class FusedThree(nn.Module):
    def __init__(self, hidden=16, kv=None, bias=True, names=("query", "key", "value")):
        super().__init__()
        self.qkv = kernels.FusedQKV(hidden, hidden, bias=bias, names=names, kv_out_features=kv)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.qkv(x)


@pytest.mark.parametrize("kv,bias,names", [
    (None, True, ("query", "key", "value")),
    (None, False, ("q_proj", "k_proj", "v_proj")),
    (4, True, ("q", "k", "v")),  # GQA-style narrower key/value
])
def test_fused_qkv_matches_three_linears_and_round_trips(kv, bias, names):
    torch.manual_seed(0)
    orig = ThreeLinears(kv=kv, bias=bias, names=names)
    torch.manual_seed(0)
    fused = FusedThree(kv=kv, bias=bias, names=names)
    # same RNG stream -> same initial weights as the separate layers
    assert fused.state_dict().keys() == orig.state_dict().keys()
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in orig.state_dict().items())
    with torch.no_grad():
        for p in orig.parameters():
            p.normal_()
    fused.load_state_dict(orig.state_dict(), strict=True)
    x = torch.randn(3, 5, 16, requires_grad=True)
    outs_f, outs_o = fused(x), orig(x)
    for a, b in zip(outs_f, outs_o):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)
    gs = [torch.randn_like(o) for o in outs_o]
    loss_f = sum((o * g).sum() for o, g in zip(outs_f, gs))
    loss_o = sum((o * g).sum() for o, g in zip(outs_o, gs))
    (gx_f,) = torch.autograd.grad(loss_f, [x])
    (gx_o,) = torch.autograd.grad(loss_o, [x])
    torch.testing.assert_close(gx_f, gx_o, atol=ATOL, rtol=1e-5)
    # saved state dict loads strictly into the original class, with identical values
    back = ThreeLinears(kv=kv, bias=bias, names=names)
    back.load_state_dict(fused.state_dict(), strict=True)
    for k, v in orig.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # the views callers apply to Linear outputs work on the projections
    for o in outs_f:
        o.view(3, 5, 2, o.shape[-1] // 2), o.view(15, o.shape[-1])


def test_fused_qkv_nested_deepcopied_and_root_round_trips():
    class Block(nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.attn = FusedThree() if fused else ThreeLinears()

    fused_model = nn.Sequential(Block(True), nn.ModuleList([Block(True)]))
    orig_model = nn.Sequential(Block(False), nn.ModuleList([Block(False)]))
    sd = orig_model.state_dict()
    assert set(fused_model.state_dict()) == set(sd)
    clone = copy.deepcopy(fused_model)
    clone.load_state_dict(sd, strict=True)
    assert torch.equal(clone[1][0].attn.qkv.weight[16:32], sd["1.0.attn.key.weight"])
    # missing or unexpected keys are still reported
    broken = dict(sd)
    del broken["0.attn.value.bias"]
    with pytest.raises(RuntimeError, match="value.bias"):
        clone.load_state_dict(broken, strict=True)
    # a FusedQKV that is itself the root saves/loads the three names at top level
    root = kernels.FusedQKV(8, 8)
    assert set(root.state_dict()) == {f"{n}.{p}" for n in ("query", "key", "value") for p in ("weight", "bias")}
    root2 = kernels.FusedQKV(8, 8)
    root2.load_state_dict(root.state_dict(), strict=True)
    assert torch.equal(root2.weight, root.weight)


# ---------------------------------------------------------------- softmax
@pytest.mark.parametrize("dim", [-1, 1, 0])
@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_softmax_matches_torch(dim, dtype):
    x = torch.randn(3, 5, 17, requires_grad=True)
    g = torch.randn(3, 5, 17, dtype=dtype or torch.float32)
    out = kernels.softmax(x, dim, dtype=dtype)
    ref = F.softmax(x, dim, dtype=dtype)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    assert_close_all(grads(out, [x], g), grads(ref, [x], g))
    torch.testing.assert_close(kernels.Softmax(dim)(x), F.softmax(x, dim), atol=ATOL, rtol=1e-5)
    assert kernels.Softmax().dim == -1


# ---------------------------------------------------------------- attention
def reference_attention(q, k, v, additive=None, scale=None, causal=False):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    if additive is not None:
        s = s + additive
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    w = s.softmax(-1)
    return w @ v, w


def _qkv(b=2, h=3, s=7, d=8, kv_heads=None, kv_len=None):
    q = torch.randn(b, h, s, d, requires_grad=True)
    k = torch.randn(b, kv_heads or h, kv_len or s, d, requires_grad=True)
    v = torch.randn(b, kv_heads or h, kv_len or s, d, requires_grad=True)
    return q, k, v


def _padding(b=2, s=7):
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, -3:] = False
    return keep


@pytest.mark.parametrize("case", ["none", "pad_float", "pad_bool", "square_mask", "causal", "causal_pad",
                                  "t5_bias", "t5_bias_pad", "gqa"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_attention_matches_reference(case, need_weights):
    torch.manual_seed(0)
    q, k, v = _qkv(kv_heads=1 if case == "gqa" else None)
    keep = _padding()
    float_pad = torch.zeros(2, 1, 1, 7).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    kwargs, additive, causal, scale = {}, None, False, None
    if case == "pad_float":
        kwargs["mask"], additive = float_pad, float_pad
    elif case == "pad_bool":
        kwargs["mask"], additive = keep[:, None, None, :], float_pad
    elif case == "square_mask":
        m = torch.randn(2, 1, 7, 7)
        kwargs["mask"], additive = m, m
    elif case in ("causal", "causal_pad"):
        kwargs["is_causal"], causal = True, True
        if case == "causal_pad":
            kwargs["mask"], additive = float_pad, float_pad
    elif case.startswith("t5_bias"):
        bias = torch.randn(1, 3, 7, 7, requires_grad=True)
        kwargs["bias"], kwargs["scale"], scale, additive = bias, 1.0, 1.0, bias
        if case == "t5_bias_pad":
            kwargs["mask"], additive = float_pad, bias + float_pad
    out = attention(q, k, v, need_weights=need_weights, **kwargs)
    ref_out, ref_w = reference_attention(q, k, v, additive, scale, causal)
    if need_weights:
        out, weights = out
        torch.testing.assert_close(weights, ref_w, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    g = torch.randn_like(out)
    inputs = [q, k, v] + ([kwargs["bias"]] if "bias" in kwargs else [])
    assert_close_all(grads(out, inputs, g), grads(ref_out, inputs, g), atol=1e-4)


def test_attention_cuts_masks_made_for_a_longer_key_cache():
    q, k, v = _qkv()
    long_mask = torch.randn(2, 1, 7, 10)
    ref_out, _ = reference_attention(q, k, v, long_mask[..., :7])
    torch.testing.assert_close(attention(q, k, v, mask=long_mask), ref_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(attention(q, k, v, mask=long_mask, need_weights=True)[0], ref_out, atol=ATOL, rtol=1e-5)


def test_attention_dropout_only_when_asked():
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.0), attention(q, k, v))
    torch.manual_seed(0)
    out, w = attention_eager(q, k, v, dropout_p=0.5)
    assert ((w == 0).float().mean() - 0.5).abs() < 0.15
    assert not torch.allclose(attention(q, k, v, dropout_p=0.5), attention(q, k, v))
    # CPU + dropout: the eager path, which draws the mask exactly like the unfused BERT code
    torch.manual_seed(3)
    out = attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    probs = F.dropout(F.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1), 0.3)
    torch.testing.assert_close(out, probs @ v, atol=ATOL, rtol=1e-5)


# ---------------------------------------------------------------- Conv/Linear + BatchNorm
class ConvBN(nn.Module):
    def __init__(self, fused, momentum=0.1, affine=True, track=True, groups=1, bias=True):
        super().__init__()
        if fused:
            self.conv = kernels.FusedConv2dBatchNorm2d(4, 6, 3, stride=2, padding=1, groups=groups, bias=bias,
                                                       bn_momentum=momentum, bn_affine=affine,
                                                       bn_track_running_stats=track, bn_eps=1e-3, bn_name="bn1")
        else:
            self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=groups, bias=bias)
            self.bn1 = nn.BatchNorm2d(6, eps=1e-3, momentum=momentum, affine=affine, track_running_stats=track)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y = self.conv(x) if isinstance(self.conv, kernels.FusedConv2dBatchNorm2d) else self.bn1(self.conv(x))
        return self.head(y.mean((2, 3)))


class LinearBN(nn.Module):
    def __init__(self, fused, momentum=0.1, affine=True, track=True):
        super().__init__()
        if fused:
            self.fc = kernels.FusedLinearBatchNorm1d(5, 7, bn_momentum=momentum, bn_affine=affine,
                                                     bn_track_running_stats=track, bn_name="norm")
        else:
            self.fc = nn.Linear(5, 7)
            self.norm = nn.BatchNorm1d(7, momentum=momentum, affine=affine, track_running_stats=track)

    def forward(self, x):
        return self.fc(x) if isinstance(self.fc, kernels.FusedLinearBatchNorm1d) else self.norm(self.fc(x))


def _pair(cls, **kw):
    torch.manual_seed(0)
    orig = cls(False, **kw)
    with torch.no_grad():
        for p in orig.parameters():
            p.normal_()
    fused = cls(True, **kw)
    fused.load_state_dict(orig.state_dict(), strict=True)
    assert list(fused.state_dict()) == list(orig.state_dict()) or set(fused.state_dict()) == set(orig.state_dict())
    return orig, fused


@pytest.mark.parametrize("cls,shape", [(ConvBN, (3, 4, 9, 11)), (LinearBN, (6, 5))])
@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"affine": False}, {"track": False}])
def test_batch_norm_fusion_training_then_eval(cls, shape, kw):
    orig, fused = _pair(cls, **kw)
    params_o, params_f = list(orig.parameters()), list(fused.parameters())
    for step in range(3):  # training: identical outputs, grads and running statistics
        x = torch.randn(shape, requires_grad=True)
        out_o, out_f = orig(x), fused(x)
        torch.testing.assert_close(out_f, out_o, atol=ATOL, rtol=1e-5)
        g = torch.randn_like(out_o)
        assert_close_all(grads(out_f, [x] + params_f, g), grads(out_o, [x] + params_o, g), atol=1e-4)
    for k, v in orig.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[k], v, atol=ATOL, rtol=1e-5)
    orig.eval(), fused.eval()
    x = torch.randn(shape, requires_grad=True)
    out_o, out_f = orig(x), fused(x)  # eval with grad: folded weights stay differentiable
    torch.testing.assert_close(out_f, out_o, atol=ATOL, rtol=1e-5)
    g = torch.randn_like(out_o)
    assert_close_all(grads(out_f, [x] + params_f, g), grads(out_o, [x] + params_o, g), atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), orig(x), atol=ATOL, rtol=1e-5)
    back = cls(False, **kw)
    back.load_state_dict(fused.state_dict(), strict=True)


def test_batch_norm_fold_cache_is_refreshed_when_parameters_change():
    orig, fused = _pair(ConvBN)
    orig.eval(), kernels.freeze(fused)  # (a fold is kept between calls only under freeze)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        fused(x)
        w1 = fused.conv._fold_cache[0]
        assert fused(x) is not None and fused.conv._fold_cache[0] is w1  # cached
        for m in (orig, fused):
            m.conv.weight.mul_(2)
        orig.bn1.running_var.add_(1)
        fused.conv.bn.running_var.add_(1)
        torch.testing.assert_close(fused(x), orig(x), atol=ATOL, rtol=1e-5)
        assert fused.conv._fold_cache[0] is not w1
        # load_state_dict copies in place: also picked up
        orig2, _ = _pair(ConvBN)
        orig2.eval()
        fused.load_state_dict(orig2.state_dict(), strict=True)
        torch.testing.assert_close(fused(x), orig2(x), atol=ATOL, rtol=1e-5)


def test_fused_conv_bn_keys_and_num_batches_tracked():
    _, fused = _pair(ConvBN)
    assert "bn1.num_batches_tracked" in fused.state_dict() and not any(".bn." in k for k in fused.state_dict())
    fused.train()
    fused(torch.randn(2, 4, 6, 6))
    assert int(fused.state_dict()["bn1.num_batches_tracked"]) == 1
    with pytest.raises(ValueError):
        kernels.FusedConv2dBatchNorm2d(3, 3, 1, bn_name="a.b")


# ---------------------------------------------------------------- backend selection
def test_backend_selection(monkeypatch):
    x = torch.randn(2, 3)
    assert backend.select_backend("op", [x], has_triton=True, has_xformers=True) == "torch"  # CPU auto
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert backend.select_backend("op", [x], has_triton=True) == "torch"
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert backend.select_backend("op", [x], has_triton=False) == "torch"  # op without a triton kernel
    with pytest.raises(backend.KernelBackendError, match="TRITON_INTERPRET"):
        backend.select_backend("op", [x], has_triton=True)
    monkeypatch.setenv(backend.ENV_VAR, "xformers")
    with pytest.raises(backend.KernelBackendError, match="no operator"):
        backend.select_backend("op", [x], has_xformers=True)
    monkeypatch.setenv(backend.ENV_VAR, "cuda-magic")
    with pytest.raises(backend.KernelBackendError, match="not one of"):
        backend.select_backend("op", [x])
    # the lazy support check is not evaluated when the device rules the backend out
    monkeypatch.delenv(backend.ENV_VAR)

    def boom():
        raise AssertionError("evaluated")

    assert backend.select_backend("op", [x], has_triton=boom) == "torch"


def test_import_needs_no_triton_or_xformers():
    code = (
        "import sys, torch, adopter.kernels as k\n"
        "x = torch.randn(2, 4, 8, requires_grad=True)\n"
        "k.FusedDropoutAddLayerNorm(8, 0.1)(x, x).sum().backward()\n"
        "k.softmax(x); k.FusedLinearBiasGeLU(8, 8)(x); k.attention(x[None], x[None], x[None])\n"
        "assert 'triton' not in sys.modules and 'xformers' not in sys.modules, sorted(sys.modules)\n"
    )
    env = {key: val for key, val in os.environ.items() if key != backend.ENV_VAR}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------- state dicts of same-name replacements
def test_layer_norm_and_gelu_replacements_keep_parent_keys_both_ways():
    class Orig(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(8, 12)
            self.LayerNorm = nn.LayerNorm(12, eps=1e-12)
            self.dropout = nn.Dropout(0.1)

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = kernels.FusedLinearBiasGeLU(8, 12)
            self.LayerNorm = kernels.FusedDropoutAddLayerNorm(12, p=0.1, eps=1e-12)

    orig, fused = Orig(), Fused()
    with torch.no_grad():
        for p in orig.parameters():
            p.normal_()
    fused.load_state_dict(orig.state_dict(), strict=True)
    back = Orig()
    back.load_state_dict(fused.state_dict(), strict=True)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in orig.state_dict().items())


# ---------------------------------------------------------------- torch.fx symbolic tracing
class TracedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = kernels.FusedQKV(16, 16)
        self.LayerNorm = kernels.FusedDropoutAddLayerNorm(16, p=0.1)
        self.intermediate = kernels.FusedLinearBiasGeLU(16, 24, approximate="tanh")
        self.down = kernels.FusedLinearBatchNorm1d(24, 6, bn_name="bn")
        self.softmax = kernels.Softmax(-1)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x)
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (q, k, v))
        ctx = kernels.attention(q, k, v, mask=mask, dropout_p=0.0).transpose(1, 2).reshape(b, s, 16)
        h = self.LayerNorm(ctx, x)
        return self.softmax(self.down(self.intermediate(h).reshape(b * s, 24)))


@pytest.mark.parametrize("training", [False, True])
def test_kernels_trace_with_torch_fx_as_single_nodes(training):
    torch.manual_seed(0)
    block = TracedBlock().train(training)
    traced = torch.fx.symbolic_trace(block)
    targets = {getattr(n.target, "__name__", n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert {"qkv_projection", "attention", "dropout_add_layer_norm", "linear_bias_gelu", "softmax"} <= targets
    x, mask = torch.randn(3, 5, 16), torch.zeros(3, 1, 1, 5)
    torch.manual_seed(1)
    out_traced = traced(x, mask)
    torch.manual_seed(1)
    out = block(x, mask)
    torch.testing.assert_close(out_traced, out, atol=ATOL, rtol=1e-5)


def test_conv_bn_traces_in_eval():
    _, fused = _pair(ConvBN)
    fused.eval()
    traced = torch.fx.symbolic_trace(fused)
    x = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(traced(x), fused(x), atol=ATOL, rtol=1e-5)


# ---------------------------------------------------------------- xformers path (layout and bias handling)
class _FakeLowerTriangularMask:
    pass


def _fake_memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None):
    # xformers' contract: (batch, seq, heads, head_dim) inputs, bias (batch, heads, q, k) or a mask object
    assert q.dim() == 4 and q.shape[2] == k.shape[2] == v.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    s = qt @ kt.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if isinstance(attn_bias, _FakeLowerTriangularMask):
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    elif attn_bias is not None:
        assert attn_bias.shape == s.shape and attn_bias.stride(-2) % 8 == 0
        s = s + attn_bias
    return (s.softmax(-1) @ vt).transpose(1, 2)


@pytest.mark.parametrize("case", ["pad_bool", "causal", "causal_bias", "gqa"])
def test_attention_xformers_path_layout(monkeypatch, case):
    import types

    from adopter.kernels.ops import attention as attention_ops

    fake = types.ModuleType("xformers.ops")
    fake.memory_efficient_attention = _fake_memory_efficient_attention
    fake.LowerTriangularMask = _FakeLowerTriangularMask
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    monkeypatch.setitem(sys.modules, "xformers.ops", fake)
    torch.manual_seed(0)
    q, k, v = _qkv(kv_heads=1 if case == "gqa" else None)
    kwargs = {}
    if case == "pad_bool":
        kwargs["mask"] = _padding()[:, None, None, :]
    if case.startswith("causal"):
        kwargs["is_causal"] = True
    if case == "causal_bias":
        kwargs["bias"], kwargs["scale"] = torch.randn(1, 3, 7, 7), 1.0
    out = attention_ops.attention_xformers(q, k, v, **kwargs)
    torch.testing.assert_close(out, attention_ops.attention_sdpa(q, k, v, **kwargs), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- transformers' loader (no load_state_dict)
@pytest.mark.slow
def test_transformers_save_and_from_pretrained_round_trip(tmp_path):
    """transformers' from_pretrained resolves keys by module path and assigns with setattr, bypassing
    the load hooks: the unregistered parent views must make `query.weight`, `batch_norm.*` land."""
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyConfig(PretrainedConfig):
        model_type = "adopter-kernels-tiny"

    class Base(PreTrainedModel):
        config_class = TinyConfig

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                module.weight.data.normal_()

    class Original(Base):
        def __init__(self, config):
            super().__init__(config)
            self.query, self.key, self.value = (nn.Linear(8, n, bias=False) for n in (8, 4, 4))
            self.conv = nn.Conv2d(3, 4, 3)
            self.batch_norm = nn.BatchNorm2d(4)
            self.post_init()

    class Fused(Base):
        def __init__(self, config):
            super().__init__(config)
            self.qkv = kernels.FusedQKV(8, 8, bias=False, kv_out_features=4)
            self.conv = kernels.FusedConv2dBatchNorm2d(3, 4, 3)
            self.post_init()

    torch.manual_seed(0)
    original = Original(TinyConfig())
    with torch.no_grad():
        for t in list(original.parameters()) + [original.batch_norm.running_mean]:
            t.normal_()
    original.save_pretrained(tmp_path / "original")
    fused, info = Fused.from_pretrained(tmp_path / "original", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert set(fused.state_dict()) == set(original.state_dict())
    for key, value in original.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    assert "query" not in dict(fused.named_modules()) and len(list(fused.parameters())) == 5  # views only
    fused.save_pretrained(tmp_path / "fused")
    back = Original.from_pretrained(tmp_path / "fused")
    for key, value in original.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    x = torch.randn(2, 8)
    torch.testing.assert_close(fused.query(x), original.query(x))  # a view computes its projection
