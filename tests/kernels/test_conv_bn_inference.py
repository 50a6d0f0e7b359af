"""Eval-mode Conv2d+BatchNorm2d on CPU (``adopter.kernels.conv_bn`` and ``FusedConv2dBatchNorm2d``):
the folded conv, run on a oneDNN weight packed once where that pays
(``kernels/ops/conv_prepacked.py``), computes what ``bn(conv(x))`` computes, in the layout it gives,
for every conv geometry; anything the packed path does not cover runs aten's conv on the folded
weights; a change of any weight, buffer or ``eps`` is seen; inference mode and inference tensors
work; fx, dynamo and torch.export see aten's conv.

Folds and packed weights are kept between calls only under ``adopter.kernels.freeze`` (the user's
promise that the weights no longer change): the pairs here are frozen unless a test says otherwise."""
from __future__ import annotations

import pytest
import torch
from adopter.kernels import FusedConv2dBatchNorm2d, batch_norm, conv_bn, freeze, guarded, is_frozen
from adopter.kernels.ops import conv_prepacked
from torch import nn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


def _pair(conv: nn.Conv2d, *, seed: int = 0, frozen: bool = True) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    """``conv`` and a BatchNorm2d with random statistics, in eval mode; under ``freeze`` unless
    ``frozen`` is False."""
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(conv.out_channels, eps=1e-3, dtype=conv.weight.dtype)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    if frozen:
        return freeze(conv), freeze(bn)
    return conv.eval(), bn.eval()


def _reference(conv, bn, x):
    with torch.no_grad():
        return bn(conv(x))


