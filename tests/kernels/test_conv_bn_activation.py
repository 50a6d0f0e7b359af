"""Conv2d + BatchNorm2d + activation (``adopter.kernels.conv_bn(conv, bn, x, activation)``): the result
is ``activation(bn(conv(x)))`` in aten's layout for every activation, layout, batch and geometry; a
plain ReLU runs in the oneDNN conv's epilogue (no separate relu op) and any other activation is
called; the route ``prepack_layout`` picks; the fallbacks (training, gradients, inference mode, a
channels-last model); the rewritten fixture classes behave as the originals (eager, TorchScript, fx,
training); ``GuardedSequential(conv, bn, relu)``.

The fused routes (a fold kept between calls, packed weights, the ReLU epilogue) are taken only under
``adopter.kernels.freeze``: the pairs and models here are frozen unless the test trains or takes
gradients of the parameters (then they are not, and fold per call or run the layers)."""
from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import conv_bn, freeze, guarded, unfreeze
from adopter.kernels.guarded_sequential import GuardedSequential
from adopter.kernels.ops import conv_prepacked
from adopter.kernels.telemetry import count_kernel_calls
from torch import nn
from torch.profiler import ProfilerActivity, profile

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rewrite"
RELU_OPS = {"aten::relu", "aten::relu_", "aten::clamp_min", "aten::clamp_min_", "aten::threshold", "aten::threshold_"}
POINTWISE = "mkldnn::_convolution_pointwise"


