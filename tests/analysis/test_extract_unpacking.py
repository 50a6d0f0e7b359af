"""Names bound by unpacking a generator expression, a list comprehension or ``map`` (the einops /
lucidrains idiom ``q, k, v = (rearrange(t, ...) for t in (q, k, v))``): each name is the element
expression run on its own element, so what the code does with ``q`` later is seen."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

from adopter.core.dsl import Var
from adopter.core.rules import all_rules
from adopter.core.scan import scan_source
from tests.analysis.test_extract import fn, paths, src

HEADER = """
import torch
from torch import nn, einsum
from einops import rearrange
"""

GENEXP = HEADER + """
class HeadsGen(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        q = q.softmax(dim=-1)
        k = k.softmax(dim=-2)
        context = einsum("bhnd,bhne->bhde", k, v)
        out = einsum("bhnd,bhde->bhne", q, context)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class HeadsMap(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.heads
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=h), qkv)
        q = q.softmax(dim=-1)
        k = k.softmax(dim=-2)
        context = einsum("bhnd,bhne->bhde", k, v)
        out = einsum("bhnd,bhde->bhne", q, context)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class HeadsList(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        q, k = [t.transpose(1, 2) for t in (q, k)]
        q = torch.softmax(q, dim=-1)
        return q.transpose(1, 2) + k.transpose(1, 2)
"""

SOFTMAX_LINES = {"HeadsGen": 17, "HeadsMap": 35, "HeadsList": 51}


def _static(text: str, rule: str) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for m in scan_source(text, "/tmp/unpacking_case.py", all_rules()):
        if m.rule == rule and m.status == "static":
            found.setdefault(m.class_name, []).append(m.lines[0])
    return found


def test_genexp_over_a_literal_tuple_binds_each_name_to_its_element():
    fs = src(GENEXP)
    nodes = [n for p in paths(fs, "HeadsGen") for n in p]
    reshapes = [n for n in nodes if n.startswith("torch.Tensor.reshape")]
    assert [r.split("(")[1].split(",")[0] for r in reshapes[:3]] == ["q#1", "k#1", "v#1"]
    # one temporary per element: q, k and v are three values, not one
    outs = {n.rsplit("-> ", 1)[1] for n in nodes if n.startswith("torch.Tensor.transpose(tmp")}
    assert len(outs) == 3
    sources = fn(fs, "HeadsGen").sources
    assert {sources[Var("q", 2)], sources[Var("k", 2)], sources[Var("v", 2)]} == {(Var(o),) for o in outs}
    assert "torch.Tensor.softmax(q#2, dim=-1) -> q#3" in nodes


def test_map_of_a_lambda_over_chunks_runs_the_lambda_per_name():
    nodes = [n for p in paths(src(GENEXP), "HeadsMap") for n in p]
    assert sum(n.startswith("einops.rearrange(item, 'b n (h d) -> b h n d'") for n in nodes) == 3
    assert "torch.Tensor.softmax(q#1, dim=-1) -> q#2" in nodes


def test_list_comprehension_and_variable_does_not_leak():
    fs = src(HEADER + """
def f(a, b, t):
    a, b = [u.float() for u in (a, b)]
    return t.relu()
""")
    (p,) = fn(fs, None, "f").paths
    from tests.analysis.test_extract import fmt

    assert [fmt(n) for n in p.nodes] == [
        "torch.Tensor.float(a) -> tmp_1", "torch.Tensor.float(b) -> tmp_2", "torch.Tensor.relu(t) -> tmp_3"]


@pytest.mark.parametrize("stmt", [
    "a, b = (u.float() for u in (x, y, z))",  # 3 elements into 2 names: Python raises
    "a, b = (u.float() for u in (x, y) if u is not None)",  # a filter: which element is which is unknown
    "a, *b = (u.float() for u in (x, y))",
])
def test_other_unpackings_stay_unknown(stmt):
    fs = src(HEADER + f"""
def f(x, y, z):
    {stmt}
    return a.softmax(-1)
""")
    nodes = [n for p in fn(fs, None, "f").paths for n in p.nodes]
    # the comprehension read once, as a loop body; ``a`` no value the code computed
    assert sum(getattr(n, "type", "") == "torch.Tensor.float" for n in nodes) == 1
    assert not any(isinstance(arg.value, Var) and arg.value.name == "a" for n in nodes for arg in n.args)


def test_softmax_after_unpacking_is_matched():
    assert _static(textwrap.dedent(GENEXP), "softmax") == {c: [line] for c, line in SOFTMAX_LINES.items()}


def _module(text: str, name: str):
    mod = types.ModuleType(name)
    exec(compile(text, f"/tmp/{name}.py", "exec"), mod.__dict__)
    return mod


@pytest.mark.parametrize("cls_name", sorted(SOFTMAX_LINES))
@pytest.mark.parametrize("train", [True, False])
def test_rewritten_softmax_after_unpacking_trains_equal(cls_name, train):
    from adopter.rewrite import rewrite_source

    text = textwrap.dedent(GENEXP)
    ms = scan_source(text, "/tmp/unpacking_case.py", all_rules())
    res = rewrite_source(text, ms, filename="/tmp/unpacking_case.py")
    line = SOFTMAX_LINES[cls_name]
    assert any(o.applied and o.match.rule == "softmax" and o.match.lines[0] == line for o in res.outcomes)
    ref_mod, new_mod = _module(text, "unpacking_ref"), _module(res.new_text, "unpacking_new")
    torch.manual_seed(0)
    ref = getattr(ref_mod, cls_name)(8)
    new = getattr(new_mod, cls_name)(8)
    new.load_state_dict(ref.state_dict())
    ref.train(train)
    new.train(train)
    x = torch.randn(2, 5, 8)
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_new = ref(xr), new(xn)
    torch.testing.assert_close(out_new, out_ref, rtol=1e-5, atol=1e-6)
    out_ref.square().sum().backward()
    out_new.square().sum().backward()
    torch.testing.assert_close(xn.grad, xr.grad, rtol=1e-4, atol=1e-6)
    for (name, p), (_, q) in zip(ref.named_parameters(), new.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_map_of_a_named_function_over_a_literal_tuple():
    fs = src(HEADER + """
import torch.nn.functional as F

def l2norm(t):
    return F.normalize(t, dim=-1)

def f(q, k):
    q, k = map(l2norm, (q, k))
    return q.softmax(-1), k
""")
    nodes = [n for p in fn(fs, None, "f").paths for n in p.nodes]
    normalized = [n for n in nodes if getattr(n, "type", "") == "torch.nn.functional.normalize"]
    assert [str(n.args[0].value) for n in normalized] == ["q", "k"]
    assert len({n.output for n in normalized}) == 2
    (soft,) = [n for n in nodes if getattr(n, "type", "") == "torch.Tensor.softmax"]
    assert isinstance(soft.args[0].value, Var) and soft.args[0].value.name == "q"


def test_a_display_of_another_length_stays_unknown():
    fs = src(HEADER + """
def f(x, y, z):
    xs = [x, y]
    xs.append(z)
    a, b, c = (u.float() for u in xs)
    return a.softmax(-1)
""")
    nodes = [n for p in fn(fs, None, "f").paths for n in p.nodes]
    assert sum(getattr(n, "type", "") == "torch.Tensor.float" for n in nodes) == 1
    assert not any(isinstance(arg.value, Var) and arg.value.name == "a" for n in nodes for arg in n.args)


def test_the_iterable_is_evaluated_once_and_its_nodes_kept():
    fs = src(HEADER + """
class M(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.to_qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = [t.float() for t in self.to_qkv(x).chunk(3, dim=-1)]
        return q
""")
    nodes = paths(fs, "M")[0]
    assert nodes[:2] == ["torch.nn.Linear@self.to_qkv(x) -> tmp_1", "torch.Tensor.chunk(tmp_1, 3, dim=-1) -> tmp_2"]
    assert [n.split("(")[0] for n in nodes[2:]] == ["torch.Tensor.float"] * 3


def test_a_returned_tuple_of_another_length_is_evaluated_once():
    fs = src(HEADER + """
def three(x):
    return x.relu(), x.tanh(), x.sigmoid()

def f(x):
    a, b = (u.float() for u in three(x))
    return a
""")
    nodes = [n for p in fn(fs, None, "f").paths for n in p.nodes]
    assert [n.type for n in nodes] == ["torch.Tensor.relu", "torch.Tensor.tanh", "torch.Tensor.sigmoid"]
