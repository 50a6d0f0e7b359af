"""Model-structure extraction (adopter.core.extract): paper §3.2 examples and the issue's cases."""

from __future__ import annotations

import glob
import os
import textwrap
import time
from pathlib import Path

import pytest

from adopter.core.dsl import Const, Layer, TensorOp, Var
from adopter.core.extract import (
    ATTENTION_TABLE_TYPE,
    MAX_PATHS,
    UNKNOWN_TYPE,
    extract_file,
    extract_source,
    format_structure,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "extract"


def fmt(n) -> str:
    """Compact, printer-independent text of a node."""
    args = ", ".join(str(a) for a in n.args)
    if isinstance(n, Layer):
        mod = f"@{n.module}" if n.module is not None else ""
        return f"{n.type}{mod}({args}) -> {n.output}"
    if len(n.args) == 2:
        return f"{n.args[0]} {n.op} {n.args[1]} -> {n.output}"
    return f"{n.op} {args} -> {n.output}"


def fn(fs, class_name, function="forward"):
    (f,) = [f for f in fs.functions if f.class_name == class_name and f.function == function]
    return f


def paths(fs, class_name, function="forward"):
    return [[fmt(n) for n in p.nodes] for p in fn(fs, class_name, function).paths]


def cls(fs, name):
    (c,) = [c for c in fs.classes if c.name == name]
    return c


def src(code: str, filename: str = "<string>"):
    return extract_source(textwrap.dedent(code), filename)


# ---------------------------------------------------------------- paper examples


def test_fig1_bert_self_output():
    fs = extract_file(FIXTURES / "bert_self_output.py")
    c = cls(fs, "BertSelfOutput")
    assert c.is_module and c.bases == ("torch.nn.Module",)
    inits = {b.attr: b for b in c.init_bindings}
    assert inits["self.dense"].layer.type == "torch.nn.Linear"
    assert inits["self.LayerNorm"].layer.type == "torch.nn.LayerNorm"
    assert [str(a) for a in inits["self.LayerNorm"].layer.args] == ["config.hidden_size", "eps=config.layer_norm_eps"]
    assert inits["self.dropout"].layer.output == Var("self.dropout")
    assert not any(b.conditional for b in c.init_bindings)
    assert paths(fs, "BertSelfOutput") == [
        [
            "torch.nn.Linear@self.dense(hidden_states) -> hidden_states#1",
            "torch.nn.Dropout@self.dropout(hidden_states#1) -> hidden_states#2",
            "hidden_states#2 + input_tensor -> tmp_1",
            "torch.nn.LayerNorm@self.LayerNorm(tmp_1) -> hidden_states#3",
        ]
    ]


def test_fig1_spans_are_exact():
    fs = extract_file(FIXTURES / "bert_self_output.py")
    nodes = fn(fs, "BertSelfOutput").paths[0].nodes
    dense, drop, add, ln = nodes
    # hidden_states = self.dense(hidden_states)   (line 14, call starts at col 24)
    assert (dense.span.line, dense.span.col, dense.span.end_line, dense.span.end_col) == (14, 24, 14, 49)
    assert dense.span.function == "BertSelfOutput.forward"
    assert (dense.span.stmt_line, dense.span.stmt_end_line) == (14, 14)
    assert (drop.span.line, drop.span.col) == (15, 24)
    # the binop inside the call: self.LayerNorm(hidden_states + input_tensor)
    assert (add.span.line, add.span.col, add.span.end_col) == (16, 39, 67)
    assert (ln.span.line, ln.span.col, ln.span.end_col) == (16, 24, 68)
    init = {b.attr: b for b in cls(fs, "BertSelfOutput").init_bindings}
    sp = init["self.LayerNorm"].span
    assert (sp.line, sp.col, sp.function, sp.stmt_line) == (10, 25, "BertSelfOutput.__init__", 10)


def test_fig3_dpt_both_paths():
    fs = extract_file(FIXTURES / "dpt_preact.py")
    c = cls(fs, "DPTPreActResidualLayer")
    cond = {b.attr: b.conditional for b in c.init_bindings}
    assert cond["self.batch_norm1"] and cond["self.batch_norm2"] and not cond["self.convolution1"]
    types = sorted(
        [[n.type for n in p.nodes if isinstance(n, Layer)] for p in fn(fs, "DPTPreActResidualLayer").paths]
    )
    # the same condition guards both BatchNorms: 2 paths, not 4
    assert types == [
        ["torch.nn.ReLU", "torch.nn.Conv2d", "torch.nn.BatchNorm2d", "torch.nn.ReLU", "torch.nn.Conv2d",
         "torch.nn.BatchNorm2d"],
        ["torch.nn.ReLU", "torch.nn.Conv2d", "torch.nn.ReLU", "torch.nn.Conv2d"],
    ]


def test_nested_call_is_unchained():
    fs = src(
        """
        from torch import nn
        class Out(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.dropout = nn.Dropout(config.hidden_dropout_prob)
                self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            def forward(self, hidden_states, input_tensor):
                hidden_states = self.layer_norm(self.dropout(hidden_states) + input_tensor)
                return hidden_states
        """
    )
    assert paths(fs, "Out") == [
        [
            "torch.nn.Dropout@self.dropout(hidden_states) -> tmp_1",
            "tmp_1 + input_tensor -> tmp_2",
            "torch.nn.LayerNorm@self.layer_norm(tmp_2) -> hidden_states#1",
        ]
    ]


def test_method_chain_and_tensor_ops():
    fs = src(
        """
        import math
        import torch
        from torch import nn
        class Attn(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.query = nn.Linear(4, 4)
            def forward(self, h, k):
                q = self.query(h).view(2, -1).transpose(1, 2)
                s = q @ k.transpose(-1, -2)
                s = s / math.sqrt(self.head_dim)
                p = torch.matmul(s, k)
                return -p
        """
    )
    assert paths(fs, "Attn") == [
        [
            "torch.nn.Linear@self.query(h) -> tmp_1",
            "torch.Tensor.view(tmp_1, 2, -1) -> tmp_2",
            "torch.Tensor.transpose(tmp_2, 1, 2) -> q#1",
            "torch.Tensor.transpose(k, -1, -2) -> tmp_3",
            "q#1 @ tmp_3 -> s#1",
            "s#1 / math.sqrt(self.head_dim) -> s#2",
            "torch.matmul(s#2, k) -> p#1",
            "- p#1 -> tmp_4",
        ]
    ]
    div = fn(fs, "Attn").paths[0].nodes[5]
    assert isinstance(div, TensorOp) and div.args[1].value == Const("math.sqrt(self.head_dim)")


@pytest.mark.parametrize(
    "imports, call, expected",
    [
        ("from torch import nn", "nn.functional.softmax(x, dim=-1)", "torch.nn.functional.softmax"),
        ("import torch.nn.functional as F", "F.softmax(x, dim=-1)", "torch.nn.functional.softmax"),
        ("from torch.nn import functional as F", "F.softmax(x, dim=-1)", "torch.nn.functional.softmax"),
        ("import torch", "torch.nn.functional.softmax(x, dim=-1)", "torch.nn.functional.softmax"),
        ("from torch.nn.functional import softmax as sm", "sm(x, dim=-1)", "torch.nn.functional.softmax"),
        ("import torch", "torch.softmax(x, dim=-1)", "torch.softmax"),
        ("import torch", "x.softmax(-1)", "torch.Tensor.softmax"),
        ("import torch", "x.float().softmax(-1)", "torch.Tensor.softmax"),
    ],
)
def test_softmax_alias_spellings(imports, call, expected):
    fs = src(f"{imports}\ndef f(x):\n    y = {call}\n    return y\n")
    (p,) = fn(fs, None, "f").paths
    assert p.nodes[-1].type == expected
    assert p.nodes[-1].output == Var("y", 1)
    assert Var("x") in [a.value for a in p.nodes[0].args]


def test_softmax_module_and_assignment_alias():
    fs = src(
        """
        import torch.nn as nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.softmax = nn.Softmax(dim=-1)
                self.LayerNorm = nn.LayerNorm(8)
            def forward(self, x):
                ln = self.LayerNorm
                x = ln(x)
                return self.softmax(x)
        """
    )
    assert paths(fs, "M") == [
        ["torch.nn.LayerNorm@self.LayerNorm(x) -> x#1", "torch.nn.Softmax@self.softmax(x#1) -> tmp_1"]
    ]


def test_extraneous_statements_dropped():
    fs = src(
        """
        import logging, warnings
        from torch import nn
        logger = logging.getLogger(__name__)
        class M(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.dropout = nn.Dropout(0.1)
                self.LayerNorm = nn.LayerNorm(8)
            def forward(self, h, x):
                h = self.dropout(h)
                print("dropout done", h.shape)
                logger.info("x")
                logger.warning_once("y")
                warnings.warn("deprecated")
                assert h.dim() == 3
                if h.shape[0] == 0:
                    raise ValueError("empty")
                n = h.size(-1)
                h = self.LayerNorm(h + x)
                return h
        """
    )
    assert paths(fs, "M") == [
        [
            "torch.nn.Dropout@self.dropout(h) -> h#1",
            "h#1 + x -> tmp_1",
            "torch.nn.LayerNorm@self.LayerNorm(tmp_1) -> h#2",
        ]
    ]


def test_ssa_breaks_unrelated_reuse():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.dropout = nn.Dropout(0.1)
                self.LayerNorm = nn.LayerNorm(8)
            def forward(self, h, x, other):
                y = self.dropout(h)
                y = other.flip(0)
                return self.LayerNorm(y + x)
        """
    )
    (p,) = fn(fs, "M").paths
    drop, flip, add, ln = p.nodes
    assert ln.type == "torch.nn.LayerNorm" and ln.args[0].value == add.output
    assert drop.output == Var("y", 1)
    assert flip.output == Var("y", 2)
    assert add.args[0].value == Var("y", 2)  # not the dropout's output


def test_branch_without_dl_node_does_not_fork():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.dense = nn.Linear(8, 8)
            def forward(self, x, flag: bool):
                if flag:
                    scale = 1.0
                else:
                    scale = 2.0
                for i in range(3):
                    n = i * 2
                try:
                    k = int(flag)
                except ValueError:
                    k = 0
                y = self.dense(x) * scale
                return y
        """
    )
    f = fn(fs, "M")
    assert len(f.paths) == 1
    assert [fmt(n) for n in f.paths[0].nodes] == ["torch.nn.Linear@self.dense(x) -> tmp_1", "tmp_1 * scale#3 -> y#1"]


