"""Dropout_LayerNorm through a helper method's return (issue 24): torch's TransformerEncoderLayer
shape, ``self.norm1(x + self._sa_block(x))`` with ``_sa_block`` ending in ``return
self.dropout1(x)``. The rewrite adds ``_sa_block_before_dropout`` (the helper without its final
dropout; the helper itself stays) and hands its value and the dropout to the kernel while
``type(self)._sa_block`` is the helper split; a subclass overriding it runs the original math.
Each site is conditional on ``self.norm_first``, so the tests confirm the matches as a trace of
the built model would, then run the rewritten layer against the original, forward and backward."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls
from adopter.rewrite import rewrite_source

from adopter.core.rules import get_rules
from adopter.core.scan import scan_source

FIXTURE = Path(__file__).parents[1] / "fixtures" / "rules" / "Dropout_LayerNorm" / "encoder_layer_outside_hf.py"
RULE = "Dropout_LayerNorm"


def _confirmed(text: str, name: str):
    """The scan's matches, the conditional ones confirmed (what optimize()'s trace does for the
    branch it runs)."""
    matches = scan_source(text, name, get_rules([RULE]))
    return [dataclasses.replace(m, status="confirmed") if m.status == "conditional" else m for m in matches]


def _rewrite_to_fixed_point(text: str, name: str) -> tuple[str, list]:
    """Rewrites until nothing more applies (as ``rewrite_file`` does): a second match through one
    helper waits for the pass after the one that added the split method."""
    outcomes = []
    for _ in range(3):
        result = rewrite_source(text, _confirmed(text, name), filename=name, rules=get_rules([RULE]))
        assert not result.error, result.error
        outcomes.extend(result.outcomes)
        if not result.changed:
            break
        text = result.new_text
    return text, outcomes


def _load(text: str, name: str, tmp_path: Path):
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


@pytest.fixture(scope="module")
def rewritten_text() -> str:
    text, outcomes = _rewrite_to_fixed_point(FIXTURE.read_text(), FIXTURE.name)
    assert sum(o.applied for o in outcomes) == 3, [(o.applied, o.reason) for o in outcomes]
    return text


def test_helpers_are_split_and_kept(rewritten_text):
    original = ast.parse(FIXTURE.read_text())
    new = ast.parse(rewritten_text)

    def methods(tree):
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EncoderLayer"]
        return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}

    old_methods, new_methods = methods(original), methods(new)
    # the helpers are unchanged; each is split once, however many sites read it
    for name in ("_sa_block", "_ff_block"):
        assert ast.dump(new_methods[name]) == ast.dump(old_methods[name])
    assert sorted(set(new_methods) - set(old_methods)) == ["_ff_block_before_dropout", "_sa_block_before_dropout"]
    split = new_methods["_sa_block_before_dropout"]
    assert isinstance(split.body[-1], ast.Return) and isinstance(split.body[-1].value, ast.Name)
    # the norm_first branch's last add is not followed by a LayerNorm: it stays as it was
    assert "x = x + self._ff_block(norm2_out)" in rewritten_text
    # a second scan finds nothing left to fuse
    assert _confirmed(rewritten_text, FIXTURE.name) == []


def _same_forward_backward(a, b, x, train: bool):
    a.train(train)
    b.train(train)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    out_a = a(xa)
    torch.manual_seed(1)
    with count_kernel_calls() as calls:
        out_b = b(xb)
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    weight = torch.linspace(-1, 1, out_a.numel()).view_as(out_a)
    params_a = [p for p in a.parameters() if p.requires_grad]
    params_b = [p for p in b.parameters() if p.requires_grad]
    grads_a = torch.autograd.grad((out_a * weight).sum(), [xa, *params_a])
    grads_b = torch.autograd.grad((out_b * weight).sum(), [xb, *params_b])
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-5)
    return [(c.kernel, c.fused, c.count) for c in calls.calls]


def _pair(a_cls, b_cls, norm_first: bool):
    torch.manual_seed(0)
    a = a_cls(16, 4, dropout=0.25, norm_first=norm_first)
    b = b_cls(16, 4, dropout=0.25, norm_first=norm_first)
    b.load_state_dict(a.state_dict(), strict=True)
    return a, b


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_rewritten_layer_computes_the_original(tmp_path, rewritten_text, norm_first, train):
    a_mod = _load(FIXTURE.read_text(), "enc_helper_original", tmp_path)
    b_mod = _load(rewritten_text, "enc_helper_rewritten", tmp_path)
    a, b = _pair(a_mod.EncoderLayer, b_mod.EncoderLayer, norm_first)
    calls = _same_forward_backward(a, b, torch.randn(2, 5, 16), train)
    # post-norm: both helpers' dropouts go through the kernel; pre-norm: only _sa_block's
    assert sum(count for kernel, _, count in calls if kernel == "dropout_add_layer_norm") == (1 if norm_first else 2)


@pytest.mark.parametrize("norm_first", [False, True])
def test_subclass_overriding_the_helper_gets_the_original_path(tmp_path, rewritten_text, norm_first):
    a_mod = _load(FIXTURE.read_text(), "enc_override_original", tmp_path)
    b_mod = _load(rewritten_text, "enc_override_rewritten", tmp_path)

    def override(base):
        class Scaled(base):
            def _sa_block(self, x, attn_mask):
                # no dropout at all, and a different value: the split method must not run
                return 2.0 * self.self_attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0]

        return Scaled

    a, b = _pair(override(a_mod.EncoderLayer), override(b_mod.EncoderLayer), norm_first)
    calls = _same_forward_backward(a, b, torch.randn(2, 5, 16), train=True)
    # the _sa_block site ran its original computation; the post-norm _ff_block site still fuses
    assert [c for c in calls if c[0] == "dropout_add_layer_norm" and not c[1]] == [("dropout_add_layer_norm", False, 1)]


def test_helper_with_other_returns_is_not_split():
    """A helper that can return before its dropout has no single pre-dropout value: refused."""
    text = FIXTURE.read_text().replace(
        "        x = self.linear2(self.dropout(F.relu(self.linear1(x))))\n        return self.dropout2(x)",
        "        if x.shape[0] == 0:\n            return x\n"
        "        x = self.linear2(self.dropout(F.relu(self.linear1(x))))\n        return self.dropout2(x)",
    )
    result = rewrite_source(text, _confirmed(text, "early_return.py"), filename="early_return.py",
                            rules=get_rules([RULE]))
    reasons = [o.reason for o in result.outcomes if not o.applied]
    assert any("_ff_block cannot be split" in r and "return" in r for r in reasons), reasons
    assert "_ff_block_before_dropout" not in result.new_text
