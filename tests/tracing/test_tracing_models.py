"""Confirmation on real transformers models (known model ids with fewer layers), with the
statuses that are true for them under transformers 5: SDPA attention by default, so the eager
softmax does not run; T5's ReLU feed-forward is not a GeLU; ResNet's conv+norm pairs run."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "tracing"))

from adopter.tracing import build_model, confirm_matches
from match_helpers import (
    biased_gelu,
    dropout_layernorm,
    fused_qkv,
    layer,
    line_of,
    make_match,
    softmax_in_function,
)

pytestmark = pytest.mark.slow


def statuses(out):
    return [(m.rule, m.class_name or m.function, m.status) for m in out]


# ------------------------------------------------------------------ BERT


def bert_matches():
    from transformers.models.bert import modeling_bert as mb

    return [
        dropout_layernorm(mb.BertSelfOutput),
        dropout_layernorm(mb.BertOutput),
        biased_gelu(mb.BertIntermediate),
        fused_qkv(mb.BertSelfAttention),
        softmax_in_function(mb.eager_attention_forward),
    ]


@pytest.mark.parametrize("attn, softmax_status", [(None, "not-executed"), ("eager", "confirmed")])
def test_bert_base_statuses(attn, softmax_status):
    built = build_model("bert-base-uncased", device="cpu", attn_implementation=attn,
                        config_overrides={"num_hidden_layers": 2})
    assert built.config._attn_implementation == (attn or "sdpa")
    out = confirm_matches(built.model, built.example_inputs, bert_matches())
    assert statuses(out) == [
        ("Dropout_LayerNorm", "BertSelfOutput", "confirmed"),
        ("Dropout_LayerNorm", "BertOutput", "confirmed"),
        ("biased_GeLU", "BertIntermediate", "confirmed"),
        ("fused_QKV", "BertSelfAttention", "confirmed"),
        ("softmax", "eager_attention_forward", softmax_status),
    ]  # and no runtime-only extras: every runtime sequence is covered
    assert "2 instances" in out[0].reason and "LayerNorm(768,)" in out[0].reason
    assert "GeLU exact" in out[2].reason and "Linear 768->3072 bias=True" in out[2].reason
    assert "3 x Linear in=768 out=[768, 768, 768] bias=True" in out[3].reason
    if softmax_status == "not-executed":
        assert out[4].trace_code == "lines-not-run"


def test_bert_runtime_only_when_static_pass_missed_them():
    from transformers.models.bert import modeling_bert as mb

    built = build_model("bert-base-uncased", device="cpu", config_overrides={"num_hidden_layers": 1})
    out = confirm_matches(built.model, built.example_inputs, [dropout_layernorm(mb.BertSelfOutput)])
    extra = {(m.rule, m.class_name, tuple(m.lines)) for m in out if m.status == "runtime-only"}
    d = line_of(mb.BertOutput.forward, "self.dropout(")
    a = line_of(mb.BertIntermediate.forward, "self.dense(")
    assert extra == {
        ("Dropout_LayerNorm", "BertOutput", (d, d + 1, d + 1)),
        ("biased_GeLU", "BertIntermediate", (a, a + 1)),
    }


# ------------------------------------------------------------------ GPT-2

GPT2_SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 2}


@pytest.mark.parametrize("attn, softmax_status", [(None, "not-executed"), ("eager", "confirmed")])
def test_gpt2_statuses(attn, softmax_status):
    from transformers.models.gpt2 import modeling_gpt2 as mg

    upcast_line = line_of(mg.GPT2Attention._upcast_and_reordered_attn, "softmax(")
    upcast = make_match("softmax", mg.GPT2Attention, [
        layer("torch.nn.functional.softmax", upcast_line, "GPT2Attention._upcast_and_reordered_attn",
              inputs=["attn_weights"], output=("attn_weights", 3)),
    ], function="_upcast_and_reordered_attn")
    summary = make_match("softmax", mg.GPT2SequenceSummary, [
        layer("torch.nn.Linear", line_of(mg.GPT2SequenceSummary.forward, "self.summary("),
              "GPT2SequenceSummary.forward", module="self.summary"),
    ])
    built = build_model("gpt2", device="cpu", attn_implementation=attn, config_overrides=GPT2_SMALL)
    out = confirm_matches(built.model, built.example_inputs,
                          [softmax_in_function(mg.eager_attention_forward), upcast, summary])
    assert statuses(out) == [
        ("softmax", "eager_attention_forward", softmax_status),
        ("softmax", "GPT2Attention", "not-executed"),  # reorder_and_upcast_attn is off
        ("softmax", "GPT2SequenceSummary", "untraced"),  # only in GPT2DoubleHeadsModel
    ]
    assert [m.trace_code for m in out] == ["lines-not-run" if softmax_status == "not-executed" else "",
                                           "lines-not-run", "not-in-model"]


# ------------------------------------------------------------------ T5

T5_SMALL = {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 2, "d_kv": 32}


def test_t5_relu_feed_forward_is_not_a_gelu():
    from transformers.models.t5 import modeling_t5 as mt

    built = build_model("t5-small", device="cpu", config_overrides=T5_SMALL)
    act = biased_gelu(mt.T5DenseActDense, linear_needle="self.wi(", act_needle="self.act(",
                      linear_attr="self.wi", act_attr="self.act")
    gated = biased_gelu(mt.T5DenseGatedActDense, linear_needle="self.wi_0(", act_needle="self.act(",
                        linear_attr="self.wi_0", act_attr="self.act")
    out = confirm_matches(built.model, built.example_inputs,
                          [act, gated, softmax_in_function(mt.eager_attention_forward)])
    sdpa = built.config._attn_implementation == "sdpa"
    assert statuses(out) == [
        ("biased_GeLU", "T5DenseActDense", "rejected"),  # t5-small: dense_act_fn relu
        ("biased_GeLU", "T5DenseGatedActDense", "untraced"),  # gated FF only in v1.1/flan configs
        ("softmax", "eager_attention_forward", "not-executed" if sdpa else "confirmed"),
    ]
    assert "activation is ReLU, not a GeLU" in out[0].reason


def test_t5_gated_gelu_is_tanh_gelu():
    from transformers.models.t5 import modeling_t5 as mt

    built = build_model("t5-small", device="cpu", config_overrides={**T5_SMALL, "feed_forward_proj": "gated-gelu"})
    gated = biased_gelu(mt.T5DenseGatedActDense, linear_needle="self.wi_0(", act_needle="self.act(",
                        linear_attr="self.wi_0", act_attr="self.act")
    (out,) = [m for m in confirm_matches(built.model, built.example_inputs, [gated]) if m.status != "runtime-only"]
    assert out.status == "confirmed"
    assert "kernel approximate='tanh'" in out.reason and "bias=False" in out.reason


# ------------------------------------------------------------------ ResNet

RESNET_SMALL = {"depths": [1, 1, 1, 1], "hidden_sizes": [16, 32, 64, 128], "embedding_size": 16, "image_size": 64}


def test_resnet_conv_batchnorm_confirmed():
    from transformers.models.resnet import modeling_resnet as mr

    def conv_bn(cls, x):
        fn = f"{cls.__name__}.forward"
        c = line_of(cls.forward, "self.convolution(")
        b = line_of(cls.forward, "self.normalization(")
        return make_match("Conv_BatchNorm", cls, [
            layer("torch.nn.Conv2d", c, fn, module="self.convolution", inputs=[x], output="h1"),
            layer("torch.nn.BatchNorm2d", b, fn, module="self.normalization", inputs=["h1"], output="h2"),
        ])

    built = build_model("microsoft/resnet-50", device="cpu", config_overrides=RESNET_SMALL)
    assert built.example_inputs["pixel_values"].shape == (2, 3, 64, 64)
    out = confirm_matches(built.model, built.example_inputs,
                          [conv_bn(mr.ResNetConvLayer, "hidden_states"), conv_bn(mr.ResNetShortCut, "input")])
    assert statuses(out) == [
        ("Conv_BatchNorm", "ResNetConvLayer", "confirmed"),
        ("Conv_BatchNorm", "ResNetShortCut", "confirmed"),
        # the bottleneck's residual add + ReLU, a sequence of another rule no match given here covers
        ("Add_ReLU", "ResNetBottleNeckLayer", "runtime-only"),
    ]
    assert "runs in 13 instances" in out[0].reason  # stem + 3 per bottleneck x 4 stages
    assert "runs in 3 instances" in out[1].reason  # stages 2-4 downsample
