"""Class hierarchies (issue 24): a base class's ``forward`` calls layers that only same-file
subclasses bind (``self.w1``, ``self.fc1``, ``self.norm``), each subclass with its own layer types,
and same-file ``nn.Linear`` subclasses whose forward only casts dtypes (``CastedLinear``).

The scan reports one site per base method and names the subclasses the kernel fits and those it
does not (``conditional``: a trace settles it); the rewritten base method runs in every subclass,
and the guarded kernel fuses for the subclasses whose layers compute what it computes (plain and
cast Linears) and runs the original computation, bit for bit, for the others (a noisy or LoRA
Linear, an RMSNorm where a LayerNorm was written). ``optimize`` on a model holding all of them
(slow)."""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls

from adopter.core.extract import extract_source
from adopter.core.match.local_layers import cast_subclass_aliases
from adopter.core.rules import get_rules
from adopter.core.scan import scan_paths

FIXTURE = Path(__file__).parents[1] / "fixtures" / "class_hierarchies" / "blocks.py"
RULES = ("gated_MLP", "biased_GeLU", "Dropout_LayerNorm")


def _rules():
    return get_rules(list(RULES))


@pytest.fixture(scope="module")
def original():
    """The fixture imported as a user's module (optimize reads its source back)."""
    name = "class_hierarchies_original"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FIXTURE.resolve())
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def rewritten():
    """The fixture rewritten with every match as a trace of a model holding the subclasses confirms
    it (``adopter rewrite`` alone leaves conditional matches out)."""
    from adopter.rewrite import rewrite_source

    text = FIXTURE.read_text()
    matches = [replace(m, status="confirmed") for m in scan_paths([FIXTURE], _rules()).matches]
    result = rewrite_source(text, matches, filename=str(FIXTURE), rules=_rules())
    assert all(o.applied for o in result.outcomes), [o.reason for o in result.outcomes if not o.applied]
    module = types.ModuleType("class_hierarchies_rewritten")
    # its own file name: the original's source stays what was imported from FIXTURE
    exec(compile(result.new_text, "<rewritten blocks.py>", "exec"), module.__dict__)
    return module


# ---------------------------------------------------------------- the scan


def test_one_site_per_base_method_naming_the_subclasses_it_fits():
    report = scan_paths([FIXTURE], _rules())
    assert report.errors == []
    found = {(m.rule, m.class_name, m.function): (m.status, m.code, m.condition) for m in report.matches}
    assert found == {
        ("gated_MLP", "GatedFFNBase", "forward"): (
            "conditional", "needs-config", "the layers forward calls fit in PlainGatedFFN, CastedGatedFFN, "
            "not in NoisyGatedFFN, LoRAGatedFFN (each binds its own)"),
        # every subclass binds a Linear (plain or cast) as fc1: a plain match
        ("biased_GeLU", "MLPBase", "forward"): ("static", "", ""),
        ("Dropout_LayerNorm", "MLPBase", "forward"): (
            "conditional", "needs-config",
            "the layers forward calls fit in PlainMLP, CastedMLP, not in RMSNormedMLP (each binds its own)"),
    }


def test_cast_only_subclasses_are_linears_statically():
    """CastedLinear's forward is F.linear up to dtype casts: a Linear for every rule; the noisy and
    LoRA layers compute something else and are not."""
    text = FIXTURE.read_text()
    aliases = cast_subclass_aliases(extract_source(text, str(FIXTURE)), text)
    assert {k.rpartition(".")[2]: v for k, v in aliases.items()} == {"CastedLinear": "torch.nn.Linear"}


# ---------------------------------------------------------------- each subclass at run time

