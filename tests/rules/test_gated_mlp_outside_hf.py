"""gated_MLP as written outside HuggingFace (issue 24): the packed ``gate_up`` projection split in
two (``.chunk``/``.split``, method or ``torch.`` function, the gate either half), litgpt's and
Meta-llama's spellings, projections built by same-file factories or subclasses; the guarded
``gated_mlp_packed`` kernel (fused only for two equal halves along the last dimension, else the
source's computation), projections that compute ``F.linear`` up to a cast of the weight; the
biased-GeLU match on a gated MLP's gate set aside; every execution mode of the rewritten classes;
``optimize()`` end to end with training equal to the original."""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls
from adopter.kernels.guarded_gated_mlp import gated_mlp, gated_mlp_packed, linear_form
from adopter.rewrite.scripting import python_view
from torch import nn

from adopter.core.rules import get_rules
from adopter.core.rules.gated_mlp import RULE, split_halves
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "gated_MLP"
POSITIVE = FIXTURES / "positive_outside_hf.py"
NEGATIVE = FIXTURES / "negative_outside_hf.py"
REWRITTEN = FIXTURES / "rewritten" / "positive_outside_hf.py"


def BOTH():  # noqa: N802 - the two rules whose matches overlap on a GeGLU's gate
    return get_rules(["gated_MLP", "biased_GeLU"])


