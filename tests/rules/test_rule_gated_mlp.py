"""gated_MLP (issue 12): the rule (matches, refusals, codemod), its guarded kernel ``gated_mlp``
(fused vs original by run-time facts), the ``act(g) * u`` op (torch path bitwise equal to eager,
saves one intermediate-width tensor less; triton path under the interpreter), and ``optimize`` on
tiny Llama (SiLU) and Gemma (tanh GeLU) models."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls
from adopter.kernels.guarded_gated_mlp import gated_activation, gated_mlp
from adopter.kernels.ops.gated_act import ACTIVATIONS, GatedActFunction, apply_activation, gated_act
from adopter.rewrite.scripting import python_view
from torch import nn

from adopter.core.rules.gated_mlp import RULE
from adopter.core.scan import scan_paths, scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "gated_MLP"
TRANSFORMERS = Path(__import__("transformers").__file__).parent / "models"


def _scan(path: Path):
    return scan_source(path.read_text(), str(path), [RULE])


def _expected(path: Path) -> Counter:
    out = Counter()
    for line in path.read_text().splitlines():
        if line.startswith("# expect: gated_MLP "):
            where, *status = line[len("# expect: gated_MLP "):].split()
            out[(where, *status)] += 1
    return out


# ---------------------------------------------------------------- rule: matches and non-matches


@pytest.mark.parametrize("path", sorted(p for p in FIXTURES.rglob("*.py") if not p.name.startswith("configuration_")),
                         ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_matches(path):
    # scanned as `adopter scan` reports a file: matches plus the refused ones (their `# expect:` carries the code)
    report = scan_paths([path], [RULE])
    assert report.errors == []
    found = Counter((f"{m.class_name}.{m.function}", *(() if m.status == "static" else (f"{m.status}:{m.code}",)))
                    for m in report.matches)
    assert found == _expected(path)


def test_activation_key_settled_by_configuration_defaults():
    """The same MLP line is SwiGLU (Llama), GeGLU (Gemma) or neither (a relu default): settled from
    the sibling configuration's defaults, never written into the rewrite."""
    statuses = {d: [m.status for m in _scan(FIXTURES / d / "modeling_toy.py")]
                for d in ("config_silu", "config_gemma", "config_relu")}
    assert statuses == {"config_silu": ["static"], "config_gemma": ["static"], "config_relu": []}


@pytest.mark.parametrize("model", ["llama", "gemma", "mistral", "qwen2"])
def test_transformers_gated_mlps_match(model):
    (match,) = [m for m in _scan(TRANSFORMERS / model / f"modeling_{model}.py") if m.class_name.endswith("MLP")]
    assert match.status == "static" and len(set(match.lines)) == 1


def test_conditional_when_the_source_cannot_settle_the_key():
    (m,) = [m for m in _scan(FIXTURES / "positive.py") if m.class_name == "LlamaLikeMLP"]
    assert (m.status, m.code) == ("conditional", "needs-config")
    assert "config.hidden_act" in m.condition and "'silu'" in m.condition


def test_negative_lookalikes_are_not_matched_for_the_right_reason():
    """Each look-alike in negative.py is dropped by the check meant for it (not by accident)."""
    from adopter.core.scan import scan_source as scan

    def rejected_reasons(path):
        rejected: list = []
        assert scan(path.read_text(), str(path), [RULE], rejected=rejected) == []
        return {m.class_name: m.reason for m in rejected}

    # the pattern fits these two; a precondition drops them, saying why
    assert rejected_reasons(FIXTURES / "negative.py") == {
        "GateReadAgain": "intermediate gate#1 ($a) is also read at line 100"}
    assert rejected_reasons(FIXTURES / "config_relu" / "modeling_toy.py") == {
        "ToyMLP": "activation config.hidden_act defaults to 'relu' (neither SiLU nor GeLU) in the model's configuration"}


# ---------------------------------------------------------------- rule: codemod


def _rewrite(path: Path) -> str:
    from adopter.rewrite import rewrite_source

    text = path.read_text()
    matches = [m for m in _scan(path) if m.status == "static"]
    result = rewrite_source(text, matches, filename=str(path), rules=[RULE])
    assert not result.error and all(o.applied for o in result.outcomes), result.outcomes
    return result.new_text


