"""functools.partial resolved statically (extract/partials.py, issue 35): a call through a partial is
the bound function's node, with the bound arguments merged as functools merges them."""
import ast

from adopter.core.dsl import Layer
from adopter.core.extract import extract_source
from adopter.core.extract.partials import unwrap

SOURCE = '''
from functools import partial
import torch
import torch.nn.functional as F
from torch import nn

first = partial(torch.clamp, min=0.0)
both = partial(first, max=1.0, min=-1.0)


class M(nn.Module):
    def __init__(self, bound=partial(torch.clamp, max=2.0)):
        super().__init__()
        self.nested = partial(partial(F.softmax, dim=-1), dtype=torch.float32)
        self.positional = partial(torch.transpose, dim0=1)
        self.bound = bound
        self.reassigned = partial(F.softmax, dim=-1)
        self.reassigned = partial(F.softmax, dim=0)

    def forward(self, x):
        a = self.nested(x, dim=1)
        b = self.positional(a, dim1=2)
        c = both(b)
        d = self.bound(c)
        return self.reassigned(d)
'''


def _calls():
    fs = extract_source(SOURCE, "m.py")
    fn = next(f for f in fs.functions if f.function == "forward")
    return [n for n in fn.paths[0].nodes if isinstance(n, Layer)]


def _kw(node):
    return {a.keyword: a.value.text for a in node.args if a.keyword}


def test_calls_through_partials_are_the_bound_functions_with_arguments_merged():
    nested, positional, both, bound, reassigned = _calls()
    assert nested.type == "torch.nn.functional.softmax"
    assert _kw(nested) == {"dim": "1", "dtype": "torch.float32"}  # the call's keyword wins
    assert nested.bound is not None and (nested.bound.line, nested.bound.col) == (14, 38)
    assert positional.type == "torch.transpose" and _kw(positional) == {"dim0": "1", "dim1": "2"}
    assert both.type == "torch.clamp" and _kw(both) == {"min": "-1.0", "max": "1.0"}  # outer overrides inner
    assert bound.type == "torch.clamp" and _kw(bound) == {"max": "2.0"}  # a parameter's default
    # an attribute assigned two different partials holds no one of them
    assert reassigned.type != "torch.nn.functional.softmax" and reassigned.bound is None


def test_unwrap_keeps_positional_order_and_refuses_what_it_cannot_settle():
    fqn = {"partial": "functools.partial"}.get
    bound = unwrap(ast.parse("partial(partial(f, a, k=1), b, k=2)", mode="eval").body, lambda d: fqn(d))
    assert ast.unparse(bound.func) == "f" and [ast.unparse(a) for a in bound.args] == ["a", "b"]
    assert [(k, ast.unparse(v)) for k, v in bound.keywords] == [("k", "2")]
    assert unwrap(ast.parse("partial(f, *args)", mode="eval").body, lambda d: fqn(d)) is None
    assert unwrap(ast.parse("partial(f, **kw)", mode="eval").body, lambda d: fqn(d)) is None
    assert unwrap(ast.parse("f(x)", mode="eval").body, lambda d: fqn(d)) is None
