"""Dropout_LayerNorm reach (issue 11): functional ``F.dropout`` and pre-norm blocks whose sum is
kept as the next residual.

* the guarded kernel ``dropout_add_layer_norm`` with ``F.dropout`` (the user's arguments as
  written) and with ``prenorm=True`` (returns the sum and its normalization): forward and backward
  against the unfused code, and every fallback;
* the triton kernel's pre-norm output and its gradient, under ``TRITON_INTERPRET=1`` in a fresh
  process (small odd shapes);
* rewrite fixtures (``tests/fixtures/rules/Dropout_LayerNorm/positive_*.py`` -> ``rewritten/``):
  exact text, compiles, idempotent, ``__init__`` untouched, same outputs and gradients;
* why look-alikes are no match, and codemod refusals;
* ``adopter.optimize`` on a research-style pre-norm block and a post-norm block with functional
  dropout, with the fused path counted by telemetry.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import backend, count_kernel_calls
from torch import nn

from adopter import kernels
from adopter.core.rules import all_rules, get_rules
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "Dropout_LayerNorm"
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
INNER = "ADOPTER_DROPOUT_LN_TRITON_INNER"  # set in the fresh process that runs the interpreted kernels


def _counts(calls) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls.calls:
        if c.kernel == "dropout_add_layer_norm":
            out[c.backend] = out.get(c.backend, 0) + c.count
    return out


def _reasons(calls) -> list[str]:
    return [c.reason for c in calls.calls if c.kernel == "dropout_add_layer_norm" and not c.fused]


def _norm(shape, dtype=torch.float32, **kw) -> nn.LayerNorm:
    norm = nn.LayerNorm(shape, **kw).to(dtype)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    return norm


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "torch")


# ---------------------------------------------------------------- the guarded kernel: F.dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, normalized", [((3, 5, 17), 17), ((7, 33), 33), ((2, 3, 4, 6), (4, 6))])
@pytest.mark.parametrize(
    "args, kwargs",
    [((), {"p": 0.3, "training": True}), ((0.3, True), {}), ((0.3,), {}), ((), {"p": 0.3, "training": False}),
     ((0.0, True), {}), ((1.0,), {})],
    ids=["keywords", "positional", "training-default", "eval", "p0", "p1"],
)
def test_functional_dropout_fused_matches_the_source(torch_backend, dtype, shape, normalized, args, kwargs):
    torch.manual_seed(0)
    norm = _norm(normalized, dtype)
    x, r = _leaves(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    g = torch.randn(shape).to(dtype)
    torch.manual_seed(3)
    with count_kernel_calls() as calls:
        out = kernels.dropout_add_layer_norm(F.dropout, norm, x, r, *args, **kwargs)
    grads = torch.autograd.grad(out, [x, r, norm.weight, norm.bias], g)
    x2, r2 = _leaves(x, r)
    torch.manual_seed(3)  # the same generator draws as the source's F.dropout
    ref = norm(F.dropout(x2, *args, **kwargs) + r2)
    ref_grads = torch.autograd.grad(ref, [x2, r2, norm.weight, norm.bias], g)
    assert _counts(calls) == {"torch": 1}
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_functional_dropout_fallbacks_compute_the_source():
    torch.manual_seed(0)
    norm = _norm(10)
    x, r = torch.randn(2, 3, 10), torch.randn(2, 3, 10)

    def alpha(t, p, training):  # another function in the dropout's place
        return F.alpha_dropout(t, p, training)

    cases = [
        (F.dropout, norm, r, (0.2,), {"inplace": True}, "in-place F.dropout"),
        (F.dropout, norm, r, (torch.tensor(0.2), True), {}, "probability is not a number"),
        (alpha, norm, r, (0.2, True), {}, "not F.dropout"),
        (F.dropout, nn.RMSNorm(10), r, (0.2, False), {}, "is not a LayerNorm"),
        (F.dropout, norm, r[:1], (0.2, False), {}, "residual is not a tensor of x's shape"),
    ]
    for dropout, layer, rr, args, kwargs, why in cases:
        torch.manual_seed(1)
        with count_kernel_calls() as calls:
            out = kernels.dropout_add_layer_norm(dropout, layer, x.clone(), rr, *args, **kwargs)
        torch.manual_seed(1)
        expected = layer(dropout(x.clone(), *args, **kwargs) + rr)
        torch.testing.assert_close(out, expected)
        assert _counts(calls) == {"original": 1}, why
        assert why in _reasons(calls)[0], (why, _reasons(calls))
    # what F.dropout refuses, the kernel refuses the same way (the fallback calls it)
    with pytest.raises(TypeError, match="must be bool"):
        kernels.dropout_add_layer_norm(F.dropout, norm, x, r, 0.2, torch.tensor(True))
    with pytest.raises(ValueError, match="between 0 and 1"):
        kernels.dropout_add_layer_norm(F.dropout, norm, x, r, 1.5)
    with pytest.raises(TypeError):
        kernels.dropout_add_layer_norm(F.dropout, norm, x, r, 0.1, unknown=1)


def test_module_with_extra_arguments_is_called_as_the_source_did():
    class TakesAScale(nn.Module):
        def forward(self, x, scale):
            return x * scale

    norm, x, r = _norm(6), torch.randn(4, 6), torch.randn(4, 6)
    with count_kernel_calls() as calls:
        out = kernels.dropout_add_layer_norm(TakesAScale(), norm, x, r, 2.0)
    torch.testing.assert_close(out, norm(x * 2.0 + r))
    assert _counts(calls) == {"original": 1}


# ---------------------------------------------------------------- the guarded kernel: prenorm


def _prenorm_reference(dropout, norm, x, r, *args, **kwargs):
    h = dropout(x, *args, **kwargs) + r
    return h, norm(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, normalized", [((3, 5, 17), 17), ((7, 33), 33), ((2, 3, 4, 6), (4, 6))])
@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("use", ["both", "sum", "normed"])
@pytest.mark.parametrize("training", [True, False])
def test_prenorm_returns_sum_and_norm_with_gradients(torch_backend, dtype, shape, normalized, form, use, training):
    torch.manual_seed(0)
    norm = _norm(normalized, dtype)
    if form == "module":
        dropout, args, kwargs = nn.Dropout(0.25).train(training), (), {}
    else:
        dropout, args, kwargs = F.dropout, (), {"p": 0.25, "training": training}
    x, r = _leaves(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    gh, gy = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)

    def loss(h, y):
        parts = {"both": (h * gh).float().sum() + (y * gy).float().sum(), "sum": (h * gh).float().sum(),
                 "normed": (y * gy).float().sum()}
        return parts[use]

    params = [norm.weight, norm.bias]
    torch.manual_seed(7)
    with count_kernel_calls() as calls:
        h, y = kernels.dropout_add_layer_norm(dropout, norm, x, r, *args, prenorm=True, **kwargs)
    grads = torch.autograd.grad(loss(h, y), [x, r])
    x2, r2 = _leaves(x, r)
    torch.manual_seed(7)
    h_ref, y_ref = _prenorm_reference(dropout, norm, x2, r2, *args, **kwargs)
    ref_grads = torch.autograd.grad(loss(h_ref, y_ref), [x2, r2])
    assert _counts(calls) == {"torch": 1}
    torch.testing.assert_close(h, h_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL[dtype])
    if use != "sum":  # parameter gradients through the normalized output
        torch.manual_seed(7)
        h, y = kernels.dropout_add_layer_norm(dropout, norm, x, r, *args, prenorm=True, **kwargs)
        got = torch.autograd.grad(loss(h, y), params)
        torch.manual_seed(7)
        want = torch.autograd.grad(loss(*_prenorm_reference(dropout, norm, x2, r2, *args, **kwargs)), params)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL[dtype])


def test_prenorm_fallbacks_return_the_pair():
    torch.manual_seed(0)
    norm, x, r = _norm(8), torch.randn(3, 8), torch.randn(3, 8)
    hooked = nn.Dropout(0.0)
    seen = []
    hooked.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    hooked_norm = _norm(8)
    hooked_norm.register_forward_pre_hook(lambda m, i: seen.append("norm"))
    for dropout, layer, args, why in [
        (hooked, norm, (), "has hooks"),
        (F.dropout, hooked_norm, (0.0,), "has hooks"),
        (nn.Dropout(0.0, inplace=True), norm, (), "in-place Dropout"),
        (nn.Identity(), norm, (), "is not a Dropout"),
        (nn.Dropout(0.0), nn.RMSNorm(8), (), "is not a LayerNorm"),
    ]:
        with count_kernel_calls() as calls:
            h, y = kernels.dropout_add_layer_norm(dropout, layer, x.clone(), r, *args, prenorm=True)
        torch.testing.assert_close(h, x + r)
        with torch.no_grad():
            torch.testing.assert_close(y, F.layer_norm(x + r, (8,), getattr(layer, "weight", None),
                                                       getattr(layer, "bias", None), 1e-5)
                                       if isinstance(layer, nn.LayerNorm) else layer(x + r))
        assert _counts(calls) == {"original": 1} and why in _reasons(calls)[0], _reasons(calls)
    assert seen == [torch.Size([3, 8]), "norm"]  # the hooks ran: the modules themselves were called


def test_fx_tracing_runs_the_original_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.norm = nn.Dropout(0.1), nn.LayerNorm(8)

        def forward(self, x, r):
            s, y = kernels.dropout_add_layer_norm(self.drop, self.norm, x, r, prenorm=True)
            return s + kernels.dropout_add_layer_norm(F.dropout, self.norm, y, s, p=0.1, training=self.training)

    graph = torch.fx.symbolic_trace(Block()).graph
    modules = [n.target for n in graph.nodes if n.op == "call_module"]
    assert modules == ["drop", "norm", "norm"]
    assert [n.target for n in graph.nodes if n.op == "call_function" and n.target is F.dropout] == [F.dropout]


# ---------------------------------------------------------------- triton (interpreted, fresh process)


def test_triton_prenorm_interpreted_in_a_fresh_process():
    pytest.importorskip("triton")
    if os.environ.get(INNER) == "1":
        pytest.skip("this is the fresh process")
    env = dict(os.environ, TRITON_INTERPRET="1", **{INNER: "1"})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton_inner", __file__],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


def _inner():
    if os.environ.get(INNER) != "1":
        pytest.skip("runs in the fresh TRITON_INTERPRET=1 process of test_triton_prenorm_interpreted_in_a_fresh_process")
    pytest.importorskip("triton")


@pytest.fixture
def triton_backend(monkeypatch):
    _inner()
    monkeypatch.setenv(backend.ENV_VAR, "triton")


TRITON_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
              torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.mark.parametrize("dtype", list(TRITON_TOL))
@pytest.mark.parametrize("use", ["both", "sum", "normed"])
def test_triton_inner_prenorm_p0_against_fp32(triton_backend, dtype, use):
    from adopter.kernels.ops.dropout_add_layer_norm import dropout_add_layer_norm as f

    torch.manual_seed(0)
    shape, n = (3, 5, 17), 17
    x, r, w, b = _leaves(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), torch.randn(n).to(dtype),
                         torch.randn(n).to(dtype))
    gh, gy = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)

    def loss(h, y):
        h_part, y_part = (h.float() * gh.float()).sum(), (y.float() * gy.float()).sum()
        return {"both": h_part + y_part, "sum": h_part, "normed": y_part}[use]

    h, y = f(x, r, n, w, b, 1e-5, 0.0, True, prenorm=True)
    assert backend.last_backend() == "triton" and h.dtype == y.dtype == dtype and h.shape == y.shape == shape
    inputs = [x, r, w, b] if use != "sum" else [x, r]
    got = torch.autograd.grad(loss(h, y), inputs)
    ref_in = [t.detach().float().requires_grad_() for t in (x, r, w, b)]
    h_ref = ref_in[0] + ref_in[1]
    y_ref = F.layer_norm(h_ref, (n,), ref_in[2], ref_in[3], 1e-5)
    want = torch.autograd.grad(loss(h_ref, y_ref), ref_in[: len(inputs)])
    torch.testing.assert_close(h.float(), h_ref, **TRITON_TOL[dtype])
    torch.testing.assert_close(y.float(), y_ref, **TRITON_TOL[dtype])
    for a, c in zip(got, want):
        torch.testing.assert_close(a.float(), c, **TRITON_TOL[dtype])


def test_triton_inner_prenorm_dropout_mask_is_the_same_both_ways(triton_backend):
    from adopter.kernels.ops.dropout_add_layer_norm import dropout_add_layer_norm as f

    torch.manual_seed(0)
    p, rows, n = 0.3, 37, 19
    x, r, w, b = _leaves(torch.randn(rows, n), torch.randn(rows, n), torch.randn(n), torch.randn(n))
    gh, gy = torch.randn(rows, n), torch.randn(rows, n)
    h, y = f(x, r, n, w, b, 1e-5, p, True, seed=5, prenorm=True)
    gx, gr, gw, gb = torch.autograd.grad((h * gh).sum() + (y * gy).sum(), [x, r, w, b])
    keep = (h - r).abs() > 0  # the sum shows the kernel's mask
    assert 0 < keep.float().mean() < 1
    ref_in = _leaves(x, r, w, b)
    h_ref = ref_in[0] * keep / (1 - p) + ref_in[1]
    y_ref = F.layer_norm(h_ref, (n,), ref_in[2], ref_in[3], 1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip((gx, gr, gw, gb), torch.autograd.grad((h_ref * gh).sum() + (y_ref * gy).sum(), ref_in)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(gx == 0, ~keep)  # the backward regenerated the forward's mask
    # the same seed gives the same pair; without grad the sum is still returned
    with torch.no_grad():
        h2, y2 = f(x, r, n, w, b, 1e-5, p, True, seed=5, prenorm=True)
    assert torch.equal(h2, h) and torch.equal(y2, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_inner_prenorm_half_x_fp32_residual(triton_backend, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24).to(dtype).requires_grad_()
    r = torch.randn(3, 5, 24, requires_grad=True)
    norm = _norm(24)
    h, y = kernels.dropout_add_layer_norm(nn.Dropout(0.0), norm, x, r, prenorm=True)
    assert backend.last_backend() == "triton" and h.dtype == y.dtype == torch.float32
    g = torch.randn(3, 5, 24)
    got = torch.autograd.grad((h * g).sum() + y.sum(), [x, r, norm.weight])
    x2, r2 = _leaves(x, r)
    h_ref = x2 + r2
    want = torch.autograd.grad((h_ref * g).sum() + norm(h_ref).sum(), [x2, r2, norm.weight])
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    assert got[0].dtype == dtype
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_triton_inner_guarded_functional_dropout_runs_the_kernel(triton_backend):
    torch.manual_seed(0)
    norm, x, r = _norm(17), torch.randn(4, 17, requires_grad=True), torch.randn(4, 17)
    with count_kernel_calls() as calls:
        out = kernels.dropout_add_layer_norm(F.dropout, norm, x, r, p=0.0, training=True)
    assert _counts(calls) == {"triton": 1}
    torch.testing.assert_close(out, norm(x + r), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- rewrite fixtures

REWRITTEN = sorted((FIXTURES / "rewritten").glob("*.py"))


def _strip_expectations(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("# expect:"))


def _rewrite(text: str, name: str, rules=None):
    from adopter.rewrite import rewrite_source

    return rewrite_source(text, scan_source(text, name, rules or all_rules()), filename=name)


def _init_bodies(text: str) -> list[str]:
    tree = ast.parse(text)
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]


@pytest.mark.parametrize("after", REWRITTEN, ids=lambda p: p.name)
def test_rewrite_fixture_text_idempotence_and_init(after):
    before = (FIXTURES / after.name).read_text()
    result = _rewrite(before, after.name)
    assert result.outcomes and all(o.applied for o in result.outcomes), [(o.match.lines, o.reason) for o in result.outcomes]
    assert {o.match.rule for o in result.outcomes} == {"Dropout_LayerNorm"}
    assert _strip_expectations(result.new_text) == after.read_text()
    compile(after.read_text(), after.name, "exec")
    again = _rewrite(after.read_text(), after.name)
    assert again.new_text == after.read_text() and not again.diff  # a second run changes nothing
    assert _init_bodies(after.read_text()) == _init_bodies(before)


def _load(path: Path) -> types.ModuleType:
    module = types.ModuleType(f"dln_fixture_{path.parent.name}_{path.stem}")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


# class -> (constructor args, input shapes)
NUMERIC = {
    "BartStyleLayer": ((8, 0.2), [(2, 3, 8)]),
    "PositionalArguments": ((8, 0.2), [(2, 3, 8), (2, 3, 8)]),
    "DefaultTraining": ((8,), [(5, 8), (5, 8)]),
    "NestedResidualLeft": ((8, 0.2), [(5, 8), (5, 8)]),
    "ResearchBlock": ((8, 0.2), [(2, 3, 8)]),
    "ViTStyleLayer": ((8,), [(2, 3, 8)]),
    "StableLayerNormStyle": ((8,), [(2, 3, 8), (2, 3, 8)]),
    "FunctionalPreNorm": ((8, 0.2), [(2, 3, 8)]),
    "SumReturnedToo": ((8,), [(5, 8), (5, 8)]),
}


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("after", REWRITTEN, ids=lambda p: p.name)
@pytest.mark.parametrize("training", [True, False])
def test_rewrite_fixture_is_equivalent_forward_and_backward(torch_backend, after, training):
    before_mod, after_mod = _load(FIXTURES / after.name), _load(after)
    classes = [n for n, v in vars(before_mod).items() if isinstance(v, type) and issubclass(v, nn.Module)
               and v.__module__ == before_mod.__name__]
    assert classes and set(classes) <= set(NUMERIC), classes
    for name in classes:
        args, shapes = NUMERIC[name]
        torch.manual_seed(0)
        reference = getattr(before_mod, name)(*args).train(training)
        candidate = getattr(after_mod, name)(*args).train(training)
        with torch.no_grad():
            for value in reference.state_dict().values():
                value.copy_(torch.randn_like(value))
        candidate.load_state_dict(reference.state_dict(), strict=True)
        assert list(candidate.state_dict()) == list(reference.state_dict())
        inputs = [torch.randn(*s) for s in shapes]
        outs = []
        for model in (reference, candidate):
            leaves = _leaves(*inputs)
            torch.manual_seed(11)  # dropout masks: the fused torch path draws as the source does
            with count_kernel_calls() as calls:
                out = _flat(model(*leaves))
            loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out)
            grads = torch.autograd.grad(loss, leaves + list(model.parameters()))
            outs.append((out, grads, _counts(calls)))
        (out_ref, g_ref, _), (out_new, g_new, counts) = outs
        assert counts.get("torch", 0) >= 1 and "original" not in counts, (name, counts)
        for a, b in zip(out_new + list(g_new), out_ref + list(g_ref)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


# ---------------------------------------------------------------- what is not a match, and why


def _rejections(text: str, name: str = "snippet.py"):
    from adopter.core.extract import extract_source
    from adopter.core.match import match_structures

    rejected = []
    found = match_structures(extract_source(text, name), get_rules(["Dropout_LayerNorm"]), rejected, source=text)
    return found, {m.class_name: m.reason for m in rejected}


def test_negative_fixture_reasons():
    found, reasons = _rejections((FIXTURES / "negative.py").read_text(), "negative.py")
    assert found == []
    assert "not in a later statement of the add's block" in reasons["KeptSumNormBehindIf"]
    assert "line 94 between the add and the LayerNorm is not a plain assignment" in reasons["KeptSumCallBetween"]
    assert "line 109 between the add" in reasons["KeptSumInPlaceBetween"]  # `r += 1` on an alias
    assert "conditionally" in reasons["KeptSumConditionalNorm"]
    assert "($y)" in reasons["FunctionalDropoutOutputUsedElsewhere"]


HEADER = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n"


def _snippet(forward: str, init: str = "") -> str:
    return HEADER + (
        "class Block(nn.Module):\n"
        "    def __init__(self, d):\n"
        "        super().__init__()\n"
        "        self.p = 0.1\n"
        "        self.drop = nn.Dropout(0.1)\n"
        "        self.norm = nn.LayerNorm(d)\n"
        "        self.f = nn.Linear(d, d)\n" + init +
        "\n    def forward(self, x, y):\n" + "".join(f"        {line}\n" for line in forward.strip().splitlines())
    )


@pytest.mark.parametrize("forward, reason", [
    ("h = F.dropout(y, self.get_p(), self.training)\nreturn self.norm(x + h)", "arguments have calls"),
    ("h = F.dropout(y, p=self.p, training=self.training, inplac=True)\nreturn self.norm(x + h)", "does not take"),
    ("return self.norm(self.f(x) + self.drop(self.f(y)))", "would swap their order"),
    ("x = x + self.drop(y)\nx2 = x\nz = self.norm(x2)\nreturn x, z", None),  # reads another name: no match
])
def test_codemod_refusals_say_why(forward, reason):
    text = _snippet(forward)
    matches = scan_source(text, "snippet.py", get_rules(["Dropout_LayerNorm"]))
    if reason is None:
        assert matches == []
        return
    result = _rewrite(text, "snippet.py", get_rules(["Dropout_LayerNorm"]))
    [outcome] = result.outcomes
    assert not outcome.applied and reason in outcome.reason, outcome.reason
    assert result.new_text == text


def test_sum_read_by_the_next_loop_iteration_is_kept():
    # `x` is read at the top of the loop body: the next iteration reads this one's sum.
    text = _snippet("for _ in range(2):\n    y = y * x\n    x = x + self.drop(y)\n    y = self.norm(x)\nreturn y")
    result = _rewrite(text, "snippet.py", get_rules(["Dropout_LayerNorm"]))
    assert [o.applied for o in result.outcomes] == [True], [o.reason for o in result.outcomes]
    assert "x, norm_out = dropout_add_layer_norm(self.drop, self.norm, y, x, prenorm=True)" in result.new_text
    before, after = types.ModuleType("b"), types.ModuleType("a")
    exec(compile(text, "b", "exec"), before.__dict__)
    exec(compile(result.new_text, "a", "exec"), after.__dict__)
    torch.manual_seed(0)
    m1 = before.Block(6).eval()
    m2 = after.Block(6).eval()
    m2.load_state_dict(m1.state_dict())
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    torch.testing.assert_close(m2(x, y), m1(x, y))


def test_fresh_name_does_not_clash():
    text = _snippet("norm_out = y\nx = x + self.drop(y)\nreturn self.norm(x) + x + norm_out")
    result = _rewrite(text, "snippet.py", get_rules(["Dropout_LayerNorm"]))
    assert "x, norm_out_2 = dropout_add_layer_norm(self.drop, self.norm, y, x, prenorm=True)" in result.new_text
    assert "return norm_out_2 + x + norm_out" in result.new_text


# ---------------------------------------------------------------- end to end: adopter.optimize

RESEARCH_BLOCKS = '''
import torch
import torch.nn.functional as F
from torch import nn


class PreNormBlock(nn.Module):
    def __init__(self, dim, p=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.drop1 = nn.Dropout(p)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.drop2 = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.norm1(x)))
        x = x + self.drop2(self.fc2(torch.relu(self.fc1(self.norm2(x)))))
        return x


class PostNormBlock(nn.Module):
    def __init__(self, dim, p=0.1):
        super().__init__()
        self.p = p
        self.attn = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x):
        h = F.dropout(self.attn(x), p=self.p, training=self.training)
        x = self.norm1(x + h)
        h = F.dropout(self.fc(x), self.p, self.training)
        return self.norm2(h + x)


class Model(nn.Module):
    def __init__(self, dim=16, depth=2, p=0.1):
        super().__init__()
        self.blocks = nn.ModuleList([PreNormBlock(dim, p) for _ in range(depth)] + [PostNormBlock(dim, p)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
'''


@pytest.fixture
def research_blocks(tmp_path, monkeypatch):
    package = tmp_path / "dln_research_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "blocks.py").write_text(RESEARCH_BLOCKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("dln_research_pkg")]:
        monkeypatch.delitem(sys.modules, name)
    import dln_research_pkg.blocks

    return dln_research_pkg.blocks


def test_optimize_research_blocks_fused_and_equivalent(research_blocks, torch_backend):
    from adopter import optimize

    optimized_cls = optimize(
        research_blocks.Model, init_kwargs={"dim": 16}, example_inputs=(torch.randn(2, 5, 16),),
        rules=["Dropout_LayerNorm"],
    )
    report = optimized_cls.adopter_report
    assert [a.rule for a in report.applied] == ["Dropout_LayerNorm"] * 3, str(report)
    assert report.equivalence is not None and report.equivalence.equivalent
    assert "prenorm=True" in report.diff and "F.dropout, self.norm1, self.attn(x), x, p=self.p" in report.diff

    torch.manual_seed(0)
    original = research_blocks.Model(dim=16, p=0.2)
    optimized = optimized_cls(dim=16, p=0.2)
    optimized.load_state_dict(original.state_dict(), strict=True)
    assert list(optimized.state_dict()) == list(original.state_dict())
    x = torch.randn(3, 7, 16)
    for training in (True, False):
        results = []
        for model in (original, optimized):
            model.train(training)
            leaf = x.clone().requires_grad_()
            torch.manual_seed(5)  # dropout p=0.2: the same masks on the torch path
            with count_kernel_calls() as calls:
                out = model(leaf)
            grads = torch.autograd.grad(out.square().sum(), [leaf, *model.parameters()])
            results.append((out, grads, _counts(calls)))
        (out_ref, g_ref, counts_ref), (out_new, g_new, counts_new) = results
        assert counts_ref == {}
        assert counts_new == {"torch": 4}, counts_new  # two pre-norm blocks, two post-norm sites
        torch.testing.assert_close(out_new, out_ref, atol=1e-5, rtol=1e-5)
        for a, b in zip(g_new, g_ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the new transformers sites, rewritten


def _transformers_cases():
    tf = pytest.importorskip("transformers")
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    small = {"num_attention_heads": 4, "intermediate_size": 37}
    bart_like = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
                 "decoder_attention_heads": 4, "encoder_ffn_dim": 37, "decoder_ffn_dim": 37, "dropout": 0.2}
    return {
        "vit": ("vit", "ViTModel", tf.ViTConfig(hidden_size=32, num_hidden_layers=2, image_size=16, patch_size=8,
                                                hidden_dropout_prob=0.2, **small),
                {"pixel_values": torch.randn(2, 3, 16, 16)}, 2),  # two layers
        "bart": ("bart", "BartModel", tf.BartConfig(vocab_size=99, max_position_embeddings=64, **bart_like),
                 {"input_ids": ids, "decoder_input_ids": ids}, 5),
        "opt-post-ln": ("opt", "OPTModel", tf.OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                        ffn_dim=37, vocab_size=99, dropout=0.2, word_embed_proj_dim=32,
                                                        do_layer_norm_before=False, max_position_embeddings=64),
                        {"input_ids": ids}, 1),
        "opt-pre-ln": ("opt", "OPTModel", tf.OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                       ffn_dim=37, vocab_size=99, dropout=0.2, word_embed_proj_dim=32,
                                                       do_layer_norm_before=True, max_position_embeddings=64),
                       {"input_ids": ids}, 0),  # the branch that keeps the unfused statements runs
        "whisper-encoder": ("whisper", "WhisperEncoder",
                            tf.WhisperConfig(num_mel_bins=8, max_source_positions=8, vocab_size=99, **bart_like),
                            {"input_features": torch.randn(2, 8, 16)}, 1),
        "wav2vec2-stable": ("wav2vec2", "Wav2Vec2Model",
                            tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, do_stable_layer_norm=True,
                                              conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2),
                                              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                                              hidden_dropout=0.2, mask_time_prob=0.0, feat_extract_norm="layer",
                                              **small),
                            {"input_values": torch.randn(2, 400)}, 1),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["vit", "bart", "opt-post-ln", "opt-pre-ln", "whisper-encoder", "wav2vec2-stable"])
def test_transformers_sites_rewritten_are_equivalent_in_training(torch_backend, case):
    import importlib

    from adopter.rewrite import rewrite_source
    from adopter.rewrite.loader import load_rewritten_module

    package, cls_name, config, inputs, fused_calls = _transformers_cases()[case]
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    text = Path(module.__file__).read_text(encoding="utf-8")
    result = rewrite_source(text, scan_source(text, module.__file__, get_rules(["Dropout_LayerNorm"])),
                            filename=module.__file__)
    assert not result.error and result.outcomes and all(o.applied for o in result.outcomes), result.outcomes
    rewritten = load_rewritten_module(module, result.new_text)
    torch.manual_seed(0)
    original = getattr(module, cls_name)(config).train()
    candidate = getattr(rewritten, cls_name)(config).train()
    candidate.load_state_dict(original.state_dict(), strict=True)
    results = []
    for model in (original, candidate):
        torch.manual_seed(3)  # hidden dropout 0.2: the same masks on the torch path
        with count_kernel_calls() as calls:
            out = model(**inputs).last_hidden_state
        params = [p for p in model.parameters() if p.requires_grad]
        results.append((out, torch.autograd.grad(out.square().sum(), params, allow_unused=True), _counts(calls)))
    (out_ref, g_ref, _), (out_new, g_new, counts) = results
    assert counts == ({"torch": fused_calls} if fused_calls else {}), counts
    torch.testing.assert_close(out_new, out_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_new, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


CHAIN = HEADER + '''class Chain(nn.Module):
    # three pre-norm residual steps in one function: each norm call is also the next step's add
    def __init__(self, d):
        super().__init__()
''' + "".join(f"        self.norm{i} = nn.LayerNorm(d)\n        self.f{i} = nn.Linear(d, d)\n"
              f"        self.drop{i} = nn.Dropout(0.1)\n" for i in (1, 2, 3)) + '''
    def forward(self, x):
        x = x + self.drop1(self.f1(self.norm1(x)))
        x = x + self.drop2(self.f2(self.norm2(x)))
        x = x + self.drop3(self.f3(self.norm3(x)))
        return x
'''


def test_chained_pre_norm_steps_reach_the_fixed_point(tmp_path, torch_backend):
    from adopter.rewrite import rewrite_file

    path = tmp_path / "chain.py"
    path.write_text(CHAIN)
    first = rewrite_file(path, get_rules(["Dropout_LayerNorm"]), write=True)
    assert first.status == "changed" and sum(o.applied for o in first.outcomes) == 2, first.outcomes
    new = path.read_text()
    flat = " ".join(new.split())  # (a file rewrite wraps lines past the file's length)
    assert "x, norm2_out = dropout_add_layer_norm( self.drop1, self.norm2, self.f1(self.norm1(x)), x, prenorm=True )" in flat
    assert "x, norm3_out = dropout_add_layer_norm( self.drop2, self.norm3, self.f2(norm2_out), x, prenorm=True )" in flat
    assert rewrite_file(path, get_rules(["Dropout_LayerNorm"])).status == "unchanged"
    before, after = types.ModuleType("chain_before"), types.ModuleType("chain_after")
    exec(compile(CHAIN, "chain_before", "exec"), before.__dict__)
    exec(compile(new, "chain_after", "exec"), after.__dict__)
    torch.manual_seed(0)
    m1, m2 = before.Chain(6), after.Chain(6)
    m2.load_state_dict(m1.state_dict())
    x = torch.randn(3, 6)
    for training in (True, False):
        m1.train(training), m2.train(training)
        torch.manual_seed(1)
        o1 = m1(x)
        torch.manual_seed(1)
        o2 = m2(x)
        torch.testing.assert_close(o2, o1)


# ---------------------------------------------------------------- torch.compile: no graph break


class _CompiledForms(nn.Module):
    def __init__(self, cols=8, p=0.1):
        super().__init__()
        self.p = p
        self.drop = nn.Dropout(p)
        self.norm1, self.norm2 = nn.LayerNorm(cols), nn.LayerNorm(cols)

    def forward(self, x, r):
        s, h = kernels.dropout_add_layer_norm(self.drop, self.norm1, x, r, prenorm=True)
        y = kernels.dropout_add_layer_norm(F.dropout, self.norm2, h, s, p=self.p, training=self.training)
        s2, y2 = kernels.dropout_add_layer_norm(F.dropout, self.norm2, y, s, self.p, self.training, prenorm=True)
        return s2 + y2


@pytest.mark.parametrize("train", [True, False])
def test_functional_and_prenorm_forms_compile_without_graph_break(torch_backend, train):
    torch._dynamo.reset()
    module = _CompiledForms().train(train)
    x, r = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    explanation = torch._dynamo.explain(module)(x, r)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    outs = []
    for fn in (module, compiled):
        leaves = _leaves(x, r)
        torch.manual_seed(0)
        out = fn(*leaves)
        outs.append((out, torch.autograd.grad(out.square().sum(), leaves + list(module.parameters()))))
    for a, b in zip([outs[1][0], *outs[1][1]], [outs[0][0], *outs[0][1]]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch._dynamo.reset()