def test_branches_with_nodes_fork_and_early_return():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(8, 8)
                self.b = nn.ReLU()
                self.c = nn.Tanh()
            def forward(self, x, mode):
                if mode is None:
                    return x
                x = self.a(x)
                if mode == 1:
                    x = self.b(x)
                elif mode == 2:
                    x = self.c(x)
                y = x if mode else self.b(x)
                return y
        """
    )
    got = sorted(tuple(n.type.split(".")[-1] for n in p.nodes) for p in fn(fs, "M").paths)
    # 1 (early return) + 3 (if/elif/else) x 2 (conditional expression) paths; a path that is
    # a prefix of another one (early return, ``y = x``) adds no match and is dropped
    assert got == [("Linear", "ReLU"), ("Linear", "ReLU", "ReLU"), ("Linear", "Tanh", "ReLU")]


def test_path_cap():
    body = "\n".join(f"        if c{i}:\n            x = self.act(x)" for i in range(12))
    code = (
        "from torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.act = nn.ReLU()\n"
        f"    def forward(self, x, {', '.join(f'c{i}' for i in range(12))}):\n{body}\n        return x\n"
    )
    f = fn(extract_source(code), "M")
    assert f.capped
    assert 1 < len(f.paths) <= MAX_PATHS


def test_loop_over_module_list_and_sequential():
    fs = src(
        """
        from torch import nn
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                return self.fc(x)
        class Stack(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.layers = nn.ModuleList([Block() for _ in range(n)])
                self.head = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Dropout(0.1))
                self.extra = nn.ModuleList()
                for i in range(n):
                    self.extra.append(nn.Conv2d(4, 4, 3))
            def forward(self, x):
                for i, layer in enumerate(self.layers):
                    x = layer(x)
                x = self.head(x)
                x = self.extra[0](x)
                return x
        """,
        "/tmp/pkg/modeling_toy.py",
    )
    c = cls(fs, "Stack")
    by_container = {b.container: b.layer.type for b in c.init_bindings if b.container}
    assert by_container == {
        "self.layers[*]": "modeling_toy.Block",
        "self.head[0]": "torch.nn.Linear",
        "self.head[1]": "torch.nn.GELU",
        "self.head[2]": "torch.nn.Dropout",
        "self.extra[*]": "torch.nn.Conv2d",
    }
    assert paths(fs, "Stack") == [
        [
            "modeling_toy.Block@self.layers[*](x) -> x#1",
            "torch.nn.Linear@self.head[0](x#1) -> tmp_1",
            "torch.nn.GELU@self.head[1](tmp_1) -> tmp_2",
            "torch.nn.Dropout@self.head[2](tmp_2) -> x#2",
            "torch.nn.Conv2d@self.extra[*](x#2) -> x#3",
        ]
    ]


# ---------------------------------------------------------------- activations


def test_act2fn_resolution():
    fs = src(
        """
        from torch import nn
        from ...activations import ACT2FN, get_activation
        class M(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.a = ACT2FN["gelu"]
                self.b = ACT2FN["gelu_new"]
                self.c = ACT2FN["gelu_pytorch_tanh"]
                self.d = ACT2FN[config.hidden_act]
                self.e = get_activation("silu")
                self.f = nn.GELU()
                self.g = nn.functional.gelu
                if isinstance(config.hidden_act, str):
                    self.h = ACT2FN[config.hidden_act]
                else:
                    self.h = config.hidden_act
            def forward(self, x):
                x = self.a(x)
                x = self.d(x)
                x = self.g(x)
                x = self.h(x)
                return ACT2FN["relu"](x)
        """
    )
    b = {x.attr: x for x in cls(fs, "M").init_bindings}
    assert b["self.a"].layer.type == "torch.nn.GELU" and b["self.a"].activation == "'gelu'"
    assert b["self.b"].layer.type == "transformers.activations.NewGELUActivation"
    assert b["self.c"].layer.type == "transformers.activations.GELUTanh"
    assert b["self.d"].layer.type == "transformers.activations.ACT2FN"
    assert b["self.d"].layer.args[0].value == Const("config.hidden_act")
    assert b["self.e"].layer.type == "torch.nn.SiLU"
    assert b["self.f"].layer.type == "torch.nn.GELU"
    assert b["self.g"].layer.type == "torch.nn.functional.gelu"
    assert b["self.h"].conditional
    assert [n.type for n in fn(fs, "M").paths[0].nodes] == [
        "torch.nn.GELU",
        "transformers.activations.ACT2FN",
        "torch.nn.functional.gelu",
        "transformers.activations.ACT2FN",
        "torch.nn.ReLU",
    ]


def test_inline_act2fn_gelu_is_functional_gelu():
    fs = src('from ...activations import ACT2FN\ndef f(x):\n    return ACT2FN["gelu"](x)\n')
    assert [fmt(n) for n in fn(fs, None, "f").paths[0].nodes] == ["torch.nn.functional.gelu(x) -> tmp_1"]


def test_conditional_bindings_of_different_types_give_path_variants():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self, config):
                super().__init__()
                if config.use_ln:
                    self.norm = nn.LayerNorm(8)
                else:
                    self.norm = nn.BatchNorm1d(8)
            def forward(self, x):
                x = self.norm(x)
                return self.norm(x)
        """
    )
    got = sorted([n.type for n in p.nodes] for p in fn(fs, "M").paths)
    # one variant per type, consistent within a path
    assert got == [["torch.nn.BatchNorm1d"] * 2, ["torch.nn.LayerNorm"] * 2]


