"""Issue 35: libraries written with einops and functools.partial, and a ConvNeXt channels-first
LayerNorm, through ``adopter.optimize()`` (scan, trace, rewrite, equivalence) and three training
steps against the original.

* ``tests/fixtures/forms/xt_style_model.py`` (x-transformers-like, self-written): the attention
  softmax bound as a nested partial in ``__init__``, a module-level partial and a partial default
  argument, rotations written with ``einops.rearrange`` (interleaved and half-split), projections
  unpacked from one tuple: each is applied; so is the ``F.normalize`` RMSNorm
  (``F.normalize(x, dim=-1) * self.scale * self.gamma``, rewritten to the guarded scaled L2 norm).
* ``tests/fixtures/forms/convnext_style_model.py``: the channels-first LayerNorm is no RMSNorm
  match at all (neither applied nor refused).
"""
from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

FORMS = Path(__file__).parents[1] / "fixtures" / "forms"
STEPS = 3
RTOL, ATOL = 1e-4, 1e-5


def _load(stem: str):
    name = f"adopter_forms_e2e_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FORMS / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tokens(g):
    return torch.randint(0, 64, (2, 16), generator=g)


def _image(g):
    return torch.randn(2, 3, 32, 32, generator=g)


MODELS = {
    "xt_style_model": ("Decoder", "tokens", _tokens),
    "convnext_style_model": ("ConvNeXt", "x", _image),
}
_OPTIMIZED: dict = {}


def _optimized(stem):
    if stem not in _OPTIMIZED:
        from adopter import optimize

        cls_name, arg, make = MODELS[stem]
        cls = getattr(_load(stem), cls_name)
        example = {arg: make(torch.Generator().manual_seed(0))}
        _OPTIMIZED[stem] = (cls, optimize(cls, example_inputs=example, torchscript="never"))
    return _OPTIMIZED[stem]


def test_einops_and_partial_forms_and_the_l2_rmsnorm_are_applied():
    _, Optimized = _optimized("xt_style_model")
    report = Optimized.adopter_report
    applied = Counter(a.rule for a in report.applied)
    # the nested partial in __init__, the partial default argument, the module-level partial
    assert applied["softmax"] == 3, report.applied
    assert applied["rotary_embedding"] == 2  # einops interleaved pairs and einops halves
    assert applied["fused_QKV"] == 1  # q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
    assert applied["RMSNorm"] == 1  # the class's forward, rewritten once (it runs 5 times)
    assert not [m for m in report.skipped if m.rule == "RMSNorm"]
    assert "+        return scaled_l2_norm(x, self.scale, self.gamma)" in report.diff


def test_the_channels_first_layernorm_is_no_rmsnorm_match():
    _, Optimized = _optimized("convnext_style_model")
    report = Optimized.adopter_report
    assert not [a for a in report.applied if a.rule == "RMSNorm"]
    assert not [m for m in report.skipped if m.rule == "RMSNorm"]


@pytest.mark.parametrize("stem", sorted(MODELS))
def test_optimized_model_trains_as_the_original(stem):
    cls, Optimized = _optimized(stem)
    _, arg, make = MODELS[stem]
    torch.manual_seed(0)
    original = cls().train()
    optimized = Optimized().train()
    assert list(optimized.state_dict()) == list(original.state_dict())
    optimized.load_state_dict(original.state_dict(), strict=True)
    opt_a = torch.optim.AdamW(original.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(optimized.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = make(g)
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        out_a, out_b = original(**{arg: x}), optimized(**{arg: x})
        torch.testing.assert_close(out_b, out_a, rtol=RTOL, atol=ATOL, msg=lambda m, s=step: f"step {s} output: {m}")
        out_a.square().mean().backward()
        out_b.square().mean().backward()
        grads_b = dict(optimized.named_parameters())
        for name, p in original.named_parameters():
            torch.testing.assert_close(grads_b[name].grad, p.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}")
        opt_a.step()
        opt_b.step()
