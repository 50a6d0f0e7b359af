"""rotary_embedding: ``x * cos + rotate_half(x) * sin`` -> ``rotary(x, cos, sin, rotate_half)``.

Static matching (fixtures, look-alikes turned down with their reason, transformers files), the
rewrite (text and numbers of the rewritten fixture), the guarded kernel (torch path forward and
backward against the eager expression, fp32/bf16, odd shapes; every fallback with its reason;
CPU memory), the triton kernel under ``TRITON_INTERPRET=1`` and ``optimize`` on tiny Llama / Phi.

TRITON_INTERPRET must be set before triton is first imported. If something in this pytest
process imported triton earlier, the triton tests re-run in a fresh process instead of skipping.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from adopter.rewrite.scripting import python_view

_TRITON_PRELOADED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from adopter.kernels import backend  # noqa: E402
from adopter.kernels.guarded_rotary import is_half_split_rotation, rotary  # noqa: E402
from adopter.kernels.ops.rotary import RotaryFunction, rotary_embedding  # noqa: E402
from adopter.kernels.telemetry import count_kernel_calls  # noqa: E402

from adopter.core.rules.rotary_embedding import RULE, half_split_rotation  # noqa: E402
from adopter.core.scan import scan_source  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "rotary_embedding"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def eager(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)


def _calls(calls, kernel="rotary"):
    out: dict[str, int] = {}
    for c in calls.calls:
        if c.kernel == kernel:
            out[c.backend] = out.get(c.backend, 0) + c.count
    return out


def _reasons(calls, kernel="rotary"):
    return {c.reason for c in calls.calls if c.kernel == kernel}


# ---------------------------------------------------------------- static matching


def _expected(path: Path) -> list[str]:
    return sorted(line.split()[3] for line in path.read_text().splitlines()
                  if line.startswith("# expect: rotary_embedding"))


def _scan(path: Path):
    rejected = []
    text = path.read_text()
    matches = scan_source(text, str(path), [RULE], rejected)
    return matches, rejected


@pytest.mark.parametrize("name", ["positive.py", "negative.py"])
def test_fixture_matches_are_the_expected_ones(name):
    matches, _ = _scan(FIXTURES / name)
    assert sorted(m.function for m in matches) == _expected(FIXTURES / name)
    assert all(m.status == "static" and m.class_name is None for m in matches)


@pytest.mark.parametrize("function, reason", [
    # (GPT-J's and GLM's interleaved rotations are matches since issue 24: tests/rules/test_rotary_forms.py)
    ("apply_flipped", "it returns cat((x2, -x1), dim=-1), not cat((-x2, x1), dim=-1)"),
    ("apply_thirds", "x.shape[-1] // 3 is not part of the half-split rotation"),
    ("apply_other_tensor", "rotate_halves(k) rotates another tensor than the one multiplied by cos (q * cos)"),
    ("apply_called_twice", "x (make_q.sample()) has calls"),
])
def test_look_alikes_are_turned_down_with_the_reason(function, reason):
    _, rejected = _scan(FIXTURES / "negative.py")
    reasons = [m.reason for m in rejected if m.function == function]
    assert any(reason in r for r in reasons), reasons


def test_sums_of_products_without_a_same_file_rotation_are_not_matches():
    # a rotation imported from another file (its source is not here), plain products; a difference
    # is not even a candidate (the pattern is a sum)
    # Not even listed among the rejected matches (NotACandidate): every ``a*b + c*d`` fits the
    # sum pattern, and reports list only look-alikes of the rule.
    matches, rejected = _scan(FIXTURES / "negative.py")
    functions = {m.function for m in matches} | {m.function for m in rejected}
    for function in ("apply_imported", "plain_products", "apply_difference"):
        assert function not in functions
    from adopter.core.extract import extract_source
    from adopter.core.match import NotACandidate
    from adopter.core.match.driver import match_structures
    from adopter.core.rules.rotary_embedding import RULE

    text = (FIXTURES / "negative.py").read_text()
    dropped = []
    match_structures(extract_source(text, "negative.py"), [RULE], dropped, source=text)
    assert all(not isinstance(m.reason, NotACandidate) for m in dropped)


def _fn(src: str):
    tree = ast.parse(src)
    return tree.body[-1], tree


@pytest.mark.parametrize("body, ok", [
    ("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1), dim=-1)",
     True),
    ("h = x.size(-1) // 2\n    return torch.cat([-x[..., h:], x[..., 0:h]], -1)", True),
    # dim 0, swapped halves, a missing minus, an odd split, a step, something extra
    ("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1), dim=0)",
     False),
    ("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x1, x2), dim=-1)",
     False),
    ("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((x2, x1), dim=-1)",
     False),
    ("x1 = x[..., : x.shape[-2] // 2]\n    x2 = x[..., x.shape[-2] // 2 :]\n    return torch.cat((-x2, x1), dim=-1)",
     False),
    ("x1 = x[..., : x.shape[-1] // 2 : 1]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1), dim=-1)",
     False),
    ("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n    return torch.cat((-x2, x1), dim=-1) * 2",
     False),
])
def test_half_split_rotation_reads_the_source(body, ok):
    fn, tree = _fn(f"import torch\ndef r(x):\n    {body}\n")
    why = half_split_rotation(fn, tree)
    assert (why == "") == ok, why


TRANSFORMERS = Path(importlib.util.find_spec("transformers").origin).parent / "models" \
    if importlib.util.find_spec("transformers") else None


@pytest.mark.skipif(TRANSFORMERS is None, reason="transformers not installed")
@pytest.mark.parametrize("model, matched_lines, reason", [
    ("llama", ["q_embed = (q * cos) + (rotate_half(q) * sin)", "k_embed = (k * cos) + (rotate_half(k) * sin)"], ""),
    # partial rotary: Phi slices in the attention and passes query_rot, GPT-NeoX slices here
    ("phi", ["q_embed = (q * cos) + (rotate_half(q) * sin)", "k_embed = (k * cos) + (rotate_half(k) * sin)"], ""),
    ("gpt_neox", ["q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)",
                  "k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)"], ""),
    # the fold cannot place rotate_half where FalconAttention inlines apply_rotary_pos_emb in turn
    ("falcon", ["q_embed = (q * cos) + (rotate_half(q) * sin)", "k_embed = (k * cos) + (rotate_half(k) * sin)"], ""),
    # named rotate_half, interleaved: rotary_interleaved since issue 24
    ("glm", ["q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)",
             "k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)"], ""),
    ("gptj", ["return (tensor * cos) + (rotate_every_two(tensor) * sin)"], ""),
    ("nanochat", [], "it returns cat((x2, -x1), dim=-1)"),
])
def test_transformers_files(model, matched_lines, reason):
    path = TRANSFORMERS / model / f"modeling_{model}.py"
    matches, rejected = _scan(path)
    lines = path.read_text().splitlines()
    assert sorted(lines[m.lines[-1] - 1].strip() for m in matches) == sorted(matched_lines)
    assert all(m.function == "apply_rotary_pos_emb" for m in matches)
    if reason:
        assert rejected and all(reason in m.reason for m in rejected), [m.reason for m in rejected]


# ---------------------------------------------------------------- rewrite


def _load(text: str, name: str):
    module = type(sys)(name)
    exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def rewritten_positive():
    from adopter.rewrite import rewrite_source

    path = FIXTURES / "positive.py"
    text = path.read_text()
    result = rewrite_source(text, scan_source(text, str(path), [RULE]), filename=str(path), rules=[RULE])
    assert all(o.applied for o in result.outcomes), [o.reason for o in result.outcomes]
    return text, result.new_text


def test_rewrite_text(rewritten_positive):
    _, new = rewritten_positive
    new = python_view(new)
    for line in (
        "q_embed = rotary(q, cos, sin, rotate_half)",
        "k_embed = rotary(k, cos, sin, rotate_half)",
        "q_embed = torch.cat([rotary(q_rot, cos, sin, rotate_half), q_pass], dim=-1)",
        "k_embed = rotary(k_rot, cos, sin, rotate_half)",
        "q_embed = rotary(q, cos, sin, rotate_by_cat)",
        "k_embed = rotary(k.float(), cos, sin, rotate_half)",
        "return rotary(q, cos[..., -q_len:, :], sin[..., -q_len:, :], rotate_half)",
        "return rotary(x, cos, sin, rotate_half)",
        "from adopter.kernels import rotary",
    ):
        assert line in new, new
    assert "rotate_half(q) * sin" not in new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewritten_functions_compute_the_original(rewritten_positive, dtype):
    old_text, new_text = rewritten_positive
    old, new = _load(old_text, "rope_old"), _load(new_text, "rope_new")
    torch.manual_seed(0)
    b, heads, kv_heads, s, d = 2, 3, 1, 5, 10  # a single KV head; odd sizes elsewhere
    q = torch.randn(b, heads, s, d, dtype=dtype)
    k = torch.randn(b, kv_heads, s, d, dtype=dtype)
    cos, sin = torch.randn(b, s, d, dtype=dtype), torch.randn(b, s, d, dtype=dtype)
    partial_cos, partial_sin = cos[..., :4].unsqueeze(1), sin[..., :4].unsqueeze(1)
    cos_long, sin_long = torch.randn(b, 1, 8, d, dtype=dtype), torch.randn(b, 1, 8, d, dtype=dtype)
    calls_by_fn = {  # function: (arguments, how many leading ones get a gradient)
        "apply_rotary_pos_emb": ((q, k, cos, sin), 2),
        "apply_partial_rotary": ((q, k, partial_cos, partial_sin), 2),
        "apply_other_orders": ((q, k, cos.unsqueeze(1), sin.unsqueeze(1)), 2),
        # cos/sin of 8 positions, sliced to the last 5 inside
        "apply_cached": ((q, cos_long, sin_long), 1),
        "apply_rotary_single": ((q, cos.unsqueeze(1), sin.unsqueeze(1)), 1),
    }
    for name, (args, n_grad) in calls_by_fn.items():
        outs = []
        for module in (old, new):
            leaves = [a.detach().clone().requires_grad_() if i < n_grad else a for i, a in enumerate(args)]
            with count_kernel_calls() as calls:
                out = getattr(module, name)(*leaves)
            out = out if isinstance(out, tuple) else (out,)
            loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in out)
            grads = torch.autograd.grad(loss, leaves[:n_grad])
            outs.append((out, grads, calls))
        (o_old, g_old, _), (o_new, g_new, calls) = outs
        tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
        for a, b_ in zip(o_old + g_old, o_new + g_new):
            assert a.dtype == b_.dtype and a.shape == b_.shape
            torch.testing.assert_close(b_, a, **tol)
        counts = _calls(calls)
        if dtype == torch.bfloat16 and name == "apply_other_orders":
            # k.float() * cos with a bf16 cos promotes: that line keeps the original computation
            assert counts == {"torch": 1, "original": 1} and any("promotes" in r for r in _reasons(calls))
        else:
            assert set(counts) == {"torch"}, (name, calls.calls)


# ---------------------------------------------------------------- the torch kernel

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _case(shape, cos_shape, dtype, *, transpose=False, partial=None):
    """x (optionally a transposed view or the first ``partial`` columns of a wider tensor), cos, sin."""
    torch.manual_seed(1)
    if transpose:
        x = torch.randn(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)
    elif partial:
        x = torch.randn(*shape[:-1], shape[-1] + partial)[..., : shape[-1]]
    else:
        x = torch.randn(shape)
    return x.to(dtype), torch.randn(cos_shape).to(dtype), torch.randn(cos_shape).to(dtype)


CASES = {
    "llama": ((2, 3, 7, 10), (2, 1, 7, 10), {}),
    "transposed": ((2, 3, 7, 10), (2, 1, 7, 10), {"transpose": True}),
    "single_kv_head": ((2, 1, 5, 6), (2, 1, 5, 6), {}),
    "partial_slice": ((2, 3, 5, 4), (2, 1, 5, 4), {"partial": 6}),
    "unsqueeze_dim_2": ((2, 5, 3, 8), (2, 5, 1, 8), {}),
    "two_d": ((5, 6), (5, 6), {}),
    "cos_last_dim_only": ((3, 4, 2), (2,), {}),
}


def _fp32_reference(x, cos, sin, g):
    xr = x.detach().float().requires_grad_()
    out = eager(xr, cos.float(), sin.float())
    (dx,) = torch.autograd.grad(out, xr, g.float())
    return out, dx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_kernel_forward_backward(case, dtype):
    shape, cos_shape, kw = CASES[case]
    x, cos, sin = _case(shape, cos_shape, dtype, **kw)
    x = x.requires_grad_()
    with count_kernel_calls() as calls:
        out = rotary(x, cos, sin, rotate_half)
    assert _calls(calls) == {"torch": 1}
    g = torch.randn(out.shape).to(dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    ref, ref_dx = _fp32_reference(x, cos, sin, g)
    assert out.dtype == dtype and out.shape == x.shape and dx.shape == x.shape
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **TOL[dtype])


def test_torch_kernel_does_not_save_x():
    x, cos, sin = _case((2, 3, 5, 8), (2, 1, 5, 8), torch.float32)
    x.requires_grad_()
    out = RotaryFunction.apply(x, cos, sin)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin


def _rotate_half_method_style(x):  # a half-split rotation written differently: the probe accepts it
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


@pytest.mark.parametrize("make, reason", [
    (lambda: (torch.randn(2, 3, 5, 7), torch.randn(2, 1, 5, 7), torch.randn(2, 1, 5, 7), rotate_half), "not even"),
    (lambda: (torch.randn(2, 3, 5, 8).bfloat16(), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), rotate_half),
     "the original promotes"),
    # a single KV head with cos/sin of all heads: the original widens k; the kernel must not run
    (lambda: (torch.randn(2, 1, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), rotate_half),
     "broadcast x (2, 1, 5, 8) to (2, 4, 5, 8)"),
    (lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 1), torch.randn(2, 1, 5, 1), rotate_half),
     "last dimension is not x's"),
    (lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8).requires_grad_(), torch.randn(2, 1, 5, 8),
              rotate_half), "cos/sin require grad"),
    (lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), rotate_every_two),
     "rotate_every_two is not the half-split rotation"),
    (lambda: (torch.arange(16).reshape(2, 8), torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long),
              rotate_half), "not floating point"),
])
def test_fallback_is_the_original_expression(make, reason):
    x, cos, sin, rot = make()
    with count_kernel_calls() as calls:
        out = rotary(x, cos, sin, rot)
    assert _calls(calls) == {"original": 1}
    assert any(reason in r for r in _reasons(calls)), _reasons(calls)
    want = (x * cos) + (rot(x) * sin)
    assert out.dtype == want.dtype and out.shape == want.shape and torch.equal(out, want)


def test_fallback_gives_cos_its_gradient():
    x, cos, sin = _case((2, 3, 5, 8), (2, 1, 5, 8), torch.float32)
    cos.requires_grad_()
    (got,) = torch.autograd.grad(rotary(x, cos, sin, rotate_half).sum(), cos)
    (want,) = torch.autograd.grad(eager(x, cos, sin).sum(), cos)
    torch.testing.assert_close(got, want)


def test_probe_tells_half_split_rotations_apart():
    assert is_half_split_rotation(rotate_half) and is_half_split_rotation(_rotate_half_method_style)
    assert not is_half_split_rotation(rotate_every_two)
    assert not is_half_split_rotation(lambda x: torch.cat((x[..., 3:], -x[..., :3]), dim=-1))
    assert not is_half_split_rotation(lambda x: x)


def test_fx_trace_records_the_original_ops():
    class Rope(torch.nn.Module):
        def forward(self, x, cos, sin):
            return rotary(x, cos, sin, rotate_half)

    with count_kernel_calls() as calls:
        graph = torch.fx.symbolic_trace(Rope()).graph
    targets = {str(n.target) for n in graph.nodes}
    assert any("cat" in t for t in targets) and any("mul" in t for t in targets), targets
    assert _reasons(calls) == {"tracing"}


def _peak_cpu_bytes(fn) -> int:
    """Peak of the bytes allocated while ``fn`` runs, from the profiler's CPU memory records
    (allocations per op, frees as ``[memory]`` events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def test_cpu_memory_forward_allocates_only_the_output():
    # Llama-like attention shape: (batch, heads, seq, head_dim), q a transposed view
    x, cos, sin = _case((2, 4, 128, 64), (2, 1, 128, 64), torch.float32, transpose=True)
    size = x.numel() * x.element_size()
    original = _peak_cpu_bytes(lambda: eager(x, cos, sin))
    fused = _peak_cpu_bytes(lambda: rotary_embedding(x, cos, sin))
    assert original >= 2.5 * size, original / size  # x*cos, -x2 and the cat, the rotated product, the sum
    assert fused <= 1.1 * size, fused / size


def test_cpu_memory_forward_and_backward():
    x, cos, sin = _case((2, 4, 128, 64), (2, 1, 128, 64), torch.float32, transpose=True)
    g = torch.randn(x.shape)
    size = x.numel() * x.element_size()

    def step(fn):
        leaf = x.detach().requires_grad_()
        return lambda: fn(leaf).backward(g)

    original = _peak_cpu_bytes(step(lambda t: eager(t, cos, sin)))
    fused = _peak_cpu_bytes(step(lambda t: rotary_embedding(t, cos, sin)))
    assert fused <= 2.1 * size and original >= fused + size, (original / size, fused / size)


# ---------------------------------------------------------------- triton (interpreter)

triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

if _TRITON_PRELOADED and HAS_TRITON:
    def test_triton_in_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "triton",
                               __file__], env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture
