"""linear_cross_entropy with the classes at dim 1 (``written_out_classes_first.py``):
``F.cross_entropy(rearrange(logits, "b n c -> b c n"), target)``, ``logits.transpose(1, 2)``,
``logits.permute(0, 2, 1)`` with a (batch, tokens) target are the per-token cross entropy of the
(tokens, vocab) rows; the rewritten models train like the originals (loss and every gradient,
ignore_index and reduction kept), and the kernel replays the source's op whenever the logits are
not (batch, tokens, vocab)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls, lm_head_cross_entropy
from adopter.rewrite import rewrite_source
from torch import nn

from adopter.core.rules.linear_cross_entropy import RULE
from adopter.core.scan import scan_source

CASE = Path(__file__).parents[1] / "fixtures" / "rules" / "linear_cross_entropy" / "written_out_classes_first.py"


@pytest.fixture(scope="module")
def rewritten():
    text = CASE.read_text()
    matches = scan_source(text, CASE.name, [RULE])
    result = rewrite_source(text, matches, filename=CASE.name, rules=[RULE])
    assert result.error == ""
    original, new = {}, {}
    exec(compile(text, str(CASE), "exec"), original)
    exec(compile(result.new_text, f"<rewritten {CASE.name}>", "exec"), new)
    return original, new, result.new_text, matches


def test_classes_at_dim_1_are_matched_and_other_moves_are_not(rewritten):
    _, _, text, matches = rewritten
    assert sorted(m.class_name for m in matches) == ["PermuteLM", "RearrangeLM", "TransposeLM"]
    assert "flatten=('rearrange', 'b n c -> b c n')" in text
    assert "flatten=('transpose', 1, 2)" in text
    assert "flatten=('permute', 0, 2, 1)" in text and "upcast=True" in text
    assert "loss = F.cross_entropy(logits.transpose(0, 2), targets)" in text


def _loss(cls, model, tokens):
    if cls == "RearrangeLM":
        return model(tokens, return_loss=True)
    if cls == "TransposeLM":
        return model(tokens[:, :-1], tokens[:, 1:])[1]
    return model(tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("cls", ["RearrangeLM", "TransposeLM", "PermuteLM"])
def test_rewritten_model_trains_like_the_original(rewritten, cls):
    original, new, _, _ = rewritten
    torch.manual_seed(0)
    a = original[cls]()
    b = new[cls]()
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(1, 48, (3, 9))
    tokens[0, 2:5] = a.ignore_index if a.ignore_index >= 0 else 0  # ignored targets where the index is a token
    if cls == "RearrangeLM":
        a.ignore_index = b.ignore_index = int(tokens[1, 3])  # some targets ignored
    loss_a = _loss(cls, a.train(), tokens)
    loss_a.backward()
    with warnings.catch_warnings(), count_kernel_calls() as calls:
        warnings.simplefilter("ignore")
        loss_b = _loss(cls, b.train(), tokens)
    loss_b.backward()
    assert [c.backend != "original" for c in calls.calls] == [True]  # the fused loss ran
    torch.testing.assert_close(loss_b, loss_a)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    a.eval(), b.eval()
    with torch.no_grad(), count_kernel_calls() as calls:
        torch.testing.assert_close(_loss(cls, b, tokens), _loss(cls, a, tokens))
    assert [c.backend for c in calls.calls] == ["original"]


@pytest.mark.parametrize("flatten", [("transpose", 1, 2), ("permute", 0, 2, 1), ("rearrange", "b n c -> b c n")])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kernel_equals_torch_over_dim_1(flatten, reduction):
    from einops import rearrange

    torch.manual_seed(1)
    head = nn.Linear(8, 11)
    h = torch.randn(2, 5, 8, requires_grad=True)
    target = torch.randint(0, 11, (2, 5))
    target[1, :2] = 3
    moved = {"transpose": lambda z: z.transpose(1, 2), "permute": lambda z: z.permute(0, 2, 1),
             "rearrange": lambda z: rearrange(z, "b n c -> b c n")}[flatten[0]]
    ref = F.cross_entropy(moved(head(h)), target, ignore_index=3, reduction=reduction)
    (gh_ref, gw_ref) = torch.autograd.grad(ref, (h, head.weight))
    with warnings.catch_warnings(), count_kernel_calls() as calls:
        warnings.simplefilter("ignore")
        logits, loss = lm_head_cross_entropy(head, h, F.cross_entropy, target, flatten=flatten, ignore_index=3,
                                             reduction=reduction)
    assert logits is None and [c.backend != "original" for c in calls.calls] == [True]
    (gh, gw) = torch.autograd.grad(loss, (h, head.weight))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gh, gh_ref)
    torch.testing.assert_close(gw, gw_ref)


def test_kernel_replays_the_source_when_the_logits_are_not_3d():
    # (b, a, n, vocab) logits moved by transpose(1, 2): dim 1 holds n classes, the target is
    # (b, a, vocab): torch's cross entropy of that layout, never the per-token one
    torch.manual_seed(2)
    head = nn.Linear(8, 5)
    h = torch.randn(2, 4, 3, 8, requires_grad=True)
    target = torch.randint(0, 3, (2, 4, 5))
    ref = F.cross_entropy(head(h).transpose(1, 2), target)
    with count_kernel_calls() as calls:
        logits, loss = lm_head_cross_entropy(head, h, F.cross_entropy, target, flatten=("transpose", 1, 2))
    assert [c.backend for c in calls.calls] == ["original"] and logits is not None
    torch.testing.assert_close(loss, ref)
    # a target of the hidden states' leading shape: 4-d logits make the source's call raise, and so
    # does the rewrite (it runs that call), never a per-token loss
    with pytest.raises(RuntimeError):
        lm_head_cross_entropy(head, h, F.cross_entropy, torch.randint(0, 3, (2, 4, 3)), flatten=("transpose", 1, 2))
    # a target that is not (batch, tokens): the source's own call runs (and raises as it does)
    with pytest.raises(ValueError, match="batch_size"):
        lm_head_cross_entropy(head, torch.randn(2, 3, 8), F.cross_entropy, torch.randint(0, 5, (6,)),
                              flatten=("permute", 0, 2, 1))
