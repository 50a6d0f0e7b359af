"""Fixture tests per rule: every ``tests/fixtures/rules/**/*.py`` lists the matches it must
produce (``# expect: RULE Class.function``, a plain ``static`` match; ``# expect: RULE
Class.function conditional:CODE`` or ``refused:CODE`` for a match of a precision class), and
produces no others (all nine rules run on every fixture, so each file is also a negative test
for the rules it does not list).
A fixture whose expectation needs an extraction feature not there yet says so with
``# xfail: reason``."""

from collections import Counter
from pathlib import Path

import pytest

from adopter.core.rules import RULE_MODULES, UnknownRuleError, all_rules, get_rules
from adopter.core.scan import scan_paths

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules"
FILES = sorted(p for p in FIXTURES.rglob("*.py") if not p.name.startswith("configuration_"))


def expected(path: Path) -> Counter:
    out = Counter()
    for line in path.read_text().splitlines():
        if line.startswith("# expect:"):
            rule, where, *status = line[len("# expect:"):].split()
            out[(rule, where, *status)] += 1
    return out


def _status_tag(m) -> tuple:
    return () if m.status == "static" else (f"{m.status}:{m.code}",)


def found(path: Path) -> Counter:
    report = scan_paths([path], all_rules())
    assert report.errors == []
    return Counter((m.rule, f"{m.class_name}.{m.function}" if m.class_name else m.function, *_status_tag(m))
                   for m in report.matches)


def _xfail_reason(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith("# xfail:"):
            return line[len("# xfail:"):].strip()
    return None


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.xfail(reason=_xfail_reason(p), strict=False)) if _xfail_reason(p) else p
        for p in FILES
    ],
    ids=lambda p: str(p.relative_to(FIXTURES)),
)
def test_fixture(path):
    assert found(path) == expected(path)


def test_registry_names_match_table_1():
    assert [r.name for r in all_rules()] == [
        "BertSelfAttention", "T5Attention", "GPT2Attention", "softmax", "Dropout_LayerNorm",
        "biased_GeLU", "Conv_BatchNorm", "Linear_BatchNorm", "fused_QKV",
        # the LLM rule pack (issue 12)
        "RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy",
        # residual blocks (issue 25)
        "Add_ReLU",
        # written-out attention outside the HF namesake classes (issue 35)
        "sdpa_attention",
    ]
    for r in all_rules():
        assert r.kernel.startswith("adopter.kernels.") and r.doc and r.variants


def test_get_rules_unknown_name_lists_known():
    assert [r.name for r in get_rules(["softmax", "fused_QKV", "softmax"])] == ["softmax", "fused_QKV"]
    with pytest.raises(UnknownRuleError) as info:
        get_rules(["softmax", "nope"])
    assert "nope" in str(info.value) and all(n in str(info.value) for n in RULE_MODULES)


def test_fig1_match_lines_and_init_nodes():
    path = FIXTURES / "Dropout_LayerNorm" / "positive_fig1.py"
    report = scan_paths([path], get_rules(["Dropout_LayerNorm"]))
    m = next(m for m in report.matches if m.class_name == "BertSelfOutput")
    text = path.read_text().splitlines()
    assert [text[i - 1].strip() for i in m.lines] == [
        "hidden_states = self.dropout(hidden_states)",
        "hidden_states = self.LayerNorm(hidden_states + input_tensor)",
        "hidden_states = self.LayerNorm(hidden_states + input_tensor)",
    ]
    assert sorted(ib.attr for ib in m.init_nodes) == ["self.LayerNorm", "self.dropout"]


def test_dpt_conv_batchnorm_spans_the_if():
    path = FIXTURES / "Conv_BatchNorm" / "positive_dpt_fig3.py"
    report = scan_paths([path], get_rules(["Conv_BatchNorm"]))
    text = path.read_text().splitlines()
    got = [[text[i - 1].strip() for i in m.lines] for m in report.matches]
    assert got == [
        ["hidden_state = self.convolution1(hidden_state)", "hidden_state = self.batch_norm1(hidden_state)"],
        ["hidden_state = self.convolution2(hidden_state)", "hidden_state = self.batch_norm2(hidden_state)"],
    ]