@pytest.fixture(autouse=True)
def _per_call_fold_on(monkeypatch):
    # the per-call fold as a user switches it on (off by default: guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE)
    monkeypatch.setattr(guarded, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", 0.01)


def _randomize_bn(bn: nn.BatchNorm2d) -> None:
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()


def _pair(conv: nn.Conv2d, *, seed: int = 0, frozen: bool = True) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    """``conv`` and a BatchNorm2d with random statistics, in eval mode; under ``freeze`` unless
    ``frozen`` is False."""
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(conv.out_channels, eps=1e-3)
    _randomize_bn(bn)
    if frozen:
        return freeze(conv), freeze(bn)
    return conv.eval(), bn.eval()


class _DoubledReLU(nn.ReLU):
    def forward(self, input):  # noqa: A002 - nn.ReLU's parameter name
        return super().forward(input) * 2.0


class _PlainSubclassReLU(nn.ReLU):
    pass


def _hooked_relu():
    relu = nn.ReLU()
    relu.calls = 0

    def hook(module, args, out):
        module.calls += 1
        return out + 0.5  # visible in the result: a skipped hook fails the comparison too

    relu.register_forward_hook(hook)
    return relu


ACTIVATIONS = {
    "ReLU": nn.ReLU,
    "ReLU-inplace": lambda: nn.ReLU(inplace=True),
    "F.relu": lambda: F.relu,
    "torch.relu": lambda: torch.relu,
    "SiLU": nn.SiLU,
    "Identity": nn.Identity,
    "ReLU-subclass-forward": _DoubledReLU,
    "ReLU-subclass": _PlainSubclassReLU,
    "ReLU-hooked": _hooked_relu,
}
FUSED = {"ReLU", "ReLU-inplace", "F.relu", "torch.relu"}

GEOMETRIES = {
    "1x1": lambda: nn.Conv2d(16, 32, 1),
    "3x3-pad1": lambda: nn.Conv2d(16, 24, 3, padding=1),
    "3x3-stride2": lambda: nn.Conv2d(16, 24, 3, stride=2, padding=1, bias=False),
    "3x3-groups": lambda: nn.Conv2d(16, 32, 3, padding=1, groups=4),
    "1x1-stride2": lambda: nn.Conv2d(16, 32, 1, stride=2),
}


def _input(batch: int, layout: str, channels: int = 16, size: int = 6, *, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(batch, channels, size, size)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


def _reference(conv, bn, x, act):
    """``act(bn(conv(x)))`` on deep copies (an in-place activation or a hook cannot interfere)."""
    conv, bn = copy.deepcopy(conv), copy.deepcopy(bn)
    act = act if not isinstance(act, nn.Module) else copy.deepcopy(act)
    with torch.no_grad():
        return act(bn(conv(x.clone())))


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


# ---------------------------------------------------------------- 1. equivalence


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("act_name", sorted(ACTIVATIONS))
def test_conv_bn_activation_matches_the_unfused_layers(geometry, batch, layout, act_name):
    conv, bn = _pair(GEOMETRIES[geometry]())
    act = ACTIVATIONS[act_name]()
    x = _input(batch, layout)
    x_before = x.clone()
    want = _reference(conv, bn, x, act)
    guarded._PACK_CACHE.pop(bn, None)
    for _ in range(2):  # the second call runs on what the first cached
        with torch.no_grad():
            got = conv_bn(conv, bn, x, act)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride(), "the result keeps the layout aten's conv + bn + activation gives"
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # the input is never written to
    if act_name == "ReLU-hooked":
        assert act.calls == 2, "the hook fires once per call"


def test_activation_none_is_bn_of_conv():
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    x = _input(2, "channels_last")
    with torch.no_grad():
        got = conv_bn(conv, bn, x)
        want = bn(conv(x))
    assert (want < 0).any(), "the check would see a ReLU applied by mistake"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.stride() == want.stride()


# ---------------------------------------------------------------- 2. the epilogue


@pytest.mark.parametrize(
    "make, layout",
    [
        (lambda: nn.Conv2d(16, 24, 3, padding=1), "channels_last"),
        (lambda: nn.Conv2d(16, 32, 1), "channels_last"),
        (lambda: nn.Conv2d(16, 24, 3, padding=1), "contiguous"),  # onednn_contiguous
        (lambda: nn.Conv2d(16, 24, 3, stride=2, padding=1, groups=4), "contiguous"),
    ],
    ids=["3x3-cl", "1x1-cl", "3x3-nchw", "3x3-grouped-nchw"],
)
def test_relu_runs_in_the_conv_epilogue_and_other_activations_are_called(make, layout):
    conv, bn = _pair(make())
    x = _input(2, layout)
    for relu in (nn.ReLU(), nn.ReLU(inplace=True), F.relu, torch.relu):
        with torch.no_grad():
            conv_bn(conv, bn, x, relu)  # (warm: packs and folds outside the profile)
            ops = _ops(lambda relu=relu: conv_bn(conv, bn, x, relu))
        assert POINTWISE in ops, ops
        assert not ops & RELU_OPS, f"a separate relu ran: {ops & RELU_OPS}"
        assert "aten::convolution" not in ops
    with torch.no_grad():
        ops = _ops(lambda: conv_bn(conv, bn, x, nn.SiLU()))
    assert any("silu" in op for op in ops), ops
    if layout == "channels_last":  # (an NCHW light conv with nothing to fuse runs aten's conv)
        assert POINTWISE in ops, ops
    with torch.no_grad():  # the same conv without an activation: no relu either
        ops = _ops(lambda: conv_bn(conv, bn, x))
    assert not ops & RELU_OPS


def test_a_relu_the_conv_cannot_apply_is_called():
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    x = _input(2, "channels_last")
    for act in (_PlainSubclassReLU(), _hooked_relu()):
        with torch.no_grad():
            ops = _ops(lambda act=act: conv_bn(conv, bn, x, act))
        assert ops & RELU_OPS, f"{type(act).__name__} is called, not fused: {ops}"


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_epilogue_switched_off_calls_the_relu(layout, monkeypatch):
    conv, bn = _pair(nn.Conv2d(8, 8, 3, padding=1))  # light: NCHW goes to oneDNN only with an epilogue
    x = _input(2, layout, channels=8)
    want = _reference(conv, bn, x, nn.ReLU())
    monkeypatch.setattr(conv_prepacked, "EPILOGUE", False)
    for relu in (nn.ReLU(), nn.ReLU(inplace=True), F.relu):
        with torch.no_grad():
            got = conv_bn(conv, bn, x, relu)
            ops = _ops(lambda relu=relu: conv_bn(conv, bn, x, relu))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride()
        assert ops & RELU_OPS, ops
        if layout == "contiguous":
            assert POINTWISE not in ops, "no epilogue: the light NCHW conv is aten's"
    monkeypatch.setattr(conv_prepacked, "EPILOGUE", True)
    with torch.no_grad():
        ops = _ops(lambda: conv_bn(conv, bn, x, nn.ReLU()))
    assert POINTWISE in ops and not ops & RELU_OPS, ops


def test_hooks_on_conv_or_bn_run_the_modules_with_the_activation():
    for hooked in ("conv", "bn"):
        conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
        x = _input(2, "channels_last")
        want = _reference(conv, bn, x, nn.ReLU())
        calls = []
        ({"conv": conv, "bn": bn}[hooked]).register_forward_hook(lambda m, a, o, calls=calls: calls.append(1))
        with torch.no_grad():
            got = conv_bn(conv, bn, x, nn.ReLU())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride() and len(calls) == 1


def test_torch_compile_sees_the_activation():
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    x = _input(2, "channels_last")
    for act in (nn.ReLU(), nn.SiLU()):
        want = _reference(conv, bn, x, act)
        torch._dynamo.reset()
        compiled = torch.compile(lambda t, act=act: conv_bn(conv, bn, t, act), backend="eager", fullgraph=True)
        with torch.no_grad():
            got = compiled(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_epilogue_activation_decides_by_exact_type_and_hooks():
    ep = guarded.epilogue_activation
    assert ep(nn.ReLU()) == ep(nn.ReLU(inplace=True)) == ep(F.relu) == ep(torch.relu) == "relu"
    for act in (nn.SiLU(), nn.Identity(), _DoubledReLU(), _PlainSubclassReLU(), _hooked_relu(), nn.ReLU6(),
                F.silu, torch.sigmoid, lambda t: t.relu()):
        assert ep(act) == "", act
    relu = nn.ReLU()
    relu.register_forward_pre_hook(lambda module, args: None)
    assert ep(relu) == ""
    own_forward = nn.ReLU()  # a forward set on the instance is what calling it runs
    own_forward.forward = lambda t: t * 3
    assert ep(own_forward) == ""


# ---------------------------------------------------------------- 3. routes


def _route(conv: nn.Conv2d, x: torch.Tensor, attr: str = "none") -> str:
    with torch.no_grad():
        return conv_prepacked.prepack_layout(x, conv.weight, conv.bias, conv.padding, conv.stride, conv.dilation,
                                             conv.groups, conv.padding_mode, attr=attr)


def test_route_choice_for_light_nchw_convs():
    one = nn.Conv2d(16, 16, 1)  # 256 weights next to thousands of activations: light
    min_batch = conv_prepacked.NCHW_ONEDNN_MIN_BATCH_1X1
    assert _route(one, torch.randn(min_batch, 16, 8, 8)) == "onednn_contiguous"
    assert _route(one, torch.randn(min_batch - 1, 16, 8, 8)) == ""
    assert _route(one, torch.randn(1, 16, 8, 8)) == ""
    # below the batch threshold aten's GEMM + a separate ReLU is still faster than oneDNN with it fused
    assert _route(one, torch.randn(min_batch - 1, 16, 8, 8), attr="relu") == ""
    # over a large spatial extent aten's GEMM wins at any batch (ResNet-50's 56x56 expansion: 3.5x)
    side = int(conv_prepacked.NCHW_ONEDNN_MAX_HW_1X1 ** 0.5)
    assert _route(one, torch.randn(min_batch, 16, side, side)) == "onednn_contiguous"
    assert _route(one, torch.randn(min_batch, 16, side + 1, side + 1)) == ""
    assert _route(one, torch.randn(min_batch, 16, side + 1, side + 1), attr="relu") == ""
    three = nn.Conv2d(8, 8, 3, padding=1)  # 576 weights, 1024 activations at batch 1: light
    assert _route(three, torch.randn(1, 8, 8, 8), attr="relu") == "onednn_contiguous"
    assert _route(three, torch.randn(1, 8, 8, 8)) == ""
    assert _route(three, torch.randn(4, 8, 8, 8)) == ""  # (not a GEMM: the batch does not matter)
    strided = nn.Conv2d(16, 16, 1, stride=2)
    assert _route(strided, torch.randn(4, 16, 8, 8)) == ""
    assert _route(strided, torch.randn(4, 16, 8, 8), attr="relu") == "onednn_contiguous"
    # channels-last inputs are packed whatever the attr
    x_cl = torch.randn(1, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    assert _route(three, x_cl) == _route(three, x_cl, attr="relu") == "channels_last"
    # gradients to record: aten
    with torch.enable_grad():
        assert conv_prepacked.prepack_layout(
            torch.randn(4, 8, 8, 8), three.weight, three.bias, three.padding, three.stride, three.dilation,
            three.groups, three.padding_mode, attr="relu") == ""


@pytest.mark.parametrize("how", ["weight.data", "module.to"])
@pytest.mark.parametrize("act_name", ["ReLU", "SiLU", "none"])
def test_channels_last_weight_with_nchw_input_runs_aten_in_its_layout(how, act_name):
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    if how == "weight.data":
        conv.weight.data = conv.weight.contiguous(memory_format=torch.channels_last)
    else:
        conv.to(memory_format=torch.channels_last)
        bn.to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    x = _input(2, "contiguous")
    assert _route(conv, x) == _route(conv, x, attr="relu") == ""
    act = {"ReLU": nn.ReLU(), "SiLU": nn.SiLU(), "none": nn.Identity()}[act_name]
    want = _reference(conv, bn, x, act)
    with torch.no_grad():
        got = conv_bn(conv, bn, x, None if act_name == "none" else act)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.stride() == want.stride()


def test_onednn_contiguous_route_is_taken_and_keeps_nchw():
    conv, bn = _pair(nn.Conv2d(16, 32, 1))
    x = _input(4, "contiguous")
    guarded._PACK_CACHE.pop(bn, None)
    with torch.no_grad():
        conv_bn(conv, bn, x)
        ops = _ops(lambda: conv_bn(conv, bn, x))
        got = conv_bn(conv, bn, x)
    assert POINTWISE in ops and bn not in guarded._PACK_CACHE  # the plain weight: nothing packed
    want = _reference(conv, bn, x, nn.Identity())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.is_contiguous() and got.stride() == want.stride()
    x1 = _input(1, "contiguous")
    with torch.no_grad():
        ops = _ops(lambda: conv_bn(conv, bn, x1))
    assert POINTWISE not in ops  # batch 1: aten's own GEMM


# ---------------------------------------------------------------- 4. fallbacks


def _forward_backward_against_reference(conv, bn, act, x):
    """``conv_bn(conv, bn, x, act)`` against ``act(bn(conv(x)))`` on deep copies: output, its
    strides, and the gradients of the input and of every parameter after one backward."""
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    ref_act = copy.deepcopy(act) if isinstance(act, nn.Module) else act
    x = x.requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    got = conv_bn(conv, bn, x, act)
    want = ref_act(ref_bn(ref_conv(x_ref)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.stride() == want.stride()
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    for p, q in zip(list(conv.parameters()) + list(bn.parameters()),
                    list(ref_conv.parameters()) + list(ref_bn.parameters())):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    return got, ref_bn


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("act_name", ["ReLU-inplace", "F.relu", "SiLU", "ReLU-hooked"])
def test_training_mode_matches_outputs_and_gradients(layout, act_name):
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1), frozen=False)
    conv.train(), bn.train()
    act = ACTIVATIONS[act_name]()
    got, ref_bn = _forward_backward_against_reference(conv, bn, act, _input(4, layout))
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)  # batch statistics were used and tracked
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    assert bn.num_batches_tracked == ref_bn.num_batches_tracked == 1
    if act_name == "ReLU-hooked":
        assert act.calls == 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("act_name", ["ReLU", "ReLU-inplace", "SiLU"])
def test_eval_with_input_gradient_matches(layout, act_name):
    # not frozen, parameters requiring grad: a light conv on a large input folds on each call
    # (differentiably), a heavy one runs the two layers
    for conv, size in ((nn.Conv2d(16, 24, 1), 32), (nn.Conv2d(16, 24, 3, padding=1), 6)):
        conv, bn = _pair(conv, frozen=False)
        x = _input(2, layout, size=size)
        assert guarded._fold_pays_per_call(conv.weight, x) == (size == 32)
        with count_kernel_calls() as calls:
            got, _ = _forward_backward_against_reference(conv, bn, ACTIVATIONS[act_name](), x)
        assert got.requires_grad
        assert [c.fused for c in calls.calls if c.kernel == "conv_bn"] == [size == 32]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("act_name", ["ReLU", "ReLU-inplace", "torch.relu", "SiLU"])
def test_inference_mode(layout, act_name):
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    act = ACTIVATIONS[act_name]()
    x = _input(2, layout)
    want = _reference(conv, bn, x, act)
    guarded._PACK_CACHE.pop(bn, None)
    guarded._FOLD_CACHE.pop(bn, None)
    with torch.inference_mode():
        got = conv_bn(conv, bn, x, act)
        got_inf_input = conv_bn(conv, bn, x.clone(), act)  # an inference tensor as input
    for out in (got, got_inf_input):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        assert out.stride() == want.stride()
    with torch.no_grad():  # what was cached in inference mode serves later calls
        torch.testing.assert_close(conv_bn(conv, bn, x, act), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("input_layout", ["contiguous", "channels_last"])
def test_channels_last_model(input_layout):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(inplace=True))
    _randomize_bn(model[1])
    freeze(model.to(memory_format=torch.channels_last))
    x = _input(2, input_layout)
    for act in (model[2], nn.SiLU()):
        want = _reference(model[0], model[1], x, act)
        with torch.no_grad():
            got = conv_bn(model[0], model[1], x, act)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride()


def test_float64_runs_aten_and_applies_the_activation():
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1).double())
    bn.double()
    x = _input(2, "channels_last").double()
    for act in (nn.ReLU(), F.relu, nn.SiLU()):
        want = _reference(conv, bn, x, act)
        with torch.no_grad():
            ops = _ops(lambda act=act: conv_bn(conv, bn, x, act))
            got = conv_bn(conv, bn, x, act)
        assert POINTWISE not in ops
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert got.dtype == torch.float64 and got.stride() == want.stride()


# ---------------------------------------------------------------- 5. rewritten modules

BEFORE = runpy.run_path(str(FIXTURES / "conv_batchnorm_activation.before.py"))
AFTER = runpy.run_path(str(FIXTURES / "conv_batchnorm_activation.after.py"))
C = 16

MODULES = {
    "TorchvisionBottleneck": (lambda ns: ns["TorchvisionBottleneck"](C), ["relu"]),
    "Nested-ReLU": (lambda ns: ns["Nested"](C, nn.ReLU), ["act"]),
    "Nested-SiLU": (lambda ns: ns["Nested"](C, nn.SiLU), ["act"]),
    "Functional": (lambda ns: ns["Functional"](C), []),
    "NotAnActivation": (lambda ns: ns["NotAnActivation"](C), ["act"]),
}


def _modules(name: str) -> tuple[nn.Module, nn.Module]:
    build = MODULES[name][0]
    torch.manual_seed(0)
    before = build(BEFORE)
    for module in before.modules():
        if isinstance(module, nn.BatchNorm2d):
            _randomize_bn(module)
    after = build(AFTER)
    assert type(after) is not type(before)
    after.load_state_dict(before.state_dict())
    return before.eval(), after.eval()


def _frozen_modules(name: str) -> tuple[nn.Module, nn.Module]:
    """:func:`_modules` with the rewritten module under ``freeze`` (its folds kept between calls)."""
    before, after = _modules(name)
    return before, freeze(after)


def _assert_same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert g.stride() == w.stride()


def _inputs():
    x = _input(2, "contiguous", channels=C, size=8, seed=3)
    return [x, x.contiguous(memory_format=torch.channels_last), _input(4, "contiguous", channels=C, size=8, seed=4)]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_rewritten_module_matches_the_original_in_eval(name):
    before, after = _frozen_modules(name)
    for x in _inputs():
        with torch.no_grad():
            want = before(x.clone())
            got = after(x.clone())
        _assert_same(got, want)
        # the rewritten module really runs conv_bn: the fold is cached for its batch norms
        bns = [m for m in after.modules() if isinstance(m, nn.BatchNorm2d)]
        assert all(bn in guarded._FOLD_CACHE for bn in bns)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", sorted(MODULES))
def test_rewritten_module_scripts(name):
    before, after = _modules(name)
    scripted = torch.jit.script(after)
    for x in _inputs()[:2]:
        with torch.no_grad():
            _assert_same(scripted(x.clone()), before(x.clone()))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_rewritten_module_fx_traces(name):
    before, after = _frozen_modules(name)
    traced = torch.fx.symbolic_trace(after)
    targets = {node.target for node in traced.graph.nodes if node.op == "call_module"}
    for act in MODULES[name][1]:
        assert act in targets, f"the activation module {act!r} shows in the graph: {targets}"
    if name == "Functional":
        assert any(node.op == "call_function" and node.target in (F.relu, torch.relu)
                   for node in traced.graph.nodes), traced.code
    # fx records the original modules, not the fold's ops (the graph then follows traced.train())
    convs_bns = {n for n, m in after.named_modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))}
    assert convs_bns and convs_bns <= targets, (convs_bns, targets)
    assert "mkldnn" not in traced.code and "fold_batch_norm" not in traced.code
    for x in _inputs()[:2]:
        with torch.no_grad():
            _assert_same(traced(x.clone()), before(x.clone()))
    # the graph follows a later change of the weights
    with torch.no_grad():
        for m in (before, after):
            for bn in (mod for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)):
                bn.running_var.mul_(2.0)
        x = _inputs()[0]
        _assert_same(traced(x.clone()), before(x.clone()))
    # ... and a later switch to training mode (batch statistics, running stats updated alike)
    unfreeze(after)
    before.train(), traced.train()
    x = _inputs()[2]
    with torch.no_grad():
        _assert_same(traced(x.clone()), before(x.clone()))
    traced_state, before_state = traced.state_dict(), before.state_dict()
    assert traced_state.keys() == before_state.keys()
    for key, want in before_state.items():
        torch.testing.assert_close(traced_state[key], want, msg=key)  # running stats updated alike


