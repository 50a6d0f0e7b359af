"""RMSNorm as written outside HuggingFace (issue 24): litgpt's ``x * x`` over ``self.dim`` with a
unit-offset flag (an ``if`` or a conditional expression), Meta-llama/torchtitan's ``_norm`` helper,
same-file hierarchies, ``.to(x.dtype)``, norms that keep the input dtype (no float32 upcast).

The rule (forms and the keywords naming them, look-alikes refused), the rewrite (fixture text,
idempotence), the rewritten classes against the originals (every dtype pairing, each flag and dim:
bitwise forward, gradients), the guard (``dim`` not the last, no upcast with a half input: the
form's eager formula), every way the rewritten classes run (TorchScript, fx, dynamo without a graph
break), and ``optimize`` training a Meta-llama-style Transformer and a litgpt-style GPT as the
originals train (slow)."""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls
from adopter.kernels.guarded_rms_norm import rms_norm
from adopter.kernels.ops.rms_norm import RMSNormForm, RMSNormFunction, rms_norm_reference

from adopter.core.rules.rms_norm import RULE, analyze_forward
from adopter.core.scan import scan_paths, scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "RMSNorm"
POSITIVE = FIXTURES / "positive_outside_hf.py"
NEGATIVE = FIXTURES / "negative_outside_hf.py"
REWRITTEN = FIXTURES / "rewritten" / "positive_outside_hf.py"
MODELS = Path(__file__).parents[1] / "fixtures" / "rms_norm_models"

HALF = (torch.bfloat16, torch.float16)
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
       torch.float16: {"atol": 4e-3, "rtol": 4e-3}}
SHAPE = (3, 5, 37)


def _tol(*dtypes):
    for d in (torch.bfloat16, torch.float16):
        if d in dtypes:
            return TOL[d]
    return TOL[torch.float32]


# ---------------------------------------------------------------- matches and refusals


def _expected(path: Path) -> Counter:
    out = Counter()
    for line in path.read_text().splitlines():
        if line.startswith("# expect: RMSNorm "):
            where, *status = line[len("# expect: RMSNorm "):].split()
            out[(where, *status)] += 1
    return out


@pytest.mark.parametrize("path", [POSITIVE, NEGATIVE], ids=lambda p: p.name)
def test_fixture_matches_and_refusals(path):
    report = scan_paths([path], [RULE])
    assert report.errors == []
    found = Counter((f"{m.class_name}.{m.function}", *(() if m.status == "static" else (f"{m.status}:{m.code}",)))
                    for m in report.matches)
    assert found == _expected(path)


# class -> the keywords its rewrite passes (facts of the source; a flag's value is read at run time)
KEYWORDS = {
    "LitGPTRMSNorm": (("offset", "1.0 if self.add_unit_offset else 0.0"), ("dim", "self.dim")),
    "LitGPTScaleRMSNorm": (("offset", "1.0 if self.add_unit_offset else 0.0"), ("weight_before_cast", "True"),
                           ("weight_fp32", "False if self.add_unit_offset else True"), ("dim", "self.dim")),
    "AssignedOffsetRMSNorm": (("offset", "1.0 if self.add_unit_offset else 0.0"), ("weight_before_cast", "True"),
                              ("weight_fp32", "False if self.add_unit_offset else True"), ("dim", "self.dim")),
    "MetaLlamaRMSNorm": (),
    "HelperInBaseRMSNorm": (),
    "OwnForwardRMSNorm": (("weight_before_cast", "True"),),
    "ToDtypeRMSNorm": (),
    "NegatedBranchRMSNorm": (("offset", "0.0 if self.plain else 1.0"), ("weight_before_cast", "True"),
                             ("weight_fp32", "True")),
    "NoUpcastRMSNorm": (("upcast", "False"),),
    "NoUpcastSquareRMSNorm": (("upcast", "False"),),
}


@pytest.mark.parametrize("cls", sorted(KEYWORDS))
def test_each_form_is_rewritten_with_its_keywords(cls):
    assert analyze_forward(POSITIVE.read_text(), cls).keywords == KEYWORDS[cls]


def _reasons(path: Path) -> dict[str, str]:
    rejected = []
    scan_source(path.read_text(), str(path), [RULE], rejected=rejected)
    return {m.class_name: m.reason for m in rejected}


