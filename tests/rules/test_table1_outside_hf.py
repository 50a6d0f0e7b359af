"""The Table-1 rules on code written outside HuggingFace (issue 24): fused_QKV with sizes from an
argument object, grouped-query k/v and projections re-initialised by another method; the MoE
router softmax whose rank a view fixes and a constructor-passed Linear and ``topk`` keep; sampling
softmaxes left alone; Linear+GeLU through an ``nn.Sequential(OrderedDict(layers))`` built under
if/else, a same-class helper method, a lambda over an ``nn.ModuleDict``; the encoder layer whose
dropouts end helper methods shared by both ``norm_first`` branches (conditional). Each rewrite is
loaded and run against the original, forward and backward."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls

from adopter.core.rules import get_rules
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules"
QKV = FIXTURES / "fused_QKV"
SOFTMAX = FIXTURES / "softmax"
GELU = FIXTURES / "biased_GeLU"
DLN = FIXTURES / "Dropout_LayerNorm"


def _scan(path: Path, rule: str) -> tuple[list, list]:
    rejected: list = []
    matches = scan_source(path.read_text(), str(path), get_rules([rule]), rejected=rejected)
    return matches, rejected


def _load(text: str, name: str, tmp_path: Path):
    """A module from source text, written to a file (TorchScript and fx read sources)."""
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _rewritten(path: Path, rule: str, tmp_path: Path, tag: str):
    """(original module, rewritten module, the rewrite's outcomes) of a fixture."""
    from adopter.rewrite import rewrite_source

    text = path.read_text()
    rules = get_rules([rule])
    result = rewrite_source(text, scan_source(text, path.name, rules), filename=path.name, rules=rules)
    return _load(text, f"{tag}_original", tmp_path), _load(result.new_text, f"{tag}_rewritten", tmp_path), result


def _pair(a_mod, b_mod, name: str, *args, **kwargs):
    torch.manual_seed(0)
    a = getattr(a_mod, name)(*args, **kwargs)
    b = getattr(b_mod, name)(*args, **kwargs)
    b.load_state_dict(a.state_dict(), strict=True)
    return a, b


def _flatten(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return [out]


def _same_forward_backward(a, b, x: torch.Tensor, atol: float = 0.0):
    """Runs both on ``x``; asserts equal outputs and gradients (input and every parameter)."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_kernel_calls() as calls:
        out_b = b(xb)
    out_a = a(xa)
    flat_a, flat_b = _flatten(out_a), _flatten(out_b)
    floats = [(p, q) for p, q in zip(flat_a, flat_b) if p.is_floating_point()]
    for p, q in zip(flat_a, flat_b):
        assert p.dtype == q.dtype and p.shape == q.shape
        torch.testing.assert_close(q, p, atol=atol, rtol=0 if atol == 0 else 1e-5)
    loss_a = sum((p.float() * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() for p, _ in floats)
    loss_b = sum((q.float() * torch.linspace(-1, 1, q.numel()).view_as(q)).sum() for _, q in floats)
    params_a = [p for p in a.parameters() if p.requires_grad]
    params_b = [p for p in b.parameters() if p.requires_grad]
    grads_a = torch.autograd.grad(loss_a, [xa, *params_a], allow_unused=True)
    grads_b = torch.autograd.grad(loss_b, [xb, *params_b], allow_unused=True)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(gb, ga, atol=atol, rtol=0 if atol == 0 else 1e-5)
    return [(c.kernel, c.backend) for c in calls.calls]


# ---------------------------------------------------------------- fused_QKV


def test_qkv_init_only_uses_do_not_keep_the_match_out_other_uses_do():
    matches, _ = _scan(QKV / "positive_outside_hf.py", "fused_QKV")
    assert sorted(m.class_name for m in matches) == ["GroupedQueryAttention", "ResetAttention", "WeightInitAttention"]
    assert all(m.status == "static" for m in matches)
    matches, rejected = _scan(QKV / "negative_outside_hf.py", "fused_QKV")
    assert matches == []
    reasons = {m.class_name: m.reason for m in rejected}
    assert reasons == {
        "LoopCallsProjections": "self.wq is also used at line 16 (LoopCallsProjections.encode_memory): fusing would "
                                "remove the module",
        "LoopReadsWeights": "self.wq is also used at line 33 (LoopReadsWeights.weight_norms): fusing would remove "
                            "the module",
        "InitResultUsed": "self.key is also used at line 51 (InitResultUsed.scaled_key_weight): fusing would remove "
                          "the module",
    }


@pytest.fixture
def fuse_qkv_on_cpu(monkeypatch):
    from adopter.kernels import guarded

    monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", True)


@pytest.mark.parametrize("name, args", [
    ("GroupedQueryAttention", ()),  # q 32 wide, k/v 16: the fused output is split by each one's size
    ("ResetAttention", (16, 4)),
    ("WeightInitAttention", (16,)),
])
def test_qkv_rewrites_fuse_and_compute_the_original(tmp_path, fuse_qkv_on_cpu, name, args):
    a_mod, b_mod, result = _rewritten(QKV / "positive_outside_hf.py", "fused_QKV", tmp_path, "qkv_out")
    assert all(o.applied for o in result.outcomes), [(o.match.class_name, o.reason) for o in result.outcomes]
    if name == "GroupedQueryAttention":
        args = (a_mod.Args(),)
    a, b = _pair(a_mod, b_mod, name, *args)
    dim = 32 if name == "GroupedQueryAttention" else 16
    calls = _same_forward_backward(a, b, torch.randn(2, 5, dim), atol=1e-5)
    assert calls == [("qkv", "torch")]


def test_qkv_reinitialised_weights_reach_the_fused_call(tmp_path, fuse_qkv_on_cpu):
    """The use that no longer keeps the match out: ``init_weights`` after a cached eval call."""
    a_mod, b_mod, _ = _rewritten(QKV / "positive_outside_hf.py", "fused_QKV", tmp_path, "qkv_init")
    a, b = _pair(a_mod, b_mod, "GroupedQueryAttention", a_mod.Args())
    a.eval()
    b.eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = b(x)
        for m in (a, b):
            torch.manual_seed(1)
            m.init_weights(std=0.5)
        torch.testing.assert_close(b(x), a(x), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(b(x), before)


# ---------------------------------------------------------------- softmax


def test_router_softmax_rank_is_inferred_through_view_gate_and_topk():
    matches, _ = _scan(SOFTMAX / "positive_outside_hf.py", "softmax")
    assert sorted((m.class_name, m.status) for m in matches) == [
        ("KeywordGateRouter", "static"), ("SortedRouter", "static"), ("TopKRouter", "static")]
    matches, rejected = _scan(SOFTMAX / "negative_outside_hf.py", "softmax")
    assert matches == []
    reasons = Counter((m.class_name, m.status, m.code) for m in rejected)
    assert reasons == Counter({("MixedGateRouter", "refused", "dim-not-last"): 1,
                               ("ForeignGateRouter", "refused", "dim-not-last"): 1,
                               ("RebindInLoop", "refused", "dim-not-last"): 1})
    # generate() is no analysis entry; a softmax sampled with multinomial is no candidate at all
    assert not any(m.function in ("generate", "sample_next_token") for m in rejected)


def test_sampling_softmax_is_not_a_candidate_but_the_same_softmax_unsampled_is():
    text = (SOFTMAX / "negative_outside_hf.py").read_text()
    kept = text.replace("return torch.multinomial(probs, num_samples=1)", "return probs")
    assert kept != text
    found = [m.function for m in scan_source(kept, "sampling.py", get_rules(["softmax"]))]
    assert found == ["sample_next_token"]


def test_router_softmax_rewrite_computes_the_original(tmp_path):
    a_mod, b_mod, result = _rewritten(SOFTMAX / "positive_outside_hf.py", "softmax", tmp_path, "softmax_out")
    assert sorted(o.match.class_name for o in result.outcomes if o.applied) == [
        "KeywordGateRouter", "SortedRouter", "TopKRouter"]
    a, b = _pair(a_mod, b_mod, "Block", 16, 4)
    calls = _same_forward_backward(a, b, torch.randn(2, 5, 16))
    assert Counter(calls) == Counter({("softmax", "torch"): 3})


# ---------------------------------------------------------------- biased_GeLU


def test_gelu_forms_outside_hf_are_matched_and_rewritten(tmp_path):
    _a, _b, result = _rewritten(GELU / "positive_outside_hf.py", "biased_GeLU", tmp_path, "gelu_scan")
    applied = sorted(o.match.class_name for o in result.outcomes if o.applied)
    assert applied == ["HelperMethodMLP", "InheritedHelperMLP", "KeyedBlock", "LambdaBlock", "ProjectionHead"]
    (left,) = [o for o in result.outcomes if not o.applied]
    # the tanh helper is not folded to its call site: one chain over two functions, left as is
    assert left.match.class_name == "TanhHelperMLP" and "several functions" in left.reason
    assert "(F.gelu if type(self).gelu is HelperMethodMLP.gelu else self.gelu)" in result.new_text
    assert "GuardedSequential(OrderedDict(layers))" in result.new_text


@pytest.mark.parametrize("name, args, kwargs, fused", [
    ("ProjectionHead", (8, 16), {}, True),
    ("ProjectionHead", (8, 16), {"norm": True}, True),  # the other way the list is built
    ("HelperMethodMLP", (8, 16), {}, True),
    ("InheritedHelperMLP", (8, 16), {}, True),
    ("QuickGeluMLP", (8, 16), {}, False),  # overrides the helper: its own activation, unfused
    ("LambdaBlock", (8,), {}, True),
    ("KeyedBlock", (8,), {}, True),
])
def test_gelu_rewrites_compute_the_original(tmp_path, name, args, kwargs, fused):
    a_mod, b_mod, _ = _rewritten(GELU / "positive_outside_hf.py", "biased_GeLU", tmp_path, "gelu_out")
    a, b = _pair(a_mod, b_mod, name, *args, **kwargs)
    calls = _same_forward_backward(a, b, torch.randn(3, 5, 8), atol=1e-6)
    assert calls == [("linear_gelu", "torch" if fused else "original")]


@pytest.mark.parametrize("name", ["HelperMethodMLP", "QuickGeluMLP"])
def test_gelu_helper_method_rewrite_scripts_traces_and_compiles(tmp_path, name):
    """The guard ``type(self).gelu is HelperMethodMLP.gelu`` is plain Python under fx and dynamo;
    TorchScript compiles the original statements kept under ``torch.jit.is_scripting()``."""
    a_mod, b_mod, _ = _rewritten(GELU / "positive_outside_hf.py", "biased_GeLU", tmp_path, "gelu_modes")
    a, b = _pair(a_mod, b_mod, name, 8, 16)
    x = torch.randn(2, 3, 8)
    want = a(x)
    for run in (torch.jit.script(b), torch.fx.symbolic_trace(b), torch.compile(b, backend="eager")):
        torch.testing.assert_close(run(x), want, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- Dropout_LayerNorm


def test_encoder_layer_dropouts_through_helper_returns_are_conditional_on_norm_first():
    """The dropout is followed through ``_sa_block``/``_ff_block``'s return; each helper runs on
    both branches of ``if self.norm_first``, so which fusion it joins is the configuration's:
    conditional (needs-config), not a prediction of a static scan."""
    matches, _ = _scan(DLN / "encoder_layer_outside_hf.py", "Dropout_LayerNorm")
    got = sorted((m.status, m.code, m.condition) for m in matches)
    lines = (DLN / "encoder_layer_outside_hf.py").read_text().splitlines()

    def line(text: str) -> int:
        (found,) = [i + 1 for i, t in enumerate(lines) if t.strip() == text]
        return found

    drop1, drop2 = line("return self.dropout1(x)"), line("return self.dropout2(x)")
    pre_sa = line("x = x + self._sa_block(self.norm1(x), src_mask)")
    post_sa = line("x = self.norm1(x + self._sa_block(x, src_mask))")
    assert got == [
        ("conditional", "needs-config", f"fuses so only if not (self.norm_first): the call at line {drop1} also runs "
                                        f"on the other branch (line {pre_sa})"),
        ("conditional", "needs-config", f"fuses so only if not (self.norm_first): the call at line {drop2} also runs "
                                        f"on the other branch (line {line('x = x + self._ff_block(self.norm2(x))')})"),
        ("conditional", "needs-config", f"fuses so only if self.norm_first: the call at line {drop1} also runs on the "
                                        f"other branch (line {post_sa})"),
    ]
