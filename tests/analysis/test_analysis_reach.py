"""Issue 11, static reach and Sequential pairs: layers built through same-file factory
functions/methods, class-valued parameters (signature defaults, ``if x is None: x = C``),
``functools.partial``, module-level aliases, ``self.<attr>`` holding a class, and entries of an
``nn.Sequential`` (inline, ``*layers``, loops, ``OrderedDict``, returned by a factory) matched
once where the Sequential is built and rewritten there to ``GuardedSequential``.

And the done-means of the issue: ``optimize()`` of a torchvision-style ResNet (own code,
``tests/fixtures/reach/tv_resnet.py``) applies Conv_BatchNorm at every conv->BN pair,
equivalent (forward+backward, train and eval), state dict unchanged."""
from __future__ import annotations

import textwrap

import pytest
import torch
from adopter.rewrite import rewrite_source
from torch import nn

from adopter.core.rules import all_rules
from adopter.core.scan import scan_source


@pytest.fixture(autouse=True)
def _fold_at_every_size(monkeypatch):
    # these small models check where the rewrite reaches and that the fused sites compute the
    # original's values; whether an unfrozen fold pays at their sizes is another question (at these
    # shapes it does not: guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE sends them to the original layers)
    from adopter.kernels import guarded

    monkeypatch.setattr(guarded, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", float("inf"))


def _scan(src: str, filename: str = "/tmp/reach_case.py"):
    src = textwrap.dedent(src)
    r = scan_source(src, filename, all_rules())
    return src, list(getattr(r, "matches", r))


def _found(src: str) -> list[tuple[str, str | None, str, tuple[int, ...]]]:
    _src, ms = _scan(src)
    return sorted((m.rule, m.class_name, m.function, tuple(m.lines)) for m in ms if m.status == "static")


HEADER = """
import functools
from collections import OrderedDict
from functools import partial
from typing import Type
import torch
import torch.nn as nn
import torch.nn.functional as F
"""


def test_factory_function_and_class_default():
    got = _found(HEADER + """
def conv3x3(i, o, stride=1):
    return nn.Conv2d(i, o, 3, stride, 1, bias=False)

class Block(nn.Module):
    def __init__(self, c, norm_layer: Type[nn.Module] = nn.BatchNorm2d):
        super().__init__()
        self.conv = conv3x3(c, c)
        self.bn = norm_layer(c)

    def forward(self, x):
        return self.bn(self.conv(x))
""")
    assert got == [("Conv_BatchNorm", "Block", "forward", (20, 20))]


def test_partial_alias_and_self_attr_class():
    got = _found(HEADER + """
BN = partial(nn.BatchNorm2d, eps=1e-3)
Conv = nn.Conv2d

class Net(nn.Module):
    def __init__(self, c, norm_layer=None):
        super().__init__()
        if norm_layer is None:
            norm_layer = BN
        self._norm = norm_layer
        self.a = Conv(c, c, 1)
        self.b = self._make_norm(c)

    def _make_norm(self, c):
        return self._norm(c)

    def forward(self, x):
        return self.b(self.a(x))
""")
    assert [g[:3] for g in got] == [("Conv_BatchNorm", "Net", "forward")]


def test_timm_style_act_layer_default():
    got = _found(HEADER + """
class Mlp(nn.Module):
    def __init__(self, dim, hidden, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        return self.fc2(x)
""")
    assert [g[:3] for g in got] == [("biased_GeLU", "Mlp", "forward")]


def test_unknown_stays_unknown():
    """A norm class passed in with no default, a factory from another module: no match."""
    got = _found(HEADER + """
from .layers import create_conv2d

class Block(nn.Module):
    def __init__(self, c, norm_layer, act_layer=nn.ReLU):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.bn = norm_layer(c)
        self.conv2 = create_conv2d(c, c, 3)
        self.bn2 = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, c)
        self.act = act_layer()

    def forward(self, x):
        x = self.bn(self.conv(x))
        x = self.bn2(self.conv2(x))
        return self.act(self.fc(x))
""")
    assert got == []


SEQUENTIALS = HEADER + """
def conv_bn(inp, oup, stride):
    return nn.Sequential(nn.Conv2d(inp, oup, 3, stride, 1, bias=False), nn.BatchNorm2d(oup), nn.ReLU6(inplace=True))


def make_layers(cfg, batch_norm=True):
    layers = []
    c = 3
    for v in cfg:
        conv2d = nn.Conv2d(c, v, kernel_size=3, padding=1)
        if batch_norm:
            layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
        else:
            layers += [conv2d, nn.ReLU(inplace=True)]
        c = v
    return nn.Sequential(*layers)


class Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.stem = conv_bn(3, c, 2)
        self.named = nn.Sequential(OrderedDict([("conv", nn.Conv2d(c, c, 1)), ("bn", nn.BatchNorm2d(c)), ("act", nn.ReLU())]))
        self.proj = nn.Sequential(nn.Linear(c, c), nn.GELU(), nn.Linear(c, c))
        self.mixed = nn.Sequential(nn.Conv2d(c, c, 1), mystery_layer(c), nn.Conv2d(c, c, 1), nn.BatchNorm2d(c))

    def forward(self, x, flag: bool):
        if flag:
            y = self.named(self.stem(x))
        else:
            y = self.named(x)
        y = self.mixed(y)
        return self.proj(y.mean((2, 3)))
"""


def test_sequential_pairs_matched_once_where_built():
    src, ms = _scan(SEQUENTIALS)
    lines = src.splitlines()
    got = sorted((m.rule, m.function, m.sequential.line) for m in ms if m.sequential is not None)
    line_of = {key: next(i + 1 for i, t in enumerate(lines) if key in t)
               for key in ("return nn.Sequential(nn.Conv2d", "return nn.Sequential(*layers)", "self.named =",
                           "self.proj =", "self.mixed =")}
    assert got == sorted([
        ("Conv_BatchNorm", "conv_bn", line_of["return nn.Sequential(nn.Conv2d"]),
        ("Conv_BatchNorm", "make_layers", line_of["return nn.Sequential(*layers)"]),
        ("Conv_BatchNorm", "__init__", line_of["self.named ="]),
        ("biased_GeLU", "__init__", line_of["self.proj ="]),
        # an unresolvable entry (mystery_layer) leaves the other pairs of the Sequential
        ("Conv_BatchNorm", "__init__", line_of["self.mixed ="]),
    ])
    # the forward calls of the Sequentials (two of self.named) add nothing
    assert not [m for m in ms if m.sequential is None and m.status == "static"]


def test_sequential_rewrite_is_guarded_sequential_and_idempotent():
    src, ms = _scan(SEQUENTIALS)
    res = rewrite_source(src, ms, filename="/tmp/reach_case.py")
    assert all(o.applied for o in res.outcomes), [o.reason for o in res.outcomes if not o.applied]
    assert res.new_text.count("GuardedSequential(") == 5
    assert "nn.Sequential(" not in res.new_text.replace("GuardedSequential(", "")
    compile(res.new_text, "x.py", "exec")
    again, ms2 = _scan(res.new_text)
    assert rewrite_source(again, ms2, filename="/tmp/reach_case.py").new_text == again


# ---------------------------------------------------------------- GuardedSequential itself


def _pairs_model(seq_cls):
    torch.manual_seed(0)
    return nn.Sequential(
        seq_cls(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()),
        nn.Flatten(),
        seq_cls(nn.Linear(6 * 5 * 7, 12), nn.BatchNorm1d(12), nn.Linear(12, 9), nn.GELU(), nn.Linear(9, 4)),
    )


@pytest.mark.parametrize("train", [True, False])
def test_guarded_sequential_equivalent_forward_backward(train):
    from adopter.kernels import GuardedSequential, count_kernel_calls

    ref = _pairs_model(nn.Sequential)
    new = _pairs_model(GuardedSequential)
    assert list(ref.state_dict()) == list(new.state_dict())
    new.load_state_dict(ref.state_dict())
    ref.train(train)
    new.train(train)
    x = torch.randn(4, 3, 5, 7)
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_kernel_calls() as calls:
        out_new = new(xn)
    out_ref = ref(xr)
    torch.testing.assert_close(out_new, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().sum().backward()
    out_new.square().sum().backward()
    torch.testing.assert_close(xn.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for (name, p), (_, q) in zip(ref.named_parameters(), new.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    kernels = {(c.kernel, c.backend != "original") for c in calls.calls}
    assert ("linear_gelu", True) in kernels
    # batch norm folds only in eval
    assert ("conv_bn", not train) in kernels and ("linear_bn", not train) in kernels
    # counted where the Sequential was built (this test's helper), not inside adopter
    assert {c.function for c in calls.calls} == {"_pairs_model"}


def test_guarded_sequential_falls_back_on_hooks_and_other_types():
    from adopter.kernels import GuardedSequential, count_kernel_calls

    seq = GuardedSequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).eval()
    seen = []
    seq[3].register_forward_hook(lambda m, i, o: seen.append(1))
    ref = nn.Sequential(*seq)
    x = torch.randn(2, 3, 4, 4)
    with count_kernel_calls() as calls:
        torch.testing.assert_close(seq(x), ref(x))
    assert seen == [1, 1]
    assert [(c.kernel, c.backend) for c in calls.calls] == [("conv_bn", "original")]


# ---------------------------------------------------------------- the torchvision-style ResNet


def _applied(report):
    return sorted((a.rule, a.class_name, a.function) for a in report.applied)


@pytest.mark.slow
@pytest.mark.parametrize("bottleneck", [False, True])
def test_optimize_torchvision_style_resnet(bottleneck):
    from adopter.kernels import count_kernel_calls

    from adopter import optimize
    from tests.fixtures.reach.tv_resnet import ResNet

    x = torch.randn(2, 3, 32, 32)
    cls = optimize(ResNet, init_kwargs={"bottleneck": bottleneck}, example_inputs={"x": x})
    report = cls.adopter_report
    block = "Bottleneck" if bottleneck else "BasicBlock"
    per_block = 3 if bottleneck else 2
    expected = sorted(
        [("Conv_BatchNorm", block, "forward")] * per_block
        + [("Conv_BatchNorm", "ResNet", "_make_layer"), ("Conv_BatchNorm", "ResNet", "forward")]
        + [("Add_ReLU", block, "forward")]  # out += identity; out = self.relu(out)
    )
    assert _applied(report) == expected, report.summary()
    assert report.equivalence.equivalent
    assert not [s for s in report.skipped if s.kind == "runtime-only"], report.summary()

    torch.manual_seed(0)
    original = ResNet(bottleneck=bottleneck)
    optimized = cls(bottleneck=bottleneck)
    assert list(optimized.state_dict()) == list(original.state_dict())
    optimized.load_state_dict(original.state_dict())
    original.load_state_dict(optimized.state_dict())
    for train in (True, False):
        original.train(train)
        optimized.train(train)
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        with count_kernel_calls() as calls:
            out_o = optimized(xo)
        out_r = original(xr)
        torch.testing.assert_close(out_o, out_r, rtol=1e-4, atol=1e-4)
        out_r.sum().backward()
        out_o.sum().backward()
        torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-4, atol=1e-4)
        original.zero_grad()
        optimized.zero_grad()
        fused = {c.function for c in calls.calls if c.kernel == "conv_bn" and c.backend != "original"}
        if not train:  # eval folds every pair, downsample included (counted where it is built)
            assert fused == {f"{block}.forward", "ResNet._make_layer", "ResNet.forward"}


# ---------------------------------------------------------------- runtime reach


RUNTIME_TYPED = "tests/fixtures/reach/runtime_typed.py"


def test_runtime_typed_layers_are_unknown_statically():
    from pathlib import Path

    src = Path(RUNTIME_TYPED).read_text()
    assert [m for m in scan_source(src, RUNTIME_TYPED, all_rules()) if m.status == "static"] == []


@pytest.mark.slow
@pytest.mark.parametrize(("norm", "act", "expected"), [
    (nn.BatchNorm2d, "gelu", ["Conv_BatchNorm", "biased_GeLU"]),
    (nn.BatchNorm2d, "relu", ["Conv_BatchNorm"]),
    (lambda c: nn.GroupNorm(2, c), "gelu", ["biased_GeLU"]),
])
def test_optimize_confirms_types_from_the_trace(norm, act, expected):
    """What the source leaves unknown (a norm class passed by the caller, a conv from an imported
    factory, an activation from a table) is typed from the built model, rewritten with guarded
    kernels and checked equivalent; other types at run time are no match."""
    from adopter import optimize
    from tests.fixtures.reach.runtime_typed import Net

    x = torch.randn(2, 3, 8, 8)
    cls = optimize(Net, init_kwargs={"norm_layer": norm, "act": act}, example_inputs={"x": x})
    report = cls.adopter_report
    assert sorted(a.rule for a in report.applied) == expected, report.summary()
    assert report.equivalence.equivalent
    torch.manual_seed(0)
    original = Net(norm, act).eval()
    optimized = cls(norm, act).eval()
    optimized.load_state_dict(original.state_dict())
    torch.testing.assert_close(optimized(x), original(x), rtol=1e-5, atol=1e-5)


def test_factory_selecting_by_a_constant_argument():
    """``get_activation_fn("gelu")`` written with the constant: the factory's branch is decided;
    with the name coming from a constructor argument it stays a condition (the caller chooses)."""
    src = HEADER + """
def get_activation_fn(name):
    if name == "relu":
        return F.relu
    elif name == "gelu":
        return F.gelu
    raise RuntimeError(name)

class Fixed(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = get_activation_fn("gelu")

    def forward(self, x):
        return self.act(self.fc(x))

class Chosen(nn.Module):
    def __init__(self, d, activation="gelu"):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = get_activation_fn(activation)

    def forward(self, x):
        return self.act(self.fc(x))
"""
    _src, ms = _scan(src)
    got = sorted((m.class_name, m.status) for m in ms if m.rule == "biased_GeLU")
    assert got == [("Chosen", "conditional"), ("Fixed", "static")]


def test_sequential_built_differently_by_its_callers_keeps_both():
    """VGG's ``make_layers(cfg, batch_norm=...)``: a call with ``batch_norm=False`` does not hide
    the pairs the ``batch_norm=True`` path builds."""
    got = _found(HEADER + """
def make_layers(cfg, batch_norm=False):
    layers = []
    c = 3
    for v in cfg:
        conv2d = nn.Conv2d(c, v, 3, padding=1)
        if batch_norm:
            layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
        else:
            layers += [conv2d, nn.ReLU(inplace=True)]
        c = v
    return nn.Sequential(*layers)

class VGG(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = make_layers([8, 8])
        self.bn = make_layers([8, 8], batch_norm=True)

    def forward(self, x):
        return self.bn(x) + self.plain(x)
""")
    assert [g[:3] for g in got] == [("Conv_BatchNorm", None, "make_layers")]


def test_factory_from_the_package(tmp_path):
    """A factory in another module of the scanned file's package (relative or absolute import,
    re-exported by the package): read, never imported; several possible returns -> conditional."""
    pkg = tmp_path / "mypkg"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layers" / "__init__.py").write_text("from .conv import create_conv2d, make_norm\n")
    (pkg / "layers" / "conv.py").write_text(textwrap.dedent("""
        from torch import nn

        def create_conv2d(cin, cout, k, **kwargs):
            return nn.Conv2d(cin, cout, k, padding=k // 2, **kwargs)

        def make_norm(c, kind="bn"):
            if kind == "bn":
                return nn.BatchNorm2d(c)
            return nn.GroupNorm(1, c)
    """))
    model = pkg / "model.py"
    model.write_text(textwrap.dedent("""
        from torch import nn
        from .layers import create_conv2d
        from mypkg.layers import make_norm

        class ConvBn(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.conv = create_conv2d(c, c, 3)
                self.bn = nn.BatchNorm2d(c)
                self.conv2 = create_conv2d(c, c, 1)
                self.bn2 = make_norm(c)
                self.bn3 = make_norm(c, "gn")

            def forward(self, x):
                x = self.bn(self.conv(x))
                x = self.bn2(self.conv2(x))
                return self.bn3(x)
    """))
    ms = scan_source(model.read_text(), str(model), all_rules())
    assert sorted((m.lines[0], m.status) for m in ms) == [(16, "static"), (17, "static")]


@pytest.mark.slow
def test_optimize_sequential_styles():
    """Sequential subclasses (``super().__init__(*layers)``, ``add_module`` + ``super().forward``),
    an ``nn.Sequential()`` grown with ``add_module`` and ``*[...] + [...]``: each pair rewritten
    where it is built (a subclass derives from GuardedSequential), equivalent, same state dict."""
    from adopter.kernels import GuardedSequential, count_kernel_calls

    from adopter import optimize
    from tests.fixtures.reach.sequential_styles import Net

    x = torch.randn(2, 3, 8, 8)
    cls = optimize(Net, example_inputs={"x": x})
    report = cls.adopter_report
    assert sorted((a.class_name or "", a.function) for a in report.applied) == [
        ("", "_conv_bn"), ("Conv2dNormActivation", "__init__"), ("DenseLayer", "__init__"), ("Net", "__init__"),
    ], report.summary()
    assert report.equivalence.equivalent
    torch.manual_seed(0)
    original = Net().eval()
    optimized = cls().eval()
    assert list(optimized.state_dict()) == list(original.state_dict())
    optimized.load_state_dict(original.state_dict())
    assert isinstance(optimized.block, GuardedSequential) and isinstance(optimized.block, nn.Sequential)
    with count_kernel_calls() as calls:
        torch.testing.assert_close(optimized(x), original(x), rtol=1e-5, atol=1e-5)
    fused = {c.function for c in calls.calls if c.kernel == "conv_bn" and c.backend != "original"}
    assert fused == {"Conv2dNormActivation.__init__", "DenseLayer.__init__", "Net.__init__", "_conv_bn"}
    # a GroupNorm passed at construction: no pair at run time, the Sequential runs as before
    other = cls(norm_layer=lambda c: nn.GroupNorm(2, c)).eval()
    reference = Net(norm_layer=lambda c: nn.GroupNorm(2, c)).eval()
    other.load_state_dict(reference.state_dict())
    torch.testing.assert_close(other(x), reference(x), rtol=1e-5, atol=1e-5)


def test_runtime_reach_types_what_the_source_left_unknown():
    """The tracing step alone (what ``adopter scan --model``/``trace`` run): the submodule
    classes of the built model type the attributes the scan left unresolved, and the matches
    they allow are confirmed against the trace."""
    from pathlib import Path

    from adopter.tracing import runtime_reach, runtime_type_hints

    from tests.fixtures.reach.runtime_typed import Net

    path = str(Path(RUNTIME_TYPED).resolve())
    model = Net()
    hints = runtime_type_hints(model, [path])[path]
    assert hints[("ConvNormAct", "self.bn")] == ("torch.nn.BatchNorm2d",)
    assert hints[("ConvNormAct", "self.conv")] == ("torch.nn.Conv2d",)
    found = runtime_reach(model, {"x": torch.randn(2, 3, 8, 8)}, [], [], [path], all_rules())
    assert sorted((m.rule, m.status) for m in found) == [("Conv_BatchNorm", "confirmed"), ("biased_GeLU", "confirmed")]
    assert all("layer types from the trace" in m.reason for m in found)
    relu = runtime_reach(Net(act="relu"), {"x": torch.randn(2, 3, 8, 8)}, [], [], [path], all_rules())
    assert sorted((m.rule, m.status) for m in relu) == [("Conv_BatchNorm", "confirmed")]


def test_factory_constants_are_those_of_its_own_call():
    """``block(c, act("relu"))``: the nested factory call evaluated for an argument does not
    leak its constants into ``block``'s, whose own default decides its branch."""
    from adopter.core.extract import extract_source

    src = textwrap.dedent(HEADER + """
def act(name):
    if name == "gelu":
        return nn.GELU()
    return nn.ReLU()

def block(c, a, kind="plain"):
    if kind == "plain":
        return nn.Sequential(nn.Linear(c, c), a)
    return nn.Sequential(nn.Linear(c, c), nn.GELU(), nn.Linear(c, c))

class M(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.b = block(c, act("relu"))

    def forward(self, x):
        return self.b(x)
""")
    fs = extract_source(src, "/tmp/reach_case.py")
    m = next(c for c in fs.classes if c.name == "M")
    # only the ``kind="plain"`` branch is what M builds: Linear then the ReLU ``act`` returned
    assert sorted((b.container, b.layer.type) for b in m.init_bindings if b.container) == [
        ("self.b[0]", "torch.nn.Linear"), ("self.b[1]", "torch.nn.ReLU"),
    ]
