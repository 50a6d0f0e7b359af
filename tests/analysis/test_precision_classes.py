"""Precision classes (issue 11, point 3): a match the pattern fits but whose kernel is not
provably applicable is reported ``conditional`` (with its condition) or ``refused`` (with a code
and a reason), never as a plain ``static`` match; each class next to its positive twin, which
stays a plain match. Conditional and refused matches are never rewritten; a trace settles a
conditional one (confirmed or rejected) and leaves a refused one as it is."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest

from adopter.core.rules import all_rules
from adopter.core.scan import scan_paths, scan_source
from adopter.core.structures import PRECISION_CODES

HEADER = """\
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN, get_activation
"""


def scan(tmp_path, body: str, name: str = "modeling_toy.py", config: str | None = None):
    """Every match of all rules in ``HEADER + body`` written to ``tmp_path/name`` (a
    ``configuration_toy.py`` beside it when ``config`` is given), refused ones included."""
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    if config is not None:
        (tmp_path / "configuration_toy.py").write_text(textwrap.dedent(config))
    report = scan_paths([path], all_rules(), jobs=1)
    assert report.errors == []
    return report.matches


def by_class(matches, rule: str) -> dict:
    return {m.class_name or m.function: m for m in matches if m.rule == rule}


def test_codes_are_documented():
    assert set(PRECISION_CODES) == {"needs-config", "dim-not-last", "not-a-layernorm", "branch-straddle",
                                    "torchscript", "norm-variant", "logits-transformed", "logits-read",
                                    "method-divergence", "probs-read", "probs-dtype"}
    assert all(PRECISION_CODES.values())


# ---------------------------------------------------------------- needs-config


ACTIVATIONS = """
class NoConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.act(self.dense(x))


