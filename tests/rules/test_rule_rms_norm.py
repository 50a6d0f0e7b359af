"""RMSNorm (issue 12): the rule (forms recognized, look-alikes refused, codemod), its guarded
kernel ``rms_norm`` (fused vs the form's eager formula by run-time facts), the pure op (torch path:
forward bitwise equal to each form's eager code, one float32 ``rstd`` per row saved; triton path
under the interpreter) and ``optimize`` on tiny Llama and Gemma models."""

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
from torch import nn

from adopter.core.rules.rms_norm import RULE, analyze_forward
from adopter.core.scan import scan_paths, scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "RMSNorm"
TRANSFORMERS = Path(__import__("transformers").__file__).parent / "models"

FORMS = {
    "llama": RMSNormForm(),
    "olmo2": RMSNormForm(weight_before_cast=True),
    "helium": RMSNormForm(weight_before_cast=True, weight_fp32=True),
    "gemma": RMSNormForm(offset=1.0, weight_before_cast=True, weight_fp32=True),
    "offset_in_weight_dtype": RMSNormForm(offset=1.0, weight_before_cast=True),
    "litgpt_offset": RMSNormForm(offset=1.0),  # n.to(x.dtype) * (1 + weight): the sum in the weight's dtype
    "t5": RMSNormForm(cast_to_half_weight=True),
}
DTYPES = (torch.float32, torch.bfloat16)
# gradients against eager autograd (which rounds its intermediates in the output dtype), by the
# narrowest dtype involved
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
SHAPE = (3, 5, 37)


def _tol(*dtypes):
    return TOL[torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32]


def _inputs(x_dtype, w_dtype, shape=SHAPE, seed=0):
    torch.manual_seed(seed)
    x = (torch.randn(shape) * 3).to(x_dtype).requires_grad_()
    w = (torch.rand(shape[-1]) + 0.5).to(w_dtype).requires_grad_()
    return x, w


# ---------------------------------------------------------------- matches and refusals


def _expected(path: Path) -> Counter:
    out = Counter()
    for line in path.read_text().splitlines():
        if line.startswith("# expect: RMSNorm "):
            where, *status = line[len("# expect: RMSNorm "):].split()
            out[(where, *status)] += 1
    return out


@pytest.mark.parametrize("name", ["positive.py", "negative.py"])
def test_fixture_matches_and_refusals(name):
    path = FIXTURES / name
    report = scan_paths([path], [RULE])
    assert report.errors == []
    found = Counter((f"{m.class_name}.{m.function}", *(() if m.status == "static" else (f"{m.status}:{m.code}",)))
                    for m in report.matches)
    assert found == _expected(path)


def _reasons(path: Path) -> dict[str, str]:
    rejected = []
    scan_source(path.read_text(), str(path), [RULE], rejected=rejected)
    return {m.class_name: m.reason for m in rejected}


def test_refusals_say_what_differs():
    reasons = _reasons(FIXTURES / "negative.py")
    assert "outside the square root" in reasons["EpsOutsideSqrt"]
    assert "rsqrt" in reasons["SqrtDivision"]
    assert "self.bias" in reasons["BiasRMSNorm"]
    assert "no weight" in reasons["Unweighted"]
    assert "gate" in reasons["GatedRMSNorm"]
    assert "dim=1" in reasons["MeanOverDim1"]
    assert "ClampedNorm._norm" in reasons["NormOverridden"]
    assert "more than the RMSNorm" in reasons["Residual"]
    assert "CenteredLayerNorm" not in reasons  # a LayerNorm: no match at all, not even a rejected one


# class -> the keywords its rewrite passes (the form, a fact of the source)
LIBRARY = {
    ("llama/modeling_llama.py", "LlamaRMSNorm"): (),
    ("mistral/modeling_mistral.py", "MistralRMSNorm"): (),
    ("qwen3/modeling_qwen3.py", "Qwen3RMSNorm"): (),
    ("olmo2/modeling_olmo2.py", "Olmo2RMSNorm"): (("weight_before_cast", "True"),),
    ("helium/modeling_helium.py", "HeliumRMSNorm"): (("weight_fp32", "True"), ("weight_before_cast", "True")),
    ("gemma/modeling_gemma.py", "GemmaRMSNorm"):
        (("offset", "1.0"), ("weight_fp32", "True"), ("weight_before_cast", "True")),
    ("gemma2/modeling_gemma2.py", "Gemma2RMSNorm"):
        (("offset", "1.0"), ("weight_fp32", "True"), ("weight_before_cast", "True")),
    ("t5/modeling_t5.py", "T5LayerNorm"): (("cast_to_half_weight", "True"),),
}


