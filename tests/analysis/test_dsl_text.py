"""DSL text parser/printer: round trips and error positions."""

import pytest

from adopter.core.dsl import Arg, Const, Layer, TensorOp, Var, Wildcard
from adopter.core.dsl_text import (
    DSLSyntaxError,
    format_node,
    format_pattern,
    format_rule,
    format_rules,
    parse_pattern,
    parse_rule,
    parse_rules,
)

FIG1 = (
    "torch.nn.Dropout@self.dropout(hidden_states#1) -> hidden_states#2; "
    "hidden_states#2 + input_tensor -> tmp_1; "
    "torch.nn.LayerNorm@self.LayerNorm(tmp_1) -> hidden_states#3"
)

RULE_TEXT = """
# a comment line
rule Dropout_LayerNorm
init:
    torch.nn.Dropout($p) -> $drop; torch.nn.LayerNorm($shape, eps=$eps) -> $ln   # trailing comment
    => adopter.kernels.FusedDropoutAddLayerNorm($shape, $p, eps=$eps) -> $ln
forward:
    torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out
    => adopter.kernels.FusedDropoutAddLayerNorm@$ln($x, $res) -> $out
"""


def test_parse_structure_objects():
    p = parse_pattern(FIG1)
    assert p.nodes[0] == Layer(
        "torch.nn.Dropout", (Arg(Var("hidden_states", 1)),), Var("hidden_states", 2), Var("self.dropout")
    )
    assert p.nodes[1] == TensorOp("+", (Arg(Var("hidden_states", 2)), Arg(Var("input_tensor"))), Var("tmp_1"))
    assert p.nodes[2].module == Var("self.LayerNorm")


@pytest.mark.parametrize(
    "text",
    [
        FIG1,
        "torch.softmax|torch.nn.functional.softmax($x, dim=-1, dtype=`torch.float32`) -> $y",
        "*; $a @ $b -> $c; - $c -> $d; ~ $d -> $e",
        "f('a#b', \"x\", 1e-5, 3, None, True, `config.hidden_size * 3`)",
        "torch.nn.Linear(`config.hidden_size`, out_features=768) -> self.dense",
        "torch.Tensor.view($x, -1, 12) -> $v; $v ** 2 -> $w; $w // 3 -> $z",
    ],
)
def test_pattern_round_trip(text):
    p = parse_pattern(text)
    printed = format_pattern(p)
    assert parse_pattern(printed) == p
    assert format_pattern(parse_pattern(printed)) == printed


def test_arrow_unicode_and_wildcard():
    p = parse_pattern("torch.nn.Dropout($x) → $y; *")
    assert p.nodes[0].output == Var("$y")
    assert p.nodes[1] == Wildcard()


def test_constants_and_vars_are_distinguished_in_print():
    node = Layer("f", (Arg(Const("torch.float32")), Arg(Var("torch.float32")), Arg(Const("-1"))))
    text = format_node(node)
    assert text == "f(`torch.float32`, torch.float32, -1)"
    assert parse_pattern(text).nodes[0] == node


def test_matmul_operator_is_not_a_module():
    p = parse_pattern("q @ k -> s")
    assert p.nodes[0] == TensorOp("@", (Arg(Var("q")), Arg(Var("k"))), Var("s"))
    p = parse_pattern("torch.nn.Linear@self.q(x) -> s")
    assert p.nodes[0].module == Var("self.q")


def test_rule_round_trip():
    rules = parse_rules(RULE_TEXT)
    assert len(rules) == 1
    r = rules[0]
    assert r.name == "Dropout_LayerNorm"
    assert len(r.init.source.nodes) == 2 and len(r.forward.source.nodes) == 3
    assert r.forward.target.nodes[0].module == Var("$ln")
    assert parse_rule(format_rule(r)) == r


def test_rule_variants_and_forward_only():
    text = RULE_TEXT + "\nrule softmax\nforward:\n    torch.softmax($x) -> $y => adopter.kernels.softmax($x) -> $y\n"
    rules = parse_rules(text)
    assert [r.name for r in rules] == ["Dropout_LayerNorm", "softmax"]
    assert rules[1].init is None
    assert parse_rules(format_rules(rules)) == rules


@pytest.mark.parametrize(
    "text, line, col",
    [
        ("a($x) -> ", 1, 10),  # missing output variable
        ("a($x) b($y)", 1, 7),  # missing ';'
        ("a($x,, $y)", 1, 6),
        ("$x + -> $y", 1, 6),
        ("a($x)\n; $y +", 2, 7),
        ("a(x=1, $y)", 1, 8),  # positional after keyword
        ("a($)", 1, 3),
        ("a('abc)", 1, 3),
    ],
)
def test_pattern_errors_name_line_and_column(text, line, col):
    with pytest.raises(DSLSyntaxError) as info:
        parse_pattern(text)
    assert (info.value.line, info.value.col) == (line, col), str(info.value)
    assert f":{line}:{col}:" in str(info.value)


def test_target_is_optional_for_rules_with_a_codemod():
    (rule,) = parse_rules("rule X\nforward:\n    a($x) -> $y; b($y) -> $z\n")  # no '=>'
    assert rule.forward.target is None and len(rule.forward.source.nodes) == 2
    assert "=>" not in format_rules([rule])
    assert parse_rules(format_rules([rule])) == [rule]


def test_rules_file_needs_targets(tmp_path):
    from adopter.core.rules import load_rules_file

    path = tmp_path / "r.dsl"
    path.write_text("rule X\nforward:\n    a($x) -> $y; b($y) -> $z\n")
    with pytest.raises(DSLSyntaxError, match="needs '=> TARGET'"):
        load_rules_file(path)


def test_rule_file_errors():
    with pytest.raises(DSLSyntaxError) as info:
        parse_rules("rule X\ninit:\n    a() -> $m => b() -> $m\n")
    assert "no 'forward:' section" in str(info.value) and info.value.line == 1
    with pytest.raises(DSLSyntaxError) as info:
        parse_rules("forward:\n  a($x) -> $y => b($x) -> $y\n")
    assert info.value.line == 1
    with pytest.raises(DSLSyntaxError) as info:
        parse_rules("rule X\nforward:\n    a($x) -> $y\n    => b($x) -> $y; c(\n")
    assert (info.value.line, info.value.col) == (5, 1)
    with pytest.raises(DSLSyntaxError) as info:
        parse_rules("rule X\nforward:\n    a($x) -> $y => b(1 2) -> $y\n")
    assert (info.value.line, info.value.col) == (3, 24)


def test_empty_pattern_is_an_error():
    with pytest.raises(DSLSyntaxError):
        parse_pattern("   # nothing\n")