def test_refusals_say_what_differs():
    reasons = _reasons(NEGATIVE)
    assert "rsqrt" in reasons["SquareSqrtDivision"]
    assert "outside the square root" in reasons["SquareEpsOutside"]
    assert "keep its dimension" in reasons["LitNoKeepdim"]
    assert "dim=1" in reasons["LitMeanOverDim1"]
    assert "self.enabled False" in reasons["BranchToIdentity"]
    assert "different weights" in reasons["BranchOtherWeight"]
    assert "never casts back" in reasons["Float32NotCastBack"]
    assert "unweighted" in reasons["UnweightedNoUpcast"]
    assert "Clamped._norm" in reasons["HelperOverridden"]  # two levels of same-file subclasses down
    assert "self.fp32, self.offset: one flag at most" in reasons["TwoFlags"]
    # no match at all: a helper an imported base may define, a centered norm, no square
    assert "does not return an RMSNorm" in reasons["UnknownBaseFirst"]
    assert "CenteredSquare" not in reasons  # a LayerNorm: not even a rejected candidate
    assert "NotASquare" not in reasons


def test_the_corpus_litgpt_norm_is_recognized_too():
    """The same class in the other spelling a real litgpt checkout carries (scale chosen by a
    conditional expression, multiplied before the cast back)."""
    text = POSITIVE.read_text()
    assert [m.class_name for m in scan_source(text, str(POSITIVE), [RULE])].count("LitGPTScaleRMSNorm") == 1


# ---------------------------------------------------------------- the rewrite


def _strip_expectations(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("# expect:"))


def _rewrite(text: str, name: str):
    from adopter.rewrite import rewrite_source

    return rewrite_source(text, scan_source(text, name, [RULE]), filename=name, rules=[RULE])


def _init_bodies(text: str) -> list[str]:
    return [ast.unparse(n) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]


def test_rewrite_fixture_text_idempotence_and_init():
    before = POSITIVE.read_text()
    result = _rewrite(before, POSITIVE.name)
    assert len(result.outcomes) == len(KEYWORDS) and all(o.applied for o in result.outcomes), result.outcomes
    assert _strip_expectations(result.new_text) == REWRITTEN.read_text()
    again = _rewrite(REWRITTEN.read_text(), POSITIVE.name)
    assert again.new_text == REWRITTEN.read_text() and not again.diff
    assert _init_bodies(REWRITTEN.read_text()) == _init_bodies(before)


# ---------------------------------------------------------------- rewritten classes vs originals


def _load(path: Path) -> types.ModuleType:
    module = types.ModuleType(f"rms_norm_outside_hf_{path.parent.name}_{path.stem}")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def modules():
    return _load(POSITIVE), _load(REWRITTEN)


# (class, constructor keywords, why the guarded call runs the eager formula for a float32 input, or "")
CASES = [
    ("LitGPTRMSNorm", {}, ""),
    ("LitGPTRMSNorm", {"add_unit_offset": True}, ""),
    ("LitGPTRMSNorm", {"dim": 2}, ""),  # the last dim of a 3-d input, spelled positively
    ("LitGPTRMSNorm", {"dim": 1}, "the norm is over dim 1"),
    ("LitGPTRMSNorm", {"dim": 1, "add_unit_offset": True}, "the norm is over dim 1"),
    ("LitGPTScaleRMSNorm", {}, ""),
    ("LitGPTScaleRMSNorm", {"add_unit_offset": True}, ""),
    ("LitGPTScaleRMSNorm", {"dim": 0}, "the norm is over dim 0"),
    ("AssignedOffsetRMSNorm", {}, ""),
    ("AssignedOffsetRMSNorm", {"add_unit_offset": True}, ""),
    ("AssignedOffsetRMSNorm", {"dim": -2}, "the norm is over dim -2"),
    ("MetaLlamaRMSNorm", {}, ""),
    ("InheritedRMSNorm", {}, ""),
    ("HelperInBaseRMSNorm", {}, ""),
    ("OwnForwardRMSNorm", {}, ""),
    ("ToDtypeRMSNorm", {}, ""),
    ("NegatedBranchRMSNorm", {}, ""),
    ("NegatedBranchRMSNorm", {"plain": False}, ""),
    ("NoUpcastRMSNorm", {}, ""),
    ("NoUpcastSquareRMSNorm", {}, ""),
]