class FromParameter(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = get_activation(name)

    def forward(self, x):
        return self.act(self.dense(x))


class KeyChoice(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = ACT2FN["gelu" if config.smooth else "relu"]

    def forward(self, x):
        return self.act(self.dense(x))


class ModuleChoice(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = nn.GELU() if config.smooth else nn.ReLU()

    def forward(self, x):
        return self.act(self.dense(x))


class BothGelu(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = ACT2FN["gelu" if config.smooth else "gelu_new"]

    def forward(self, x):
        return self.act(self.dense(x))


class ConstantKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = ACT2FN["gelu"]

    def forward(self, x):
        return self.act(self.dense(x))
"""


def test_activation_keys_not_resolvable_statically_are_conditional(tmp_path):
    got = by_class(scan(tmp_path, ACTIVATIONS), "biased_GeLU")
    for name in ("NoConfig", "FromParameter", "KeyChoice", "ModuleChoice"):
        assert (got[name].status, got[name].code) == ("conditional", "needs-config"), name
    assert got["NoConfig"].condition.startswith("GeLU only if config.hidden_act in {'gelu'")
    assert "no configuration default resolves it" in got["NoConfig"].condition
    assert got["FromParameter"].condition.startswith("GeLU only if name in")
    assert got["KeyChoice"].condition.startswith("GeLU only if config.smooth")
    assert got["ModuleChoice"].condition == "self.act is nn.GELU only if config.smooth"
    # positive twins: every possible key is a GeLU
    for name in ("BothGelu", "ConstantKey"):
        assert (got[name].status, got[name].code, got[name].condition) == ("static", "", ""), name


CONFIG = """
class ToyConfig:
    def __init__(self, hidden_act="gelu", smooth=True, norm_type="layer_norm"):
        self.hidden_act = hidden_act
        self.smooth = smooth
"""


def test_configuration_defaults_settle_the_key_and_the_branch(tmp_path):
    got = by_class(scan(tmp_path, ACTIVATIONS, config=CONFIG), "biased_GeLU")
    assert got["NoConfig"].status == "static"  # hidden_act defaults to "gelu"
    assert got["ModuleChoice"].status == "static"  # smooth defaults to True: nn.GELU
    assert got["FromParameter"].status == "conditional"  # a parameter no caller in the file sets


def test_configuration_default_selecting_another_layer_is_conditional(tmp_path):
    """Defaults that pick the other layer do not make the site disappear: another configuration
    runs it, so it stays a site, conditional (not a plain match), for a trace to settle."""
    config = CONFIG.replace("smooth=True", "smooth=False")
    got = by_class(scan(tmp_path, ACTIVATIONS, config=config), "biased_GeLU")
    assert got["ModuleChoice"].status == "conditional"
    assert got["ModuleChoice"].code == "needs-config"
    assert "false under the configuration defaults" in got["ModuleChoice"].condition


FACTORY = """
def get_activation_fn(activation):
    if activation == "relu":
        return F.relu
    elif activation == "gelu":
        return F.gelu
    else:
        raise RuntimeError(activation)


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.activation_fn = get_activation_fn(config.hidden_act)

    def forward(self, x):
        return self.activation_fn(self.fc1(x))


class Chosen(nn.Module):
    def __init__(self, activation_fn: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.activation_fn = get_activation_fn(activation_fn)

    def forward(self, x):
        return self.activation_fn(self.fc1(x))


class Built(nn.Module):
    def __init__(self, activation_fn: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.activation_fn = get_activation_fn(activation_fn)

    def forward(self, x):
        return self.activation_fn(self.fc1(x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Built() for _ in range(2)])
"""


def test_an_in_file_factory_is_followed_for_a_key_settled_statically(tmp_path):
    got = by_class(scan(tmp_path, FACTORY, config=CONFIG), "biased_GeLU")
    assert got["Layer"].status == "static"  # config.hidden_act defaults to "gelu": F.gelu
    # a constructor parameter: the default settles it where the file builds the class without
    # passing it (Built); a class the file never builds is the caller's choice (Chosen)
    assert got["Built"].status == "static"
    assert (got["Chosen"].status, got["Chosen"].code) == ("conditional", "needs-config")
    relu = tmp_path / "relu"  # another folder: configuration files are read once per path
    relu.mkdir()
    got = by_class(scan(relu, FACTORY, config=CONFIG.replace('hidden_act="gelu"', 'hidden_act="relu"')),
                   "biased_GeLU")
    assert "Layer" not in got  # F.relu under the defaults


def test_conditional_json_and_text(tmp_path, capsys):
    from adopter.cli import main

    (tmp_path / "m.py").write_text(HEADER + textwrap.dedent(ACTIVATIONS))
    assert main(["scan", "--format", "json", "-j", "1", str(tmp_path / "m.py")]) == 0
    data = json.loads(capsys.readouterr().out)
    row = next(m for m in data["matches"] if m["class"] == "NoConfig")
    assert row["status"] == "conditional" and row["code"] == "needs-config" and "config.hidden_act" in row["condition"]
    plain = next(m for m in data["matches"] if m["class"] == "ConstantKey")
    assert "code" not in plain and "condition" not in plain
    assert main(["scan", "-j", "1", str(tmp_path / "m.py")]) == 0
    out = capsys.readouterr().out
    assert "conditional (needs-config: GeLU only if config.hidden_act in {" in out
    assert "; 4 conditional" in out.splitlines()[-1]


# ---------------------------------------------------------------- dim-not-last

SOFTMAX = """
class Dims(nn.Module):
    def __init__(self):
        super().__init__()
        self.sm_row = nn.Softmax(dim=-1)
        self.sm_col = nn.Softmax(dim=1)
        self.gate = nn.Linear(8, 4)

    def forward(self, x, q, k):
        a = F.softmax(x, dim=-1)
        b = x.softmax(-1)
        c = F.softmax(x, dim=-1, dtype=torch.float32)
        d = F.softmax(x, dim=1)
        e = F.softmax(x, dim=-2)
        f = F.softmax(x)
        g = F.softmax(x.view(2, 3, 4, 5), dim=3)
        h = torch.softmax(x.reshape(6, 20).float(), 1)
        s = torch.matmul(q.view(2, 3, 4, 5), k.view(2, 3, 4, 5).transpose(-1, -2))
        i = s.softmax(dim=3)
        j = s.softmax(dim=2)
        r = self.gate(x.view(-1, 8))
        l = F.softmax(r, dim=1)
        m = self.sm_row(x)
        n = self.sm_col(x)
        o = nn.Softmax(dim=1)(x)
        return a, b, c, d, e, f, g, h, i, j, l, m, n, o


def normalise(scores, dim):
    return F.softmax(scores, dim=dim)


def normalise_rows(scores, dim=-1):
    return F.softmax(scores, dim=dim)


class Callers(nn.Module):
    def forward(self, x):
        return normalise(x, -1) + normalise(x, dim=1) + normalise_rows(x) + normalise_rows(x, dim=-1)
"""


def _line(body: str, text: str) -> int:
    lines = (HEADER + textwrap.dedent(body)).splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_softmax_dim_must_be_provably_last(tmp_path):
    matches = [m for m in scan(tmp_path, SOFTMAX) if m.rule == "softmax"]
    status = {m.lines[0]: (m.status, m.code) for m in matches}
    plain = ("static", "")
    refused = ("refused", "dim-not-last")
    expect = {
        "a = F.softmax(x, dim=-1)": plain, "b = x.softmax(-1)": plain,
        "c = F.softmax(x, dim=-1, dtype": plain,  # keeps-dtype: the kernel takes dtype=
        "d = F.softmax(x, dim=1)": refused, "e = F.softmax(x, dim=-2)": refused, "f = F.softmax(x)": refused,
        "g = F.softmax(x.view(2, 3, 4, 5), dim=3)": plain, "h = torch.softmax(x.reshape(6, 20)": plain,
        "i = s.softmax(dim=3)": plain, "j = s.softmax(dim=2)": refused, "l = F.softmax(r, dim=1)": plain,
        "m = self.sm_row(x)": plain, "n = self.sm_col(x)": refused, "o = nn.Softmax(dim=1)(x)": refused,
    }
    for text, want in expect.items():
        assert status[_line(SOFTMAX, text)] == want, text
    reasons = {m.lines[0]: m.reason for m in matches}
    assert reasons[_line(SOFTMAX, "d = F.softmax")] == (
        "dim=1: the input's rank is not known statically, so the dimension is not provably the last")
    assert reasons[_line(SOFTMAX, "j = s.softmax")] == "dim=2 of a 4-D input is not the last dimension"
    assert "without dim" in reasons[_line(SOFTMAX, "f = F.softmax")]


def test_dim_parameter_values_from_the_call_sites(tmp_path):
    from adopter.core.dsl import Layer, Span
    from adopter.core.match import MatchContext
    from adopter.core.rules.softmax import _parameter_values

    ctx = MatchContext(None, None, None, None, None, (), (), source=HEADER + textwrap.dedent(SOFTMAX))
    first = _line(SOFTMAX, "return F.softmax(scores, dim=dim)")  # in normalise; normalise_rows' is 4 lines on
    for function, line, want in (("normalise", first, ["-1", "1"]), ("normalise_rows", first + 4, ["-1", "-1"])):
        node = Layer("torch.nn.functional.softmax", span=Span(line, 11, line, 40, function=function))
        assert _parameter_values(ctx, node, "dim")[0] == want, function


def test_softmax_dim_parameter_follows_the_call_sites(tmp_path):
    got = {m.function: m for m in scan(tmp_path, SOFTMAX) if m.rule == "softmax" and m.class_name is None}
    # inlined at ``normalise(x, dim=1)`` the softmax reads dim=1 (and the helper as an entry function
    # reads its parameter, which a call site sets to 1): one rewrite of the helper serves every caller
    assert (got["normalise"].status, got["normalise"].code) == ("refused", "dim-not-last")
    assert "dim=1" in got["normalise"].reason
    assert got["normalise_rows"].status == "static"  # the default and every call site: -1


# ---------------------------------------------------------------- not-a-layernorm

NORMS = """
NORM2FN = {"layer_norm": nn.LayerNorm, "no_norm": nn.Identity}


class ByName(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = NORM2FN[config.norm_type](8, eps=1e-5)

    def forward(self, h, r):
        return self.LayerNorm(self.dropout(h) + r)


class Plain(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = nn.LayerNorm(8, eps=1e-5)

    def forward(self, h, r):
        return self.LayerNorm(self.dropout(h) + r)
"""


def test_norm_from_a_dict_lookup_is_not_a_layernorm(tmp_path):
    got = by_class(scan(tmp_path, NORMS), "Dropout_LayerNorm")
    assert (got["ByName"].status, got["ByName"].code) == ("refused", "not-a-layernorm")
    assert "self.LayerNorm may be nn.Identity (bound by NORM2FN[config.norm_type]" in got["ByName"].reason
    assert got["Plain"].status == "static"
    # even with a configuration whose default names layer_norm: a dict lookup is not proof
    got = by_class(scan(tmp_path, NORMS, config=CONFIG), "Dropout_LayerNorm")
    assert got["ByName"].status == "refused"


# ---------------------------------------------------------------- branch-straddle

BRANCHES = """
class Hoistable(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = nn.LayerNorm(8)

    def forward(self, h, r):
        h = self.dropout(h)
        h = h + r
        if self.config.post_norm:
            h = self.LayerNorm(h)
        return h


class InALoop(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = nn.LayerNorm(8)

    def forward(self, h, r):
        h = self.dropout(h) + r
        for _ in range(2):
            h = self.LayerNorm(h)
        return h


class OtherBranches(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = nn.LayerNorm(8)

    def forward(self, h, r):
        if self.config.concat:
            h = torch.cat([h, r], -1)
        else:
            h = self.dropout(h)
            h = r + h
        if self.config.post_norm:
            h = self.LayerNorm(h)
        return h


class ConditionCalls(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, h):
        h = self.dense(h)
        if torch.is_grad_enabled():
            h = self.act(h)
        return h
"""


def test_statements_the_rewrite_cannot_hoist_are_refused(tmp_path):
    matches = scan(tmp_path, BRANCHES)
    got = {m.class_name: m for m in matches}
    assert got["Hoistable"].status == "static"  # the dropout and add are copied into both branches
    for name, why in (("InALoop", "a `for _ in range(2)` lies between them"),
                      ("OtherBranches", "they lie in different branches"),
                      ("ConditionCalls", "calls a function")):
        assert (got[name].status, got[name].code) == ("refused", "branch-straddle"), name
        assert why in got[name].reason, got[name].reason
    assert "(else branch)" in got["OtherBranches"].reason


# ---------------------------------------------------------------- torchscript

SCRIPTED = """
@torch.jit.script
def scripted(x):
    return F.softmax(x, dim=-1)


def plain(x):
    return F.softmax(x, dim=-1)


class Legacy(torch.jit.ScriptModule):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.act = nn.GELU()

    @torch.jit.script_method
    def forward(self, x):
        return self.act(self.dense(x))


class ScriptedLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.dense(x))


class Eager(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.dense(x))


compiled = torch.jit.script(ScriptedLater())
"""


def test_torchscript_code_is_refused(tmp_path):
    matches = scan(tmp_path, SCRIPTED)
    got = {m.class_name or m.function: m for m in matches}
    for name, how in (("scripted", "@torch.jit.script"), ("Legacy", "@torch.jit.script_method"),
                      ("ScriptedLater", "torch.jit.script(ScriptedLater())")):
        assert (got[name].status, got[name].code) == ("refused", "torchscript"), name
        assert how in got[name].reason
    assert got["plain"].status == "static" and got["Eager"].status == "static"


# ---------------------------------------------------------------- Linear -> BatchNorm1d through flatten/reshape

LINEAR_BN = """
class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x).flatten(0, 1)).reshape_as(x)


class Merged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(64)

    def forward(self, x):
        return self.bn(self.fc(x).flatten(1))


class Reshaped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(64)

    def forward(self, x):
        return self.bn(self.fc(x).reshape(x.shape[0], -1))
"""


def test_batchnorm1d_over_a_flatten_or_reshape_of_the_linear_output(tmp_path):
    got = by_class(scan(tmp_path, LINEAR_BN), "Linear_BatchNorm")
    assert got["Flat"].status == "static"  # the feature dimension stays last (LeViT)
    assert "Merged" not in got and "Reshaped" not in got  # not Linear -> BN1d


# ---------------------------------------------------------------- never rewritten; settled by a trace


def test_rewrite_never_applies_conditional_or_refused_matches(tmp_path):
    from adopter.rewrite import rewrite_source

    text = HEADER + textwrap.dedent(ACTIVATIONS + NORMS)
    matches = scan_source(text, str(tmp_path / "m.py"), all_rules())
    rejected: list = []
    scan_source(text, str(tmp_path / "m.py"), all_rules(), rejected)
    refused = [m for m in rejected if m.status == "refused"]
    assert refused and any(m.status == "conditional" for m in matches)
    result = rewrite_source(text, matches + refused, filename="m.py")
    for outcome in result.outcomes:
        m = outcome.match
        if m.status in ("conditional", "refused"):
            assert not outcome.applied and outcome.reason.startswith(f"{m.status} ({m.code})"), outcome
    assert any(o.applied for o in result.outcomes)  # the plain matches are rewritten
    assert "ACT2FN[config.hidden_act]" in result.new_text


TRACED = HEADER + """
class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = ACT2FN[act]

    def forward(self, x):
        return self.act(self.dense(x))


class Net(nn.Module):
    def __init__(self, act="gelu"):
        super().__init__()
        self.mlp = Mlp(act)

    def forward(self, x):
        return torch.softmax(self.mlp(x), dim=0)
"""


@pytest.mark.parametrize("act, status", [("gelu", "confirmed"), ("relu", "rejected")])
def test_a_trace_settles_a_conditional_match_and_keeps_a_refused_one(tmp_path, act, status):
    pytest.importorskip("torch")
    from adopter.tracing import confirm_matches

    path = tmp_path / f"traced_{act}.py"
    path.write_text(TRACED)
    name = f"precision_traced_{act}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        matches = scan_paths([path], all_rules(), jobs=1).matches
        assert sorted((m.rule, m.status) for m in matches) == [("biased_GeLU", "conditional"), ("softmax", "refused")]
        import torch

        out = confirm_matches(module.Net(act), {"x": torch.randn(2, 8)}, matches, runtime_only=False)
    finally:
        sys.modules.pop(name, None)
    got = {m.rule: m for m in out}
    assert got["biased_GeLU"].status == status, got["biased_GeLU"].reason
    assert got["biased_GeLU"].code == "needs-config" and got["biased_GeLU"].condition  # kept after the trace
    assert got["softmax"].status == "refused" and got["softmax"].code == "dim-not-last"


# ---------------------------------------------------------------- method-divergence

DIVERGING = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_stem = nn.Conv2d(3, 8, 3)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward_features(self, x):
        x = self.bn1(self.conv_stem(x))
        return self.bn(self.conv(x))

    def forward_intermediates(self, x):
        x = self.conv_stem(x)
        taps = [x]  # the value between conv and BN is read: this method cannot fuse them
        x = self.bn1(x)
        x = self.bn(self.conv(x))
        return x, taps
"""


def test_a_pair_another_method_runs_unfused_is_refused_and_one_both_fuse_is_not():
    rejected: list = []
    found = [m for m in scan_source(DIVERGING, "net.py", all_rules(), rejected) + rejected
             if m.rule == "Conv_BatchNorm" and (m.status == "refused" or not m.reason)]
    lines = {m.lines[0]: m for m in found}
    stem = lines[DIVERGING.splitlines().index("        x = self.bn1(self.conv_stem(x))") + 1]
    assert stem.status == "refused" and stem.code == "method-divergence"
    assert "Net.forward_intermediates also runs self.bn1, self.conv_stem" in stem.reason
    body = [m for m in found if m is not stem]
    assert len(body) == 2 and all(m.status == "static" for m in body)  # both methods take that rewrite
    assert {m.function.split(".")[-1] for m in body} == {"forward_features", "forward_intermediates"}


PRE_AND_POST_NORM = """
import torch
from torch import nn


class EncoderLayer(nn.Module):
    def __init__(self, d, normalize_before=False):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.norm2 = nn.LayerNorm(d)
        self.dropout1 = nn.Dropout(0.1)
        self.dropout2 = nn.Dropout(0.1)
        self.normalize_before = normalize_before

    def forward_post(self, src):
        src = src + self.dropout1(self.ff(src))
        src = self.norm1(src)
        src = src + self.dropout2(self.ff(src))
        src = self.norm2(src)
        return src

    def forward_pre(self, src):
        hidden = self.norm1(src)
        src = src + self.dropout1(self.ff(hidden))
        hidden = self.norm2(src)
        src = src + self.dropout2(self.ff(hidden))
        return src

    def forward(self, src):
        if self.normalize_before:
            return self.forward_pre(src)
        return self.forward_post(src)


class Tapped(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.drop(self.ff(x)))

    def forward_with_taps(self, x):
        taps = []
        y = x + self.drop(self.ff(x))
        taps.append(y)  # the sum before the norm is read: this method cannot fuse the two
        y = self.norm(y)
        return y, taps
"""


def test_methods_running_the_same_layers_in_another_composition_do_not_diverge():
    # DETR-style pre-norm and post-norm methods run dropout1/norm1 (and dropout1/norm2) in different
    # orders: neither computes the other's dropout+add+norm chain, so rewriting one cannot make the
    # two answer a same quantity two ways. A method that does compute the chain (with the sum read
    # in between) still keeps the fusion out.
    rejected: list = []
    found = [m for m in scan_source(PRE_AND_POST_NORM, "layer.py", all_rules(), rejected=rejected)
             if m.rule == "Dropout_LayerNorm"]
    refused = [m for m in rejected if m.rule == "Dropout_LayerNorm" and m.status == "refused"]
    by_class = {(m.class_name, m.function.split(".")[-1], m.nodes[-1].node.module.name): m for m in found}
    assert set(by_class) >= {("EncoderLayer", "forward_post", "self.norm1"), ("EncoderLayer", "forward_post", "self.norm2"),
                             ("EncoderLayer", "forward_pre", "self.norm2")}, sorted(by_class)
    assert all(m.status == "static" for m in by_class.values())
    assert [(m.class_name, m.code) for m in refused] == [("Tapped", "method-divergence")]
    assert "Tapped.forward_with_taps also runs self.drop, self.norm" in refused[0].reason


CLASS_PARAMETERS = """
import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, d, h, act=nn.GELU):
        super().__init__()
        self.lin1 = nn.Linear(d, h)
        self.lin2 = nn.Linear(h, d)
        self.act = act()

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


class ReluBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp = MLPBlock(d, 4 * d, act=nn.ReLU)


class Mlp(nn.Module):
    def __init__(self, d, act_layer=nn.GELU):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.act = act_layer()

    def forward(self, x):
        return self.act(self.fc1(x))


class Block(nn.Module):
    def __init__(self, d, act_layer=nn.GELU):
        super().__init__()
        self.mlp = Mlp(d, act_layer=act_layer)


class Net(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
"""


@pytest.mark.parametrize("construction, status", [
    ("", "static"),  # every construction leaves the GeLU default (through Block's own default)
    ("        self.extra = Block(d, act_layer=nn.SiLU)\n", "conditional"),
    ("        self.extra = Block(d, **kwargs_of_somewhere)\n", "conditional"),
])
def test_a_class_parameter_is_what_the_files_constructions_pass(construction, status):
    # SAM's MLPBlock(act=nn.ReLU): the default is not what runs; timm's Mlp(act_layer=act_layer)
    # through a block whose own default no construction changes: it is
    text = CLASS_PARAMETERS + construction
    found = {m.class_name: m for m in scan_source(text, "blocks.py", all_rules()) if m.rule == "biased_GeLU"}
    assert found["MLPBlock"].status == "conditional" and found["MLPBlock"].code == "needs-config"
    assert "not nn.ReLU" in found["MLPBlock"].condition
    assert found["Mlp"].status == status, found["Mlp"]