def _load(path: Path, name: str):
    """A module from a file under a unique name (optimize and TorchScript read its source)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def original():
    return _load(POSITIVE, "gated_mlp_outside_hf_original")


@pytest.fixture(scope="module")
def rewritten():
    return _load(REWRITTEN, "gated_mlp_outside_hf_rewritten")


# ---------------------------------------------------------------- the rule


def test_negative_lookalikes_are_dropped_for_the_right_reason():
    rejected: list = []
    path = NEGATIVE
    assert scan_source(path.read_text(), str(path), [RULE], rejected=rejected) == []
    reasons = {m.class_name: (m.status, m.code, m.reason) for m in rejected}
    assert reasons == {
        "ChunkWithoutDim": ("refused", "dim-not-last", "the split has no dim: it splits dimension 0, not the features"),
        "ChunkAlongDimOne": ("refused", "dim-not-last", "the split's dim=1 is not provably the last dimension"),
        "HalfReadAgain": ("static", "", "the half 'x2' of the split is also read at line 57"),
    }  # the other look-alikes are no candidates at all (another half, another tensor, no down...)


def test_which_half_is_the_gate_is_read_from_the_source():
    """``gate, up`` and ``up, gate`` unpackings; method and function spellings, keywords."""
    cases = {
        "a, b = y.chunk(2, dim=-1)": ("a", "b", "chunks", "2", "-1"),
        "b, a = torch.chunk(y, 2, -1)": ("b", "a", "chunks", "2", "-1"),
        "a, b = torch.split(tensor=y, split_size_or_sections=[h, h], dim=-1)": ("a", "b", "split", "[h, h]", "-1"),
        "[a, b] = self.w(x).split(self.h, -1)": ("a", "b", "split", "self.h", "-1"),
    }
    for text, (first, second, kind, count, dim) in cases.items():
        stmt = ast.parse(text).body[0]
        halves = split_halves(stmt.value, stmt)
        assert (halves.names, halves.kind, ast.unparse(halves.count), ast.unparse(halves.dim)) == (
            (first, second), kind, count, dim), text
    for text in ("a, b, c = y.chunk(3, dim=-1)", "a = y.chunk(2, dim=-1)", "a, a = y.chunk(2, dim=-1)",
                 "a, b = y.chunk(*n)", "a, b = y.chunk(2, dim=-1, out=z)"):
        stmt = ast.parse(text).body[0]
        assert isinstance(split_halves(stmt.value, stmt), str), text


def test_a_gated_mlp_supersedes_the_biased_gelu_on_its_gate():
    """Both rules in use: the gate's Linear + GeLU is not reported (the gated MLP fuses it), but set
    aside with the reason; where no gated MLP matches (the gate is returned too), biased_GeLU stays;
    with biased_GeLU alone in use, the gate is its site again. (Every rule on every fixture:
    tests/rules/test_rules.py.)"""
    text = POSITIVE.read_text()
    rejected: list = []
    found = Counter((m.rule, m.class_name) for m in scan_source(text, str(POSITIVE), BOTH(), rejected=rejected))
    assert found[("biased_GeLU", "BiasedGeGLU")] == 0 and found[("gated_MLP", "BiasedGeGLU")] == 1
    assert found[("biased_GeLU", "GateKeptGeGLU")] == 1
    (aside,) = [m for m in rejected if m.rule == "biased_GeLU" and m.class_name == "BiasedGeGLU"]
    assert aside.reason == "part of a gated_MLP match (lines 194, 195, 196), which fuses it"
    alone = {m.class_name for m in scan_source(text, str(POSITIVE), get_rules(["biased_GeLU"]))}
    assert alone == {"BiasedGeGLU", "GateKeptGeGLU"}


def test_rewriting_with_both_rules_fuses_the_gated_mlp_only():
    from adopter.rewrite import rewrite_source

    text = (FIXTURES / "positive.py").read_text()
    matches = [m for m in scan_source(text, "positive.py", BOTH()) if m.class_name == "ModuleGeLU"]
    assert [m.rule for m in matches] == ["gated_MLP"]
    result = rewrite_source(text, matches, filename="positive.py", rules=BOTH())
    assert all(o.applied for o in result.outcomes)
    assert "return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act, x)" in python_view(result.new_text)
    assert "linear_gelu" not in result.new_text


# ---------------------------------------------------------------- the codemod


def _without_notes(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("# expect:", "# rewritten:")))


def _rewrite(text: str):
    from adopter.rewrite import rewrite_source

    return rewrite_source(text, scan_source(text, POSITIVE.name, [RULE]), filename=POSITIVE.name, rules=[RULE])


def _init_bodies(text: str) -> list[str]:
    return [ast.unparse(n) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]


def test_rewrite_fixture_text_idempotence_and_init():
    before = POSITIVE.read_text()
    result = _rewrite(before)
    applied = sorted(o.match.class_name for o in result.outcomes if o.applied)
    assert applied == sorted(["FeedForward", "LLaMAMLP", "Phi3MLP", "GeGLUFeedForward", "SwiGLUSplit",
                              "TorchChunkSwiGLU", "TorchSplitGeGLU", "FactoryMLP", "NoBiasLinearMLP", "BiasedGeGLU"])
    # the conditional match waits for a trace (optimize / rewrite --model)
    assert [o.match.class_name for o in result.outcomes if not o.applied] == ["LoRAFactoryMLP"]
    assert _without_notes(result.new_text) == _without_notes(REWRITTEN.read_text())
    again = _rewrite(REWRITTEN.read_text())
    assert again.new_text == REWRITTEN.read_text() and not again.diff
    assert _init_bodies(REWRITTEN.read_text()) == _init_bodies(before)
    view = python_view(REWRITTEN.read_text())
    for line in (
        "return gated_mlp_packed(self.gate_up_proj, self.down_proj, self.activation_fn, hidden_states, chunks=2, "
        "dim=-1, gate=0)",
        'return gated_mlp_packed(self.proj_in, self.proj_out, F.gelu, x, chunks=2, dim=-1, gate=1, approximate="tanh")',
        "return gated_mlp_packed(self.w12, self.w3, F.silu, x, split=self.hidden, dim=-1, gate=0)",
        "return gated_mlp_packed(self.wi, self.wo, self.act, x, split=[self.hidden, self.hidden], dim=-1, gate=1)",
        "return gated_mlp(self.fc_1, self.fc_2, self.proj, torch.nn.functional.silu, x)",
        "return gated_mlp(self.w1, self.w3, self.w2, F.silu, x)",
    ):
        assert line in view, line


SIZES = {"FeedForward": (16, 40), "LLaMAMLP": (16, 24), "Phi3MLP": (16, 24), "GeGLUFeedForward": (16, 24),
         "SwiGLUSplit": (16, 24), "TorchChunkSwiGLU": (16, 24), "TorchSplitGeGLU": (16, 24), "FactoryMLP": (16, 24),
         "NoBiasLinearMLP": (16, 24), "BiasedGeGLU": (16, 24)}


def _pair(original, rewritten, name: str, dtype=torch.float32):
    torch.manual_seed(0)
    a = getattr(original, name)(*SIZES[name]).to(dtype)
    b = getattr(rewritten, name)(*SIZES[name]).to(dtype)
    b.load_state_dict(a.state_dict(), strict=True)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SIZES))
def test_rewritten_classes_compute_what_the_originals_compute(original, rewritten, name, dtype):
    """Bitwise on the CPU, forward and backward: the fused path runs eager's ops in eager's order."""
    a, b = _pair(original, rewritten, name, dtype)
    x = torch.randn(3, 7, 16).to(dtype)
    grad = torch.randn(3, 7, 16).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_kernel_calls() as calls:
        out = b(x2)
    ref = a(x1)
    assert [(c.kernel, c.backend) for c in calls.calls] == [("gated_mlp", "torch")]
    assert out.dtype == ref.dtype == dtype and torch.equal(out, ref)
    for g, r in zip(torch.autograd.grad(out, [x2, *b.parameters()], grad),
                    torch.autograd.grad(ref, [x1, *a.parameters()], grad)):
        assert torch.equal(g, r)


# ---------------------------------------------------------------- every way the rewrite runs


@pytest.mark.parametrize("name", sorted(SIZES))
def test_rewritten_classes_trace_script_compile_and_export(original, rewritten, name):
    a, b = _pair(original, rewritten, name)
    x = torch.randn(2, 5, 16)
    eager = b(x)
    # fx: the kernel traces the user's computation, bit for bit
    traced = torch.fx.symbolic_trace(b)
    assert torch.equal(traced(x), eager)
    # TorchScript: the rewrite keeps the user's statements for it; scripts when the original does
    assert torch.equal(torch.jit.script(b)(x), torch.jit.script(a)(x))
    # dynamo: one graph, no break in adopter.kernels
    explanation = torch._dynamo.explain(b)(x)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
    torch.testing.assert_close(torch.export.export(b, (x,)).module()(x), eager, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("gate", [0, 1])
def test_packed_kernel_compiles_to_one_graph_forward_and_backward(gate):
    torch.manual_seed(0)
    gate_up, down = nn.Linear(16, 48), nn.Linear(24, 16)

    def fn(x):
        return gated_mlp_packed(gate_up, down, F.silu, x, chunks=2, dim=-1, gate=gate)

    x = torch.randn(2, 5, 16)
    explanation = torch._dynamo.explain(fn)(x)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        xi = x.clone().requires_grad_()
        out = f(xi)
        results.append((out, torch.autograd.grad(out.square().sum(), [xi, *gate_up.parameters(), *down.parameters()])))
    torch._dynamo.reset()
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the packed kernel


def _reference(gate_up, down, act, x, chunks, split, dim, gate, *args, **kwargs):
    y = gate_up(x)
    first, second = y.chunk(chunks, dim) if split is None else y.split(split, dim)
    g, u = (first, second) if gate == 0 else (second, first)
    return down(act(g, *args, **kwargs) * u)


ACTS = {
    "nn.SiLU": (lambda: nn.SiLU(), (), {}),
    "F.silu": (lambda: F.silu, (), {}),
    "F.gelu": (lambda: F.gelu, (), {}),
    "F.gelu(tanh)": (lambda: F.gelu, (), {"approximate": "tanh"}),
    "nn.GELU(tanh)": (lambda: nn.GELU(approximate="tanh"), (), {}),
}
# name -> (chunks, split, features per half): ``split`` None, "int" (the half width) or "sections"
SPLITS = {"chunk": (2, None, 37), "split": (None, "int", 37), "sections": (None, "sections", 37),
          "chunk(3) of 4": (3, None, 2)}  # ceil(4 / 3) = 2: two halves of 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gate", [0, 1])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("act", list(ACTS))
def test_packed_kernel_matches_the_written_computation(act, split, gate, bias, dtype):
    """Odd widths (13 in, 37 per half), forward and backward, bitwise against the expression the
    source writes: the torch path runs eager's ops in eager's order."""
    make, args, kwargs = ACTS[act]
    chunks, kind, hidden = SPLITS[split]
    split_ = None if kind is None else hidden if kind == "int" else [hidden, hidden]
    torch.manual_seed(0)
    gate_up = nn.Linear(13, 2 * hidden, bias=bias).to(dtype)
    down = nn.Linear(hidden, 13, bias=bias).to(dtype)
    activation = make()
    x = torch.randn(3, 7, 13).to(dtype)
    grad = torch.randn(3, 7, 13).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_kernel_calls() as calls:
        out = gated_mlp_packed(gate_up, down, activation, x1, *args, chunks=chunks, split=split_, dim=-1, gate=gate,
                               **kwargs)
    assert [(c.kernel, c.backend) for c in calls.calls] == [("gated_mlp", "torch")], calls.calls
    ref = _reference(gate_up, down, activation, x2, chunks, split_, -1, gate, *args, **kwargs)
    params = [*gate_up.parameters(), *down.parameters()]
    assert out.dtype == dtype and torch.equal(out, ref)
    for a, b in zip(torch.autograd.grad(out, [x1, *params], grad), torch.autograd.grad(ref, [x2, *params], grad)):
        assert torch.equal(a, b)


def test_packed_kernel_dim_as_positive_index_and_2d_input():
    torch.manual_seed(0)
    gate_up, down = nn.Linear(8, 20), nn.Linear(10, 8)
    x = torch.randn(5, 8)
    with count_kernel_calls() as calls:
        out = gated_mlp_packed(gate_up, down, F.silu, x, chunks=2, dim=1, gate=1)
    assert calls.calls[0].backend == "torch"
    assert torch.equal(out, _reference(gate_up, down, F.silu, x, 2, None, 1, 1))


class LoRALinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 1.0


FALLBACKS = {
    # (gate_up out, down in, chunks, split, dim, activation, x shape): the reason
    "dim 0": ((48, 48), 2, None, 0, F.silu, (4, 5, 16), "split dim=0 is not the last dimension"),
    "dim 1 of 3": ((48, 48), 2, None, 1, F.silu, (4, 6, 16), "split dim=1 is not the last dimension"),
    "unequal chunks": ((3, 2), 2, None, -1, F.silu, (4, 5, 16), "chunk(2) of 3 features does not give two equal"),
    "unequal sections": ((48, 20), None, [20, 28], -1, F.silu, (4, 5, 16), "split([20, 28]) of 48 features"),
    "relu": ((48, 24), 2, None, -1, torch.relu, (4, 5, 16), "activation is relu, not a SiLU or GeLU"),
    "lora gate_up": ((48, 24), 2, None, -1, F.silu, (4, 5, 16), "LoRALinear overrides forward"),
    "hooked down": ((48, 24), 2, None, -1, F.silu, (4, 5, 16), "Linear has hooks"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_packed_kernel_runs_the_original_otherwise(case):
    (n_out, d_in), chunks, split, dim, act, shape, reason = FALLBACKS[case]
    torch.manual_seed(0)
    gate_up = (LoRALinear if case == "lora gate_up" else nn.Linear)(16, n_out)
    down = nn.Linear(d_in, 16)
    if case == "hooked down":
        down.register_forward_hook(lambda m, i, o: o * 2)
    if case == "unequal sections":
        down = nn.Linear(28, 16)  # the product broadcasts nowhere: the original raises, as the kernel does
        with pytest.raises(RuntimeError):
            _reference(gate_up, down, act, torch.randn(*shape), chunks, split, dim, 0)
        with count_kernel_calls() as calls, pytest.raises(RuntimeError):
            gated_mlp_packed(gate_up, down, act, torch.randn(*shape), chunks=chunks, split=split, dim=dim)
        assert reason in calls.calls[0].reason
        return
    x = torch.randn(*shape)
    with count_kernel_calls() as calls:
        out = gated_mlp_packed(gate_up, down, act, x, chunks=chunks, split=split, dim=dim)
    (call,) = calls.calls
    assert (call.kernel, call.backend) == ("gated_mlp", "original") and reason in call.reason, call.reason
    assert torch.equal(out, _reference(gate_up, down, act, x, chunks, split, dim, 0))


def test_packed_kernel_three_parts_raise_as_the_source_does():
    gate_up, down = nn.Linear(16, 24), nn.Linear(8, 16)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="too many values to unpack"):
        _reference(gate_up, down, F.silu, x, 3, None, -1, 0)
    with pytest.raises(ValueError, match="too many values to unpack"):
        gated_mlp_packed(gate_up, down, F.silu, x, chunks=3, dim=-1)


def test_packed_kernel_arguments():
    gate_up, down = nn.Linear(4, 8), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for kwargs in ({}, {"chunks": 2, "split": 4}, {"chunks": 2, "gate": 2}):
        with pytest.raises(TypeError, match="one of chunks= and split="):
            gated_mlp_packed(gate_up, down, F.silu, x, **kwargs)


def test_packed_kernel_under_fx_traces_the_users_modules():
    class Site(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up, self.down, self.act = nn.Linear(8, 20), nn.Linear(10, 8), nn.SiLU()

        def forward(self, x):
            return gated_mlp_packed(self.gate_up, self.down, self.act, x, chunks=2, dim=-1, gate=1)

    site = Site()
    traced = torch.fx.symbolic_trace(site)
    assert {"gate_up", "down", "act"} <= {str(n.target) for n in traced.graph.nodes if n.op == "call_module"}
    x = torch.randn(3, 8)
    assert torch.equal(traced(x), site(x))


def _saved_bytes(fn) -> int:
    seen: dict = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.shape, t.stride(), t.storage_offset())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    assert out.requires_grad
    return sum(seen.values())


def test_packed_kernel_saves_one_intermediate_less():
    """Of what eager keeps for the backward (the two halves, act(gate), the product), the kernel
    drops act(gate): one half-width tensor per call."""
    torch.manual_seed(0)
    gate_up, down = nn.Linear(16, 80, bias=False), nn.Linear(40, 16, bias=False)
    x = torch.randn(4, 32, 16, requires_grad=True)
    eager = _saved_bytes(lambda: _reference(gate_up, down, F.silu, x, 2, None, -1, 0))
    fused = _saved_bytes(lambda: gated_mlp_packed(gate_up, down, F.silu, x, chunks=2, dim=-1))
    assert eager - fused == 4 * 32 * 40 * 4


# ---------------------------------------------------------------- projections that compute F.linear


def _subclass(body: str, namespace: dict | None = None) -> type:
    """An nn.Linear subclass whose forward is ``body`` (compiled as a user's file would be)."""
    ns = {"torch": torch, "F": F, "nn": nn, "fn": F, **(namespace or {})}
    exec(compile(f"class Sub(nn.Linear):\n{body}", "<user file>", "exec"), ns)
    return ns["Sub"]


CAST = "    def forward(self, x):\n        return F.linear(x, self.weight.to(x.dtype), self.bias)\n"
CAST_ALL = ("    def forward(self, x):\n        return F.linear(x, self.weight.to(x.dtype), "
            "self.bias.to(x.dtype) if self.bias is not None else None)\n")
LINEAR_FORMS = {
    "nn.Linear": (lambda: nn.Linear(4, 4), "plain"),
    "init-only subclass": (lambda: _subclass("    def __init__(self, i, o):\n        super().__init__(i, o, False)\n")(
        4, 4), "plain"),
    "cast": (lambda: _subclass(CAST)(4, 4), "cast"),
    "cast, docstring, annotations, another alias": (lambda: _subclass(
        '    def forward(self, input: torch.Tensor) -> torch.Tensor:\n        """Cast."""\n'
        "        return fn.linear(input, self.weight.to(input.dtype), self.bias)\n")(4, 4), "cast"),
    "cast with the bias cast too": (lambda: _subclass(CAST_ALL)(4, 4), "cast_all"),
    "cast with the bias cast too, the test the other way": (lambda: _subclass(
        "    def forward(self, x):\n        return F.linear(x, self.weight.to(x.dtype), "
        "None if self.bias is None else self.bias.to(x.dtype))\n")(4, 4), "cast_all"),
    "bias cast without the None test (fails without a bias)": (lambda: _subclass(
        "    def forward(self, x):\n        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))\n")(4, 4),
        None),
    "bias cast to float32, not the input's dtype": (lambda: _subclass(
        "    def forward(self, x):\n        return F.linear(x, self.weight.to(x.dtype), "
        "self.bias.float() if self.bias is not None else None)\n")(4, 4), None),
    "cast plus an op": (lambda: _subclass(
        "    def forward(self, x):\n        return F.linear(x, self.weight.to(x.dtype), self.bias) * 2\n")(4, 4), None),
    "cast, F another module": (lambda: _subclass(CAST, {"F": torch})(4, 4), None),
    "cast spelled torch.nn.functional": (lambda: _subclass(
        "    def forward(self, x):\n        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)\n")(
        4, 4), None),
    "LoRA": (lambda: LoRALinear(4, 4), None),
    "hooked cast": (lambda: _hooked(_subclass(CAST)(4, 4)), None),
    "not a Linear": (lambda: nn.Identity(), None),
}


def _hooked(module):
    module.register_forward_pre_hook(lambda m, i: None)
    return module


@pytest.mark.parametrize("case", list(LINEAR_FORMS))
def test_linear_form_accepts_only_what_computes_f_linear(case):
    make, expected = LINEAR_FORMS[case]
    form, why = linear_form(make())
    assert form == expected, why
    assert bool(why) == (expected is None)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("body, bias", [(CAST, False), (CAST_ALL, True), (CAST_ALL, False)],
                         ids=["weight cast", "weight and bias cast", "weight and bias cast, no bias"])
def test_cast_linears_are_fused_as_they_compute(x_dtype, body, bias):
    """Float32 weights, a bf16 input: each cast layer casts its weight (and bias) to the input's
    dtype; the kernel computes that very expression, bitwise, forward and backward; both kernel
    forms."""
    Cast = _subclass(body)
    torch.manual_seed(0)
    gate, up, down = Cast(16, 24, bias=bias), Cast(16, 24, bias=bias), Cast(24, 16, bias=bias)
    gate_up = Cast(16, 48, bias=bias)
    x = torch.randn(2, 5, 16).to(x_dtype)
    for run, ref in (
        (lambda x: gated_mlp(gate, up, down, F.silu, x), lambda x: down(F.silu(gate(x)) * up(x))),
        (lambda x: gated_mlp_packed(gate_up, down, F.silu, x, chunks=2, dim=-1),
         lambda x: _reference(gate_up, down, F.silu, x, 2, None, -1, 0)),
    ):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with count_kernel_calls() as calls:
            out = run(x1)
        assert [c.backend for c in calls.calls] == ["torch"]
        expected = ref(x2)
        assert out.dtype == expected.dtype == x_dtype and torch.equal(out, expected)
        params = [p for m in (gate, up, down, gate_up) for p in m.parameters()]
        got = torch.autograd.grad(out.float().sum(), [x1, *params], allow_unused=True)
        want = torch.autograd.grad(expected.float().sum(), [x2, *params], allow_unused=True)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)


