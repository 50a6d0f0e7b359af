"""``adopter.optimize()`` end to end on the call styles of issue 35 (tests/fixtures/tracing/call_styles/):
a Llama-style decoder calling its feed-forwards' ``forward`` directly, a llama2.c-style decoder
storing its loss on ``self.last_loss``, a CLIP-ModifiedResNet-style stem nested in ``forward``, an
attention with an ``nn.Softmax`` module. Each site is applied (not dropped as ``not-executed``,
``method-divergence`` or "not equivalent"), its kernel calls are counted at its site, and the
optimized model trains as the original: same state dict, three AdamW steps with the same losses and
gradients. The equivalence check's handling of a stored loss is pinned on small modules."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from adopter.verification.equivalence import check_equivalence

pytestmark = pytest.mark.slow

STYLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "tracing",
                      "call_styles")
sys.path.insert(0, STYLES)

import direct_forward  # noqa: E402
import softmax_module  # noqa: E402
import stem_closure  # noqa: E402
import stored_loss  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
STEPS = 3


def _tokens(high, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (2, 6), generator=g)


def _direct_forward_loss(model, seed):
    return model(_tokens(32, seed)).float().logsumexp(-1).mean()


def _stored_loss(model, seed):
    x, y = _tokens(48, seed), _tokens(48, seed + 100)
    model(x, y)
    return model.last_loss


def _images_loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(2, 3, 16, 16, generator=g)).square().mean()


def _sequence_loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(2, 5, 16, generator=g)).square().mean()


# fixture module -> (class, optimize's example inputs, one training step's loss, rules applied)
CASES = {
    "direct_forward": (direct_forward.Transformer, {"tokens": _tokens(32, 0)}, _direct_forward_loss,
                       {("gated_MLP", "FeedForward", "forward")}),
    "stored_loss": (stored_loss.Transformer, {"tokens": _tokens(48, 0), "targets": _tokens(48, 1)}, _stored_loss,
                    {("linear_cross_entropy", "Transformer", "forward")}),
    "stem_closure": (stem_closure.ModifiedResNet, {"x": torch.randn(2, 3, 16, 16)}, _images_loss,
                     {("Conv_BatchNorm", "ModifiedResNet", "forward.stem"), ("Conv_BatchNorm", "Bottleneck", "forward"),
                      ("Add_ReLU", "Bottleneck", "forward")}),
    "softmax_module": (softmax_module.Encoder, {"x": torch.randn(2, 5, 16)}, _sequence_loss,
                       {("softmax", "Attention", "forward")}),
}

_OPTIMIZED: dict = {}


def _optimized(name):
    if name not in _OPTIMIZED:
        from adopter import optimize

        cls, inputs, _, _ = CASES[name]
        _OPTIMIZED[name] = optimize(cls, example_inputs=inputs)
    return _OPTIMIZED[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_site_is_applied_and_its_kernel_calls_counted_there(name):
    report = _optimized(name).adopter_report
    assert {(a.rule, a.class_name, a.function) for a in report.applied} == CASES[name][3], report
    assert {a.status for a in report.applied} == {"confirmed"}
    assert not [s for s in report.skipped if s.rule in {r for r, _, _ in CASES[name][3]}], report
    for applied in report.applied:  # a site whose kernel never ran would say "no adopter kernel call"
        assert sum(applied.kernel_calls.get("analysed", {}).values()) > 0, applied


def test_the_stored_loss_and_gradients_are_what_was_compared():
    equivalence = _optimized("stored_loss").adopter_report.equivalence
    assert equivalence.equivalent
    assert equivalence.not_returned == ["output"]  # the logits, left out when training with targets


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_optimized_model_trains_as_the_original(name):
    cls, _, loss_of, _ = CASES[name]
    optimized_cls = _optimized(name)
    torch.manual_seed(0)
    original = cls().train()
    optimized = optimized_cls().train()
    assert [n for n, _ in optimized.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert list(optimized.state_dict()) == list(original.state_dict())
    optimized.load_state_dict(original.state_dict(), strict=True)
    original.load_state_dict(optimized.state_dict(), strict=True)
    opt_a = torch.optim.AdamW(original.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(optimized.parameters(), lr=1e-3)
    for step in range(STEPS):
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        loss_a, loss_b = loss_of(original, step), loss_of(optimized, step)
        loss_a.backward()
        loss_b.backward()
        torch.testing.assert_close(loss_b, loss_a, rtol=RTOL, atol=ATOL)
        grads = dict(optimized.named_parameters())
        for pname, p in original.named_parameters():
            assert (p.grad is None) == (grads[pname].grad is None), (step, pname)
            if p.grad is not None:
                torch.testing.assert_close(grads[pname].grad, p.grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, pname=pname, step=step: f"step {step} grad {pname}: {m}")
        opt_a.step()
        opt_b.step()
    for buffer_name, value in original.named_buffers():  # BatchNorm statistics after the steps
        torch.testing.assert_close(dict(optimized.named_buffers())[buffer_name], value, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- a loss stored on a module


class StoredLossLM(nn.Module):
    """Returns the logits; stores the loss on ``self.last_loss`` when given targets. ``fused``: in
    training with targets it returns None instead of the logits (as the fused LM-head loss does)."""

    def __init__(self, fused=False, scale=1.0, store=True):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.fused, self.scale, self.store = fused, scale, store
        self.last_loss = None

    def forward(self, tokens, targets=None):
        logits = self.head(self.embed(tokens))
        if targets is not None and self.store:
            self.last_loss = nn.functional.cross_entropy(logits.flatten(0, 1) * self.scale, targets.flatten())
        if self.fused and self.training and targets is not None:
            return None
        return logits


def _lm_inputs():
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    return {"tokens": ids, "targets": ids}


def test_a_model_storing_its_loss_is_compared_on_the_loss_and_gradients():
    torch.manual_seed(0)
    original = StoredLossLM()
    result = check_equivalence(original, StoredLossLM(fused=True), _lm_inputs())
    assert result.equivalent, result.summary()
    assert result.not_returned == ["output"]
    assert "train self.last_loss" not in {f.name for f in result.failures}
    # the stored loss is compared, and it drives the gradients
    assert not check_equivalence(original, StoredLossLM(fused=True, scale=1.5), _lm_inputs()).equivalent
    # a model that stores no loss where the original did is not equivalent
    missing = check_equivalence(original, StoredLossLM(fused=True, store=False), _lm_inputs())
    assert not missing.equivalent
    assert "train self.last_loss" in {f.name for f in missing.failures}
    # both models are left as they were: no stored loss (and its autograd graph) kept
    assert original.last_loss is None


def test_a_stored_loss_returned_with_the_logits_compares_both():
    torch.manual_seed(0)
    original = StoredLossLM()
    result = check_equivalence(original, StoredLossLM(), _lm_inputs())
    assert result.equivalent and result.not_returned == []
    # eval output; train output and the stored loss; the gradients of the two weights
    assert result.compared == 1 + 2 + 2
    wrong = check_equivalence(original, StoredLossLM(scale=1.5), _lm_inputs())
    assert [f.name for f in wrong.failures if not f.name.startswith("grad")] == ["train self.last_loss"]


def test_the_training_step_backpropagates_a_stored_loss():
    from adopter.verification.benchmark import make_train_step

    torch.manual_seed(0)
    model = StoredLossLM(fused=True)
    before = model.head.weight.detach().clone()
    step = make_train_step(model, _lm_inputs(), lr=1e-2)
    step()  # the forward returns None: the stored loss is what trains
    step()
    assert not torch.equal(model.head.weight, before)