def test_codemod_rewrites_every_spelling_to_one_guarded_call():
    new = python_view(_rewrite(FIXTURES / "positive.py"))
    for line in (
        "return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act, x)",  # up(x) * act(gate(x))
        "return gated_mlp(self.w1, self.w3, self.w2, self.act, hidden_states)",  # split statements
        "return gated_mlp(self.gate, self.up, self.down, F.silu, x)",  # g = gate(x); u = up(x); F.silu(g) * u
        "return gated_mlp(self.w1, self.w3, self.w2, F.silu, x)",
        'return gated_mlp(self.wi_0, self.wi_1, self.wo, F.gelu, x, approximate="tanh")',
    ):
        assert line in new, line
    assert "from adopter.kernels import gated_mlp" in new
    assert "gate = self.act(self.w1(hidden_states))" not in new and "u = self.up(x)" not in new
    # __init__ is untouched: the same modules, so the same state dict
    init_lines = [ln for ln in (FIXTURES / "positive.py").read_text().splitlines() if "= nn." in ln]
    assert all(ln in new for ln in init_lines)


def test_codemod_llama_line():
    new = _rewrite(FIXTURES / "config_silu" / "modeling_toy.py")
    assert "down_proj = gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act_fn, x)" in new
    assert "silu" not in new.split("class ToyMLP")[1]  # nothing of the configuration reaches the source


# ---------------------------------------------------------------- op: act(g) * u

TOL = {torch.float32: {"atol": 0.0, "rtol": 0.0}, torch.bfloat16: {"atol": 0.0, "rtol": 0.0}}


def _eager(g, u, activation):
    return apply_activation(g, activation) * u


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_torch_matches_eager_bitwise(activation, dtype):
    """The torch path runs eager's ops in eager's order: bitwise equal, forward and backward."""
    torch.manual_seed(0)
    g0, u0 = (torch.randn(3, 5, 37) * 2).to(dtype), torch.randn(3, 5, 37).to(dtype)
    grad = torch.randn(3, 5, 37).to(dtype)
    g1, u1 = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    g2, u2 = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    out = gated_act(g1, u1, activation)
    ref = _eager(g2, u2, activation)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for a, b in zip(torch.autograd.grad(out, (g1, u1), grad), torch.autograd.grad(ref, (g2, u2), grad)):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_gated_act_double_backward_as_eager():
    torch.manual_seed(0)
    g = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: GatedActFunction.apply(g, u, "silu"), (g, u))
    assert torch.autograd.gradgradcheck(lambda g, u: GatedActFunction.apply(g, u, "gelu_tanh"), (g, u))


def test_gated_act_broadcast_and_mixed_dtypes_run_eager_ops():
    g, u = torch.randn(2, 5), torch.randn(5)
    torch.testing.assert_close(gated_act(g, u, "silu"), F.silu(g) * u, atol=0, rtol=0)
    g16 = g.to(torch.bfloat16)
    assert gated_act(g16, torch.randn(2, 5), "gelu").dtype == torch.float32  # promotion, as eager


def test_gated_act_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_act(torch.randn(2), torch.randn(2), "relu")


def _saved_bytes(fn) -> int:
    """Bytes of distinct tensors autograd keeps for the backward of ``fn()`` (packed by hooks)."""
    seen: dict = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.shape, t.stride(), t.storage_offset())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    assert out.requires_grad
    return sum(seen.values())


def test_gated_act_saves_g_and_u_only():
    g = torch.randn(8, 64, requires_grad=True)
    u = torch.randn(8, 64, requires_grad=True)
    size = g.numel() * 4
    assert _saved_bytes(lambda: _eager(g, u, "silu")) == 3 * size  # g, silu(g), u
    assert _saved_bytes(lambda: gated_act(g, u, "silu")) == 2 * size  # g, u


# ---------------------------------------------------------------- guarded kernel

D, H = 16, 40


class MLP(nn.Module):
    def __init__(self, act, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(D, H, bias=bias)
        self.up_proj = nn.Linear(D, H, bias=bias)
        self.down_proj = nn.Linear(H, D, bias=bias)
        self.act_fn = act

    def original(self, x, *args, **kwargs):
        return self.down_proj(self.act_fn(self.gate_proj(x), *args, **kwargs) * self.up_proj(x))

    def guarded(self, x, *args, **kwargs):
        return gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act_fn, x, *args, **kwargs)


def _act2fn(key):
    from transformers.activations import ACT2FN

    return ACT2FN[key]