def _pair(modules, name, kwargs, w_dtype):
    before, after = modules
    torch.manual_seed(0)
    original = getattr(before, name)(37, **kwargs).to(w_dtype)
    with torch.no_grad():
        for p in original.parameters():
            p.normal_()
    rewritten = getattr(after, name)(37, **kwargs).to(w_dtype)
    rewritten.load_state_dict(original.state_dict(), strict=True)
    return original, rewritten


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("x_dtype, w_dtype", list(itertools.product(DTYPES, (torch.float32, torch.bfloat16))),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_rewritten_classes_compute_what_the_originals_compute(modules, x_dtype, w_dtype):
    """Every form, flag and dim, every dtype pairing: the same output dtype, bitwise the same
    forward, the same gradients; fused where the run-time facts allow it, the form's eager formula
    (over the source's dim) otherwise."""
    for name, kwargs, fallback in CASES:
        original, rewritten = _pair(modules, name, kwargs, w_dtype)
        x = (torch.randn(SHAPE) * 3).to(x_dtype).requires_grad_()
        with count_kernel_calls() as calls:
            out = rewritten(x)
        if "NoUpcast" in name and x_dtype != torch.float32:
            fallback = "the source normalizes in the input dtype"
        (call,) = calls.calls
        assert (call.backend, call.reason.startswith(fallback) if fallback else call.reason) == (
            ("original", True) if fallback else ("torch", "")), (name, kwargs, call)
        ref = original(x)
        assert out.dtype == ref.dtype, (name, kwargs)
        assert torch.equal(out, ref), (name, kwargs)
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, [x, *rewritten.parameters()], g)
        want = torch.autograd.grad(ref, [x, *original.parameters()], g)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **_tol(x_dtype, w_dtype), msg=f"{name} {kwargs}")