def test_function_ast_parses_one_function_with_file_line_numbers():
    from adopter.core.match.source import function_ast

    source = (
        "import torch\n"
        "class A:\n"
        "    @staticmethod\n"
        "    def forward(x):\n"
        "        doc = '''\n"
        "text at column 0\n"
        "'''\n"
        "        y = (x +\n"
        "    1)\n"
        "        return y\n"
        "\n"
        "    def other(self):\n"
        "        return 2\n"
    )
    fn = function_ast(source, "A.forward", 8)
    assert fn is not None and fn.name == "forward" and fn.lineno == 4 and fn.end_lineno == 10
    other = function_ast(source, "A.other", 13)
    assert other.name == "other" and other.lineno == 12


def test_config_defaults_follow_the_annotated_config_class(tmp_path):
    from adopter.core.rules._config_defaults import config_annotation, config_defaults

    (tmp_path / "configuration_toy.py").write_text(
        "class ToyVisionConfig:\n    hidden_act: str = 'gelu'\n\n"
        "class ToyTextConfig:\n    def __init__(self, hidden_act='silu'):\n        self.hidden_act = hidden_act\n"
    )
    modeling = tmp_path / "modeling_toy.py"
    src = "class ToyVisionMLP:\n    def __init__(self, config: ToyVisionConfig):\n        pass\n"
    modeling.write_text(src)
    assert config_defaults(str(modeling), "hidden_act") == frozenset({"gelu", "silu"})
    assert config_annotation(src, "ToyVisionMLP") == "ToyVisionConfig"
    assert config_defaults(str(modeling), "hidden_act", "ToyVisionConfig") == frozenset({"gelu"})
    assert config_defaults(str(modeling), "hidden_act", "ToyTextConfig") == frozenset({"silu"})
    assert config_defaults(str(tmp_path / "other.py"), "hidden_act") is None


def _toy_transformers(tmp_path, config_body: str, base_body: str = "    return_dict: bool = True\n"):
    """tmp/transformers/{configuration_utils.py, models/toy/{configuration_toy.py, modeling_toy.py}}"""
    root = tmp_path / "transformers"
    (root / "models" / "toy").mkdir(parents=True)
    (root / "configuration_utils.py").write_text("class PreTrainedConfig:\n" + base_body)
    (root / "models" / "toy" / "configuration_toy.py").write_text(
        "from ...configuration_utils import PreTrainedConfig\n\n\n" + config_body)
    return root / "models" / "toy" / "modeling_toy.py"


def test_config_defines_follows_in_file_bases_up_to_pretrained_config(tmp_path):
    from adopter.core.rules._config_defaults import config_defines

    modeling = _toy_transformers(
        tmp_path,
        'class ToyConfig(PreTrainedConfig):\n    """summary_activation in the docstring only"""\n'
        '    hidden_act: str = "gelu"\n    attribute_map = {"n_act": "hidden_act"}\n\n'
        "class ToySubConfig(ToyConfig):\n    extra: int = 1\n\n"
        "class ToyOtherConfig(ExternalConfig):\n    pass\n",
        base_body="    return_dict: bool = True\n    summary_type = None\n",
    )
    m = str(modeling)
    assert config_defines(m, "hidden_act", "ToyConfig") is True
    assert config_defines(m, "n_act", "ToyConfig") is True  # attribute_map alias
    assert config_defines(m, "summary_activation", "ToyConfig") is False  # docstrings do not define
    assert config_defines(m, "hidden_act", "ToySubConfig") is True  # through the in-file base
    assert config_defines(m, "summary_activation", "ToySubConfig") is False
    assert config_defines(m, "summary_type", "ToyConfig") is None  # the base class may provide it
    assert config_defines(m, "summary_activation", "ToyOtherConfig") is None  # base not in the file
    assert config_defines(m, "summary_activation", "NoSuchConfig") is None
    assert config_defines(m, "summary_activation") is None  # ToyOtherConfig's base is unknown
    other = _toy_transformers(tmp_path / "b", "class ToyConfig(PreTrainedConfig):\n    hidden_act = 'gelu'\n")
    assert config_defines(str(other), "summary_activation") is False  # every config class checked
    (tmp_path / "b" / "transformers" / "configuration_utils.py").unlink()
    assert config_defines(str(other).replace("toy", "toy2"), "x") is None  # no such configuration file


SUMMARY = '''
from torch import nn

from ...activations import get_activation
from .configuration_toy import ToyConfig


class ToySequenceSummary(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.summary = nn.Linear(config.hidden_size, config.hidden_size)
        activation_string = getattr(config, "summary_activation", None)
        self.activation = get_activation(activation_string) if activation_string else nn.Identity()

    def forward(self, hidden_states):
        return self.activation(self.summary(hidden_states[:, 0]))
'''