def interpreted_triton(request):
    if _TRITON_PRELOADED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1: covered by the fresh-process run")


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["llama", "transposed", "single_kv_head", "partial_slice", "two_d",
                                  "cos_last_dim_only"])
def test_triton_kernel_forward_backward(interpreted_triton, case, dtype):
    from adopter.kernels.ops.triton_rotary import TritonRotaryFunction

    shape, cos_shape, kw = CASES[case]
    x, cos, sin = _case(shape, cos_shape, dtype, **kw)
    x = x.requires_grad_()
    out = TritonRotaryFunction.apply(x, cos, sin)
    g = torch.randn(out.shape).to(dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    ref, ref_dx = _fp32_reference(x, cos, sin, g)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **TOL[dtype])


@triton_only
def test_triton_backend_through_the_guarded_entry(interpreted_triton, monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    x, cos, sin = _case((2, 3, 5, 6), (2, 1, 5, 6), torch.float32)
    with count_kernel_calls() as calls:
        out = rotary(x, cos, sin, rotate_half)
    assert _calls(calls) == {"triton": 1}
    torch.testing.assert_close(out, eager(x, cos, sin), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- optimize()

transformers = pytest.importorskip("transformers") if TRANSFORMERS is not None else None


def _llama_config(**overrides):
    sizes = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1000}
    return transformers.LlamaConfig(**{**sizes, **overrides})


@pytest.fixture(scope="module")
def optimized_llama():
    from adopter import optimize

    return optimize(transformers.LlamaForCausalLM, rules=[RULE], config=_llama_config())


def _equivalent_and_fused(original_cls, optimized_cls, config):
    from adopter.verification.equivalence import check_equivalence

    torch.manual_seed(0)
    inputs = {"input_ids": torch.randint(0, config.vocab_size, (2, 9))}
    with count_kernel_calls() as calls:
        result = check_equivalence(original_cls(config).eval(), optimized_cls(config).eval(), inputs)
    return result, _calls(calls)


@pytest.mark.slow
def test_optimize_llama_applies_both_lines(optimized_llama):
    report = optimized_llama.adopter_report
    applied = [a for a in report.applied if a.rule == "rotary_embedding"]
    assert [a.function for a in applied] == ["apply_rotary_pos_emb"] * 2
    assert all(a.status == "confirmed" for a in applied)
    assert report.equivalence.equivalent
    assert all(set(a.kernel_calls["analysed"]) == {"torch"} for a in applied), [a.kernel_calls for a in applied]
    assert "rotary(q, cos, sin, rotate_half)" in report.diff


@pytest.mark.slow
def test_optimized_llama_with_a_single_kv_head(optimized_llama):
    config = _llama_config(num_key_value_heads=1)
    result, counts = _equivalent_and_fused(transformers.LlamaForCausalLM, optimized_llama, config)
    assert result.equivalent, result.summary()
    assert set(counts) == {"torch"}, counts


@pytest.mark.slow
def test_optimize_phi_partial_rotary():
    from adopter import optimize

    config = transformers.PhiConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=1000, partial_rotary_factor=0.5)
    optimized = optimize(transformers.PhiForCausalLM, rules=[RULE], config=config)
    report = optimized.adopter_report
    assert [a.function for a in report.applied if a.rule == "rotary_embedding"] == ["apply_rotary_pos_emb"] * 2
    assert report.equivalence.equivalent
    # another partial factor and a full rotary on the same rewritten class
    for factor in (0.25, 1.0):
        config.partial_rotary_factor = factor
        result, counts = _equivalent_and_fused(transformers.PhiForCausalLM, optimized, config)
        assert result.equivalent, (factor, result.summary())
        assert set(counts) == {"torch"}, counts