def _check(conv, bn, x, *, packed: bool):
    guarded._PACK_CACHE.pop(bn, None)
    want = _reference(conv, bn, x)
    with torch.no_grad():
        got = conv_bn(conv, bn, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.stride() == want.stride(), "the result keeps the layout aten's conv gives"
    assert (bn in guarded._PACK_CACHE) == packed
    return got


# (conv, input shape): weight-heavy next to the activations, so an NCHW input is packed too
GEOMETRIES = {
    "plain": (lambda: nn.Conv2d(64, 48, 3), (1, 64, 5, 5)),
    "no-bias": (lambda: nn.Conv2d(64, 48, 3, bias=False), (2, 64, 4, 4)),
    "stride-padding": (lambda: nn.Conv2d(64, 48, 3, stride=2, padding=1), (1, 64, 5, 7)),
    "dilation": (lambda: nn.Conv2d(64, 48, 3, dilation=2, padding=2), (1, 64, 5, 5)),
    "asymmetric": (lambda: nn.Conv2d(64, 48, (3, 1), stride=(2, 1), padding=(1, 0)), (1, 64, 5, 3)),
    "groups": (lambda: nn.Conv2d(64, 96, 3, groups=4, padding=1), (1, 64, 3, 3)),
    "depthwise": (lambda: nn.Conv2d(64, 64, 3, groups=64, padding=1, bias=False), (1, 64, 4, 4)),
    "1x1": (lambda: nn.Conv2d(512, 256, 1), (1, 512, 3, 3)),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_packed_conv_matches_the_unfused_layers(name, layout):
    make, shape = GEOMETRIES[name]
    conv, bn = _pair(make())
    x = torch.randn(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    groups = conv.groups
    packed = not (groups == conv.in_channels and layout == "contiguous")  # depthwise: light weight
    got = _check(conv, bn, x, packed=packed)
    if layout == "contiguous":
        assert got.view(got.shape[0], -1).shape[1] == got[0].numel()  # .view of the result works


def test_large_activations_in_nchw_run_aten_and_channels_last_is_packed():
    conv, bn = _pair(nn.Conv2d(8, 16, 3, padding=1))
    x = torch.randn(2, 8, 16, 16)
    _check(conv, bn, x, packed=False)  # (the weight is small next to the activations)
    _check(conv, bn, x.contiguous(memory_format=torch.channels_last), packed=True)


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
def test_padding_modes_run_aten_on_the_folded_weights(padding_mode):
    conv, bn = _pair(nn.Conv2d(64, 48, 3, padding=1, padding_mode=padding_mode))
    _check(conv, bn, torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last), packed=False)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_string_padding_runs_aten(padding):
    conv, bn = _pair(nn.Conv2d(64, 48, 3, padding=padding))
    _check(conv, bn, torch.randn(1, 64, 5, 5).contiguous(memory_format=torch.channels_last), packed=False)


def test_float64_and_ambiguous_or_strided_layouts_run_aten():
    conv, bn = _pair(nn.Conv2d(64, 48, 3, dtype=torch.float64))
    _check(conv, bn, torch.randn(1, 64, 5, 5, dtype=torch.float64), packed=False)
    conv, bn = _pair(nn.Conv2d(64, 48, 1))
    _check(conv, bn, torch.randn(2, 64, 1, 1), packed=False)  # NCHW and NHWC at once: aten decides
    _check(conv, bn, torch.randn(1, 64, 6, 6)[:, :, ::2, ::2], packed=False)  # a strided view


def test_switched_off_and_autocast_run_aten():
    conv, bn = _pair(nn.Conv2d(64, 48, 3))
    x = torch.randn(1, 64, 5, 5)
    conv_prepacked.ENABLED = False
    try:
        _check(conv, bn, x, packed=False)
    finally:
        conv_prepacked.ENABLED = True
    guarded._PACK_CACHE.pop(bn, None)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = bn(conv(x))
        got = conv_bn(conv, bn, x)
    assert got.dtype == want.dtype == torch.bfloat16 and bn not in guarded._PACK_CACHE
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.1)


def test_gradients_run_aten_and_flow():
    conv, bn = _pair(nn.Conv2d(64, 48, 3), frozen=False)
    x = torch.randn(1, 64, 5, 5, requires_grad=True)
    guarded._PACK_CACHE.pop(bn, None)
    out = conv_bn(conv, bn, x)  # grad enabled, parameters require grad: the differentiable fold
    out.sum().backward()
    assert bn not in guarded._PACK_CACHE and x.grad is not None and conv.weight.grad is not None
    want_x = x.detach().clone().requires_grad_()
    conv.weight.grad = None
    bn(conv(want_x)).sum().backward()
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_change_of_any_weight_buffer_or_eps_is_seen(layout):
    conv, bn = _pair(nn.Conv2d(64, 48, 3))
    x = torch.randn(1, 64, 5, 5)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    _check(conv, bn, x, packed=True)

    def again():
        want = _reference(conv, bn, x)
        with torch.no_grad():
            got = conv_bn(conv, bn, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        conv.weight.mul_(-0.5)
    again()
    with torch.no_grad():
        conv.bias.add_(1.0)
    again()
    with torch.no_grad():
        bn.running_var.mul_(3.0)
        bn.running_mean.add_(0.25)
    again()
    with torch.no_grad():
        bn.weight.mul_(2.0)
        bn.bias.sub_(1.0)
    again()
    bn.eps = 0.5
    again()
    assert is_frozen(conv) and is_frozen(bn), "in-place changes under no_grad refold; they keep the promise"
    conv.weight = nn.Parameter(torch.randn_like(conv.weight))  # a new tensor (a load that replaces it)
    again()
    assert not is_frozen(conv), "a parameter that is not the object frozen drops the promise"
    bn.train()  # batch statistics: no folding at all
    with torch.no_grad():
        torch.testing.assert_close(conv_bn(conv, bn, x), nn.BatchNorm2d.forward(bn, conv(x)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_without_freeze_nothing_is_kept_or_packed(layout):
    # weight-heavy pairs (the per-call fold would cost more than the BatchNorm): the two layers run
    conv, bn = _pair(nn.Conv2d(64, 48, 3), frozen=False)
    x = torch.randn(1, 64, 5, 5)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    guarded._FOLD_CACHE.pop(bn, None)
    _check(conv, bn, x, packed=False)
    assert bn not in guarded._FOLD_CACHE
    # after freeze the same call packs; a train-mode call drops the promise and packs nothing again
    freeze(conv), freeze(bn)
    _check(conv, bn, x, packed=True)
    bn.train()
    with torch.no_grad():
        conv_bn(conv, bn, x)
    bn.eval()
    assert not is_frozen(bn)
    _check(conv, bn, x, packed=False)


def test_inference_mode():
    conv, bn = _pair(nn.Conv2d(64, 48, 3))
    x = torch.randn(1, 64, 5, 5)
    want = _reference(conv, bn, x)
    guarded._PACK_CACHE.pop(bn, None)
    guarded._FOLD_CACHE.pop(bn, None)
    with torch.inference_mode():
        got = conv_bn(conv, bn, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert bn in guarded._PACK_CACHE
    # what was cached in inference mode serves later calls outside it, with gradients too
    assert not guarded._FOLD_CACHE[bn][1][0].is_inference()
    with torch.no_grad():
        torch.testing.assert_close(conv_bn(conv, bn, x), want, rtol=1e-4, atol=1e-4)
    conv.requires_grad_(False), bn.requires_grad_(False)
    xg = x.clone().requires_grad_()
    conv_bn(conv, bn, xg).sum().backward()
    assert xg.grad is not None

    # a model built in inference mode holds inference tensors (no version counter): no cache at all
    with torch.inference_mode():
        conv, bn = _pair(nn.Conv2d(64, 48, 3))
        want = bn(conv(x))
        got = conv_bn(conv, bn, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert bn not in guarded._PACK_CACHE and bn not in guarded._FOLD_CACHE
        with torch.no_grad():
            conv.weight.mul_(2.0)  # (an in-place change nothing could see)
        torch.testing.assert_close(conv_bn(conv, bn, x), bn(conv(x)), rtol=1e-4, atol=1e-4)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 48, 3, padding=1)
        self.bn = nn.BatchNorm2d(48)

    def forward(self, x):
        return conv_bn(self.conv, self.bn, x).relu()


def _block():
    block = _Block()
    block.conv, block.bn = _pair(block.conv)
    return block.eval()


def test_fx_dynamo_and_export_see_aten_conv():
    block = _block()
    x = torch.randn(2, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        eager = block(x)
        assert block.bn in guarded._PACK_CACHE
        traced = torch.fx.symbolic_trace(block)
        assert "mkldnn" not in traced.code
        # fx records the original modules (the graph follows traced.train() as the original does)
        assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["conv", "bn"]
        torch.testing.assert_close(traced(x), eager, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.jit.script(traced)(x), eager, rtol=1e-4, atol=1e-4)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), eager, rtol=1e-4, atol=1e-4)
        torch._dynamo.reset()
    exported = torch.export.export(block, (x,))
    assert "mkldnn" not in str(exported.graph)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), eager, rtol=1e-4, atol=1e-4)


def test_module_form_packs_too():
    module = FusedConv2dBatchNorm2d(64, 48, 3, bn_name="norm").eval()
    conv, bn = _pair(nn.Conv2d(64, 48, 3))
    with torch.no_grad():
        module.weight.copy_(conv.weight)
        module.bias.copy_(conv.bias)
        module.bn.load_state_dict(bn.state_dict())
    module.bn.eps = bn.eps
    freeze(module)
    for x in (torch.randn(1, 64, 5, 5), torch.randn(2, 64, 5, 5).contiguous(memory_format=torch.channels_last)):
        with torch.no_grad():
            want = bn(conv(x))
            got = module(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride()
        assert module in batch_norm._PACK_CACHE
    with torch.no_grad():
        module.weight.mul_(2.0)
        conv.weight.mul_(2.0)
        torch.testing.assert_close(module(x), bn(conv(x)), rtol=1e-4, atol=1e-4)
    assert set(module.state_dict()) == {"weight", "bias", "norm.weight", "norm.bias", "norm.running_mean",
                                        "norm.running_var", "norm.num_batches_tracked"}


def test_nchw_choice_weighs_the_weight_against_the_activations():
    def layout(conv, shape):
        x = torch.randn(shape)
        with torch.no_grad():
            return conv_prepacked.prepack_layout(x, conv.weight, conv.bias, conv.padding, conv.stride, conv.dilation,
                                                 conv.groups, conv.padding_mode)

    one = nn.Conv2d(64, 64, 1)  # 4096 weights; aten runs it as a GEMM on the NCHW data
    three = nn.Conv2d(64, 64, 3, padding=1)  # 36864 weights; aten runs it in oneDNN
    assert layout(one, (1, 64, 4, 4)) == ""  # ratio 2
    assert layout(one, (1, 64, 2, 2)) == "contiguous"  # ratio 8
    assert layout(three, (1, 64, 8, 8)) == "contiguous"  # ratio 4.5
    assert layout(three, (1, 64, 32, 32)) == ""  # ratio 0.28


def test_a_deep_frozen_stack_stays_folded():
    """Each fold records a bound on its output derived from its input's (ops/finite.py): through a
    deep stack those bounds compound past the dtype's range (ResNet-50 from its config went to the
    original layers in its last blocks); the range guard then reads the input's own magnitude."""
    from adopter.kernels import count_kernel_calls

    torch.manual_seed(0)
    layers = [(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64)) for _ in range(40)]
    for conv, bn in layers:
        freeze(conv), freeze(bn)
    x = torch.randn(1, 64, 8, 8)
    with torch.no_grad(), count_kernel_calls() as calls:
        h, want = x, x
        for conv, bn in layers:
            h = conv_bn(conv, bn, h, nn.ReLU())
            want = torch.relu(bn(conv(want)))
    assert [(c.backend, c.count) for c in calls.calls if c.kernel == "conv_bn"] == [("torch", 40)]
    torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-5)
