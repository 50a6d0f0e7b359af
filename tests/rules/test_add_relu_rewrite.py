"""The Add_ReLU rewrite of ``tests/fixtures/rules/Add_ReLU/positive_resnets.py`` (with the Conv_BatchNorm
rewrites the same scan finds), rewritten in memory by the real scan + rewrite and loaded next to the
original: the rewritten classes compute what the originals compute in eval (eager, TorchScript, fx)
and in training (outputs and gradients), keep a NaN input's NaNs, and in eval with a channels-last
input the residual blocks' ``add_relu`` runs fused (their operands come from the frozen model's
``conv_bn``: only a fold kept under ``adopter.kernels.freeze`` records its output finite)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls, freeze
from adopter.kernels.ops import finite
from adopter.rewrite import rewrite_source
from test_conv_bn_activation import _assert_same, _randomize_bn  # (before vs after, rewritten fixture classes)
from test_execution_modes import _module  # (a real file: TorchScript reads the source it compiles)
from torch import nn

from adopter.core.rules import all_rules
from adopter.core.scan import scan_source

FIXTURE = Path(__file__).parents[1] / "fixtures" / "rules" / "Add_ReLU" / "positive_resnets.py"
# odd sizes: the last elements of a block's output fall in aten's scalar tail loop, where a fused
# _add_relu would turn a NaN into 0 (its vectorized body keeps it): a NaN input is put there
C, SIZE = 15, 7

CLASSES = {
    "Bottleneck": lambda ns: ns.Bottleneck(C, 8),
    "BasicBlock": lambda ns: ns.BasicBlock(C),
    "FunctionalBlock": lambda ns: ns.FunctionalBlock(C),
    "TorchReluBlock": lambda ns: ns.TorchReluBlock(C),
    "RebindBlock": lambda ns: ns.RebindBlock(C),
    # the in-place and tensor-method spellings of the ReLU (detectron2's F.relu_, .relu(), .relu_())
    "InPlaceFunctionalBlock": lambda ns: ns.InPlaceFunctionalBlock(C),
    "TorchReluOfSum": lambda ns: ns.TorchReluOfSum(C),
    "MethodReluBlock": lambda ns: ns.MethodReluBlock(C),
    "MethodInPlaceReluBlock": lambda ns: ns.MethodInPlaceReluBlock(C),
}
HAS_BN = {"Bottleneck", "BasicBlock"}  # (conv_bn folds: the results agree within rounding, else bit for bit)
SKETCH = "out = add_relu(self.relu, out, identity, in_place=True)"


@pytest.fixture(scope="module")
def fixture_modules(tmp_path_factory):
    text = FIXTURE.read_text()
    result = rewrite_source(text, scan_source(text, FIXTURE.name, all_rules()), filename=FIXTURE.name)
    assert not result.error
    assert result.outcomes and all(o.applied for o in result.outcomes), [(o.match.rule, o.reason) for o in result.outcomes]
    assert sorted(o.match.rule for o in result.outcomes).count("Add_ReLU") == len(CLASSES)
    assert SKETCH in result.new_text and "add_relu(F.relu, self.body(x), x)" in result.new_text
    folder = tmp_path_factory.mktemp("add_relu_rewrite")
    return _module(text, "add_relu_fixture_original", folder), _module(result.new_text, "add_relu_fixture_rewritten", folder)


@pytest.fixture(autouse=True)
def _fresh_provenance():
    finite.forget()
    yield
    finite.forget()


def _models(fixture_modules, name: str, *, frozen: bool = True) -> tuple[nn.Module, nn.Module]:
    """The original and the rewritten ``name`` with the same state, in eval; the rewritten one
    under ``freeze`` unless ``frozen`` is False."""
    original_module, rewritten_module = fixture_modules
    torch.manual_seed(0)
    before = CLASSES[name](original_module)
    for module in before.modules():
        if isinstance(module, nn.BatchNorm2d):
            _randomize_bn(module)
    after = CLASSES[name](rewritten_module)
    assert type(after) is not type(before)
    after.load_state_dict(before.state_dict())
    return before.eval(), freeze(after) if frozen else after.eval()


def _input(batch: int, layout: str, *, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(batch, C, SIZE, SIZE)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


INPUTS = [(2, "contiguous"), (2, "channels_last"), (1, "channels_last"), (4, "contiguous")]


def _check(got, want, name):
    _assert_same(got, want)
    if name not in HAS_BN:
        assert torch.equal(got, want)


def _add_relu_calls(counted, name: str) -> list[tuple[str, str]]:
    return [(c.backend, c.reason) for c in counted.calls
            if c.kernel == "add_relu" and c.function == f"{name}.forward" for _ in range(c.count)]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_eval_matches_the_original(fixture_modules, name):
    before, after = _models(fixture_modules, name)
    for batch, layout in INPUTS:
        x = _input(batch, layout)
        x_before = x.clone()
        with torch.no_grad():
            want = before(x.clone())
            with count_kernel_calls() as counted:
                got = after(x)
        _check(got, want, name)
        assert torch.equal(x, x_before), "the input is not written to"
        assert len(_add_relu_calls(counted, name)) == 1, "the rewritten forward calls add_relu"


def test_eval_channels_last_residual_blocks_fuse(fixture_modules):
    for name in sorted(CLASSES):
        before, after = _models(fixture_modules, name)
        x = _input(2, "channels_last")
        with torch.no_grad():
            want = before(x.clone())
            with count_kernel_calls() as counted:
                got = after(x)
        _check(got, want, name)
        calls = _add_relu_calls(counted, name)
        if name in HAS_BN:  # (operands computed by conv_bn from the checked input, and the input)
            assert calls == [("torch", "")], (name, calls)
        else:  # (a plain conv's output is not known finite: never read to find out)
            assert calls == [("original", "operands not known finite (a NaN would become 0)")], (name, calls)


def test_eval_without_freeze_marks_nothing_finite(fixture_modules):
    # not frozen: conv_bn keeps no fold and records nothing finite, so add_relu takes the original ops
    for name in sorted(HAS_BN):
        before, after = _models(fixture_modules, name, frozen=False)
        x = _input(2, "channels_last")
        with torch.no_grad():
            want = before(x.clone())
            with count_kernel_calls() as counted:
                got = after(x)
        _assert_same(got, want)
        assert _add_relu_calls(counted, name) == [("original", "operands not known finite (a NaN would become 0)")]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_eval_nan_input_keeps_the_nans(fixture_modules, name, layout):
    before, after = _models(fixture_modules, name)
    x = _input(2, layout)
    x[-1, 0, -1, -1] = float("nan")
    with torch.no_grad():
        want = before(x.clone())
        with count_kernel_calls() as counted:
            got = after(x.clone())
    assert want.isnan().any()
    assert torch.equal(got.isnan(), want.isnan()), f"{int(got.isnan().sum())} NaN, want {int(want.isnan().sum())}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert got.stride() == want.stride()
    assert all(backend == "original" for backend, _ in _add_relu_calls(counted, name))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_torchscript(fixture_modules, name):
    before, after = _models(fixture_modules, name)
    scripted = torch.jit.script(after)
    assert "add_relu" not in scripted.code.replace("torch._add_relu", "")
    for batch, layout in INPUTS[:2]:
        x = _input(batch, layout)
        with torch.no_grad():
            want = before(x.clone())
            got = scripted(x.clone())
        _assert_same(got, want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # (the source's statements are scripted)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_fx_symbolic_trace(fixture_modules, name):
    import operator

    before, after = _models(fixture_modules, name)
    with count_kernel_calls() as counted:
        traced = torch.fx.symbolic_trace(after)
    assert _add_relu_calls(counted, name) == [("original", "tracing or global hooks")]
    nodes = list(traced.graph.nodes)
    assert any(n.op == "call_function" and n.target in (operator.add, operator.iadd) for n in nodes), traced.code
    relus = [n for n in nodes if (n.op == "call_module" and isinstance(traced.get_submodule(n.target), nn.ReLU))
             or (n.op == "call_function" and n.target in (torch.relu, torch.nn.functional.relu, torch.relu_))
             or (n.op == "call_method" and n.target in ("relu", "relu_"))]
    assert relus, traced.code
    assert "_add_relu" not in traced.code
    for batch, layout in INPUTS[:2]:
        x = _input(batch, layout)
        with torch.no_grad():
            want = before(x.clone())
            got = traced(x.clone())
            eager = after(x.clone())
        _check(got, want, name)
        _assert_same(got, eager)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_training_outputs_and_gradients(fixture_modules, name):
    before, after = _models(fixture_modules, name, frozen=False)
    before.train(), after.train()
    x = _input(4, "channels_last", seed=5)
    xb, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = before(xb)
    with count_kernel_calls() as counted:
        got = after(xa)
    _check(got, want, name)
    [(backend, reason)] = _add_relu_calls(counted, name)
    assert backend == "original" and "gradient recorded" in reason, reason
    torch.manual_seed(7)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
    assert (xa.grad != 0).any()
    pb, pa = dict(before.named_parameters()), dict(after.named_parameters())
    assert pb.keys() == pa.keys()
    for key in pb:
        torch.testing.assert_close(pa[key].grad, pb[key].grad, rtol=1e-4, atol=1e-4, msg=key)
    sb, sa = before.state_dict(), after.state_dict()
    for key in sb:
        torch.testing.assert_close(sa[key], sb[key], msg=key)  # (running statistics updated alike)
