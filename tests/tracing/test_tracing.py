"""adopter.tracing: model building, fx capture, node->source mapping and confirmation on small models.

Static matches here are hand-built (tests/fixtures/tracing/match_helpers.py) so these tests pin tracing
behaviour independently of extraction; tests/tracing/test_tracing_scan.py runs the real scanner.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "fixtures", "tracing"))

import dpt_like
from adopter.tracing import (
    TracingError,
    build_model,
    capture_model,
    confirm_matches,
    known_model_ids,
    map_nodes,
)
from adopter.tracing.capture import CaptureError
from match_helpers import layer, line_of, make_match

FN = "PreActResidualLayer.forward"


def conv_bn_match(i: int, *, bn: int | None = None):
    """The static Conv_BatchNorm match of DPT's pre-activation layer (``convolution{i}`` then
    ``batch_norm{i}`` under ``if self.use_batch_norm``); ``bn`` pairs it with another batch norm."""
    bn = bn or i
    c = line_of(dpt_like.PreActResidualLayer.forward, f"self.convolution{i}(")
    b = line_of(dpt_like.PreActResidualLayer.forward, f"self.batch_norm{bn}(")
    return make_match("Conv_BatchNorm", dpt_like.PreActResidualLayer, [
        layer("torch.nn.Conv2d", c, FN, module=f"self.convolution{i}", inputs=["hidden_state"], output=("hidden_state", 2)),
        layer("torch.nn.BatchNorm2d", b, FN, module=f"self.batch_norm{bn}", inputs=[("hidden_state", 2)],
              output=("hidden_state", 3)),
    ])


def head_gelu_match():
    fwd = dpt_like.Head.forward
    line = line_of(fwd, "self.act(self.dense(")
    return make_match("biased_GeLU", dpt_like.Head, [
        layer("torch.nn.Linear", line, "Head.forward", module="self.dense", inputs=["pooled"], output="tmp_1"),
        layer("torch.nn.GELU", line, "Head.forward", module="self.act", inputs=["tmp_1"], output=("pooled", 1)),
    ])


@pytest.fixture(scope="module")
def dpt_off():
    return build_model(dpt_like.DPTLikeModel, init_kwargs={"use_batch_norm": False}, device="cpu")


@pytest.fixture(scope="module")
def dpt_on():
    return build_model(dpt_like.DPTLikeModel, init_kwargs={"use_batch_norm": True}, device="cpu")


# ------------------------------------------------------------------ building


def test_known_model_ids_cover_the_issue_list():
    ids = set(known_model_ids())
    for required in ("bert-base-uncased", "roberta-base", "distilbert-base-uncased", "gpt2", "t5-small",
                     "google/vit-base-patch16-224", "microsoft/resnet-50", "facebook/bart-base",
                     "Intel/dpt-large", "meta-llama/Llama-2-7b-hf", "tiny-bert"):
        assert required in ids


def test_shipped_configs_have_the_published_sizes():
    from adopter.tracing.models import _config_from_dict

    from adopter.configs import load_config_dict

    bert = _config_from_dict(load_config_dict("bert-base-uncased"))
    assert (bert.hidden_size, bert.num_hidden_layers, bert.vocab_size) == (768, 12, 30522)
    llama = _config_from_dict(load_config_dict("meta-llama/Llama-2-7b-hf"))
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (4096, 11008, 32)
    tiny = _config_from_dict(load_config_dict("tiny-bert"))
    assert (tiny.hidden_size, tiny.num_hidden_layers) == (128, 2)
    assert load_config_dict("microsoft/resnet-50")["architectures"] == ["ResNetModel"]


def test_unknown_model_id_lists_the_known_ones():
    with pytest.raises(TracingError) as err:
        build_model("no-such-model-xyz", device="cpu")
    msg = str(err.value)
    assert "unknown model id 'no-such-model-xyz'" in msg and "bert-base-uncased" in msg and "\n" not in msg


def test_constructor_needing_arguments_is_a_clear_error():
    with pytest.raises(TracingError, match=r"NeedsArgs\(\.\.\.\) needs constructor arguments not given: width, depth"):
        build_model(dpt_like.NeedsArgs, device="cpu")


def test_forward_failing_on_generated_inputs_says_which_input_to_pass():
    with pytest.raises(TracingError) as err:
        build_model(dpt_like.BadForward, device="cpu")
    msg = str(err.value)
    assert "forward of BadForward failed on the generated inputs (pixel_values[2, 3, 224, 224])" in msg
    assert "example_inputs" in msg and "\n" not in msg


def test_forward_needing_an_input_adopter_cannot_generate():
    with pytest.raises(TracingError, match="needs inputs adopter cannot generate: x; pass them with example_inputs"):
        build_model(dpt_like.NeedsArgs, init_args=(4, 2), device="cpu")
    built = build_model(dpt_like.NeedsArgs, init_args=(4, 2), device="cpu", example_inputs={"x": torch.randn(3, 4)})
    assert built.forward_checked


def test_example_inputs_pad_and_follow_the_forward_signature(dpt_off):
    assert set(dpt_off.example_inputs) == {"pixel_values"}
    assert dpt_off.example_inputs["pixel_values"].shape == (2, 3, 224, 224)
    assert dpt_off.source_files == [os.path.realpath(dpt_like.__file__)]


@pytest.mark.slow
def test_text_and_encoder_decoder_inputs():
    bert = build_model("tiny-bert", device="cpu", seq_len=12)
    mask = bert.example_inputs["attention_mask"]
    assert mask.shape == (2, 12) and mask[0].all() and not mask[-1].all()  # real padding
    t5 = build_model("t5-small", device="cpu", config_overrides={"num_layers": 1, "num_decoder_layers": 1,
                                                                  "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16})
    assert set(t5.example_inputs) == {"input_ids", "attention_mask", "decoder_input_ids"}


@pytest.mark.slow
def test_meta_device_allocates_no_weights():
    built = build_model("tiny-bert", device="meta")
    assert all(p.device.type == "meta" for p in built.model.parameters())
    assert not built.forward_checked


# ------------------------------------------------------------------ capture + source map


def test_plain_model_is_captured_by_symbolic_trace_with_sources(dpt_on):
    cap = capture_model(dpt_on.model, dpt_on.example_inputs)
    assert cap.method == "symbolic_trace"
    sources = {s.node_name: s for s in map_nodes(cap.graph_module)}
    bn = sources["layers_1_batch_norm2"]
    assert bn.op == "call_module"
    assert bn.file == os.path.realpath(dpt_like.__file__)
    assert bn.line == line_of(dpt_like.PreActResidualLayer.forward, "self.batch_norm2(")
    assert (bn.function, bn.class_name) == (FN, "PreActResidualLayer")
    assert (bn.module_path, bn.module_class) == ("layers.1.batch_norm2", "torch.nn.modules.batchnorm.BatchNorm2d")


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if self.linear(x).sum() > 0:  # a branch on tensor data: neither fx nor export can capture it
            return x
        return -x


def test_untraceable_model_keeps_static_matches_as_untraced():
    model = DataDependent().eval()
    with pytest.raises(CaptureError) as err:
        capture_model(model, {"x": torch.randn(2, 4)})
    assert set(err.value.errors) == {"symbolic_trace", "export"}
    m = make_match("Conv_BatchNorm", DataDependent, [layer("torch.nn.Linear", 10, "DataDependent.forward", module="self.linear")])
    (out,) = confirm_matches(model, {"x": torch.randn(2, 4)}, [m])
    assert (out.status, out.trace_code) == ("untraced", "capture-failed")
    assert "symbolic_trace: " in out.reason and "export: " in out.reason  # the reason names each tracer's error


# ------------------------------------------------------------------ confirmation


def test_trace_codes_are_documented_and_belong_to_one_status():
    from typing import get_args

    from adopter.tracing.trace_codes import TRACE_CODES, TraceCode, traced

    assert set(TRACE_CODES) == set(get_args(TraceCode))
    assert {status for status, _ in TRACE_CODES.values()} == {"untraced", "not-executed", "rejected"}
    m = make_match("Conv_BatchNorm", DataDependent, [layer("torch.nn.Linear", 10, "DataDependent.forward",
                                                           module="self.linear")])
    assert traced(m, "untraced", "why", "not-in-model").trace_code == "not-in-model"
    assert traced(traced(m, "untraced", "why", "not-in-model"), "confirmed", "runs").trace_code == ""
    with pytest.raises(ValueError, match="not one of status"):
        traced(m, "not-executed", "why", "not-in-model")
    with pytest.raises(ValueError, match="not one of status"):
        traced(m, "untraced", "why")  # every untraced, not-executed or rejected match names its cause


def test_dpt_batch_norm_branch_off_is_not_executed(dpt_off):
    out = confirm_matches(dpt_off.model, dpt_off.example_inputs, [conv_bn_match(1), conv_bn_match(2)])
    static = [m for m in out if m.status != "runtime-only"]
    assert [(m.status, m.trace_code) for m in static] == [("not-executed", "lines-not-run")] * 2
    bn_line = line_of(dpt_like.PreActResidualLayer.forward, "self.batch_norm1(")
    assert f"line {bn_line} (under `if self.use_batch_norm`) never executes" in static[0].reason
    assert "PreActResidualLayer runs (2 instances)" in static[0].reason


def test_dpt_batch_norm_branch_on_is_confirmed(dpt_on):
    out = confirm_matches(dpt_on.model, dpt_on.example_inputs, [conv_bn_match(1), conv_bn_match(2)])
    static = [m for m in out if m.status != "runtime-only"]
    assert [m.status for m in static] == ["confirmed", "confirmed"]
    assert "Conv2d(8->8) + BatchNorm2d(8)" in static[0].reason
    # the returned matches are new objects carrying the original static data
    assert static[0].lines == conv_bn_match(1).lines and static[0].rule == "Conv_BatchNorm"


def test_lines_that_run_without_the_matched_data_flow_are_not_confirmed(dpt_on):
    # convolution1 does not feed batch_norm2: both lines run, the sequence does not
    (out,) = confirm_matches(dpt_on.model, dpt_on.example_inputs, [conv_bn_match(1, bn=2)], runtime_only=False)
    assert (out.status, out.trace_code) == ("not-executed", "not-fed")


def test_class_not_in_the_model_is_untraced(dpt_on):
    m = make_match("Linear_BatchNorm", dpt_like.NeedsArgs, [layer("torch.nn.Linear", 60, "NeedsArgs.forward", module="self.layers[0]")])
    (out,) = confirm_matches(dpt_on.model, dpt_on.example_inputs, [m], runtime_only=False)
    assert (out.status, out.trace_code) == ("untraced", "not-in-model")


def test_runtime_only_sequences_are_reported_with_their_lines(dpt_on):
    out = confirm_matches(dpt_on.model, dpt_on.example_inputs, [])
    by_rule = {m.rule: m for m in out}
    assert set(by_rule) == {"biased_GeLU", "Linear_BatchNorm", "Conv_BatchNorm"}
    assert all(m.status == "runtime-only" for m in out)
    gelu_line = line_of(dpt_like.Head.forward, "self.act(self.dense(")
    assert by_rule["biased_GeLU"].lines == [gelu_line, gelu_line]
    assert by_rule["biased_GeLU"].class_name == "Head"
    conv = line_of(dpt_like.PreActResidualLayer.forward, "self.convolution1(")
    conv_bn = [m for m in out if m.rule == "Conv_BatchNorm"]
    assert sorted(m.lines[0] for m in conv_bn) == [conv, line_of(dpt_like.PreActResidualLayer.forward, "self.convolution2(")]
    assert "in 2 instances" in conv_bn[0].reason
    # covered by a static match: no longer runtime-only, and the static one is confirmed with tanh GeLU
    out2 = confirm_matches(dpt_on.model, dpt_on.example_inputs, [head_gelu_match(), conv_bn_match(1), conv_bn_match(2)])
    assert {m.rule for m in out2 if m.status == "runtime-only"} == {"Linear_BatchNorm"}
    gelu = next(m for m in out2 if m.rule == "biased_GeLU")
    assert gelu.status == "confirmed" and "approximate='tanh'" in gelu.reason


def test_non_gelu_activation_rejects_biased_gelu(dpt_on):
    model = dpt_on.model
    original = model.head.act
    model.head.act = nn.ReLU()
    try:
        (out,) = confirm_matches(model, dpt_on.example_inputs, [head_gelu_match()], runtime_only=False)
    finally:
        model.head.act = original
    assert (out.status, out.trace_code) == ("rejected", "runtime-check")
    assert "activation is ReLU, not a GeLU" in out.reason  # the reason says which check failed


def test_gelu_kind_inspects_the_instance():
    from transformers.activations import ACT2FN

    from adopter.core.rules.biased_gelu import gelu_kind

    assert gelu_kind(nn.GELU())[0] == "none"
    assert gelu_kind(nn.GELU(approximate="tanh"))[0] == "tanh"
    assert gelu_kind(ACT2FN["gelu"])[0] == "none"
    assert gelu_kind(ACT2FN["gelu_new"])[0] == "tanh"
    assert gelu_kind(ACT2FN["quick_gelu"])[0] is None
    assert gelu_kind(ACT2FN["relu"]) == (None, "activation is ReLU, not a GeLU")


@pytest.mark.slow
def test_local_directory_with_config_and_weights(tmp_path):
    from transformers import BertConfig, BertModel

    original = BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                    intermediate_size=64, vocab_size=100))
    original.save_pretrained(tmp_path)
    built = build_model(str(tmp_path), device="cpu")
    assert type(built.model).__name__ == "BertModel" and built.forward_checked
    assert torch.equal(built.model.embeddings.word_embeddings.weight, original.embeddings.word_embeddings.weight)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    config_only = build_model(str(tmp_path), device="cpu", config_overrides={"num_hidden_layers": 2})
    assert len(config_only.model.encoder.layer) == 2
    (tmp_path / "config.json").unlink()
    with pytest.raises(TracingError, match="has no config.json"):
        build_model(str(tmp_path), device="cpu")


def test_module_instance_and_bad_device(dpt_on):
    built = build_model(dpt_on.model, device="cpu")
    assert built.model is dpt_on.model and set(built.example_inputs) == {"pixel_values"}
    with pytest.raises(TracingError, match="unknown device 'tpu'"):
        build_model(dpt_on.model, device="tpu")


@pytest.mark.parametrize("kwargs, status, reason", [
    ({}, "confirmed", "3 x Linear in=8 out=[8, 8, 8] bias=True"),
    ({"kv_hidden": 4}, "confirmed", "out=[8, 4, 4]"),  # grouped k/v: FusedQKV(kv_out_features=4)
    ({"value_bias": False}, "rejected", "projections differ in bias"),
])
def test_fused_qkv_runtime_shapes_and_biases(kwargs, status, reason):
    import attention_like
    from match_helpers import fused_qkv

    built = build_model(attention_like.SelfAttention, init_kwargs=kwargs, device="cpu",
                        example_inputs={"hidden_states": torch.randn(2, 5, 8)})
    (out,) = confirm_matches(built.model, built.example_inputs, [fused_qkv(attention_like.SelfAttention)])
    assert out.status == status and reason in out.reason


def test_fused_qkv_reading_different_tensors_is_not_confirmed():
    import attention_like
    from match_helpers import fused_qkv

    # a static match claiming all three read hidden_states; at runtime k/v read encoder_states
    built = build_model(attention_like.CrossAttention, device="cpu",
                        example_inputs={"hidden_states": torch.randn(2, 5, 8), "encoder_states": torch.randn(2, 3, 8)})
    (out,) = confirm_matches(built.model, built.example_inputs, [fused_qkv(attention_like.CrossAttention)])
    assert (out.status, out.trace_code) == ("not-executed", "inputs-differ")