def test_getattr_default_applies_only_when_no_configuration_defines_the_attribute(tmp_path):
    from adopter.core.scan import scan_paths

    def scan(config_body):
        # a fresh directory each time: configuration files are read once per path (cached)
        modeling = _toy_transformers(tmp_path / str(len(list(tmp_path.iterdir()))), config_body)
        modeling.write_text(SUMMARY)
        report = scan_paths([modeling], get_rules(["biased_GeLU"]))
        assert report.errors == []
        return report.matches

    body = "class ToyConfig(PreTrainedConfig):\n    hidden_size: int = 8\n"
    assert scan(body) == []  # getattr default None: nn.Identity
    assert len(scan(body + '    summary_activation: str = "gelu"\n')) == 1
    # the annotated class lacks it but another configuration of the model defines a GeLU default:
    # the passed config may be that one (CLVP annotates ClvpConfig, passes ClvpEncoderConfig)
    assert len(scan(body + '\nclass ToyDecoderConfig(PreTrainedConfig):\n    summary_activation = "gelu"\n')) == 1


@pytest.mark.parametrize("fixture, line, reason", [
    ("fused_QKV/negative_cross_attention.py", 15, "self.key is also used at line 18"),
    ("fused_QKV/negative_side_keys.py", 17, "self.k is also used at line 20"),
    ("fused_QKV/negative_other_uses.py", 15, "self.k_proj is also used at line 18 (OtherMethod.keys_only)"),
    ("fused_QKV/negative_other_uses.py", 29, "(Flash.forward)"),
    # Base.forward's three calls on one input are a QKV site too: what keeps Flash's out is its own
    # read of the weight
    ("fused_QKV/negative_other_uses.py", 37, "self.q_proj is also used at line 36 (Flash.forward)"),
    ("biased_GeLU/transformers/models/toyhead/modeling_toyhead.py", 64,
     "defaults to None (not GeLU) in ToyHeadConfig, which defines no summary_activation (getattr default)"),
    ("biased_GeLU/transformers/models/toyhead/modeling_toyhead.py", 48, "defaults to 'silu'"),
    ("biased_GeLU/transformers/models/toyhead/modeling_toyhead.py", 79, "defines no pooler_hidden_act"),
])
def test_rejections_say_why(fixture, line, reason):
    from adopter.core.extract import extract_source
    from adopter.core.match import match_structures

    path = FIXTURES / fixture
    text = path.read_text()
    rejected = []
    match_structures(extract_source(text, str(path)), all_rules(), rejected, source=text)
    reasons = [m.reason for m in rejected if m.lines and m.lines[0] == line]
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("fixture, rule, want, not_want", [
    # the self-attention path (c_attn split), not `if is_cross_attention:` (q_attn, built only
    # with is_cross_attention=True): a plain GPT-2 runs the reported lines
    ("attention/v5_gpt2.py", "GPT2Attention",
     ["query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)"],
     ["q_attn"]),
    ("attention/old_gpt2_2023.py", "GPT2Attention", ["self.c_attn(hidden_states).split"], ["q_attn"]),
    # T5: the position bias add is part of the match
    ("attention/v5_t5.py", "T5Attention", ["attn_weights = attn_weights + position_bias"], []),
    ("attention/old_t5_2023.py", "T5Attention", ["scores += position_bias_masked"], []),
    # 2023 BERT: key/value of the `else:` branch, not of `elif is_cross_attention:`
    ("attention/old_bert_2023.py", "BertSelfAttention", ["self.key(hidden_states)", "self.value(hidden_states)"],
     ["encoder_hidden_states"]),
])
def test_attention_lines_are_the_path_a_plain_model_runs(fixture, rule, want, not_want):
    from adopter.core.extract import extract_source
    from adopter.core.match import match_structures

    path = FIXTURES / fixture
    text = path.read_text()
    lines = text.splitlines()
    sources = (text, None) if "old_bert" not in fixture else (text,)  # optional inputs need the source
    for source in sources:
        (m,) = match_structures(extract_source(text, str(path)), get_rules([rule]), source=source)
        got = [lines[i - 1].strip() for i in m.lines]
        for w in want:
            assert any(w in g for g in got), (source is None, got)
        for w in not_want:
            assert not any(w in g for g in got), (source is None, got)