# ---------------------------------------------------------------- inter-procedural


def test_interprocedural_method_2023_style():
    fs = src(
        """
        import torch
        from torch import nn
        class SelfAttn(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.query = nn.Linear(8, 8)
                self.key = nn.Linear(8, 8)
                self.dropout = nn.Dropout(0.1)
            def _split_heads(self, x):
                new_shape = x.size()[:-1] + (2, 4)
                x = x.view(new_shape)
                return x.permute(0, 2, 1, 3)
            def forward(self, hidden_states, attention_mask=None):
                q = self._split_heads(self.query(hidden_states))
                k = self._split_heads(self.key(hidden_states))
                scores = torch.matmul(q, k.transpose(-1, -2))
                if attention_mask is not None:
                    scores = scores + attention_mask
                probs = nn.functional.softmax(scores, dim=-1)
                probs = self.dropout(probs)
                return probs
        """
    )
    ps = paths(fs, "SelfAttn")
    assert len(ps) == 2
    full = max(ps, key=len)
    assert full[:3] == [
        "torch.nn.Linear@self.query(hidden_states) -> tmp_1",
        "torch.Tensor.view(tmp_1, new_shape#1) -> x#1",
        # the callee's returned node writes into the caller's target: data flow kept
        "torch.Tensor.permute(x#1, 0, 2, 1, 3) -> q#1",
    ]
    nodes = max(fn(fs, "SelfAttn").paths, key=lambda p: len(p.nodes)).nodes
    view = nodes[1]
    assert view.span.function == "SelfAttn._split_heads"
    assert view.span.line == 12 and view.span.inlined_at == (15,)
    # the two calls of the helper get distinct SSA versions
    assert fmt(nodes[4]) == "torch.Tensor.view(tmp_2, new_shape#2) -> x#2"
    assert fmt(nodes[5]) == "torch.Tensor.permute(x#2, 0, 2, 1, 3) -> k#1"
    assert "torch.Tensor.transpose(k#1, -1, -2) -> tmp_3" in full
    assert "torch.matmul(q#1, tmp_3) -> scores#1" in full
    assert "torch.nn.functional.softmax(scores#2, dim=-1) -> probs#1" in full