@pytest.mark.parametrize("x_dtype, w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_meta_llama_form_rounds_as_llama_hf(modules, x_dtype, w_dtype):
    """Meta-llama's ``self._norm(x.float()).type_as(x) * self.weight`` casts back before the weight
    multiplies, as HF Llama's ``self.weight * h.to(input_dtype)`` does: the default form, bit for bit
    (a product is commutative); OLMo-2's order (weight before the cast) rounds differently."""
    original, _ = _pair(modules, "MetaLlamaRMSNorm", {}, w_dtype)
    x = (torch.randn(SHAPE) * 3).to(x_dtype)
    with torch.no_grad():
        out = original(x)
        llama = rms_norm_reference(x, original.weight, original.eps, RMSNormForm())
        olmo2 = rms_norm_reference(x, original.weight, original.eps, RMSNormForm(weight_before_cast=True))
    assert out.dtype == llama.dtype and torch.equal(out, llama)
    if x_dtype in HALF and w_dtype in HALF:
        assert not torch.equal(out, olmo2)


# ---------------------------------------------------------------- the guard


@pytest.mark.parametrize("dim, fused", [(-1, True), (2, True), ([-1], True), ((2,), True), (0, False), (1, False),
                                        (-2, False), ([1, 2], False)])
def test_guard_fuses_only_over_the_last_dim(dim, fused):
    torch.manual_seed(0)
    x, w = torch.randn(SHAPE), torch.rand(37) + 0.5
    form = RMSNormForm(offset=1.0)
    with count_kernel_calls() as calls:
        out = rms_norm(x, w, 1e-6, offset=1.0, dim=dim)
    (call,) = calls.calls
    assert call.backend == ("torch" if fused else "original"), call
    if not fused:
        assert call.reason.startswith(f"the norm is over dim {dim!r}")
    assert torch.equal(out, rms_norm_reference(x, w, 1e-6, form, dim))


def test_guard_a_bool_dim_fails_as_the_source_fails():
    """``dim=True`` is no dimension: not fused, and the form's formula raises what the source's
    ``torch.mean(x * x, dim=True, ...)`` raises (a TypeError)."""
    x, w = torch.randn(SHAPE), torch.ones(37)
    with pytest.raises(TypeError, match="mean"):
        torch.mean(x * x, dim=True, keepdim=True)
    with count_kernel_calls() as calls, pytest.raises(TypeError, match="mean"):
        rms_norm(x, w, 1e-6, dim=True)
    assert [(c.backend, c.reason) for c in calls.calls] == [("original", "the norm is over dim True, not the last of 3")]


def _no_upcast_eager(x, w, eps):
    """``NoUpcastRMSNorm.forward`` as the source writes it."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_guard_no_upcast_fuses_float32_only(x_dtype, w_dtype):
    torch.manual_seed(0)
    x = (torch.randn(SHAPE) * 3).to(x_dtype).requires_grad_()
    w = (torch.rand(37) + 0.5).to(w_dtype).requires_grad_()
    with count_kernel_calls() as calls:
        out = rms_norm(x, w, 1e-6, upcast=False)
    (call,) = calls.calls
    if x_dtype == torch.float32:
        assert (call.backend, call.reason) == ("torch", "")
    else:
        assert call.backend == "original" and "no upcast" in call.reason
    ref = _no_upcast_eager(x, w, 1e-6)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        torch.testing.assert_close(a, b, **_tol(x_dtype, w_dtype))


def test_op_refuses_a_half_input_without_upcast():
    with pytest.raises(ValueError, match="float32 inputs only"):
        RMSNormFunction.apply(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6, RMSNormForm(upcast=False))
    with pytest.raises(ValueError, match="T5LayerNorm"):
        RMSNormForm(cast_to_half_weight=True, upcast=False)


# ---------------------------------------------------------------- every way they run


def test_rewritten_classes_script_and_fx_trace_as_the_originals(modules):
    """TorchScript compiles the kept original (``torch.jit.is_scripting()``); an fx trace records
    the form's eager ops: both compute the original's output bit for bit."""
    x = torch.randn(SHAPE)
    for name, kwargs, _ in CASES:
        original, rewritten = _pair(modules, name, kwargs, torch.float32)
        torch.jit.script(original)  # the original scripts: so must the rewrite
        scripted = torch.jit.script(rewritten)
        assert torch.equal(scripted(x), original(x)), (name, kwargs)
        with count_kernel_calls() as calls:
            gm = torch.fx.symbolic_trace(rewritten)
        assert [(c.backend, c.reason) for c in calls.calls] == [("original", "tracing")]
        assert "rsqrt" in gm.code
        assert torch.equal(gm(x), original(x)), (name, kwargs)


COMPILED = ["LitGPTRMSNorm", "LitGPTScaleRMSNorm", "AssignedOffsetRMSNorm", "MetaLlamaRMSNorm", "NegatedBranchRMSNorm",
            "NoUpcastRMSNorm"]


@pytest.mark.parametrize("name", COMPILED)
def test_rewritten_classes_compile_to_one_graph(modules, name):
    """dynamo: no graph break, the fused aten op in the graph, the compiled module computing what
    the eager rewritten one computes (forward and backward, aot_eager)."""
    torch._dynamo.reset()
    try:
        _, rewritten = _pair(modules, name, {"add_unit_offset": True} if "Offset" in name or "LitGPT" in name else {},
                             torch.float32)
        x = torch.randn(SHAPE, requires_grad=True)
        explanation = torch._dynamo.explain(rewritten)(x)
        assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
        code = "\n".join(m.code for g in explanation.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule))
        assert "_fused_rms_norm" in code
        torch._dynamo.reset()
        compiled = torch.compile(rewritten, backend="aot_eager", fullgraph=True)
        results = []
        for module in (rewritten, compiled):
            xi = x.detach().clone().requires_grad_()
            out = module(xi)
            grads = torch.autograd.grad((out * torch.linspace(-1, 1, 37)).sum(), [xi, *rewritten.parameters()])
            results.append((out, grads))
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
        for a, b in zip(results[1][1], results[0][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------- optimize end to end


def _models(name):
    sys.path.insert(0, str(MODELS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(MODELS))


def _train_alike(original, rewritten, make_batch, vocab, steps=3):
    """A few SGD steps of each from the same weights: the same losses and gradients at every step."""
    rewritten.load_state_dict(original.state_dict(), strict=True)
    opt_a = torch.optim.SGD(original.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(rewritten.parameters(), lr=0.05)
    fused = 0
    for step in range(steps):
        ids, targets = make_batch(step)
        losses = []
        for model, opt in ((original, opt_a), (rewritten, opt_b)):
            opt.zero_grad()
            with count_kernel_calls() as calls:
                loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, vocab), targets.reshape(-1))
                loss.backward()
            if model is rewritten:
                fused += sum(c.count for c in calls.calls if c.kernel == "rms_norm" and c.backend == "torch")
                assert not [c for c in calls.calls if c.backend == "original"], calls.calls
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
        for (n, a), b in zip(rewritten.named_parameters(), original.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=f"step {step} {n}")
        opt_a.step()
        opt_b.step()
    return fused


@pytest.mark.slow
def test_optimize_meta_llama_transformer_trains_like_the_original():
    from adopter import optimize

    meta = _models("meta_llama")
    optimized = optimize(meta.Transformer, rules=["RMSNorm"], example_inputs=(torch.randint(0, 128, (2, 9)),))
    report = optimized.adopter_report
    (applied,) = report.applied
    assert (applied.rule, applied.class_name, applied.status) == ("RMSNorm", "RMSNorm", "confirmed")
    assert report.equivalence.equivalent and set(applied.kernel_calls["analysed"]) == {"torch"}
    assert "return rms_norm(x, self.weight, self.eps)" in report.diff
    torch.manual_seed(0)
    original, rewritten = meta.Transformer(), optimized()
    gen = torch.Generator().manual_seed(0)

    def batch(step):
        ids = torch.randint(0, 128, (2, 17), generator=gen)
        return ids[:, :-1], ids[:, 1:]

    # 2 layers x 2 norms + the final norm, per step
    assert _train_alike(original, rewritten, batch, 128) == 3 * 5


@pytest.mark.slow
@pytest.mark.parametrize("unit_offset", [False, True])
def test_optimize_litgpt_gpt_trains_like_the_original(unit_offset):
    from adopter import optimize

    lit = _models("litgpt_block")
    optimized = optimize(lit.GPT, rules=["RMSNorm"], example_inputs=(torch.randint(0, 96, (2, 9)),))
    report = optimized.adopter_report
    (applied,) = report.applied
    assert (applied.rule, applied.class_name, applied.status) == ("RMSNorm", "RMSNorm", "confirmed")
    assert report.equivalence.equivalent and set(applied.kernel_calls["analysed"]) == {"torch"}
    assert "offset=1.0 if self.add_unit_offset else 0.0, dim=self.dim)" in report.diff
    # the config of the rewritten module builds the rewritten norm (its ``norm_class`` reads that
    # module's ``RMSNorm``); Gemma's unit offset is the other side of the rewritten flag
    rewritten_config = optimized.__init__.__globals__["Config"]
    torch.manual_seed(0)
    original = lit.GPT(lit.Config(unit_offset=unit_offset))
    rewritten = optimized(rewritten_config(unit_offset=unit_offset))
    assert type(rewritten.transformer.ln_f) is not lit.RMSNorm
    gen = torch.Generator().manual_seed(0)

    def batch(step):
        ids = torch.randint(0, 96, (2, 17), generator=gen)
        return ids[:, :-1], ids[:, 1:]

    assert _train_alike(original, rewritten, batch, 96) == 3 * 5


# ---------------------------------------------------------------- triton (interpreter, fresh process)

_CHILD = "ADOPTER_RMS_NORM_OUTSIDE_HF_TRITON_CHILD"


@pytest.mark.slow
def test_triton_new_forms_under_the_interpreter():
    """litgpt's ``offset`` after the cast back and the form without upcast (float32) through the
    triton kernels, run by the interpreter in a fresh process."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD: "1"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interp_"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


_IN_CHILD = os.environ.get(_CHILD) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
child_only = pytest.mark.skipif(not _IN_CHILD, reason="runs in the interpreter child process")


@child_only
@pytest.mark.parametrize("form, x_dtype", [(RMSNormForm(offset=1.0), torch.float32),
                                           (RMSNormForm(offset=1.0), torch.bfloat16),
                                           (RMSNormForm(upcast=False), torch.float32),
                                           (RMSNormForm(upcast=False, weight_before_cast=True), torch.float32)])
@pytest.mark.parametrize("w_dtype", (torch.float32, torch.bfloat16))
def test_interp_triton_new_forms_against_eager(form, x_dtype, w_dtype):
    from adopter.kernels.ops.triton_rms_norm import TritonRMSNormFunction

    torch.manual_seed(0)
    x = (torch.randn(SHAPE) * 3).to(x_dtype).requires_grad_()
    w = (torch.rand(37) + 0.5).to(w_dtype).requires_grad_()
    ref = rms_norm_reference(x, w, 1e-6, form)
    out = TritonRMSNormFunction.apply(x, w, 1e-6, form)
    assert out.dtype == ref.dtype
    tol = _tol(x_dtype, w_dtype, out.dtype)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)


@child_only
def test_interp_triton_refuses_a_half_input_without_upcast():
    from adopter.kernels.ops.triton_rms_norm import TritonRMSNormFunction

    with pytest.raises(ValueError, match="float32 inputs only"):
        TritonRMSNormFunction.apply(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6, RMSNormForm(upcast=False))
