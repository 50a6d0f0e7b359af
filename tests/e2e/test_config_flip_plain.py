"""The flipped-configuration check of ``optimize()`` on plain configuration objects.

Models outside transformers keep their configuration in a dataclass (nanoGPT's ``GPTConfig``), a
``types.SimpleNamespace`` or a dict, passed positionally or by keyword, or built by the model
itself when none is given. The second equivalence check must flip the values the rewritten code
reads there too (``bias``, ``dropout``) and build the flipped configuration the way such an
object is built. The models below are written for these tests, in the style of those projects.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from adopter.core.dsl import Layer, Span
from adopter.core.structures import Match, MatchedNode
from adopter.optimizing.config_flip import (
    _reads,
    config_fields_read,
    constructor_arguments,
    find_plain_config,
    with_values,
)
from adopter.optimizing.optimize import Pipeline, RewriteOutput, optimize

# nanoGPT style: a dataclass config, a LayerNorm with an optional bias (F.layer_norm), an MLP
# c_fc -> GELU -> c_proj with dropout; the config is optional and built by the model when absent.
DATACLASS_MODEL = '''
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class TinyConfig:
    n_embd: int = 16
    bias: bool = True
    dropout: float = 0.0


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)  # MARK bias_added_after


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        h = self.c_proj(x)
        h = torch.relu(h)  # MARK good
        return self.dropout(h)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class TinyGPT(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        config = config if config is not None else TinyConfig()
        self.config = config
        self.block = Block(config)

    def forward(self, x):
        return self.block(x)
'''

# the same model with a namespace config under ``cfg``
NAMESPACE_MODEL = '''
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NamespaceNet(nn.Module):
    def __init__(self, width, cfg):
        super().__init__()
        self.inp = nn.Linear(width, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        return self.mlp(self.inp(x))
'''

# a dict config, read by subscript and .get
DICT_MODEL = '''
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        n = config["n_embd"]
        self.c_fc = nn.Linear(n, 4 * n, bias=config["bias"])
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n, n, bias=config["bias"])
        self.dropout = nn.Dropout(config.get("dropout", 0.0))

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class DictNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = MLP(config)

    def forward(self, x):
        return self.mlp(x)
'''


def _load(tmp_path: Path, name: str, text: str):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load(tmp_path, request):
    names = []

    def loader(text: str):
        name = f"adopter_flip_plain_{request.node.name.split('[')[0]}_{len(names)}"
        names.append(name)
        return _load(tmp_path, name, text)

    yield loader
    for name in names:
        sys.modules.pop(name, None)


def _x():
    torch.manual_seed(0)
    return torch.randn(2, 5, 16)


def _flips(report) -> dict:
    return {f.field: f.flipped for f in report.flipped}


# ------------------------------------------------------------------- the real rules


def _assert_gelu_checked_under_flips(report, expected: dict):
    assert report.applied_rules == ["biased_GeLU"], report.summary()
    assert report.flipped_equivalence is not None, report.flipped_note
    assert report.flipped_equivalence.equivalent, report.flipped_equivalence.summary()
    assert _flips(report) == expected
    gelu = report.applied[0]
    # the rewritten site ran in the flipped configuration's check too
    assert sum(gelu.kernel_calls["flipped"].values()) > 0, gelu.kernel_calls


def test_dataclass_config_passed_positionally_is_flipped(load):
    module = load(DATACLASS_MODEL)
    config = module.TinyConfig(bias=True, dropout=0.1)
    Optimized = optimize(module.TinyGPT, rules=["biased_GeLU"], config=config, example_inputs=(_x(),))
    _assert_gelu_checked_under_flips(Optimized.adopter_report, {"bias": False, "dropout": 0.0})
    assert config == module.TinyConfig(bias=True, dropout=0.1)  # the user's config is never changed


def test_dataclass_config_the_model_builds_itself_is_passed_back_by_keyword(load):
    # nanoGPT's GPT(config=None): built without arguments, the instance's config is flipped
    module = load(DATACLASS_MODEL)
    Optimized = optimize(module.TinyGPT, rules=["biased_GeLU"], example_inputs=(_x(),))
    _assert_gelu_checked_under_flips(Optimized.adopter_report, {"bias": False, "dropout": 0.1})


def test_namespace_config_passed_by_keyword_is_flipped(load):
    module = load(NAMESPACE_MODEL)
    cfg = types.SimpleNamespace(n_embd=16, bias=True, dropout=0.0)
    Optimized = optimize(module.NamespaceNet, rules=["biased_GeLU"], init_args=(16,), init_kwargs={"cfg": cfg},
                         example_inputs=(_x(),))
    _assert_gelu_checked_under_flips(Optimized.adopter_report, {"bias": False, "dropout": 0.1})
    assert cfg == types.SimpleNamespace(n_embd=16, bias=True, dropout=0.0)


def test_dict_config_passed_positionally_is_flipped(load):
    module = load(DICT_MODEL)
    config = {"n_embd": 16, "bias": False, "dropout": 0.1}
    Optimized = optimize(module.DictNet, rules=["biased_GeLU"], init_args=(config,), example_inputs=(_x(),))
    _assert_gelu_checked_under_flips(Optimized.adopter_report, {"bias": True, "dropout": 0.0})
    assert config == {"n_embd": 16, "bias": False, "dropout": 0.1}


# ------------------------------------------------------------------- a rewrite right only for the analysed config

# Stand-in rewrites (the pipeline is replaceable): "good" is right for every configuration;
# "bias_added_after" moves the LayerNorm bias out of F.layer_norm (y = norm(x) * w + b, so the same
# numbers while the bias exists) but does not guard it: with bias=False, ``+ None`` fails.
EDITS = {
    "good": ("torch.relu(h)", "torch.clamp(h, min=0.0)"),
    "bias_added_after": ("self.weight, self.bias, 1e-5)", "self.weight, None, 1e-5) + self.bias"),
}


def _enclosing_class(tree: ast.Module, line: int) -> str | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.lineno <= line <= node.end_lineno:
            return node.name
    return None


def _marked_scan(files, rules):
    wanted = {r.name for r in rules}
    matches = []
    for path in files:
        text = Path(path).read_text()
        tree = ast.parse(text)
        for number, line in enumerate(text.splitlines(), 1):
            mark = line.split("# MARK ")[1].strip() if "# MARK " in line else None
            if mark in wanted:
                span = Span(number, 0, number, len(line), "forward", number, number)
                matches.append(Match(mark, path, _enclosing_class(tree, number), "forward",
                                     (MatchedNode(0, Layer(type="marked", span=span)),)))
    return matches, []


def _confirm_all(model, inputs, matches, rules=()):
    return [replace(m, status="confirmed") for m in matches]


def _edit(text, matches, filename, rules=()):
    lines = text.splitlines(keepends=True)
    applied = []
    for m in matches:
        old, new = EDITS[m.rule]
        if old in lines[m.lines[0] - 1]:
            lines[m.lines[0] - 1] = lines[m.lines[0] - 1].replace(old, new)
            applied.append(m)
    return RewriteOutput("".join(lines), applied, [], f"--- {filename}\n+++ {filename}\n")


MARKED = Pipeline(scan=_marked_scan, confirm=_confirm_all, rewrite=_edit)


def _stand_in(*names):
    return [types.SimpleNamespace(name=n) for n in names]


def test_rewrite_wrong_under_the_flipped_dataclass_config_is_dropped(load):
    module = load(DATACLASS_MODEL)
    Optimized = optimize(module.TinyGPT, rules=_stand_in("good", "bias_added_after"),
                         config=module.TinyConfig(bias=True), example_inputs=(_x(),), pipeline=MARKED)
    report = Optimized.adopter_report
    # LayerNorm takes (ndim, bias), no config: its bias comes from Block's LayerNorm(config.n_embd, bias=config.bias)
    assert _flips(report)["bias"] is False
    # equivalent on the analysed config, so only the flipped check can have dropped it
    dropped = [s for s in report.skipped if s.rule == "bias_added_after"]
    assert len(dropped) == 1 and "not equivalent under the flipped config (" in dropped[0].reason, report.summary()
    assert "bias=False" in dropped[0].reason
    assert report.applied_rules == ["good"]
    assert report.flipped_equivalence is not None and report.flipped_equivalence.equivalent


def test_the_same_rewrite_is_kept_when_nothing_reads_a_flippable_value(load):
    # control: without the flipped check's bias=False the unguarded rewrite is equivalent (so the
    # test above fails for the flip, not for the rewrite itself)
    module = load(DATACLASS_MODEL.replace("bias: bool = True", "bias: str = 'yes'"))
    Optimized = optimize(module.TinyGPT, rules=_stand_in("bias_added_after"),
                         config=module.TinyConfig(), example_inputs=(_x(),), pipeline=MARKED)
    report = Optimized.adopter_report
    assert report.applied_rules == ["bias_added_after"], report.summary()
    assert "bias" not in _flips(report)


def test_model_without_any_config_says_so(load):
    module = load(NAMESPACE_MODEL + '''

class NoConfig(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inp = nn.Linear(width, width)

    def forward(self, x):
        h = self.inp(x)
        return torch.relu(h)  # MARK good
''')
    Optimized = optimize(module.NoConfig, rules=_stand_in("good"), init_args=(16,), example_inputs=(_x(),),
                         pipeline=MARKED)
    report = Optimized.adopter_report
    assert report.applied_rules == ["good"]
    assert report.flipped == [] and report.flipped_note.startswith("no configuration to flip")


# ------------------------------------------------------------------- units


def test_reads_of_dict_configs_and_of_a_named_parameter():
    tree = ast.parse("def f(config, params):\n"
                     "    a = config['bias']\n    b = config.get('dropout', 0.0)\n    c = params.eps\n"
                     "    d = getattr(cfg, 'act', None)\n    e = other['x']\n")
    assert _reads(tree) - {"get"} == {"bias", "dropout", "act"}
    assert "eps" in _reads(tree, ("config", "cfg", "params"))


def test_config_fields_read_follows_the_constructor_call(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(DATACLASS_MODEL)
    m = Match("r", str(path), "LayerNorm", "forward", ())
    assert config_fields_read({str(path.resolve()): DATACLASS_MODEL}, [m]) == {"n_embd", "bias"}


def test_with_values_builds_each_kind_without_touching_the_original():
    @dataclasses.dataclass
    class Cfg:
        bias: bool = True
        width: int = 4
        derived: int = dataclasses.field(init=False, default=0)

        def __post_init__(self):
            self.derived = self.width * (2 if self.bias else 1)

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        bias: bool = True
        scale: float = dataclasses.field(init=False, default=1.0)

    cfg = Cfg()
    flipped = with_values(cfg, {"bias": False})
    assert (flipped.bias, flipped.derived, cfg.bias, cfg.derived) == (False, 4, True, 8)  # __post_init__ ran again
    frozen = Frozen()
    assert with_values(frozen, {"bias": False}).bias is False and frozen.bias is True
    assert with_values(frozen, {"scale": 2.0}).scale == 2.0 and frozen.scale == 1.0  # init=False: copy + set
    ns = types.SimpleNamespace(bias=True)
    assert with_values(ns, {"bias": False}) == types.SimpleNamespace(bias=False) and ns.bias is True
    d = {"bias": True}
    assert with_values(d, {"bias": False}) == {"bias": False} and d == {"bias": True}


def test_find_plain_config_locations():
    class Net(torch.nn.Module):
        def __init__(self, width, config=None, *, extra=None):
            super().__init__()
            self.config = config or types.SimpleNamespace(bias=True)

    ns = types.SimpleNamespace(bias=False)
    found = find_plain_config(Net, Net(4, ns), (4, ns), {})
    assert (found.index, found.parameter) == (1, "config")
    found = find_plain_config(Net, Net(4, config=ns), (4,), {"config": ns})
    assert (found.index, found.keyword) == (None, "config")
    # built without one: the instance's own, passed back by keyword
    found = find_plain_config(Net, Net(4), (4,), {})
    assert found.keyword == "config" and found.arguments({"bias": False}) == ((4,), {"config": types.SimpleNamespace(bias=False)})
    # a dict is a config only first or under a config-like keyword; other dicts are left alone
    assert find_plain_config(Net, torch.nn.Identity(), (4,), {"extra": {"bias": True}}) is None
    assert constructor_arguments(Net, ns, (), None) == ((ns,), {})
    assert constructor_arguments(Net, {"width": 4}, (), None) == ((), {"width": 4})