def test_interprocedural_alias_to_module_function():
    fs = extract_file(FIXTURES / "eager_attention.py")
    for entry in ("ToySelfAttention", "ToyInterfaceAttention"):
        f = fn(fs, entry)
        # eager with and without the mask add (attention_mask is unknown), plus the dispatch table
        assert len(f.paths) == 3, entry
        eager = [p for p in f.paths if any(n.span.function == "eager_attention_forward" for n in p.nodes)]
        table = [p for p in f.paths if any(getattr(n, "type", "") == ATTENTION_TABLE_TYPE for n in p.nodes)]
        assert len(eager) == 2 and len(table) == 1
        nodes = max(eager, key=lambda p: len(p.nodes)).nodes
        # parameters renamed to the caller's arguments; scaling passed -> `if scaling is None` not taken
        (kt,) = [n for n in nodes if fmt(n).startswith("torch.Tensor.transpose(key_states#1, 2, 3) -> tmp_")]
        (mm,) = [n for n in nodes if fmt(n).startswith("torch.matmul(query_states#1, ")]
        assert mm.args[1].value == kt.output
        (scale,) = [n for n in nodes if isinstance(n, TensorOp) and n.op == "*"]
        assert scale.args[0].value == mm.output and scale.args[1].value == Const("self.scaling")
        (drop,) = [n for n in nodes if isinstance(n, Layer) and n.type == "torch.nn.functional.dropout"]
        assert [str(a) for a in drop.args][1:] == ["p=0.0", "training=module.training"]
        softmaxes = [n for n in nodes if isinstance(n, Layer) and n.type == "torch.nn.functional.softmax"]
        (softmax,) = softmaxes
        assert softmax.span.function == "eager_attention_forward"
        assert (softmax.span.line, softmax.span.col) == (17, 19)
        assert len(softmax.span.inlined_at) == 1
    # the module-level function is an entry of its own, parameters unrenamed
    own = fn(fs, None, "eager_attention_forward")
    assert own.class_name is None
    assert any("torch.matmul(query, tmp_" in fmt(n) for p in own.paths for n in p.nodes)