# subclass -> {kernel: backend or the original's reason}
EXPECTED = {
    "PlainGatedFFN": {"gated_mlp": "torch"},
    "CastedGatedFFN": {"gated_mlp": "torch"},
    "NoisyGatedFFN": {"gated_mlp": "NoisyLinear overrides forward"},
    "LoRAGatedFFN": {"gated_mlp": "LoRALinear overrides forward"},
    "ConvGatedFFN": {"gated_mlp": "Conv1d is not a Linear"},
    "PlainMLP": {"linear_gelu": "torch", "dropout_add_layer_norm": "torch"},
    "CastedMLP": {"linear_gelu": "CastedLinear overrides forward", "dropout_add_layer_norm": "torch"},
    "RMSNormedMLP": {"linear_gelu": "torch", "dropout_add_layer_norm": "RMSNorm is not a LayerNorm"},
}


def _step(model, x, seed):
    torch.manual_seed(seed)  # the noisy layer draws the same noise on both sides
    out = model(x)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *model.parameters()])
    return out, grads


@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_each_subclass_fuses_or_runs_the_original_bit_for_bit(original, rewritten, name, training):
    torch.manual_seed(0)
    ref = getattr(original, name)(16, 24).train(training)
    new = getattr(rewritten, name)(16, 24).train(training)
    new.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 5, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, want_grads = _step(ref, x1, 1)
    with count_kernel_calls() as calls:
        got, got_grads = _step(new, x2, 1)
    taken = {c.kernel: c.backend if c.backend != "original" else c.reason for c in calls.calls}
    assert taken == EXPECTED[name]
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


def test_cast_subclass_with_float32_weights_and_a_bf16_input(original, rewritten):
    """CastedGatedFFN keeps float32 weights and computes in the input's dtype: fused, bit for bit."""
    torch.manual_seed(0)
    ref = original.CastedGatedFFN(16, 24)
    new = rewritten.CastedGatedFFN(16, 24)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, want_grads = _step(ref, x1, 0)
    with count_kernel_calls() as calls:
        got, got_grads = _step(new, x2, 0)
    assert [(c.kernel, c.backend) for c in calls.calls] == [("gated_mlp", "torch")]
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ---------------------------------------------------------------- optimize()


@pytest.mark.slow
def test_optimize_a_model_holding_every_subclass(original):
    """The trace confirms each base method's site; in the checks and in training, the subclasses the
    kernel fits fuse and the others run the original computation; the model trains as the original."""
    from adopter import optimize

    optimized = optimize(original.MixedStack, rules=_rules(), example_inputs=(torch.randn(2, 5, 16),))
    report = optimized.adopter_report
    assert {(a.rule, a.class_name, a.status) for a in report.applied} == {
        ("gated_MLP", "GatedFFNBase", "confirmed"), ("biased_GeLU", "MLPBase", "confirmed"),
        ("Dropout_LayerNorm", "MLPBase", "confirmed")}
    assert report.equivalence.equivalent

    torch.manual_seed(0)
    model = original.MixedStack()
    fused = optimized()
    fused.load_state_dict(model.state_dict(), strict=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, fused)]
    for step in range(2):
        x, target = torch.randn(3, 4, 16), torch.randn(3, 4, 16)
        losses = []
        with count_kernel_calls() as calls:
            for m, opt in zip((model, fused), opts):
                torch.manual_seed(100 + step)  # the same noise on both sides
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(m(x), target)
                loss.backward()
                losses.append(loss)
                opt.step()
        per = {}
        for c in calls.calls:
            per[(c.kernel, c.backend, c.reason)] = per.get((c.kernel, c.backend, c.reason), 0) + c.count
        assert per == {
            ("gated_mlp", "torch", ""): 2, ("gated_mlp", "original", "NoisyLinear overrides forward"): 1,
            ("gated_mlp", "original", "LoRALinear overrides forward"): 1,
            ("linear_gelu", "torch", ""): 2, ("linear_gelu", "original", "CastedLinear overrides forward"): 1,
            ("dropout_add_layer_norm", "torch", ""): 2,
            ("dropout_add_layer_norm", "original", "RMSNorm is not a LayerNorm"): 1,
        }
        assert torch.equal(losses[0], losses[1]), step
        for (n, p), q in zip(model.named_parameters(), fused.parameters()):
            assert torch.equal(p, q), (step, n)