FUSED_ACTIVATIONS = {
    "nn.SiLU": (lambda: nn.SiLU(), (), {}, "silu"),
    "F.silu": (lambda: F.silu, (), {}, "silu"),
    "ACT2FN[silu]": (lambda: _act2fn("silu"), (), {}, "silu"),
    "ACT2FN[swish]": (lambda: _act2fn("swish"), (), {}, "silu"),
    "ACT2FN[gelu]": (lambda: _act2fn("gelu"), (), {}, "gelu"),
    "ACT2FN[gelu_pytorch_tanh]": (lambda: _act2fn("gelu_pytorch_tanh"), (), {}, "gelu_tanh"),
    # (not gelu_new: NewGELUActivation writes the tanh formula out, the original runs; guarded_gated_mlp.py)
    "nn.GELU(tanh)": (lambda: nn.GELU(approximate="tanh"), (), {}, "gelu_tanh"),
    "F.gelu": (lambda: F.gelu, (), {}, "gelu"),
    "F.gelu(approximate=tanh)": (lambda: F.gelu, (), {"approximate": "tanh"}, "gelu_tanh"),
}


@pytest.mark.parametrize("name", list(FUSED_ACTIVATIONS))
@pytest.mark.parametrize("bias", [False, True])
def test_guarded_fuses_silu_and_gelu_equivalently(name, bias):
    make, args, kwargs, expected = FUSED_ACTIVATIONS[name]
    assert gated_activation(make(), args, kwargs) == (expected, "")
    torch.manual_seed(0)
    mlp = MLP(make(), bias=bias)
    x = torch.randn(3, 5, D)
    g = torch.randn(3, 5, D)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_kernel_calls() as calls:
        out = mlp.guarded(x1, *args, **kwargs)
    assert [(c.kernel, c.backend) for c in calls.calls] == [("gated_mlp", "torch")]
    ref = mlp.original(x2, *args, **kwargs)
    params = list(mlp.parameters())
    grads = torch.autograd.grad(out, [x1, *params], g)
    ref_grads = torch.autograd.grad(ref, [x2, *params], g)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


class LoraLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 1.0


ORIGINAL_CASES = {
    "relu": (lambda: nn.ReLU(), "activation is ReLU, not a SiLU or GeLU"),
    "quick_gelu": (lambda: _act2fn("quick_gelu"), "QuickGELUActivation, not a GeLU the kernel computes"),
    "sigmoid": (lambda: torch.sigmoid, "activation is sigmoid, not a SiLU or GeLU"),
    "lora_up": (lambda: nn.SiLU(), "LoraLinear overrides forward"),
    "hooked_gate": (lambda: nn.SiLU(), "Linear has hooks"),
    "hooked_act": (lambda: nn.SiLU(), "SiLU has hooks"),
}


@pytest.mark.parametrize("case", list(ORIGINAL_CASES))
def test_guarded_runs_the_original_otherwise(case):
    make, reason = ORIGINAL_CASES[case]
    torch.manual_seed(0)
    mlp = MLP(make())
    if case == "lora_up":
        lora = LoraLinear(D, H, bias=False)
        lora.load_state_dict(mlp.up_proj.state_dict())
        mlp.up_proj = lora
    if case == "hooked_gate":
        mlp.gate_proj.register_forward_hook(lambda m, i, o: o * 2)
    if case == "hooked_act":
        mlp.act_fn.register_forward_hook(lambda m, i, o: o + 1)
    x = torch.randn(2, 3, D)
    with count_kernel_calls() as calls:
        out = mlp.guarded(x)
    (call,) = calls.calls
    assert (call.kernel, call.backend) == ("gated_mlp", "original") and reason in call.reason, call.reason
    torch.testing.assert_close(out, mlp.original(x), atol=0, rtol=0)


def test_guarded_under_fx_trace_keeps_the_users_modules():
    mlp = MLP(nn.SiLU())

    class Site(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp.guarded(x)

    graph = torch.fx.symbolic_trace(Site())
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_module"}
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn"} <= targets


def test_guarded_saves_one_intermediate_less():
    """Memory on CPU: of the four intermediate-width tensors eager keeps for the backward (g,
    act(g), u, the product), the guarded kernel keeps three."""
    torch.manual_seed(0)
    mlp = MLP(nn.SiLU())
    x = torch.randn(4, 32, D, requires_grad=True)
    width = 4 * 32 * H * 4
    eager = _saved_bytes(lambda: mlp.original(x))
    fused = _saved_bytes(lambda: mlp.guarded(x))
    assert eager - fused == width


# ---------------------------------------------------------------- optimize on tiny LLMs


def _llama_config(**kw):
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=1000, **kw)


