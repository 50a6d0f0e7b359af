"""A rule is one unit: a rule defined in one test-local module (plus its kernel) is scanned,
confirmed, rewritten, verified and reported without any other file naming it; built-in rules
declare their parts; no layer above the rules names a built-in rule."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from adopter.core.rules import RULE_MODULES, all_rules, find_rule, register_rule, unregister_rule
from adopter.core.scan import scan_source

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).parents[1] / "fixtures" / "plugin_rule"
MODEL_FILE = PLUGIN / "tanh_mlp.py"


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN))
    for name in ("linear_tanh_rule", "tanh_mlp"):
        sys.modules.pop(name, None)
    import linear_tanh_rule
    import tanh_mlp

    yield linear_tanh_rule, tanh_mlp
    unregister_rule(linear_tanh_rule.NAME)


def _scan(rule):
    text = MODEL_FILE.read_text()
    return text, scan_source(text, str(MODEL_FILE), [rule])


def test_plugin_rule_is_scanned_confirmed_and_rewritten(plugin):
    from adopter.rewrite import rewrite_source
    from adopter.tracing import confirm_matches

    rule_module, model_module = plugin
    rule = rule_module.RULE
    text, matches = _scan(rule)
    assert [(m.rule, m.class_name, m.lines) for m in matches] == [(rule.name, "TanhMLP", [15, 16])]

    model = model_module.TanhMLP()
    inputs = {"x": torch.randn(4, 8)}
    (confirmed,) = confirm_matches(model, inputs, matches, rules=[rule])
    assert confirmed.status == "confirmed", confirmed.reason
    assert "Linear(8->16) + tanh" in confirmed.reason  # the rule's own runtime check ran

    # the rule's runtime sequence finds the site in the trace when no static match covers it
    (runtime_only,) = confirm_matches(model, inputs, [], rules=[rule], scanned_files=[str(MODEL_FILE)])
    assert (runtime_only.rule, runtime_only.status, runtime_only.lines) == (rule.name, "runtime-only", [15, 16])

    result = rewrite_source(text, matches, filename=str(MODEL_FILE), rules=[rule])
    assert [o.applied for o in result.outcomes] == [True], result.outcomes
    assert "self.up = FusedLinearTanh(d_in, d_hidden)" in result.new_text
    assert "torch.tanh" not in result.new_text.split("def forward")[1]


def test_plugin_rule_runtime_check_rejects_what_it_cannot_fuse(plugin):
    from adopter.tracing import confirm_matches

    rule_module, model_module = plugin
    _, matches = _scan(rule_module.RULE)
    model = model_module.TanhMLP()
    model.up = torch.nn.Bilinear(8, 8, 16)  # not what the pattern named
    model.up.forward = lambda x: torch.nn.Bilinear.forward(model.up, x, x)
    (checked,) = confirm_matches(model, {"x": torch.randn(4, 8)}, matches, rules=[rule_module.RULE])
    assert checked.status == "rejected"
    assert "Bilinear, not nn.Linear" in checked.reason


@pytest.mark.slow
def test_plugin_rule_is_verified_by_optimize(plugin):
    from adopter import optimize

    rule_module, model_module = plugin
    optimized_cls = optimize(model_module.TanhMLP, rules=[rule_module.RULE], example_inputs=(torch.randn(4, 8),))
    report = optimized_cls.adopter_report
    assert report.applied_rules == [rule_module.RULE.name], str(report)
    assert report.equivalence.equivalent
    original = model_module.TanhMLP()
    optimized = optimized_cls()
    optimized.load_state_dict(original.state_dict(), strict=True)
    before = rule_module.FusedLinearTanh.calls
    x = torch.randn(3, 8)
    torch.testing.assert_close(optimized.eval()(x), original.eval()(x))
    assert rule_module.FusedLinearTanh.calls == before + 1  # the kernel ran


def test_registered_plugin_rule_is_listed_and_scanned_by_the_cli(plugin, capsys):
    from adopter.cli import main

    rule_module, _ = plugin
    register_rule(rule_module.RULE)
    assert find_rule(rule_module.NAME) is rule_module.RULE
    assert main(["rules", rule_module.NAME]) == 0
    assert rule_module.NAME in capsys.readouterr().out
    assert main(["scan", str(MODEL_FILE), "--rules", rule_module.NAME, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["rule"] for m in out["matches"]] == [rule_module.NAME]


def test_builtin_rules_declare_their_parts():
    fixtures = Path(__file__).parents[1] / "fixtures" / "rules"
    for rule in all_rules():
        assert rule.codemod is not None, rule.name
        # The codemod alone says what a site becomes: no DSL target that could drift from it.
        assert all(v.forward.target is None and (v.init is None or v.init.target is None) for v in rule.variants), rule.name
        assert rule.fixtures and (fixtures / rule.fixtures).is_dir(), rule.name
        assert rule.doc and rule.kernel.startswith("adopter.kernels."), rule.name


# Everything outside the rule modules looks rules up by name and must never name one.
OUTSIDE_RULES = ["rewrite/**/*.py", "tracing/**/*.py", "adopter/**/*.py"]
# ``softmax`` is also a torch op and a kernel function: outside the rules it may appear as those
# (``torch.softmax``, ``softmax(x)``, the kernel ``softmax``), and in the op-name tables.
_SOFTMAX_AS_OP = re.compile(r"\.softmax\b|\bsoftmax\(|``softmax``")
OP_TABLES = {"adopter/core/ops.py", "adopter/core/extract/tables.py"}


def test_no_builtin_rule_name_outside_the_rules():
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, RULE_MODULES)) + r")\b")
    found = []
    for glob in OUTSIDE_RULES:
        for path in sorted(ROOT.glob(glob)):
            if path.is_relative_to(ROOT / "adopter" / "core" / "rules"):
                continue
            op_table = str(path.relative_to(ROOT)) in OP_TABLES
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                names = set(pattern.findall(line))
                if names == {"softmax"} and (op_table or _SOFTMAX_AS_OP.search(line)):
                    continue
                if names:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
