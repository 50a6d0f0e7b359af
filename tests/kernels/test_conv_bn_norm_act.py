"""``conv_bn`` with a norm+act module (issue 35): a BatchNorm2d subclass whose forward applies its own
submodules to its batch norm (timm's ``BatchNormAct2d`` style) is recognised at run time from its
class's forward (``kernels/norm_act.py``, the reader the static analysis shares), the batch norm folded
and the submodules called after it — a lone plain ReLU in the conv's epilogue —; anything that makes it
another module (a forward changed since, hooks, an instance forward, training, a name its forward reads
rebound) takes the original path. And ``run_sequential``: a Sequential another file built, called from
a rewritten site. Each result is compared with the original modules, forward and backward."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import conv_bn, freeze, guarded, run_sequential
from adopter.kernels.norm_act import norm_act_parts
from adopter.kernels.telemetry import count_kernel_calls
from torch import nn

SITE = Path(__file__).resolve().parents[1] / "fixtures" / "factories"


@pytest.fixture(autouse=True)
def _fixture_packages(monkeypatch):
    monkeypatch.syspath_prepend(str(SITE / "site"))
    monkeypatch.syspath_prepend(str(SITE))
    # small shapes: the per-call fold on everywhere (it checks the math, not whether it pays)
    monkeypatch.setattr(guarded, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", float("inf"))


def _classes():
    from fakepkg.layers.norm_act import BatchNormAct2d
    from instlayers.blocks import NormAct2d

    return BatchNormAct2d, NormAct2d


def _randomized(bn):
    torch.manual_seed(0)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return bn


_MAKERS = {
    "bnact-relu": lambda c: _classes()[0](c),
    "bnact-gelu-drop": lambda c: _classes()[0](c, act_layer=nn.GELU, drop_layer=lambda: nn.Dropout(0.0)),
    "bnact-no-act": lambda c: _classes()[0](c, apply_act=False),
    "written-out-silu": lambda c: _classes()[1](c),
    "written-out-relu": lambda c: _classes()[1](c, act_layer=nn.ReLU),
}


def _compare(conv, bn, x, activation=None, *, fused: bool):
    ref_conv, ref_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    ref = ref_bn(ref_conv(xr))
    if activation is not None:
        ref = activation(ref)
    with count_kernel_calls() as calls:
        out = conv_bn(conv, bn, x, activation)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if x.requires_grad:
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
        for a, b in zip(conv.parameters(), ref_conv.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    # the module's state (running statistics in training) moves as the original's
    for a, b in zip(bn.buffers(), ref_bn.buffers()):
        torch.testing.assert_close(a, b)
    backends = [c.backend for c in calls.calls if c.kernel == "conv_bn"]
    assert backends == (["torch"] if fused else ["original"]), [(c.backend, c.reason) for c in calls.calls]
    return calls


@pytest.mark.parametrize("kind", list(_MAKERS))
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_norm_act_folded_in_eval_original_in_training(kind, train, grad):
    bn = _randomized(_MAKERS[kind](6)).train(train)
    conv = nn.Conv2d(3, 6, 3, padding=1).train(train)
    x = torch.randn(2, 3, 7, 5, requires_grad=grad)
    _compare(conv, bn, x, fused=not train)


def test_caller_activation_after_the_modules_own():
    BatchNormAct2d, _ = _classes()
    bn = _randomized(BatchNormAct2d(4, act_layer=nn.GELU)).eval()
    conv = nn.Conv2d(3, 4, 1).eval()
    _compare(conv, bn, torch.randn(2, 3, 5, 5), nn.Tanh(), fused=True)
    _compare(conv, bn, torch.randn(2, 3, 5, 5), F.relu, fused=True)


def test_frozen_relu_in_the_epilogue():
    BatchNormAct2d, _ = _classes()
    bn = freeze(_randomized(BatchNormAct2d(8)))
    conv = freeze(nn.Conv2d(4, 8, 3, padding=1))
    x = torch.randn(2, 4, 9, 9)
    for _ in range(2):  # (the second call: the fold kept under freeze)
        _compare(conv, bn, x, fused=True)


def test_what_makes_it_another_module_takes_the_original_path(monkeypatch):
    BatchNormAct2d, NormAct2d = _classes()
    conv = nn.Conv2d(3, 4, 3, padding=1).eval()
    x = torch.randn(2, 3, 6, 6)

    hooked = _randomized(BatchNormAct2d(4)).eval()
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    _compare(conv, hooked, x, fused=False)

    own = _randomized(BatchNormAct2d(4)).eval()
    own.forward = lambda t: nn.BatchNorm2d.forward(own, t) + 1
    _compare(conv, own, x, fused=False)

    class Scaled(BatchNormAct2d):
        def forward(self, x):  # more than the norm and its activation
            return super().forward(x) * 2

    _compare(conv, _randomized(Scaled(4)).eval(), x, fused=False)

    class PreAct(nn.BatchNorm2d):
        def __init__(self, c):
            super().__init__(c)
            self.act = nn.ReLU()

        def forward(self, x):  # the activation before the norm
            return super().forward(self.act(x))

    assert norm_act_parts(PreAct(4)) is None
    _compare(conv, _randomized(PreAct(4)).eval(), x, fused=False)

    # a global name the written-out forward reads, rebound: no longer the batch norm it was read as
    written = _randomized(NormAct2d(4)).eval()
    assert norm_act_parts(written) == ("act",)
    module = sys.modules[NormAct2d.__module__]
    monkeypatch.setattr(module, "F", type("Fake", (), {"batch_norm": staticmethod(lambda *a, **k: a[0])}))
    assert norm_act_parts(written) is None
    monkeypatch.undo()
    assert norm_act_parts(written) == ("act",)


def test_a_plain_batch_norm_is_no_norm_act():
    assert norm_act_parts(nn.BatchNorm2d(3)) is None
    BatchNormAct2d, _ = _classes()
    assert norm_act_parts(BatchNormAct2d(3)) == ("drop", "act")
    assert norm_act_parts(nn.GroupNorm(1, 3)) is None


@pytest.mark.parametrize("train", [False, True])
def test_run_sequential_as_the_sequential(train):
    from instlayers import FeedForward, conv_bn_act

    torch.manual_seed(0)
    for seq, x in ((conv_bn_act(3, 6), torch.randn(2, 3, 8, 8)), (FeedForward(5), torch.randn(4, 5))):
        for m in seq.modules():
            if isinstance(m, nn.BatchNorm2d):
                _randomized(m)
        seq.train(train)
        ref = copy.deepcopy(seq)
        xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        with count_kernel_calls() as calls:
            out = run_sequential(seq, xa)
        expected = ref(xr)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-4, atol=1e-4)
        kernels = {c.kernel for c in calls.calls}
        assert kernels & {"conv_bn", "linear_gelu"}, kernels  # each pair through its guarded kernel


def test_run_sequential_calls_anything_else_as_before():
    seq = nn.Sequential(nn.Linear(3, 3), nn.GELU())
    seen = []
    seq.register_forward_hook(lambda m, i, o: seen.append(o))
    with count_kernel_calls() as calls:
        run_sequential(seq, torch.randn(2, 3))
    assert len(seen) == 1 and [c.backend for c in calls.calls if c.kernel == "run_sequential"] == ["original"]

    class Twice(nn.Sequential):
        def forward(self, x):
            return super().forward(super().forward(x))

    twice = Twice(nn.Linear(3, 3))
    x = torch.randn(2, 3)
    torch.testing.assert_close(run_sequential(twice, x), twice(x))


@pytest.mark.parametrize("train", [False, True])
def test_rewritten_rule_fixture_computes_the_original(train):
    """The Conv_BatchNorm fixture of same-file norm+act classes and its committed rewrite: same
    outputs and gradients (the written-out F.batch_norm form and the ``super().forward`` form fused in
    eval; ScaledNorm, no norm+act module, left alone)."""
    import runpy

    root = Path(__file__).resolve().parents[1]
    original = runpy.run_path(str(root / "fixtures" / "rules" / "Conv_BatchNorm" / "positive_norm_act.py"))
    rewritten = runpy.run_path(str(root / "rules" / "Conv_BatchNorm" / "positive_norm_act.rewritten.py"))
    torch.manual_seed(0)
    a = original["ConvNormAct"](4)
    for m in a.modules():
        if isinstance(m, nn.BatchNorm2d):
            _randomized(m)
    b = rewritten["ConvNormAct"](4)
    b.load_state_dict(a.state_dict())
    a.train(train), b.train(train)
    xa = torch.randn(2, 4, 6, 6, requires_grad=True)
    xb = xa.detach().clone().requires_grad_()
    with count_kernel_calls() as calls:
        out = b(xb)
    ref = a(xa)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-4)
    fused = [c for c in calls.calls if c.kernel == "conv_bn" and c.backend != "original"]
    assert sum(c.count for c in fused) == (0 if train else 2)


def test_run_sequential_of_a_subclass_filling_itself():
    """A Sequential subclass that only fills itself in ``__init__`` (torchvision's
    Conv2dNormActivation style) runs its pairs through the kernels; one with a forward of its own is
    called as it is."""
    from instlayers import Conv2dNormActivation

    torch.manual_seed(0)
    seq = Conv2dNormActivation(3, 6, 3).eval()
    _randomized(seq[1])
    x = torch.randn(2, 3, 8, 8)
    with count_kernel_calls() as calls:
        out = run_sequential(seq, x)
    torch.testing.assert_close(out, seq(x), rtol=1e-5, atol=1e-5)
    assert [c.backend for c in calls.calls if c.kernel == "conv_bn"] == ["torch"]

    class Reversed(Conv2dNormActivation):
        def __iter__(self):
            return reversed(list(self._modules.values()))

    odd = Reversed(3, 3, 1).eval()
    x = torch.randn(2, 3, 4, 4)
    with count_kernel_calls() as calls:
        out = run_sequential(odd, x)
    torch.testing.assert_close(out, odd(x), rtol=0, atol=0)
    assert not [c for c in calls.calls if c.kernel == "conv_bn"]