@pytest.mark.slow
def test_optimize_llama_swiglu_and_relu_fallback_at_run_time():
    import transformers

    from adopter import optimize

    optimized = optimize(transformers.LlamaForCausalLM, rules=[RULE], config=_llama_config())
    report = optimized.adopter_report
    (applied,) = report.applied
    assert (applied.rule, applied.class_name, applied.function, applied.status) == (
        "gated_MLP", "LlamaMLP", "forward", "confirmed")
    assert report.equivalence.equivalent and report.flipped_equivalence.equivalent
    assert applied.kernel_calls["analysed"] == {"torch": 4}
    assert "gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act_fn, x)" in report.diff

    # The rewritten class built with a relu config: the guard runs the original MLP.
    relu = _llama_config(hidden_act="relu")
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(relu).eval()
    rewritten = optimized(relu).eval()
    rewritten.load_state_dict(original.state_dict(), strict=True)
    ids = torch.randint(0, 1000, (2, 7))
    with count_kernel_calls() as calls:
        out = rewritten(ids).logits
    assert {(c.kernel, c.backend, c.reason) for c in calls.calls} == {
        ("gated_mlp", "original", "activation is ReLU, not a SiLU or GeLU")}
    torch.testing.assert_close(out, original(ids).logits, atol=0, rtol=0)

    # Analysed with relu, the trace rejects the site: nothing applied.
    rejected = optimize(transformers.LlamaForCausalLM, rules=[RULE], config=relu).adopter_report
    assert rejected.applied == [] and "ReLU" in str(rejected)


@pytest.mark.slow
def test_optimize_gemma_geglu():
    import transformers

    from adopter import optimize

    config = transformers.GemmaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=1000)
    assert config.hidden_act == "gelu_pytorch_tanh"
    optimized = optimize(transformers.GemmaForCausalLM, rules=[RULE], config=config)
    report = optimized.adopter_report
    (applied,) = report.applied
    assert (applied.rule, applied.status, applied.kernel_calls["analysed"]) == ("gated_MLP", "confirmed", {"torch": 4})
    assert report.equivalence.equivalent
    # the flipped config (hidden_act relu) runs the original MLP through the same rewritten line
    assert report.flipped_equivalence.equivalent and applied.kernel_calls["flipped"] == {"original": 4}


# ---------------------------------------------------------------- triton (interpreter, fresh process)

_CHILD = "ADOPTER_GATED_MLP_TRITON_CHILD"


@pytest.mark.slow
def test_triton_gated_act_under_the_interpreter():
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
TRITON_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@child_only
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_triton_gated_act(activation, dtype):
    from adopter.kernels.ops.triton_gated_act import GatedActTritonFunction

    torch.manual_seed(0)
    g = (torch.randn(3, 5, 37) * 2).to(dtype).requires_grad_()
    u = torch.randn(3, 5, 37).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 37).to(dtype)
    out = GatedActTritonFunction.apply(g, u, activation)
    dg, du = torch.autograd.grad(out, (g, u), grad)
    g32, u32 = g.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    ref = _eager(g32, u32, activation)
    rdg, rdu = torch.autograd.grad(ref, (g32, u32), grad.float())
    assert out.dtype == dg.dtype == du.dtype == dtype
    for a, b in ((out, ref), (dg, rdg), (du, rdu)):
        torch.testing.assert_close(a.float(), b, **TRITON_TOL[dtype])


@child_only
def test_interp_guarded_selects_triton_when_forced(monkeypatch):
    from adopter.kernels import backend

    monkeypatch.setenv(backend.ENV_VAR, "triton")
    torch.manual_seed(0)
    mlp = MLP(nn.SiLU())
    x = torch.randn(3, 5, D, requires_grad=True)
    with count_kernel_calls() as calls:
        out = mlp.guarded(x)
    assert [(c.kernel, c.backend) for c in calls.calls] == [("gated_mlp", "triton")]
    ref = mlp.original(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), [x, *mlp.parameters()]),
                    torch.autograd.grad(ref.sum(), [x, *mlp.parameters()])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