@pytest.mark.parametrize("name", sorted(MODULES))
def test_rewritten_module_matches_the_original_in_training(name):
    before, after = _modules(name)
    before.train(), after.train()
    x = _input(4, "channels_last", channels=C, size=8, seed=5)
    xb, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = before(xb), after(xa)
    _assert_same(got, want)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    torch.manual_seed(7)
    grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(want, grads)
    torch.autograd.backward(got, grads)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
    pb, pa = dict(before.named_parameters()), dict(after.named_parameters())
    assert pb.keys() == pa.keys()
    for key in pb:
        torch.testing.assert_close(pa[key].grad, pb[key].grad, rtol=1e-4, atol=1e-4, msg=key)
    sb, sa = before.state_dict(), after.state_dict()
    for key in sb:
        torch.testing.assert_close(sa[key], sb[key], msg=key)  # running stats updated alike


def test_bottleneck_relu_runs_in_the_epilogue():
    before, after = _frozen_modules("TorchvisionBottleneck")
    x = _input(2, "channels_last", channels=C, size=8)
    with torch.no_grad():
        after(x)
        ops_after = _ops(lambda: after(x))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            before(x)
    relus_before = sum(e.name in ("aten::relu", "aten::relu_") for e in prof.events())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            after(x)
    relus_after = sum(e.name in ("aten::relu", "aten::relu_") for e in prof.events())
    add_relus_after = sum(e.name == "aten::_add_relu_" for e in prof.events())
    assert POINTWISE in ops_after
    # the ReLUs after the convs run in their epilogues, the one after the residual add in add_relu
    assert (relus_before, relus_after, add_relus_after) == (2, 0, 1)