# ---------------------------------------------------------------- optimize() end to end

TRAIN = {
    "FeedForward": {"dim": 16, "hidden_dim": 40},  # Meta-llama
    "Phi3MLP": {"hidden_size": 16, "intermediate_size": 24},  # packed gate_up, chunk
    "LLaMAMLP": {"n_embd": 16, "intermediate_size": 24},  # litgpt
    "LoRAFactoryMLP": {"dim": 16, "hidden": 24},  # factory Linears, the trace settles the type
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN))
def test_optimize_applies_gated_mlp_and_trains_as_the_original(original, name):
    from adopter import optimize

    kwargs = TRAIN[name]
    optimized = optimize(getattr(original, name), rules=BOTH(), init_kwargs=kwargs,
                         example_inputs=(torch.randn(2, 5, 16),))
    report = optimized.adopter_report
    (applied,) = [a for a in report.applied if a.class_name == name]
    assert (applied.rule, applied.status, applied.kernel_calls["analysed"]) == ("gated_MLP", "confirmed", {"torch": 2})
    assert report.equivalence.equivalent
    # no gated_MLP match over the applied site's lines was left out (SkippedRewrite names the place by lines)
    assert not [s for s in report.skipped if s.rule == "gated_MLP" and set(s.lines) & set(applied.lines)], \
        report.summary()

    torch.manual_seed(0)
    model = getattr(original, name)(**kwargs)
    fused = optimized(**kwargs)
    fused.load_state_dict(model.state_dict(), strict=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, fused)]
    for step in range(3):
        x, target = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
        losses = []
        with count_kernel_calls() as calls:
            for m, opt in zip((model, fused), opts):
                opt.zero_grad()
                loss = F.mse_loss(m(x), target)
                loss.backward()
                losses.append(loss)
                opt.step()
        assert {(c.kernel, c.backend) for c in calls.calls} == {("gated_mlp", "torch")}
        assert torch.equal(losses[0], losses[1]), step
        for (n, p), q in zip(model.named_parameters(), fused.parameters()):
            assert torch.equal(p.grad, q.grad) and torch.equal(p, q), (step, n)


@pytest.mark.slow
def test_optimize_factory_that_may_return_a_lora_layer_runs_the_original_for_it(original):
    """Analysed with lora=True: the trace confirms the site (the layers are nn.Linear subclasses),
    the kernel runs the original for the LoRA layers and fuses in the flipped configuration."""
    from adopter import optimize

    kwargs = {"dim": 16, "hidden": 24, "lora": True}
    optimized = optimize(original.LoRAFactoryMLP, rules=BOTH(), init_kwargs=kwargs,
                         example_inputs=(torch.randn(2, 5, 16),))
    report = optimized.adopter_report
    (applied,) = [a for a in report.applied if a.class_name == "LoRAFactoryMLP"]
    assert applied.kernel_calls == {"analysed": {"original": 2}, "flipped": {"torch": 2}}
    assert report.equivalence.equivalent and report.flipped_equivalence.equivalent
    # the run-time guard says why: the LoRA layer overrides forward
    model = optimized(**kwargs)
    with count_kernel_calls() as calls:
        model(torch.randn(2, 5, 16))
    assert {(c.backend, c.reason) for c in calls.calls} == {("original", "LoRALinear overrides forward")}