def test_recursion_is_guarded():
    fs = src(
        """
        from torch import nn
        def f(x, n):
            if n:
                return f(x.relu(), n - 1)
            return x
        class M(nn.Module):
            def forward(self, x):
                return self.forward(x)
        """
    )
    assert fn(fs, None, "f").paths
    assert fn(fs, "M").paths


# ---------------------------------------------------------------- names and imports


def test_relative_imports_and_local_classes():
    code = textwrap.dedent(
        """
        from torch import nn
        from .configuration_bert import BertConfig
        from ...activations import ACT2FN
        class BertSelfOutput(nn.Module):
            pass
        class BertAttention(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.output = BertSelfOutput(config)
            def forward(self, h, x):
                return self.output(h, x)
        """
    )
    inside = extract_source(code, "/x/site-packages/transformers/models/bert/modeling_bert.py")
    assert inside.imports["BertConfig"] == "transformers.models.bert.configuration_bert.BertConfig"
    assert inside.imports["ACT2FN"] == "transformers.activations.ACT2FN"
    assert inside.imports["nn"] == "torch.nn"
    outside = extract_source(code, "/x/project/modeling_bert.py")
    assert outside.imports["BertConfig"] == ".configuration_bert.BertConfig"
    assert outside.imports["ACT2FN"] == "...activations.ACT2FN"
    assert paths(inside, "BertAttention") == [["modeling_bert.BertSelfOutput@self.output(h, x) -> tmp_1"]]


def test_module_detection_through_bases():
    fs = src(
        """
        from torch import nn
        from ...modeling_utils import PreTrainedModel
        from ...modeling_layers import GradientCheckpointingLayer
        class Base(nn.Module):
            pass
        class Child(Base):
            pass
        class Pre(PreTrainedModel):
            pass
        class BertPreTrainedModel(Pre):
            pass
        class Layer(GradientCheckpointingLayer):
            pass
        class NotAModule:
            pass
        """
    )
    mods = {c.name: c.is_module for c in fs.classes}
    assert mods == {"Base": True, "Child": True, "Pre": True, "BertPreTrainedModel": True, "Layer": True,
                    "NotAModule": False}


def test_tuple_unpacking_and_ifexp():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(8, 24)
                self.drop = nn.Dropout(0.1)
            def forward(self, x, train: bool):
                q, k, v = self.qkv(x).chunk(3, dim=-1)
                a, b = q, k
                p = 0.1 if train else 0.0
                y = self.drop(a) if train else a
                return y + b
        """
    )
    ps = paths(fs, "M")
    assert len(ps) == 2
    for p in ps:
        assert p[:2] == ["torch.nn.Linear@self.qkv(x) -> tmp_1", "torch.Tensor.chunk(tmp_1, 3, dim=-1) -> tmp_2"]
    assert "torch.nn.Dropout@self.drop(a#1) -> y#1" in max(ps, key=len)
    assert max(ps, key=len)[-1] == "y#1 + b#1 -> tmp_3"


def test_attr_uses_and_self_attr_versions():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.dense = nn.Linear(8, 8)
                self.unused = nn.Dropout(0.1)
                self.cache = None
            def forward(self, x):
                self.cache = self.dense(x)
                return self.helper(self.cache)
            def helper(self, y):
                return self.dense(y) + y
        """
    )
    uses = cls(fs, "M").attr_uses
    assert uses["self.dense"] == (10, 13)
    assert uses["self.cache"] == (11,)
    assert "self.unused" not in uses
    (p,) = paths(fs, "M")
    assert p == [
        "torch.nn.Linear@self.dense(x) -> self.cache#1",
        "torch.nn.Linear@self.dense(self.cache#1) -> tmp_1",
        "tmp_1 + self.cache#1 -> tmp_2",
    ]