@pytest.mark.parametrize("where", sorted(LIBRARY), ids=lambda w: w[1])
def test_library_forms_are_recognized_with_their_keywords(where):
    file, cls = where
    path = TRANSFORMERS / file
    text = path.read_text()
    matches = [m for m in scan_source(text, str(path), [RULE]) if m.class_name == cls]
    assert [(m.function, m.status) for m in matches] == [("forward", "static")]
    assert analyze_forward(text, cls).keywords == LIBRARY[where]


@pytest.mark.parametrize("file, cls", [("deberta/modeling_deberta.py", "DebertaLayerNorm"),
                                       ("cohere/modeling_cohere.py", "CohereLayerNorm")])
def test_library_layer_norms_written_out_are_no_match(file, cls):
    path = TRANSFORMERS / file
    rejected = []
    matches = scan_source(path.read_text(), str(path), [RULE], rejected=rejected)
    assert not [m for m in matches if m.class_name == cls]
    assert all(m.status != "refused" for m in rejected if m.class_name == cls)


# ---------------------------------------------------------------- the rewrite


def _strip_expectations(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("# expect:"))


def _rewrite(text: str, name: str):
    from adopter.rewrite import rewrite_source

    return rewrite_source(text, scan_source(text, name, [RULE]), filename=name, rules=[RULE])


def _init_bodies(text: str) -> list[str]:
    return [ast.unparse(n) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]


def test_rewrite_fixture_text_idempotence_and_init():
    before = (FIXTURES / "positive.py").read_text()
    after = FIXTURES / "rewritten" / "positive.py"
    result = _rewrite(before, "positive.py")
    assert len(result.outcomes) == 8 and all(o.applied for o in result.outcomes), result.outcomes
    assert _strip_expectations(result.new_text) == after.read_text()
    compile(after.read_text(), str(after), "exec")
    again = _rewrite(after.read_text(), "positive.py")
    assert again.new_text == after.read_text() and not again.diff
    assert _init_bodies(after.read_text()) == _init_bodies(before)


def _load(path: Path) -> types.ModuleType:
    module = types.ModuleType(f"rms_norm_fixture_{path.parent.name}_{path.stem}")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


NORM_CLASSES = ["LlamaRMSNorm", "TypeAsRMSNorm", "SpelledRMSNorm", "Olmo2RMSNorm", "HeliumRMSNorm",
                "GemmaRMSNorm", "Llama4TextRMSNorm", "T5LayerNorm"]


@pytest.mark.parametrize("x_dtype, w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_rewritten_fixture_classes_compute_what_the_originals_compute(x_dtype, w_dtype):
    """Every form, every dtype pairing (bf16 input with a float32 weight: Llama's result is float32,
    OLMo-2's bf16): the same output dtype, bitwise the same forward, the same gradients."""
    before, after = _load(FIXTURES / "positive.py"), _load(FIXTURES / "rewritten" / "positive.py")
    for name in NORM_CLASSES:
        torch.manual_seed(0)
        original = getattr(before, name)(37).to(w_dtype)
        with torch.no_grad():
            for p in original.parameters():
                p.normal_()
        rewritten = getattr(after, name)(37).to(w_dtype)
        rewritten.load_state_dict(original.state_dict(), strict=True)
        x = (torch.randn(SHAPE) * 3).to(x_dtype).requires_grad_()
        with count_kernel_calls() as calls:
            out = rewritten(x)
        assert [(c.kernel, c.backend) for c in calls.calls] == [("rms_norm", "torch")], name
        ref = original(x)
        assert out.dtype == ref.dtype, name
        assert torch.equal(out, ref), name
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, [x, *rewritten.parameters()], g)
        want = torch.autograd.grad(ref, [x, *original.parameters()], g)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **_tol(x_dtype, w_dtype), msg=name)


# ---------------------------------------------------------------- the op (torch path)


@pytest.mark.parametrize("form", list(FORMS), ids=str)
@pytest.mark.parametrize("x_dtype, w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_op_forward_bitwise_and_backward_against_eager(form, x_dtype, w_dtype):
    x, w = _inputs(x_dtype, w_dtype)
    ref = rms_norm_reference(x, w, 1e-6, FORMS[form])
    out = RMSNormFunction.apply(x, w, 1e-6, FORMS[form])
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **_tol(x_dtype, w_dtype))


