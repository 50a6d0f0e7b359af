"""The rank of ``t * self.scale`` is the rank of ``t`` when ``self.scale`` is a Python number the
class's ``__init__`` sets (``dim ** -0.5`` with ``dim`` a layer width): a softmax over the last
dimension written positively (``dim=2`` of a 3-D einsum output) is then matched. Where the scale
could be a tensor (broadcasting can raise the rank), the rank stays unknown."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

from adopter.core.rules import all_rules
from adopter.core.scan import scan_source

HEADER = """
import math
import torch
from torch import nn, einsum
"""


def _case(scale_init: str, extra: str = "", params: str = "dim") -> str:
    return textwrap.dedent(HEADER) + textwrap.dedent(f"""
class Slots(nn.Module):
    def __init__(self, {params}, num_slots=4):
        super().__init__()
        self.slots = nn.Parameter(torch.randn(num_slots, dim) * 0.02)
        self.to_k = nn.Linear(dim, dim, bias=False)
{textwrap.indent(textwrap.dedent(scale_init), " " * 8)}
    def forward(self, x):
        logits = einsum("bnd,kd->bnk", self.to_k(x), self.slots) * self.scale
        return torch.softmax(logits, dim=2)
""") + textwrap.dedent(extra)


SOFTMAX_LINE = 15


def _softmax(text: str) -> list[tuple[str, str]]:
    rejected: list = []
    found = scan_source(text, "/tmp/rank_case.py", all_rules(), rejected)
    return [(m.status, m.code) for m in found + [r for r in rejected if r.status == "refused"]
            if m.rule == "softmax" and m.class_name == "Slots"]


@pytest.mark.parametrize("scale_init", [
    "self.scale = dim ** -0.5\n",
    "head_dim = dim // 2\nself.scale = 1 / math.sqrt(head_dim)\n",
    "self.width = dim\nself.scale = float(self.width) ** -0.5 * 2\n",
    "self.scale = -0.125\n",
])
def test_scale_that_is_a_number_keeps_the_rank(scale_init):
    assert _softmax(_case(scale_init)) == [("static", "")]


@pytest.mark.parametrize("scale_init, extra, params", [
    # a parameter the __init__ uses as no size: it could be a tensor of any rank
    ("self.scale = temperature ** -0.5\n", "", "dim, temperature"),
    ("self.scale = nn.Parameter(torch.ones(dim))\n", "", "dim"),
    ("self.scale = torch.tensor(dim) ** -0.5\n", "", "dim"),
    # set under a branch: another store may run, or none
    ("if dim > 2:\n    self.scale = dim ** -0.5\nelse:\n    self.scale = torch.ones(1, 1, 1, 1)\n", "", "dim"),
    # a subclass in the file stores a tensor there
    ("self.scale = dim ** -0.5\n",
     "\nclass WideSlots(Slots):\n    def __init__(self, dim):\n        super().__init__(dim)\n"
     "        self.scale = torch.ones(1, 1, 1, dim)\n", "dim"),
    # math.floor hands back the argument's own __floor__ (a tensor for a tensor)
    ("self.scale = math.floor(dim ** 0.5)\n", "", "dim"),
])
def test_scale_that_may_be_a_tensor_keeps_the_rank_unknown(scale_init, extra, params):
    assert _softmax(_case(scale_init, extra, params)) == [("refused", "dim-not-last")]


def test_unrelated_class_storing_the_same_attribute_does_not_matter():
    other = "\nclass Other(nn.Module):\n    def __init__(self):\n        super().__init__()\n" \
            "        self.scale = torch.ones(1, 1, 1, 1)\n"
    assert _softmax(_case("self.scale = dim ** -0.5\n", other)) == [("static", "")]


def _module(text: str, name: str):
    mod = types.ModuleType(name)
    exec(compile(text, f"/tmp/{name}.py", "exec"), mod.__dict__)
    return mod


@pytest.mark.parametrize("train", [True, False])
def test_rewritten_softmax_trains_equal(train):
    from adopter.rewrite import rewrite_source

    text = _case("self.scale = dim ** -0.5\n")
    ms = scan_source(text, "/tmp/rank_case.py", all_rules())
    res = rewrite_source(text, ms, filename="/tmp/rank_case.py")
    assert [o.match.lines[0] for o in res.outcomes if o.applied and o.match.rule == "softmax"] == [SOFTMAX_LINE]
    torch.manual_seed(0)
    ref = _module(text, "rank_ref").Slots(8)
    new = _module(res.new_text, "rank_new").Slots(8)
    new.load_state_dict(ref.state_dict())
    ref.train(train)
    new.train(train)
    x = torch.randn(2, 5, 8)
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_new = ref(xr), new(xn)
    torch.testing.assert_close(out_new, out_ref, rtol=1e-5, atol=1e-6)
    (out_ref * torch.arange(out_ref.numel()).reshape(out_ref.shape)).sum().backward()
    (out_new * torch.arange(out_new.numel()).reshape(out_new.shape)).sum().backward()
    torch.testing.assert_close(xn.grad, xr.grad, rtol=1e-4, atol=1e-6)
    for (name, p), (_, q) in zip(ref.named_parameters(), new.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_parameter_only_a_layer_norm_or_one_factory_size_reads_is_no_int():
    # LayerNorm's normalized_shape and torch.ones(shape) take a sequence too
    text = _case("self.norm = nn.LayerNorm(shape)\nself.bias = torch.ones(shape)\nself.scale = shape ** -0.5\n",
                 params="dim, shape")
    assert _softmax(text) == [("refused", "dim-not-last")]
