"""Generic codemod (paper §3.5): rewrites synthesized from a user rule's DSL target patterns
(rules from ``--rules-file`` have no hand-written codemod). Golden before/after fixtures,
numeric equivalence of the rewritten model (forward and backward, same weights), skips."""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from adopter.rewrite import rewrite_file, rewrite_source
from adopter.rewrite.loader import load_rewritten_module

from adopter.core.codemod.generic import snake_case
from adopter.core.rules import load_rules_file
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rewrite" / "generic"
BEFORE = FIXTURES / "linear_relu.before.py"


@pytest.fixture(autouse=True)
def kernels_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))  # the rules' target module `mykernels`


def _rewrite(rules_file: str, text: str | None = None, register: bool = True):
    rules = load_rules_file(FIXTURES / rules_file)
    text = BEFORE.read_text() if text is None else text
    matches = scan_source(text, "linear_relu.py", rules)
    return rules, matches, rewrite_source(text, matches, filename="linear_relu.py", rules=rules if register else ())


def _load(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(BEFORE)
    exec(compile(text, str(BEFORE), "exec"), module.__dict__)  # noqa: S102 - the test's own fixture
    return module


def _compare(original: torch.nn.Module, rewritten: torch.nn.Module, shape) -> None:
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y1, y2 = original(x), rewritten(x2)
    torch.testing.assert_close(y2, y1)
    y1.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    grads1 = {k: p.grad for k, p in original.named_parameters()}
    return grads1, {k: p.grad for k, p in rewritten.named_parameters()}


# ---------------------------------------------------------------- golden text


@pytest.mark.parametrize(
    "rules_file, golden", [("rules.dsl", "linear_relu.after.py"), ("rules_fresh.dsl", "linear_relu_fresh.after.py")]
)
def test_golden(rules_file, golden):
    _, _, result = _rewrite(rules_file)
    assert not result.error
    assert result.new_text == (FIXTURES / golden).read_text()
    compile(result.new_text, golden, "exec")


IMPORTED = FIXTURES / "imported.before.py"


def test_module_level_imports_for_adopter_kernels_and_existing_imports():
    _, _, result = _rewrite("rules_adopter_kernel.dsl", IMPORTED.read_text())
    assert [o.applied for o in result.outcomes] == [True, True], [o.reason for o in result.outcomes]
    assert result.new_text == (FIXTURES / "imported.after.py").read_text()
    rules = load_rules_file(FIXTURES / "rules_adopter_kernel.dsl")
    again = rewrite_source(result.new_text, scan_source(result.new_text, "imported.py", rules), filename="i.py")
    assert not again.changed

    original = _load(IMPORTED.read_text(), "generic_imported_before")
    rewritten = load_rewritten_module(original, result.new_text, register=False)
    torch.manual_seed(2)
    for name, shape in (("GeLUBlock", (3, 4)), ("ReLUBlock", (5, 4))):
        a = getattr(original, name)(4).double()
        b = getattr(rewritten, name)(4).double()
        b.load_state_dict(a.state_dict(), strict=True)
        a.load_state_dict(b.state_dict(), strict=True)
        g1, g2 = _compare(a, b, shape)
        for key in g1:
            torch.testing.assert_close(g2[key], g1[key])
    assert type(rewritten.GeLUBlock(4).fc).__name__ == "FusedLinearBiasGeLU"


BRANCH_REASON = (
    "line 91: matched statements are split by a branch (if self.act); the generic codemod rewrites only"
    " statements of one block"
)


def test_applied_and_skipped_with_reasons():
    _, _, result = _rewrite("rules.dsl")
    got = sorted((o.match.rule, o.match.class_name, tuple(o.match.lines), o.applied, o.reason) for o in result.outcomes)
    assert got == sorted([
        ("My_Linear_ReLU", "Escapes", (47, 48), False, "intermediate 'h' is also read at line 49"),
        ("My_Linear_ReLU", "Branch", (89, 91), False, BRANCH_REASON),
        ("My_Linear_ReLU", "MLP", (19, 20), True, ""),
        ("My_Linear_ReLU", "MLP", (23, 23), False, "self.gate is assigned 2 times in MLP (lines 14, 16)"),
        ("My_Linear_ReLU", "Shared", (35, 35), False,
         "self.proj is also used at line 36 (forward); it would become the kernel"),
        ("My_Linear_ReLU", "OptionalProj", (75, 76), True, ""),
        ("My_Linear_ReLU_Fn", "Functional", (59, 60), True, ""),
    ])


def test_idempotent_second_run_changes_nothing():
    rules, _, first = _rewrite("rules.dsl")
    assert first.changed
    again = rewrite_source(first.new_text, scan_source(first.new_text, "linear_relu.py", rules), filename="x.py")
    assert again.new_text == first.new_text and not again.changed
    assert not again.applied


def test_rewrite_file_with_user_rules_diff_and_fixed_point(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(BEFORE.read_text())
    rules = load_rules_file(FIXTURES / "rules_fresh.dsl")
    result = rewrite_file(path, rules, write=False)  # registers the rules itself
    assert result.status == "changed" and "+        h = self.linear_relu(x)" in result.diff
    assert path.read_text() == BEFORE.read_text()  # nothing written without write=True
    assert rewrite_file(path, rules, write=True).written
    assert rewrite_file(path, rules, write=False).status == "unchanged"


# ---------------------------------------------------------------- numerics


def test_kept_attribute_is_state_dict_compatible_and_equivalent():
    _, _, result = _rewrite("rules.dsl")
    original = _load(BEFORE.read_text(), "generic_before")
    rewritten = load_rewritten_module(original, result.new_text, register=False)
    torch.manual_seed(0)
    cases = [("MLP", (5, 7, 3), (4, 5)), ("Functional", (6,), (3, 6)),
             ("OptionalProj", (4, True), (2, 4)), ("OptionalProj", (4, False), (2, 4))]
    for name, args, shape in cases:
        a = getattr(original, name)(*args).double()
        b = getattr(rewritten, name)(*args).double()
        b.load_state_dict(a.state_dict(), strict=True)
        a.load_state_dict(b.state_dict(), strict=True)  # both ways
        assert set(a.state_dict()) == set(b.state_dict())
        g1, g2 = _compare(a, b, shape)
        for key in g1:
            torch.testing.assert_close(g2[key], g1[key])
    assert type(rewritten.MLP(5, 7, 3).up).__name__ == "LinearReLU"
    # built under the same condition as before
    assert type(rewritten.OptionalProj(4, True).proj).__name__ == "LinearReLU"
    assert not hasattr(rewritten.OptionalProj(4, False), "proj")


def test_fresh_attribute_is_equivalent_with_renamed_weights():
    _, _, result = _rewrite("rules_fresh.dsl")
    original = _load(BEFORE.read_text(), "generic_before_fresh")
    rewritten = load_rewritten_module(original, result.new_text, register=False)
    torch.manual_seed(1)
    a = original.MLP(5, 7, 3).double()
    b = rewritten.MLP(5, 7, 3).double()
    renamed = {k.replace("up.", "linear_relu.", 1): v for k, v in a.state_dict().items()}
    b.load_state_dict(renamed, strict=True)
    assert "up.weight" not in b.state_dict()
    g1, g2 = _compare(a, b, (2, 5))
    torch.testing.assert_close(g2["linear_relu.weight"], g1["up.weight"])


# ---------------------------------------------------------------- skips


def test_targets_that_cannot_be_synthesized_are_skipped_with_reason():
    _, matches, result = _rewrite("rules_unsupported.dsl")
    assert matches and not result.changed and not result.applied
    reasons = {o.match.rule: o.reason for o in result.outcomes if o.match.lines == [19, 20]}
    assert reasons == {
        "Two_Targets": "forward target is 2 node(s) (Layer, Layer); only a single kernel call is synthesized",
        "Method_Target": "target torch.Tensor.relu is a tensor method; only module and function targets are synthesized",
        "Init_Value_In_Forward": "forward target argument $in is bound in __init__ (d_in), which forward cannot read",
        "Forward_Value_In_Init": "init target argument $x is the forward value x",
        "Wrong_Output": "target output $h is not the output of the last matched node ($y)",
    }


def test_unregistered_rule_without_variant_has_no_codemod():
    rules = load_rules_file(FIXTURES / "rules.dsl")
    text = BEFORE.read_text()
    matches = [replace(m, rule="Never_Registered_Rule", variant=None) for m in scan_source(text, "m.py", rules)]
    result = rewrite_source(text, matches, filename="m.py")
    assert not result.changed
    assert all(o.reason == "no codemod for rule Never_Registered_Rule" for o in result.outcomes)


def test_variant_recorded_on_the_match_needs_no_registration():
    rules = load_rules_file(FIXTURES / "rules.dsl")
    text = BEFORE.read_text()
    variant = rules[0].variants[0]
    matches = [
        replace(m, rule="Recorded_Variant_Rule", variant=variant)
        for m in scan_source(text, "m.py", rules[:1])
    ]
    result = rewrite_source(text, matches, filename="m.py")
    applied = [o for o in result.outcomes if o.applied]
    assert len(applied) == 2 and "self.up = LinearReLU(d_in, d_hidden, bias=True)" in result.new_text


def test_snake_case_names():
    assert [snake_case(n) for n in ("LinearReLU", "FusedQKV", "FusedDropoutAddLayerNorm", "Conv2dBN")] == [
        "linear_relu", "fused_qkv", "fused_dropout_add_layer_norm", "conv2d_bn"
    ]


def test_fresh_attribute_avoids_collisions():
    text = BEFORE.read_text().replace("self.down = nn.Linear(d_hidden, d_out)",
                                      "self.down = nn.Linear(d_hidden, d_out)\n        self.linear_relu = None")
    _, _, result = _rewrite("rules_fresh.dsl", text)
    assert "self.linear_relu_2 = LinearReLU(d_in, d_hidden)" in result.new_text
    assert "h = self.linear_relu_2(x)" in result.new_text


# ---------------------------------------------------------------- CLI


def test_cli_rewrite_with_rules_file_shows_diff(tmp_path, capsys):
    from adopter.cli import main

    path = tmp_path / "model.py"
    path.write_text(BEFORE.read_text())
    code = main(["rewrite", str(path), "--rules-file", str(FIXTURES / "rules.dsl"), "--diff", "-j", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "+        self.up = LinearReLU(d_in, d_hidden, bias=True)" in out
    assert path.read_text() == BEFORE.read_text()