def test_op_gradients_against_float64_math():
    """The fused backward is the RMSNorm derivative (float32 inputs, checked in float64)."""
    x, w = _inputs(torch.float32, torch.float32)
    g = torch.randn(SHAPE)
    got = torch.autograd.grad(RMSNormFunction.apply(x, w, 1e-6, FORMS["gemma"]), (x, w), g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = torch.autograd.grad(n * (1.0 + w64), (x64, w64), g.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def _saved_bytes(fn, *inputs) -> int:
    """Bytes autograd keeps for the backward of ``fn(*inputs)`` (storages counted once; the
    inputs themselves excluded: the caller keeps them alive anyway)."""
    storages = {}
    excluded = {t.untyped_storage().data_ptr() for t in inputs}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


@pytest.mark.parametrize("x_dtype", DTYPES)
def test_op_keeps_one_rstd_per_row(x_dtype):
    """Eager Llama code keeps the float32 copy (bf16 input), ``x * rstd`` and ``rstd`` for autograd;
    the fused op keeps one float32 ``rstd`` per row beside its inputs."""
    x, w = _inputs(x_dtype, torch.float32, shape=(4, 64, 96))
    rows = 4 * 64
    fused = _saved_bytes(lambda a, b: RMSNormFunction.apply(a, b, 1e-6, FORMS["llama"]), x, w)
    eager = _saved_bytes(lambda a, b: rms_norm_reference(a, b, 1e-6, FORMS["llama"]), x, w)
    assert fused == rows * 4
    assert eager >= rows * 96 * 4  # at least one full-size float32 tensor


def test_two_norms_reading_one_residual_get_the_gradients_of_eager():
    """Pre-norm blocks read one residual stream through two norms: the backward must not write into
    a gradient buffer the other norm still needs."""
    torch.manual_seed(0)
    h = torch.randn(2, 7, 37, requires_grad=True)
    w1, w2 = (torch.rand(37) + 0.5).requires_grad_(), (torch.rand(37) + 0.5).requires_grad_()

    def block(norm):
        a = norm(h, w1)
        b = norm(h, w2)
        return (a * b + a).sum() + (h * b).sum()

    fused = block(lambda x, w: rms_norm(x, w, 1e-6))
    eager = block(lambda x, w: rms_norm_reference(x, w, 1e-6))
    got = torch.autograd.grad(fused, (h, w1, w2))
    want = torch.autograd.grad(eager, (h, w1, w2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_double_backward_matches_eager():
    """create_graph: the fused backward recomputes rstd in the graph, so second derivatives hold."""
    x, w = _inputs(torch.float32, torch.float32)

    def second_derivatives(norm):
        (gx,) = torch.autograd.grad((norm(x, w, 1e-6, FORMS["olmo2"]) ** 2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), (x, w))

    for a, b in zip(second_derivatives(RMSNormFunction.apply), second_derivatives(rms_norm_reference)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the guard


def _calls(fn):
    with count_kernel_calls() as calls:
        out = fn()
    return out, [(c.kernel, c.backend, c.reason) for c in calls.calls]


@pytest.mark.parametrize("case, reason", [
    ("float64 input", "input dtype torch.float64"),
    ("integer input", "input is not a floating tensor"),
    ("broadcast weight", "weight of shape (1,) for rows of 37"),
    ("tensor eps", "eps is a Tensor, not a number"),
    ("bool eps", "eps is a bool, not a number"),
])
@pytest.mark.parametrize("form", list(FORMS), ids=str)
def test_guard_runs_the_forms_eager_formula_otherwise(case, reason, form):
    torch.manual_seed(0)
    x, w, eps = torch.randn(SHAPE), torch.rand(37) + 0.5, 1e-6
    if case == "float64 input":
        x = x.double()
    elif case == "integer input":
        x = (x * 10).long()
    elif case == "broadcast weight":
        w = w[:1]
    elif case == "tensor eps":
        eps = torch.tensor(1e-6)
    elif case == "bool eps":
        eps = True
    out, calls = _calls(lambda: rms_norm(x, w, eps, **_keywords(FORMS[form])))
    ref = rms_norm_reference(x, w, eps, FORMS[form])
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert calls == [("rms_norm", "original", calls[0][2])] and calls[0][2].startswith(reason)


def _keywords(form: RMSNormForm) -> dict:
    return {k: getattr(form, k) for k in ("offset", "weight_before_cast", "weight_fp32", "cast_to_half_weight", "upcast")}


def test_guard_under_fx_tracing_shows_the_original_ops():
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(37))

        def forward(self, x):
            return rms_norm(x, self.weight, 1e-6, offset=1.0, weight_fp32=True, weight_before_cast=True)

    gm, calls = _calls(lambda: torch.fx.symbolic_trace(Norm()))
    assert calls == [("rms_norm", "original", "tracing")]
    targets = {str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes}
    assert {"rsqrt", "mean", "pow"} <= targets
    x = torch.randn(SHAPE)
    torch.testing.assert_close(gm(x), Norm()(x))


def test_guard_fused_path_is_counted():
    x, w = _inputs(torch.bfloat16, torch.float32)
    out, calls = _calls(lambda: rms_norm(x, w, 1e-6))
    assert calls == [("rms_norm", "torch", "")]
    assert out.dtype == torch.float32  # bf16 input, float32 weight: Llama's result is float32


# ---------------------------------------------------------------- optimize


def _llama_config(**kw):
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=1000, **kw)


@pytest.mark.slow
def test_optimize_tiny_llama():
    import transformers

    from adopter import optimize

    optimized = optimize(transformers.LlamaForCausalLM, rules=[RULE], config=_llama_config())
    report = optimized.adopter_report
    (applied,) = report.applied
    assert (applied.rule, applied.class_name, applied.function, applied.status) == (
        "RMSNorm", "LlamaRMSNorm", "forward", "confirmed")
    assert report.equivalence.equivalent
    # 2 layers x 2 norms + the final norm, per forward
    assert set(applied.kernel_calls["analysed"]) == {"torch"} and applied.kernel_calls["analysed"]["torch"] % 5 == 0
    assert "return rms_norm(hidden_states, self.weight, self.variance_epsilon)" in report.diff

    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(_llama_config())
    rewritten = optimized(_llama_config())
    assert list(rewritten.state_dict()) == list(original.state_dict())
    rewritten.load_state_dict(original.state_dict(), strict=True)
    ids = torch.randint(0, 1000, (2, 9))
    out, ref = rewritten(ids).logits, original(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), list(rewritten.parameters())),
                    torch.autograd.grad(ref.sum(), list(original.parameters()))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_optimize_tiny_gemma():
    import transformers

    from adopter import optimize

    config = transformers.GemmaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=1000)
    report = optimize(transformers.GemmaForCausalLM, rules=[RULE], config=config).adopter_report
    (applied,) = report.applied
    assert (applied.rule, applied.class_name, applied.status) == ("RMSNorm", "GemmaRMSNorm", "confirmed")
    assert report.equivalence.equivalent and set(applied.kernel_calls["analysed"]) == {"torch"}
    assert "offset=1.0, weight_fp32=True, weight_before_cast=True" in report.diff


# ---------------------------------------------------------------- triton (interpreter, fresh process)

_CHILD = "ADOPTER_RMS_NORM_TRITON_CHILD"


@pytest.mark.slow
def test_triton_rms_norm_under_the_interpreter():
    """The triton kernels run by the interpreter in a fresh process (TRITON_INTERPRET must be set
    before triton is imported)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD: "1"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interp_"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


_IN_CHILD = os.environ.get(_CHILD) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
child_only = pytest.mark.skipif(not _IN_CHILD, reason="runs in the interpreter child process")


@child_only
@pytest.mark.parametrize("form", list(FORMS), ids=str)
@pytest.mark.parametrize("x_dtype, w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_interp_triton_forms_against_eager(form, x_dtype, w_dtype):
    from adopter.kernels.ops.triton_rms_norm import TritonRMSNormFunction

    x, w = _inputs(x_dtype, w_dtype)
    ref = rms_norm_reference(x, w, 1e-6, FORMS[form])
    out = TritonRMSNormFunction.apply(x, w, 1e-6, FORMS[form])
    assert out.dtype == ref.dtype
    # the interpreter truncates float32 -> bf16 (the GPU rounds to nearest): one bf16 ulp apart
    tol = _tol(x_dtype, w_dtype, out.dtype)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)


@child_only
def test_interp_guarded_selects_triton_when_forced(monkeypatch):
    from adopter.kernels import backend

    monkeypatch.setenv(backend.ENV_VAR, "triton")
    x, w = _inputs(torch.float32, torch.float32)
    out, calls = _calls(lambda: rms_norm(x, w, 1e-6, weight_before_cast=True))
    assert calls == [("rms_norm", "triton", "")]
    ref = rms_norm_reference(x, w, 1e-6, FORMS["olmo2"])
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    for a, b in zip(torch.autograd.grad(out.sum(), (x, w)), torch.autograd.grad(ref.sum(), (x, w))):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
