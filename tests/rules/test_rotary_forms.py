"""rotary_embedding as written outside HuggingFace (issue 24): the interleaved rotation (GPT-J's
``rotate_every_two``), ``rotate_half`` as a method, the half rotation written inline (litgpt), the
complex rotation (Meta-llama, torchtitan, mistral-inference), the pairs rotated in real numbers and
stacked or concatenated (llama2.c, DeepSeek, Flux).

Static matching (fixtures ``positive_forms.py``/``negative_forms.py``, every look-alike turned down
with its reason, the source readers, transformers files), the rewrite (the text is
``rewritten/positive_forms.py``; the rewritten functions compute the originals, forward and
backward, fused), every way the rewritten code runs (TorchScript, fx, dynamo without graph breaks),
the guarded kernels (forward and backward against the written expression, fp32/bf16, odd shapes;
every fallback with its reason; CPU memory), the triton kernel under ``TRITON_INTERPRET=1``, and
``optimize`` on a Meta-llama and a litgpt attention that then train like the originals.

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

_TRITON_PRELOADED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from adopter.kernels import backend  # noqa: E402
from adopter.kernels.guarded_rotary import (  # noqa: E402
    _PROBED,
    is_interleaved_rotation,
    rotary,
    rotary_complex,
    rotary_interleaved,
    rotary_pairs,
)
from adopter.kernels.ops.rotary import (  # noqa: E402
    InterleavedRotaryFunction,
    PairRotaryFunction,
    rotary_embedding_interleaved,
    rotary_embedding_pairs,
)
from adopter.kernels.telemetry import count_kernel_calls  # noqa: E402
from adopter.rewrite.scripting import python_view  # noqa: E402

from adopter.core.rules.rotary_embedding import RULE, rotation_layout  # noqa: E402
from adopter.core.scan import scan_source  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "rotary_embedding"
POSITIVE = FIXTURES / "positive_forms.py"
NEGATIVE = FIXTURES / "negative_forms.py"
REWRITTEN = FIXTURES / "rewritten" / "positive_forms.py"
MODELS = Path(__file__).parents[1] / "fixtures" / "rotary_models"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_every_two_4d(x):  # GPT-J's: the last dimension only of a 4-d tensor
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _calls(calls, kernel="rotary"):
    out: dict[str, int] = {}
    for c in calls.calls:
        if c.kernel == kernel:
            out[c.backend] = out.get(c.backend, 0) + c.count
    return out


def _reasons(calls, kernel="rotary"):
    return {c.reason for c in calls.calls if c.kernel == kernel and c.reason}


# ---------------------------------------------------------------- static matching


def _scan(path: Path):
    rejected = []
    matches = scan_source(path.read_text(), str(path), [RULE], rejected)
    return matches, rejected


def _expected(path: Path) -> list[str]:
    return sorted(line.split()[3] for line in path.read_text().splitlines()
                  if line.startswith("# expect: rotary_embedding"))


UNBIND = FIXTURES / "positive_unbind_halves.py"
LEARNED = FIXTURES / "negative_learned_complex.py"


@pytest.mark.parametrize("path", [POSITIVE, NEGATIVE, UNBIND, LEARNED], ids=lambda p: p.name)
def test_fixture_matches_are_the_expected_ones(path):
    matches, _ = _scan(path)
    assert sorted(f"{m.class_name}.{m.function}" if m.class_name else m.function for m in matches) == _expected(path)
    assert all(m.status == "static" for m in matches)


@pytest.mark.parametrize("function, reason", [
    ("apply_interleaved_flipped", "rotate_every_two_flipped is not the interleaved rotate_every_two: it stacks (x2, -x1)"),
    ("apply_interleaved_wrong_dim", "torch.stack((-x2, x1), dim=-2) is not a stack of two parts along dim=-1"),
    ("apply_inline_flipped", "it returns cat((x2, -x1), dim=-1), not cat((-x2, x1), dim=-1)"),
    ("apply_inline_swapped", "it returns cat((-x1, x2), dim=-1)"),
    ("apply_inline_other_tensor", "rotated rotates another tensor than the one multiplied by cos (x * cos)"),
    ("apply_inline_reassigned", "x is assigned between its halves and the sum"),
    ("apply_pairs_flipped", "its first part is not a difference of two products"),
    ("apply_pairs_swapped", "its first part is not a difference of two products"),
    ("apply_pairs_mixed", "its parts pair the factors otherwise"),
    ("apply_pairs_other_dim", "on another dimension than -1"),
    ("apply_pairs_part_read", "computes a rotated part that other code reads, or not right before the stack"),
    ("apply_pairs_apart", "computes a rotated part that other code reads, or not right before the stack"),
])
def test_look_alikes_are_turned_down_with_the_reason(function, reason):
    _, rejected = _scan(NEGATIVE)
    reasons = [m.reason for m in rejected if m.function == function]
    assert reasons and all(reason in r for r in reasons), reasons


def test_what_is_no_candidate_is_not_reported():
    # another module's rotate_half (its source is not here), a method reading self, stacks of
    # other things and complex products not of pairs: not listed among the look-alikes either
    _, rejected = _scan(NEGATIVE)
    listed = {m.function for m in rejected} | {m.class_name for m in rejected}
    assert not listed & {"apply_module_rotation", "ReadsSelf", "not_rotations"}


def _fn(src: str):
    tree = ast.parse("import torch\n" + src)
    return tree.body[-1], tree


@pytest.mark.parametrize("src, layout", [
    ("def r(x):\n    x1 = x[:, :, :, ::2]\n    x2 = x[:, :, :, 1::2]\n    x = torch.stack((-x2, x1), dim=-1)\n"
     "    return x.flatten(-2)", "interleaved"),
    ("def r(x):\n    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(start_dim=-2)", "interleaved"),
    ("def r(x):\n    x = x.view(*x.shape[:-1], -1, 2)\n    x1, x2 = x.unbind(dim=-1)\n"
     "    x = torch.stack((-x2, x1), dim=-1)\n    return x.flatten(start_dim=-2)", "interleaved"),
    ("def r(x):\n    p = x.unflatten(-1, (-1, 2))\n    return torch.stack((-p[..., 1], p[..., 0]), dim=-1).reshape(x.shape)",
     "interleaved"),
    ("def r(x):\n    x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat((-x2, x1), dim=-1)", "half-split"),
    ("def r(x):\n    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]\n    return torch.cat((-x2, x1), -1)",
     "half-split"),
    # a flipped sign, the odd positions first, a step of 3, stacked on -2, flattened from -3, chunked in 3
    ("def r(x):\n    return torch.stack((x[..., 1::2], -x[..., ::2]), -1).flatten(-2)", ""),
    ("def r(x):\n    return torch.stack((-x[..., ::2], x[..., 1::2]), -1).flatten(-2)", ""),
    ("def r(x):\n    return torch.stack((-x[..., 1::3], x[..., ::3]), -1).flatten(-2)", ""),
    ("def r(x):\n    return torch.stack((-x[..., 1::2], x[..., ::2]), -2).flatten(-2)", ""),
    ("def r(x):\n    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-3)", ""),
    ("def r(x):\n    x1, x2 = x.chunk(3, dim=-1)\n    return torch.cat((-x2, x1), dim=-1)", ""),
])
def test_rotation_layout_reads_the_source(src, layout):
    fn, tree = _fn(src)
    got, why = rotation_layout(fn, tree)
    assert got == layout, why


@pytest.mark.parametrize("src, kind, layout", [
    ("@staticmethod\ndef r(x):\n    h = x.shape[-1] // 2\n    return torch.cat((-x[..., h:], x[..., :h]), -1)", "method",
     "half-split"),
    ("def r(self, x):\n    h = x.shape[-1] // 2\n    return torch.cat((-x[..., h:], x[..., :h]), -1)", "method",
     "half-split"),
    # reads self: not a rotation of x alone
    ("def r(self, x):\n    h = self.half\n    return torch.cat((-x[..., h:], x[..., :h]), -1)", "method", ""),
    # a method called on the class needs no self
    ("def r(self, x):\n    h = x.shape[-1] // 2\n    return torch.cat((-x[..., h:], x[..., :h]), -1)", "static", ""),
])
def test_methods_are_read_without_self(src, kind, layout):
    fn, tree = _fn(src)
    assert rotation_layout(fn, tree, kind)[0] == layout


TRANSFORMERS = Path(importlib.util.find_spec("transformers").origin).parent / "models" \
    if importlib.util.find_spec("transformers") else None


@pytest.mark.skipif(TRANSFORMERS is None, reason="transformers not installed")
@pytest.mark.parametrize("model, kernel, lines", [
    ("gptj", "rotary_interleaved", ["return (tensor * cos) + (rotate_every_two(tensor) * sin)"]),
    ("codegen", "rotary_interleaved", ["return (tensor * cos) + (rotate_every_two(tensor) * sin)"]),
    ("cohere", "rotary_interleaved", ["q_embed = (q * cos) + (rotate_half(q) * sin)",
                                      "k_embed = (k * cos) + (rotate_half(k) * sin)"]),
    ("deepseek_v3", "rotary_pairs", ["q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)",
                                     "k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)"]),
    ("gpt_oss", "rotary_pairs", ["return torch.cat((first_, second_), dim=-1)"]),
    ("deepseek_v2", "rotary_complex", ["xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)",
                                       "xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)"]),
])
def test_transformers_files(model, kernel, lines):
    from adopter.rewrite import rewrite_source

    path = TRANSFORMERS / model / f"modeling_{model}.py"
    if not path.exists():
        pytest.skip(f"{model} not in this transformers")
    matches, _ = _scan(path)
    text = path.read_text().splitlines()
    found = sorted(text[m.lines[-1] - 1].strip() for m in matches)
    assert all(line in found for line in lines), found
    result = rewrite_source(path.read_text(), matches, filename=str(path), rules=[RULE])
    assert all(o.applied for o in result.outcomes), [o.reason for o in result.outcomes]
    assert f"{kernel}(" in python_view(result.new_text)


# ---------------------------------------------------------------- rewrite


def _strip_expectations(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.lstrip().startswith("# expect:"))


def _rewrite(text: str, filename: str):
    from adopter.rewrite import rewrite_source

    return rewrite_source(text, scan_source(text, filename, [RULE]), filename=filename, rules=[RULE])


def test_rewrite_is_the_rewritten_fixture_and_idempotent():
    result = _rewrite(POSITIVE.read_text(), str(POSITIVE))
    assert result.outcomes and all(o.applied for o in result.outcomes), [o.reason for o in result.outcomes]
    assert _strip_expectations(result.new_text) == REWRITTEN.read_text()
    again = _rewrite(REWRITTEN.read_text(), str(REWRITTEN))
    assert again.new_text == REWRITTEN.read_text() and not again.outcomes


def test_rewrite_removes_the_inline_rotation_only_where_it_can():
    view = python_view(REWRITTEN.read_text())
    tree = ast.parse(view)
    bodies = {fn.name: ast.unparse(fn) for fn in tree.body if isinstance(fn, ast.FunctionDef)}
    # litgpt's apply_rope: the halves and the concatenation right before the sum go
    assert "torch.cat" not in bodies["apply_rope"] and "head_size" not in bodies["apply_rope"]
    assert "roped = rotary(x, cos, sin)" in bodies["apply_rope"]
    # cos/sin unsqueezed in between: the rotation stays and is handed over
    assert "rotated = torch.cat((-x2, x1), dim=-1)" in bodies["apply_rope_batched"]
    assert "rotary(x, cos, sin, rotated)" in bodies["apply_rope_batched"]
    # llama2.c: q's and k's rotated parts interleave; both go with their stacks
    assert "xq_out_r" not in bodies["apply_rotary_emb_real"] and "xk_out_i" not in bodies["apply_rotary_emb_real"]


def _load(path: Path, name: str):
    # a real file: TorchScript reads the source of what it compiles
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def forms():
    return _load(POSITIVE, "rotary_forms_original"), _load(REWRITTEN, "rotary_forms_rewritten")


def _polar(*shape, dtype=torch.float32):
    return torch.polar(torch.ones(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype))


B, S, H, D = 2, 5, 3, 10  # odd sizes but the rotated (even) dimension

# function: (make(dtype) -> arguments, how many leading ones get a gradient)
CALLS = {
    "apply_gptj": (lambda dt: (torch.randn(B, S, H, D), torch.randn(B, S, D // 2), torch.randn(B, S, D // 2)), 1),
    "apply_glm": (lambda dt: (torch.randn(B, H, S, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)), 1),
    "apply_unbind": (lambda dt: (torch.randn(B, H, S, D), torch.randn(S, D), torch.randn(S, D)), 1),
    "apply_chunks": (lambda dt: (torch.randn(B, H, S, D), torch.randn(S, D), torch.randn(S, D)), 1),
    "apply_rope": (lambda dt: (torch.randn(B, H, S, D), torch.randn(S, D), torch.randn(S, D)), 1),
    "apply_rope_batched": (lambda dt: (torch.randn(B, H, S, D), torch.randn(B, S, D), torch.randn(B, S, D)), 1),
    "apply_rope_in_product": (lambda dt: (torch.randn(B, H, S, D), torch.randn(S, D), torch.randn(S, D)), 1),
    "apply_rotary_emb": (lambda dt: (torch.randn(B, S, H, D), torch.randn(B, S, 1, D), _polar(S, D // 2)), 2),
    "apply_rotary_emb_mistral": (lambda dt: (torch.randn(B * S, H, D), torch.randn(B * S, 1, D), _polar(B * S, D // 2)),
                                 2),
    "apply_rotary_emb_real": (lambda dt: (torch.randn(B, S, H, D), torch.randn(B, S, 1, D), torch.randn(1, S, 1, D // 2),
                                          torch.randn(1, S, 1, D // 2)), 2),
    "apply_interleaved_inline": (lambda dt: (torch.randn(B, H, S, D), torch.randn(S, D // 2), torch.randn(S, D // 2)), 1),
    "apply_halves_written_out": (lambda dt: (torch.randn(B, H, S, D), torch.randn(S, D // 2), torch.randn(S, D // 2)), 1),
}
# the complex and llama2.c forms compute in fp32 whatever x is (x.float()): cos/sin stay fp32
FLOAT32_ANGLES = {"apply_rotary_emb", "apply_rotary_emb_mistral", "apply_rotary_emb_real"}


def _arguments(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    make, n_grad = CALLS[name]
    args = make(dtype)
    cast = [a.to(dtype) if not a.is_complex() and (i < n_grad or name not in FLOAT32_ANGLES) else a
            for i, a in enumerate(args)]
    return cast, n_grad


def _run_grad(fn, args, n_grad):
    leaves = [a.detach().clone().requires_grad_() if i < n_grad else a for i, a in enumerate(args)]
    with count_kernel_calls() as calls:
        out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in out)
    grads = torch.autograd.grad(loss, leaves[:n_grad])
    return out, grads, calls


TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_rewritten_functions_compute_the_original_fused(forms, name, dtype):
    old, new = forms
    args, n_grad = _arguments(name, dtype)
    out_old, grads_old, _ = _run_grad(getattr(old, name), args, n_grad)
    out_new, grads_new, calls = _run_grad(getattr(new, name), args, n_grad)
    for a, b in zip(out_old + grads_old, out_new + grads_new):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b, a, **TOL[dtype])
    assert set(_calls(calls)) == {"torch"}, calls.calls


@pytest.mark.parametrize("cls, args", [
    ("NeoXAttention", (4,)), ("MethodRotary", ()), ("InterleavedChild", ()),
])
def test_rewritten_methods_compute_the_original_fused(forms, cls, args):
    old, new = forms
    torch.manual_seed(0)
    cos_dim = 4 if cls == "NeoXAttention" else D
    q, k = torch.randn(B, H, S, D), torch.randn(B, 1, S, cos_dim if cls == "NeoXAttention" else D)
    cos, sin = torch.randn(1, S, cos_dim), torch.randn(1, S, cos_dim)
    inputs = (q, k, cos, sin) if cls == "NeoXAttention" else (q, cos, sin)
    want = getattr(old, cls)(*args)(*inputs)
    with count_kernel_calls() as calls:
        got = getattr(new, cls)(*args)(*inputs)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert set(_calls(calls)) == {"torch"}, calls.calls


# ---------------------------------------------------------------- every way the rewritten code runs


def _scripts(fn) -> bool:
    try:
        torch.jit.script(fn)
    except Exception:  # noqa: BLE001  (whatever TorchScript cannot compile)
        return False
    return True


@pytest.mark.parametrize("name", sorted(CALLS))
def test_torchscript_compiles_the_users_statements(forms, name):
    old, new = forms
    if not _scripts(getattr(old, name)):
        assert not _scripts(getattr(new, name))  # the complex forms: TorchScript has no view_as_complex of these
        return
    args, _ = _arguments(name, torch.float32)
    scripted = torch.jit.script(getattr(new, name))
    want = torch.jit.script(getattr(old, name))(*args)
    got = scripted(*args)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls, args", [("NeoXAttention", (4,)), ("MethodRotary", ()), ("InterleavedChild", ())])
def test_torchscript_compiles_the_rewritten_classes(forms, cls, args):
    old, new = forms
    assert _scripts(getattr(old, cls)(*args)) and _scripts(getattr(new, cls)(*args))


class _Three(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b, c):
        return self.fn(a, b, c)


class _Four(_Three):
    def forward(self, a, b, c, d):
        return self.fn(a, b, c, d)


def _traceable(module) -> bool:
    try:
        torch.fx.symbolic_trace(module)
    except Exception:  # noqa: BLE001  (control flow on a proxy, *proxy.shape: the original's own limits)
        return False
    return True


@pytest.mark.parametrize("name", sorted(CALLS))
def test_fx_traces_the_users_computation(forms, name):
    old, new = forms
    args, _ = _arguments(name, torch.float32)
    wrap = _Three if len(args) == 3 else _Four
    if not _traceable(wrap(getattr(old, name))):
        assert not _traceable(wrap(getattr(new, name)))
        return
    with count_kernel_calls() as calls:
        traced = torch.fx.symbolic_trace(wrap(getattr(new, name)))
    assert _reasons(calls) <= {"tracing"}
    targets = {str(n.target) for n in traced.graph.nodes}
    assert not any("adopter" in t for t in targets), targets
    want, got = getattr(old, name)(*args), traced(*args)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_dynamo_compiles_without_graph_breaks(forms, name):
    _, new = forms
    args, n_grad = _arguments(name, torch.float32)
    torch._dynamo.reset()
    _PROBED.clear()  # as when a model is compiled before it ever ran
    leaves = [a.detach().clone().requires_grad_() if i < n_grad else a for i, a in enumerate(args)]
    explanation = torch._dynamo.explain(getattr(new, name))(*leaves)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [b.reason.splitlines()[0] for b in explanation.break_reasons]
    code = "\n".join(m.code for g in explanation.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule))
    assert "addcmul" in code  # the fused rotation was compiled, not the written expression
    compiled = torch.compile(getattr(new, name), backend="aot_eager")
    out_c, grads_c, _ = _run_grad(compiled, args, n_grad)
    out_e, grads_e, _ = _run_grad(getattr(new, name), args, n_grad)
    torch._dynamo.reset()
    for a, b in zip(out_e + grads_e, out_c + grads_c):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_dynamo_probes_a_method_handed_over(forms):
    _, new = forms
    torch._dynamo.reset()
    _PROBED.clear()
    model = new.MethodRotary()
    q, cos, sin = torch.randn(B, H, S, D), torch.randn(S, D), torch.randn(S, D)
    explanation = torch._dynamo.explain(model)(q, cos, sin)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [b.reason.splitlines()[0] for b in explanation.break_reasons]
    code = "\n".join(m.code for g in explanation.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule))
    assert "addcmul" in code


# ---------------------------------------------------------------- the guarded kernels

KTOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}

# x shape, cos/sin shape, x a transposed view
INTERLEAVED_CASES = {
    "gptj": ((2, 7, 3, 6), (2, 7, 1, 6), False),
    "transposed": ((2, 3, 7, 10), (2, 1, 7, 10), True),
    "single_kv_head": ((2, 1, 5, 6), (2, 1, 5, 6), False),
    "two_d": ((5, 14), (5, 14), False),
    "cos_last_dim_only": ((3, 4, 2), (2,), False),
}


def _x(shape, transpose):
    if transpose:
        return torch.randn(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)
    return torch.randn(shape)


def _fp32_grad(fn, x, g):
    xr = x.detach().float().requires_grad_()
    out = fn(xr)
    (dx,) = torch.autograd.grad(out, xr, g.float())
    return out, dx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(INTERLEAVED_CASES))
def test_interleaved_kernel_forward_backward(case, dtype):
    shape, cos_shape, transpose = INTERLEAVED_CASES[case]
    torch.manual_seed(1)
    x = _x(shape, transpose).to(dtype).requires_grad_()
    cos, sin = torch.randn(cos_shape).to(dtype), torch.randn(cos_shape).to(dtype)
    rot = rotate_every_two_4d if len(shape) == 4 and case == "gptj" else rotate_every_two
    with count_kernel_calls() as calls:
        out = rotary_interleaved(x, cos, sin, rot)
    assert _calls(calls) == {"torch": 1}
    g = torch.randn(out.shape).to(dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    ref, ref_dx = _fp32_grad(lambda t: t * cos.float() + rotate_every_two(t) * sin.float(), x, g)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref, **KTOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **KTOL[dtype])


def test_interleaved_kernel_with_one_angle_per_pair():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 5, 6, requires_grad=True)
    cos, sin = torch.randn(1, 1, 5, 3), torch.randn(1, 1, 5, 3)
    out = InterleavedRotaryFunction.apply(x, cos, sin)
    g = torch.randn(out.shape)
    (dx,) = torch.autograd.grad(out, x, g)
    wide_cos, wide_sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    ref, ref_dx = _fp32_grad(lambda t: t * wide_cos + rotate_every_two(t) * wide_sin, x, g)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dx, ref_dx, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("join", ["stack", "cat"])
def test_pairs_kernel_forward_backward(join, dtype):
    torch.manual_seed(3)
    x = torch.randn(2, 5, 3, 14).to(dtype).requires_grad_()  # 7 pairs, even/odd views
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = torch.randn(1, 5, 1, 7).to(dtype), torch.randn(1, 5, 1, 7).to(dtype)

    def written(a, b, c, s):
        if join == "cat":
            return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1)

    with count_kernel_calls() as calls:
        out = rotary_pairs(x1, x2, cos, sin, join=join)
    assert _calls(calls) == {"torch": 1}
    g = torch.randn(out.shape).to(dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    xr = x.detach().float().requires_grad_()
    ref = written(xr[..., ::2], xr[..., 1::2], cos.float(), sin.float())
    (ref_dx,) = torch.autograd.grad(ref, xr, g.float())
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **KTOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **KTOL[dtype])


def test_pairs_kernel_takes_whichever_pair_is_constant():
    # ``freqs_cos * x_r - freqs_sin * x_i``: the source does not say which pair is the angles
    torch.manual_seed(4)
    x1, x2 = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    with count_kernel_calls() as calls:
        out = rotary_pairs(cos, sin, x1, x2)
    assert _calls(calls) == {"torch": 1}
    want = torch.stack((cos * x1 - sin * x2, cos * x2 + sin * x1), dim=-1)
    torch.testing.assert_close(out, want)
    g = torch.randn(out.shape)
    torch.testing.assert_close(torch.autograd.grad(out, (x1, x2), g), torch.autograd.grad(want, (x1, x2), g))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_kernel_forward_backward(dtype):
    torch.manual_seed(5)
    real = torch.randn(2, 7, 3, 10, dtype=torch.float32 if dtype == torch.complex64 else torch.float64,
                       requires_grad=True)
    freqs = torch.polar(torch.ones(7, 5, dtype=real.dtype), torch.randn(7, 5, dtype=real.dtype)).view(1, 7, 1, 5)

    def complex_of(t):
        return torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))

    with count_kernel_calls() as calls:
        out = rotary_complex(complex_of(real), freqs).flatten(3)
    assert _calls(calls) == {"torch": 1}
    want = torch.view_as_real(complex_of(real) * freqs).flatten(3)
    assert out.dtype == want.dtype and out.shape == want.shape
    torch.testing.assert_close(out, want)
    g = torch.randn(out.shape, dtype=out.dtype)
    torch.testing.assert_close(torch.autograd.grad(out, real, g)[0], torch.autograd.grad(want, real, g)[0])
    # the operands in source order (freqs_cis * xq_) and a lazily conjugated freqs_cis
    torch.testing.assert_close(rotary_complex(freqs, complex_of(real)), torch.view_as_real(freqs * complex_of(real)))
    conj = freqs.conj()
    torch.testing.assert_close(rotary_complex(complex_of(real), conj), torch.view_as_real(complex_of(real) * conj))


def test_inline_rotation_kernels():
    torch.manual_seed(6)
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    g = torch.randn(x.shape)
    for handed in (False, True):  # the statements removed, or the rotated tensor handed over
        with count_kernel_calls() as calls:
            out = rotary(x, cos, sin, rotate_half(x) if handed else None)
        assert _calls(calls) == {"torch": 1}
        want = x * cos + rotate_half(x) * sin
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(want, x, g)[0])


@pytest.mark.parametrize("call, reason", [
    # the interleaved entry with a half-split function, a function of another rank
    (lambda: rotary_interleaved(torch.randn(2, 6), torch.randn(2, 6), torch.randn(2, 6), rotate_half),
     "rotate_half is not the interleaved rotation"),
    (lambda: rotary_interleaved(torch.randn(2, 3, 6), torch.randn(3, 6), torch.randn(3, 6), lambda x: -x),
     "is not the interleaved rotation"),
    (lambda: rotary_interleaved(torch.randn(2, 3, 6), torch.randn(3, 6, requires_grad=True), torch.randn(3, 6),
                                rotate_every_two), "cos/sin require grad"),
    (lambda: rotary_interleaved(torch.randn(2, 1, 6), torch.randn(4, 6), torch.randn(4, 6), rotate_every_two),
     "broadcast x (2, 1, 6) to (2, 4, 6)"),
    # the pairs: promotion, widening, both pairs wanting a gradient
    (lambda: rotary_pairs(torch.randn(3, 4).bfloat16(), torch.randn(3, 4).bfloat16(), torch.randn(3, 4),
                          torch.randn(3, 4)), "the original promotes"),
    # (the pairs and the angles enter symmetrically: the kernel also tries them swapped, so each
    # case here fails both ways round)
    (lambda: rotary_pairs(torch.randn(1, 4), torch.randn(1, 4), torch.randn(3, 1), torch.randn(3, 1)),
     "broadcast x1 (1, 4) to (3, 4)"),
    (lambda: rotary_pairs(*(torch.randn(3, 4, requires_grad=True) for _ in range(4))), "cos/sin require grad"),
    (lambda: rotary_pairs(torch.randn(3, 4), torch.randn(3, 4).double(), torch.randn(3, 4), torch.randn(3, 4)),
     "x1 and x2 differ"),
    # the complex form: freqs of another dtype, wanting a gradient, widening x
    (lambda: rotary_complex(_polar(3, 4), _polar(3, 4, dtype=torch.float64)), "not one complex dtype"),
    # (the product commutes: the kernel also tries the operands swapped, so both fail here)
    (lambda: rotary_complex(_polar(3, 4).requires_grad_(), _polar(3, 4).requires_grad_()), "freqs_cis requires grad"),
    (lambda: rotary_complex(_polar(1, 4), _polar(3, 1)), "freqs_cis broadcasts x (1, 4) to (3, 4)"),
    # the rotated tensor handed over: promotion
    (lambda: rotary(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4).double()),
     "the original promotes"),
])
def test_fallback_is_the_original_expression_with_its_reason(call, reason):
    torch.manual_seed(7)
    with count_kernel_calls() as calls:
        call()
    assert _calls(calls) == {"original": 1}, calls.calls
    assert any(reason in r for r in _reasons(calls)), _reasons(calls)


def test_fallback_values_are_the_written_expressions():
    torch.manual_seed(8)
    x, cos, sin = torch.randn(2, 6), torch.randn(2, 6, requires_grad=True), torch.randn(2, 6)
    assert torch.equal(rotary_interleaved(x, cos, sin, rotate_half), x * cos + rotate_half(x) * sin)
    a, b = torch.randn(3, 4).bfloat16(), torch.randn(3, 4).bfloat16()
    c, s = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(rotary_pairs(a, b, c, s), torch.stack((a * c - b * s, a * s + b * c), dim=-1))
    assert torch.equal(rotary_pairs(a, b, c, s, join="cat"), torch.cat((a * c - b * s, b * c + a * s), dim=-1))
    z, f = _polar(3, 4).requires_grad_(), _polar(3, 4).requires_grad_()
    assert torch.equal(rotary_complex(z, f), torch.view_as_real(z * f))


def test_odd_width_fails_as_the_original_does():
    # rotate_every_two of an odd width raises in the original expression: the kernel says why it
    # does not fuse and runs that expression, which raises the same error
    x, cos, sin = torch.randn(2, 3, 7), torch.randn(3, 7), torch.randn(3, 7)
    with pytest.raises(RuntimeError) as original:
        x * cos + rotate_every_two(x) * sin
    with count_kernel_calls() as calls, pytest.raises(RuntimeError) as guarded:
        rotary_interleaved(x, cos, sin, rotate_every_two)
    assert str(guarded.value) == str(original.value)
    assert any("not even" in r for r in _reasons(calls)), _reasons(calls)


def test_probe_is_per_rank_and_per_method_function():
    _PROBED.clear()
    # GPT-J's function is the interleaved rotation of 4-d tensors only
    assert is_interleaved_rotation(rotate_every_two_4d, 4) and not is_interleaved_rotation(rotate_every_two_4d, 3)
    assert is_interleaved_rotation(rotate_every_two, 2) and not is_interleaved_rotation(rotate_half, 2)

    class Holder(torch.nn.Module):
        def rotate(self, x):
            return rotate_every_two(x)

    holder = Holder()
    assert holder.rotate is not holder.rotate  # a new bound method at each access: cached by its function
    assert is_interleaved_rotation(holder.rotate, 3) and Holder.rotate in _PROBED


def _peak_cpu_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def test_cpu_memory_forward_allocates_only_the_output():
    torch.manual_seed(9)
    x = torch.randn(2, 128, 4, 64)
    cos, sin = torch.randn(1, 128, 1, 64), torch.randn(1, 128, 1, 64)
    x1, x2, c, s = x[..., ::2], x[..., 1::2], cos[..., ::2], sin[..., ::2]
    size = x.numel() * x.element_size()
    written = {
        "interleaved": (lambda: x * cos + rotate_every_two(x) * sin, lambda: rotary_embedding_interleaved(x, cos, sin)),
        "pairs": (lambda: torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1),
                  lambda: rotary_embedding_pairs(x1, x2, c, s)),
    }
    for name, (original, fused) in written.items():
        before, after = _peak_cpu_bytes(original), _peak_cpu_bytes(fused)
        # the written pairs peak at two outputs' worth (products, then the stack); the rest three
        least = 1.9 if name == "pairs" else 2.5
        assert before >= least * size and after <= 1.1 * size, (name, before / size, after / size)


def test_pairs_function_saves_only_the_angles():
    x1, x2 = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    out = PairRotaryFunction.apply(x1, x2, cos, sin, True)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin


# ---------------------------------------------------------------- triton (interpreter)

triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

if _TRITON_PRELOADED and HAS_TRITON:
    def test_triton_in_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "triton",
                               __file__], env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture
def interpreted_triton():
    if _TRITON_PRELOADED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1: covered by the fresh-process run")


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["gptj", "transposed", "two_d", "cos_last_dim_only", "half_width"])
def test_triton_interleaved_forward_backward(interpreted_triton, case, dtype):
    from adopter.kernels.ops.triton_rotary import TritonInterleavedRotaryFunction

    torch.manual_seed(10)
    if case == "half_width":
        shape, cos_shape, transpose = (2, 3, 5, 10), (1, 1, 5, 5), False
    else:
        shape, cos_shape, transpose = INTERLEAVED_CASES[case]
    x = _x(shape, transpose).to(dtype).requires_grad_()
    cos, sin = torch.randn(cos_shape).to(dtype), torch.randn(cos_shape).to(dtype)
    out = TritonInterleavedRotaryFunction.apply(x, cos, sin)
    g = torch.randn(out.shape).to(dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    wide_cos, wide_sin = cos.float(), sin.float()
    if case == "half_width":
        wide_cos, wide_sin = wide_cos.repeat_interleave(2, -1), wide_sin.repeat_interleave(2, -1)
    ref, ref_dx = _fp32_grad(lambda t: t * wide_cos + rotate_every_two(t) * wide_sin, x, g)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, **KTOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **KTOL[dtype])


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [True, False])
def test_triton_pairs_forward_backward(interpreted_triton, stacked, dtype):
    from adopter.kernels.ops.triton_rotary import TritonPairRotaryFunction

    torch.manual_seed(11)
    x = torch.randn(2, 5, 3, 10).to(dtype).requires_grad_()
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = torch.randn(1, 5, 1, 5).to(dtype), torch.randn(1, 5, 1, 5).to(dtype)
    out = TritonPairRotaryFunction.apply(x1, x2, cos, sin, stacked)
    want = PairRotaryFunction.apply(x1.float(), x2.float(), cos.float(), sin.float(), stacked)
    g = torch.randn(out.shape).to(dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    xr = x.detach().float().requires_grad_()
    ref = PairRotaryFunction.apply(xr[..., ::2], xr[..., 1::2], cos.float(), sin.float(), stacked)
    (ref_dx,) = torch.autograd.grad(ref, xr, g.float())
    torch.testing.assert_close(out.float(), want, **KTOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **KTOL[dtype])


@triton_only
def test_triton_backend_through_the_guarded_entries(interpreted_triton, monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    torch.manual_seed(12)
    x, cos, sin = torch.randn(2, 3, 5, 6), torch.randn(5, 6), torch.randn(5, 6)
    z, f = torch.view_as_complex(x.reshape(2, 3, 5, 3, 2)), _polar(5, 3)
    with count_kernel_calls() as calls:
        a = rotary_interleaved(x, cos, sin, rotate_every_two)
        b = rotary_pairs(x[..., ::2], x[..., 1::2], cos[..., :3], sin[..., :3])
        c = rotary_complex(z, f)
        d = rotary(x, cos, sin)
    assert _calls(calls) == {"triton": 4}
    torch.testing.assert_close(a, x * cos + rotate_every_two(x) * sin)
    c3, s3 = cos[..., :3], sin[..., :3]
    torch.testing.assert_close(b, torch.stack((x[..., ::2] * c3 - x[..., 1::2] * s3,
                                               x[..., ::2] * s3 + x[..., 1::2] * c3), dim=-1))
    torch.testing.assert_close(c, torch.view_as_real(z * f))
    torch.testing.assert_close(d, x * cos + rotate_half(x) * sin)


# ---------------------------------------------------------------- optimize(): train like the originals


def _model_module(name: str):
    sys.path.insert(0, str(MODELS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(MODELS))


def _train_alike(original, optimized, steps=3):
    """A few SGD steps of each from the same weights: the same losses and gradients at every step;
    returns the fused rotary calls of the optimized model."""
    optimized.load_state_dict(original.state_dict(), strict=True)
    opt_a = torch.optim.SGD(original.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(optimized.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    fused = 0
    for step in range(steps):
        x = torch.randn(2, 9, 32, generator=gen)
        target = torch.randn(2, 9, 32, generator=gen)
        losses = []
        for model, opt in ((original, opt_a), (optimized, opt_b)):
            opt.zero_grad()
            with count_kernel_calls() as calls:
                loss = torch.nn.functional.mse_loss(model(x), target)
                loss.backward()
            if model is optimized:
                fused += _calls(calls).get("torch", 0)
                assert "original" not in _calls(calls), calls.calls
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
        for (n, a), b in zip(optimized.named_parameters(), original.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=f"step {step} {n}")
        opt_a.step()
        opt_b.step()
    return fused


@pytest.mark.slow
@pytest.mark.parametrize("module, cls, kernel, sites", [
    ("meta_llama_attention", "Attention", "rotary_complex", 2),
    ("litgpt_attention", "CausalSelfAttention", "rotary", 1),
])
def test_optimize_trains_like_the_original(module, cls, kernel, sites):
    from adopter import optimize

    mod = _model_module(module)
    model_cls = getattr(mod, cls)
    optimized = optimize(model_cls, rules=[RULE], example_inputs={"x": torch.randn(2, 9, 32)})
    report = optimized.adopter_report
    applied = [a for a in report.applied if a.rule == "rotary_embedding"]
    assert len(applied) == sites and all(a.status == "confirmed" for a in applied), report.summary()
    assert report.equivalence.equivalent
    assert all(set(a.kernel_calls["analysed"]) == {"torch"} for a in applied), [a.kernel_calls for a in applied]
    assert f"{kernel}(" in report.diff
    torch.manual_seed(0)
    original, rewritten = model_cls(), optimized()
    # two rotary calls (q and k) per step, each forward
    assert _train_alike(original, rewritten) == 3 * 2
    # the rewritten class compiles to one graph, as the original does
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(rewritten)(torch.randn(2, 9, 32))
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [b.reason.splitlines()[0] for b in explanation.break_reasons]


# ---------------------------------------------------------------- issue 24: halves by a (2, d/2) view; learned complex weights


def test_learned_complex_weights_are_no_candidate_with_the_reason():
    from adopter.core.rules.rotary_embedding import _Site, complex_parts

    matches, rejected = _scan(LEARNED)
    assert {m.class_name for m in matches + rejected} == {"PositionsBuffer"}
    tree = ast.parse(LEARNED.read_text())
    for cls, attr in (("ComplexChannelMix", "weight"), ("RealPairsWeight", "filt"), ("RegisteredParameter", "gain")):
        forward = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls).body[-1]
        call = next(n for n in ast.walk(forward) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.view_as_real")
        why = complex_parts(call, _Site.of(tree, forward, f"{cls}.forward", call))
        assert f"reads the learned parameter self.{attr}" in str(why), (cls, why)


def test_unbound_halves_rotation_layout_and_look_alikes():
    tree = ast.parse(UNBIND.read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("rotate_half", "rotate_half_chained", "rotate_half_unflatten"):
        assert rotation_layout(defs[name], tree) == ("half-split", ""), name
    assert rotation_layout(defs["rotate_pairs_unbound_wrong_dim"], tree)[0] == ""
    assert "cat((x2, -x1), dim=-1)" in rotation_layout(defs["rotate_half_swapped"], tree)[1]


def _exec_text(text: str, name: str) -> dict:
    namespace: dict = {}
    exec(compile(text, name, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewritten_unbound_halves_compute_the_original_fused(dtype):
    from adopter.rewrite import rewrite_source

    text = UNBIND.read_text()
    result = rewrite_source(text, scan_source(text, UNBIND.name, [RULE]), filename=UNBIND.name, rules=[RULE])
    assert result.error == "" and len(result.applied) == 4, result.skipped
    new = python_view(result.new_text)
    assert new.count("rotary(") >= 4 and "rotate_half(t) * freqs.sin()" not in new
    original, rewritten = _exec_text(text, "original"), _exec_text(result.new_text, "rewritten")
    torch.manual_seed(0)
    t = torch.randn(2, 3, 5, 16, dtype=dtype)
    freqs = torch.randn(5, 16, dtype=dtype)
    cos, sin = freqs.cos(), freqs.sin()
    # bf16: the kernel rounds once (fp32 inside), the written ops after each product
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    cases = [("apply_rotary_emb", (t, freqs)), ("apply_partial", (freqs[:, :8], t)),
             ("apply_unflatten", (t, cos, sin))]
    for name, args in cases:
        xs = [a.clone().requires_grad_(a is t) for a in args]
        ys = [a.clone().requires_grad_(a is t) for a in args]
        want = original[name](*xs)
        with count_kernel_calls() as calls:
            got = rewritten[name](*ys)
        assert _calls(calls) == {"torch": 1}, name
        torch.testing.assert_close(got, want, **tol)
        grad = torch.randn_like(want)
        want.backward(grad)
        got.backward(grad)
        gx = next(a.grad for a in xs if a.grad is not None)
        gy = next(a.grad for a in ys if a.grad is not None)
        torch.testing.assert_close(gy, gx, **tol)
    torch.manual_seed(1)
    a = original["RotaryAttention"]().to(dtype)
    b = rewritten["RotaryAttention"]().to(dtype)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 16, dtype=dtype)
    want, got = a(x, freqs), b(x, freqs)
    torch.testing.assert_close(got, want, **tol)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(b.to_q.weight.grad, a.to_q.weight.grad, **tol)


def test_complex_kernel_runs_a_learned_weight_as_written():
    from adopter.kernels.telemetry import ORIGINAL

    x = torch.view_as_complex(torch.randn(2, 3, 8, 2))
    weight = torch.nn.Parameter(torch.randn(8, dtype=torch.cfloat))
    with torch.no_grad(), count_kernel_calls() as calls:
        out = rotary_complex(x, weight)
    assert torch.equal(out, torch.view_as_real(x * weight))
    assert [(c.backend, c.reason) for c in calls.calls] == [
        (ORIGINAL, "freqs_cis is a learned parameter (a complex weight, not rotation angles)")]