def test_unknown_self_call_is_a_barrier_node():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def forward(self, x):
                return self.block(x)
        """
    )
    (p,) = fn(fs, "M").paths
    assert p.nodes[0].type == UNKNOWN_TYPE and p.nodes[0].module == Var("self.block")


def test_syntax_error_propagates():
    with pytest.raises(SyntaxError):
        extract_source("def f(:\n    pass\n", "bad.py")


def test_format_structure_runs():
    text = format_structure(extract_file(FIXTURES / "eager_attention.py"))
    assert "ToySelfAttention.forward" in text and "eager_attention_forward" in text


# ---------------------------------------------------------------- corpus smoke


def _transformers_models_dir():
    transformers = pytest.importorskip("transformers")
    return os.path.join(os.path.dirname(transformers.__file__), "models")


@pytest.mark.slow
def test_every_transformers_modeling_file_extracts():
    files = sorted(glob.glob(os.path.join(_transformers_models_dir(), "*", "modeling_*.py")))
    assert len(files) > 100
    t0 = time.process_time()
    for path in files:
        fs = extract_file(path)
        assert fs.classes or fs.functions, path
    # generous bound (CPU time, shared machine); the measured figure is in benchmarks/
    assert time.process_time() - t0 < 120


# ---------------------------------------------------------------- more real-code shapes


def test_module_instances_built_in_forward():
    fs = src(
        """
        from torch import nn
        from torch.nn import CrossEntropyLoss
        class Head(nn.Module):
            def forward(self, scores, logits, labels):
                probs = nn.Softmax(dim=-1)(scores)
                loss_fct = CrossEntropyLoss()
                loss = loss_fct(logits, labels)
                return probs, loss
        """
    )
    assert paths(fs, "Head") == [
        ["torch.nn.Softmax(scores) -> probs#1", "torch.nn.CrossEntropyLoss(logits, labels) -> loss#1"]
    ]


def test_loop_targets_through_enumerate_zip():
    fs = src(
        """
        from torch import nn
        class FPN(nn.Module):
            def __init__(self):
                super().__init__()
                self.lateral_convs = nn.ModuleList([nn.Conv2d(4, 4, 1) for _ in range(3)])
                self.fpn_blocks = nn.ModuleList([nn.BatchNorm2d(4) for _ in range(3)])
            def forward(self, feats):
                for idx, (lateral_conv, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
                    x = lateral_conv(feats[idx])
                    x = block(x)
                return x
        """
    )
    # iterating module containers: no zero-trip path
    assert paths(fs, "FPN") == [
        [
            "torch.nn.Conv2d@self.lateral_convs[*](feats[idx]) -> x#1",
            "torch.nn.BatchNorm2d@self.fpn_blocks[*](x#1) -> x#2",
        ]
    ]


def test_staticmethod_nested_def_and_chunking_helper():
    fs = src(
        """
        import torch
        from torch import nn
        from ...pytorch_utils import apply_chunking_to_forward
        class T5Like(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(8, 8)
                self.intermediate = nn.Linear(8, 32)
            @staticmethod
            def _bucket(relative_position, num_buckets=32):
                return torch.abs(relative_position)
            def forward(self, hidden_states, pos):
                def shape(states):
                    return states.view(2, -1, 4).transpose(1, 2)
                q = shape(self.q(hidden_states))
                b = self._bucket(pos)
                return apply_chunking_to_forward(self.ff_chunk, 0, 1, q)
            def ff_chunk(self, x):
                return self.intermediate(x)
        """
    )
    (p,) = paths(fs, "T5Like")
    assert p == [
        "torch.nn.Linear@self.q(hidden_states) -> tmp_1",
        "torch.Tensor.view(tmp_1, 2, -1, 4) -> tmp_2",
        "torch.Tensor.transpose(tmp_2, 1, 2) -> q#1",
        "torch.abs(pos) -> b#1",  # static: the first parameter is not self
        "torch.nn.Linear@self.intermediate(q#1) -> tmp_3",
    ]
    nodes = fn(fs, "T5Like").paths[0].nodes
    assert nodes[1].span.function == "T5Like.forward.shape"
    assert nodes[4].span.function == "T5Like.ff_chunk"


def test_sources_record_copies_and_joins():
    fs = src(
        """
        from torch import nn
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.k = nn.Linear(8, 8)
            def forward(self, h, cache=None):
                key = self.k(h)
                if cache is not None:
                    key = cache.update(key)
                keys = key
                return keys.softmax(-1)
        """
    )
    f = fn(fs, "Attn")
    (p,) = f.paths  # the cache branch holds no DL node: no fork
    lin, sm = p.nodes
    assert lin.output == Var("key", 1)
    joined = sm.args[0].value
    assert joined.name == "keys"
    (copy_of,) = f.sources[joined]
    assert set(f.sources[copy_of]) == {Var("key", 1), Var("key", 2)}


def test_with_and_try_blocks():
    fs = src(
        """
        import torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(8, 8)
                self.b = nn.ReLU()
            def forward(self, x):
                with torch.no_grad():
                    x = self.a(x)
                try:
                    x = self.b(x)
                except RuntimeError:
                    pass
                return x
        """
    )
    got = sorted(tuple(n.type for n in p.nodes) for p in fn(fs, "M").paths)
    # the handler path (Linear only) is a prefix of the try path and is dropped
    assert got == [("torch.nn.Linear", "torch.nn.ReLU")]


def test_super_forward_of_base_in_same_file():
    fs = src(
        """
        from torch import nn
        class Base(nn.Module):
            def __init__(self):
                super().__init__()
                self.dense = nn.Linear(8, 8)
            def forward(self, x):
                return self.dense(x)
        class Child(Base):
            def __init__(self):
                super().__init__()
                self.dropout = nn.Dropout(0.1)
            def forward(self, x):
                x = super().forward(x)
                return self.dropout(x)
        """
    )
    assert paths(fs, "Child") == [
        ["torch.nn.Linear@self.dense(x) -> x#1", "torch.nn.Dropout@self.dropout(x#1) -> tmp_1"]
    ]
    assert fn(fs, "Child").paths[0].nodes[0].span.function == "Base.forward"


def test_bert_self_attention_2023_style():
    fs = extract_file(FIXTURES / "bert_attention_2023.py")
    f = fn(fs, "BertSelfAttention")
    assert not f.capped
    # 4 key/value branches x relative-position or not (x the inner relative_key test) x mask x head_mask
    assert len(f.paths) == 48

    def plain_self_attention(p):
        types = [getattr(n, "type", n.op if isinstance(n, TensorOp) else "") for n in p.nodes]
        return (
            "torch.cat" not in types and "torch.nn.Embedding" not in types and "*" not in types
            and "+" in types and "torch.nn.Linear@self.key(hidden_states) -> tmp_5" in [fmt(n) for n in p.nodes]
        )

    (p,) = [p for p in f.paths if plain_self_attention(p)]
    texts = [fmt(n) for n in p.nodes]
    assert texts[0] == "torch.nn.Linear@self.query(hidden_states) -> mixed_query_layer#1"
    k_lin = texts.index("torch.nn.Linear@self.key(hidden_states) -> tmp_5")
    # the helper's return writes into the caller's target
    assert texts[k_lin + 1:k_lin + 3] == [
        "torch.Tensor.view(tmp_5, new_x_shape#5) -> x#5",
        "torch.Tensor.permute(x#5, 0, 2, 1, 3) -> key_layer#5",
    ]
    tail = texts[-10:]
    assert tail[:4] == [
        "torch.Tensor.transpose(key_layer#5, -1, -2) -> tmp_7",
        "torch.matmul(query_layer#1, tmp_7) -> attention_scores#1",
        "attention_scores#1 / math.sqrt(self.attention_head_size) -> attention_scores#3",
        "attention_scores#3 + attention_mask -> attention_scores#4",
    ]
    assert tail[4:7] == [
        "torch.nn.functional.softmax(attention_scores#4, dim=-1) -> attention_probs#1",
        "torch.nn.Dropout@self.dropout(attention_probs#1) -> attention_probs#2",
        "torch.matmul(attention_probs#2, value_layer#5) -> context_layer#1",
    ]


def test_activation_instances_and_inline_act2fn_key():
    fs = src(
        """
        from torch import nn
        from ...activations import ACT2FN, gelu, gelu_new
        class Head(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config
                self.dense = nn.Linear(8, 8)
                self.act = gelu_new
            def forward(self, x):
                x = gelu(self.dense(x))
                x = self.act(x)
                return ACT2FN[self.config.hidden_act](x)
        """,
        "/x/site-packages/transformers/models/roberta/modeling_roberta.py",
    )
    assert {b.attr: b.layer.type for b in cls(fs, "Head").init_bindings}["self.act"] == (
        "transformers.activations.NewGELUActivation"
    )
    assert paths(fs, "Head") == [
        [
            "torch.nn.Linear@self.dense(x) -> tmp_1",
            # the module-level exact-GELU instance called like a function: nn.functional.gelu
            "torch.nn.functional.gelu(tmp_1) -> x#1",
            "transformers.activations.NewGELUActivation@self.act(x#1) -> x#2",
            "transformers.activations.ACT2FN(x#2, activation=self.config.hidden_act) -> tmp_2",
        ]
    ]


def test_init_helpers_and_sequentials_inside_module_lists():
    fs = src(
        """
        from torch import nn
        from ...activations import ACT2FN
        class Stage(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.projects = nn.ModuleList()
                if config.hybrid:
                    self._init_hybrid(config)
                else:
                    self._init_plain(config)
            def _init_hybrid(self, config):
                for i in range(4):
                    self.projects.append(nn.Sequential(nn.Identity()))
            def _init_plain(self, config):
                for i in range(4):
                    self.projects.append(nn.Sequential(nn.Linear(8, 8), ACT2FN["gelu"]))
            def forward(self, x, i):
                return self.projects[i](x)
        """
    )
    b = [(x.container, x.layer.type, x.span.function) for x in cls(fs, "Stage").init_bindings if x.container]
    assert ("self.projects[*][0]", "torch.nn.Linear", "Stage._init_plain") in b
    assert ("self.projects[*][1]", "torch.nn.GELU", "Stage._init_plain") in b
    assert all(x.conditional for x in cls(fs, "Stage").init_bindings if x.span.function != "Stage.__init__")
    assert sorted(paths(fs, "Stage")) == [
        ["torch.nn.Identity@self.projects[*][0](x) -> tmp_1"],
        ["torch.nn.Linear@self.projects[*][0](x) -> tmp_1", "torch.nn.GELU@self.projects[*][1](tmp_1) -> tmp_2"],
    ]


def test_inplace_tensor_method_rebinds_receiver():
    fs = src(
        """
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.drop = nn.Dropout(0.1)
            def forward(self, scores, mask):
                scores.masked_fill_(mask, -1e4)
                return self.drop(scores)
        """
    )
    assert paths(fs, "M") == [
        [
            "torch.Tensor.masked_fill_(scores, mask, -10000.0) -> tmp_1",
            "torch.nn.Dropout@self.drop(tmp_1) -> tmp_2",
        ]
    ]


def test_comprehension_calls_modules_once():
    fs = src(
        """
        from torch import nn
        class Heads(nn.Module):
            def __init__(self):
                super().__init__()
                self.convs = nn.ModuleList([nn.Conv2d(4, 4, 1) for _ in range(3)])
            def forward(self, feats):
                layer = "not a module"
                outs = [conv(f) for conv, f in zip(self.convs, feats)]
                return outs, layer
        """
    )
    (p,) = fn(fs, "Heads").paths
    (n,) = p.nodes
    assert n.type == "torch.nn.Conv2d" and n.module == Var("self.convs[*]")


def test_torch_base_of_same_file_subclass():
    from adopter.core.extract import torch_base_of

    fs = src(
        """
        from torch import nn
        class DepthwiseConv2d(nn.Conv2d):
            def __init__(self, c):
                super().__init__(c, c, 3, groups=c)
        class Deeper(DepthwiseConv2d):
            pass
        class Custom(nn.Conv2d):
            def forward(self, x):
                return x
        """,
        "/tmp/modeling_toy.py",
    )
    assert torch_base_of(fs, "modeling_toy.DepthwiseConv2d") == "torch.nn.Conv2d"
    assert torch_base_of(fs, "modeling_toy.Deeper") == "torch.nn.Conv2d"
    assert torch_base_of(fs, "modeling_toy.Custom") is None
    assert torch_base_of(fs, "torch.nn.Conv2d") is None


def test_output_is_deterministic_across_hash_seeds():
    import subprocess
    import sys

    code = (
        "import hashlib, sys; from adopter.core.extract import extract_file\n"
        "h = hashlib.sha256()\n"
        "for f in sys.argv[1:]:\n"
        "    fs = extract_file(f)\n"
        "    h.update(repr([(fn.function, [[(n, n.span) for n in p.nodes] for p in fn.paths],"
        " sorted(fn.sources.items(), key=repr)) for fn in fs.functions]).encode())\n"
        "print(h.hexdigest())\n"
    )
    files = [str(FIXTURES / "bert_attention_2023.py"), str(FIXTURES / "eager_attention.py")]
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, env=env, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_unparse_by_source_text_equals_ast_unparse_for_every_expression():
    # _unparse caches ast.unparse by (node type, exact source text) across files; check the
    # source slicing on non-ASCII text, multi-line expressions, f-strings and \r\n newlines.
    import ast as _ast

    from adopter.core.extract import values

    source = (
        'def f(x, config):\n'
        '    s = "héllo wörld" + x  # ünïcode\n'
        '    y = (x +\n'
        '         config.hidden_size * 3)\n'
        '    z = f"{x!r:>{config.w}} {y}"\n'
        '    if x is not None and (y or\n'
        '                          z):\n'
        '        return {"k": [1, 2], **config.d}\n'
        '    return lambda a, *b: a[1:2, ::3]\n'
    )
    for text in (source, source.replace("\n", "\r\n")):
        tree = _ast.parse(text)
        values.SOURCE_LINES[:] = text.encode().splitlines(keepends=True)
        try:
            exprs = [n for n in _ast.walk(tree) if isinstance(n, _ast.expr)]
            assert len(exprs) > 40
            for node in exprs:
                assert values._unparse_by_source(node) == _ast.unparse(node)
        finally:
            values.SOURCE_LINES.clear()


def test_a_statement_after_a_fork_is_one_node_on_every_path():
    # both states the `if` leaves run the softmax: equal nodes, made one object (matching shares
    # its work between paths by identity); no path holds a node twice
    src = textwrap.dedent('''
        import torch
        from torch import nn

        class M(nn.Module):
            def forward(self, x, w, scale=None):
                if scale is not None:
                    x = x * scale
                else:
                    x = x + 1
                y = torch.softmax(w, dim=-1)
                return x * y
    ''')
    paths = fn(extract_source(src, "m.py"), "M").paths
    assert len(paths) == 2
    (a, b) = [p.nodes[1] for p in paths]
    assert fmt(a) == "torch.softmax(w, dim=-1) -> y#1" and a is b
    assert fmt(paths[0].nodes[2]) != fmt(paths[1].nodes[2])  # (x * y reads another x on each path)
    for p in paths:
        assert len({id(n) for n in p.nodes}) == len(p.nodes)