# ---------------------------------------------------------------- 6. GuardedSequential


def _sequentials(act: nn.Module, *, conv=None):
    torch.manual_seed(0)
    conv = conv or nn.Conv2d(16, 24, 3, padding=1)
    bn = nn.BatchNorm2d(24)
    _randomize_bn(bn)
    children = (conv, bn, act)
    plain = nn.Sequential(*copy.deepcopy(children)).eval()
    guarded_seq = freeze(GuardedSequential(*children))
    return plain, guarded_seq


@pytest.mark.parametrize("act_factory", [nn.ReLU, lambda: nn.ReLU(inplace=True), nn.SiLU, _hooked_relu,
                                         _PlainSubclassReLU],
                         ids=["ReLU", "ReLU-inplace", "SiLU", "ReLU-hooked", "ReLU-subclass"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_guarded_sequential_matches_sequential(act_factory, layout):
    plain, seq = _sequentials(act_factory())
    assert list(seq.state_dict()) == list(plain.state_dict())
    for batch in (1, 4):
        x = _input(batch, layout)
        with torch.no_grad():
            want = plain(x.clone())
            got = seq(x.clone())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride()
    assert seq[1] in guarded._FOLD_CACHE, "the pair ran through conv_bn"
    if isinstance(seq[2], nn.ReLU) and hasattr(seq[2], "calls"):
        assert seq[2].calls == 2


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_guarded_sequential_relu_in_the_epilogue(layout):
    _, seq = _sequentials(nn.ReLU())
    x = _input(2, layout)
    with torch.no_grad():
        seq(x)
        ops = _ops(lambda: seq(x))
    assert POINTWISE in ops and not ops & RELU_OPS, ops
    _, seq = _sequentials(nn.SiLU())
    with torch.no_grad():
        seq(x)
        ops = _ops(lambda: seq(x))
    assert any("silu" in op for op in ops), ops


def test_guarded_sequential_longer_chains_and_training():
    torch.manual_seed(0)
    children = [nn.Conv2d(16, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(),
                nn.Conv2d(24, 24, 1), nn.BatchNorm2d(24), nn.ReLU(inplace=True),
                nn.Conv2d(24, 8, 3), nn.BatchNorm2d(8)]
    for child in children:
        if isinstance(child, nn.BatchNorm2d):
            _randomize_bn(child)
    plain = nn.Sequential(*copy.deepcopy(children)).eval()
    seq = freeze(GuardedSequential(*children))
    assert list(seq.state_dict()) == list(plain.state_dict())
    for x in (_input(4, "contiguous"), _input(2, "channels_last")):
        with torch.no_grad():
            want, got = plain(x), seq(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride()
    assert all(seq[i] in guarded._FOLD_CACHE for i in (1, 4, 7)), "the pairs ran through conv_bn"
    unfreeze(seq)
    plain.train(), seq.train()
    x = _input(4, "channels_last")
    xp, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = plain(xp), seq(xs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(xs.grad, xp.grad, rtol=1e-4, atol=1e-4)
    for (name, p), (_, q) in zip(seq.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)
