"""x-transformers' RMSNorm (``F.normalize(x, dim=-1) * self.scale * self.gamma``, issue 35): the
forms the RMSNorm rule rewrites to ``scaled_l2_norm`` (the call each class gets), those it refuses,
and the rewritten classes (``rewritten/positive_l2_normalize.py``: what ``rewrite_source`` writes,
the original kept for TorchScript) against the fixture's originals: the same outputs and
gradients in float32 and bfloat16, scripted too, and a model built of them trains as the original
over three optimizer steps."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls
from torch import nn

from adopter.core.rules.rms_norm import RULE, analyze_forward
from adopter.core.rules.rms_norm.forms import _Variant
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "RMSNorm"
POSITIVE = FIXTURES / "positive_l2_normalize.py"
NEGATIVE = FIXTURES / "negative_l2_normalize.py"
REWRITTEN = FIXTURES / "rewritten" / "positive_l2_normalize.py"
SNAPSHOT = Path(__file__).parent / "RMSNorm" / "positive_l2_normalize.rewritten.py"

CALLS = {
    "RMSNorm": "scaled_l2_norm(x, self.scale, self.gamma)",
    "SimpleRMSNorm": "scaled_l2_norm(x, self.scale)",
    "GammaFirstRMSNorm": "scaled_l2_norm(x, self.g, self.scale)",
    "CastRMSNorm": "scaled_l2_norm(x, self.g, self.scale, eps=self.eps, upcast=True, cast_back=True)",
    "OffsetRMSNorm": "scaled_l2_norm(x, self.scale, (self.gamma + 1.0), eps=1e-6)",
    "LeftScaledRMSNorm": "scaled_l2_norm(x, (self.scale * self.gamma))",
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_form_becomes_its_call(name):
    form = analyze_forward(POSITIVE.read_text(), name)
    assert f"{form.kernel}({', '.join(form.arguments())})" == CALLS[name]
    assert f"return {CALLS[name]}" in REWRITTEN.read_text() and f"return {CALLS[name]}" in SNAPSHOT.read_text()


def test_refused_and_unmatched_forms():
    with pytest.raises(_Variant) as exc:
        analyze_forward(NEGATIVE.read_text(), "CastBetweenRMSNorm")
    assert exc.value.code == "norm-variant"
    rejected: list = []
    assert scan_source(NEGATIVE.read_text(), NEGATIVE.name, [RULE], rejected) == []
    refused = [(m.class_name, m.code) for m in rejected if m.status == "refused"]
    assert refused == [("CastBetweenRMSNorm", "norm-variant")]  # L1, dim=1, a factor of x: no match


def _rewrite(text: str):
    from adopter.rewrite import rewrite_source

    return rewrite_source(text, scan_source(text, POSITIVE.name, [RULE]), filename=POSITIVE.name, rules=[RULE])


def test_rewrite_text_and_idempotence():
    result = _rewrite(POSITIVE.read_text())
    assert len(result.outcomes) == len(CALLS) and all(o.applied for o in result.outcomes), result.outcomes
    text = "".join(line for line in result.new_text.splitlines(keepends=True) if not line.startswith("# expect:"))
    assert text == REWRITTEN.read_text()
    again = _rewrite(REWRITTEN.read_text())
    assert again.new_text == REWRITTEN.read_text() and not again.diff


@pytest.mark.parametrize("name", sorted(CALLS))
def test_rewritten_classes_script_as_the_originals(modules, name):
    """TorchScript compiles the kept original (``torch.jit.is_scripting()``)."""
    before, after = modules
    torch.manual_seed(0)
    original = getattr(before, name)(16)
    rewritten = getattr(after, name)(16)
    rewritten.load_state_dict(original.state_dict())
    x = torch.randn(3, 16)
    torch.jit.script(original)  # the original scripts: so must the rewrite
    assert torch.equal(torch.jit.script(rewritten)(x), original(x))


def _load(path: Path) -> types.ModuleType:
    module = types.ModuleType(f"l2_normalize_{path.stem.replace('.', '_')}")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def modules():
    return _load(POSITIVE), _load(REWRITTEN)


TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_rewritten_class_computes_the_original(modules, name, x_dtype, w_dtype):
    before, after = modules
    torch.manual_seed(0)
    original = getattr(before, name)(37).to(w_dtype)
    with torch.no_grad():
        for p in original.parameters():
            p.normal_()
    rewritten = getattr(after, name)(37).to(w_dtype)
    rewritten.load_state_dict(original.state_dict(), strict=True)
    x = torch.randn(3, 5, 37).to(x_dtype)
    x[0, 0] = 0.0  # an all-zero row: divided by eps, as F.normalize does
    x.requires_grad_()
    with count_kernel_calls() as calls:
        out = rewritten(x)
    assert [(c.kernel, c.backend) for c in calls.calls] == [("scaled_l2_norm", "torch")]
    ref = original(x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, [x, *rewritten.parameters()], g)
    want = torch.autograd.grad(ref, [x, *original.parameters()], g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        scale = max(float(b.abs().max()), 1.0)
        torch.testing.assert_close(a / scale, b / scale, **TOL[x_dtype if x_dtype != torch.float32 else w_dtype])


def _model(module: types.ModuleType, dim: int = 24) -> nn.Module:
    """A small network of every form: a Linear, each norm class in turn with a Linear after it."""
    layers: list[nn.Module] = [nn.Linear(dim, dim)]
    for name in sorted(CALLS):
        layers += [getattr(module, name)(dim), nn.Linear(dim, dim)]
    return nn.Sequential(*layers)


def test_the_rewritten_model_trains_as_the_original(modules):
    before, after = modules
    torch.manual_seed(0)
    original = _model(before)
    rewritten = _model(after)
    rewritten.load_state_dict(original.state_dict(), strict=True)
    assert [n for n, _ in original.named_parameters()] == [n for n, _ in rewritten.named_parameters()]
    opt_a = torch.optim.AdamW(original.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(rewritten.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [(torch.randn(8, 6, 24), torch.randn(8, 6, 24)) for _ in range(3)]
    fused = 0
    for x, target in batches:
        losses = []
        for model, opt in ((original, opt_a), (rewritten, opt_b)):
            opt.zero_grad()
            with count_kernel_calls() as calls:
                loss = torch.nn.functional.mse_loss(model(x), target)
                loss.backward()
            if model is rewritten:
                fused += sum(c.count for c in calls.calls if c.kernel == "scaled_l2_norm" and c.fused)
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-5)
        for (name, a), b in zip(original.named_parameters(), rewritten.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
        opt_a.step()
        opt_b.step()
    assert fused == 3 * len(CALLS)
    for (name, a), b in zip(original.named_parameters(), rewritten.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["RMSNorm", "CastRMSNorm", "OffsetRMSNorm"])
def test_rewritten_classes_compile_to_one_graph_and_export(modules, name):
    """torch.compile (fullgraph: no graph break in the guard or the kernel) and torch.export of a
    rewritten class compute what the original computes, forward and backward."""
    import torch._dynamo

    before, after = modules
    torch.manual_seed(0)
    original = getattr(before, name)(32)
    rewritten = getattr(after, name)(32)
    rewritten.load_state_dict(original.state_dict())
    x = torch.randn(4, 32, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(rewritten, fullgraph=True, backend="aot_eager")(x)
    ref = original(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])
    exported = torch.export.export(rewritten, (x.detach(),))
    torch.testing.assert_close(exported.module()(x.detach()), ref.detach())
