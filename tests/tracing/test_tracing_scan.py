"""Tracing with the real scanner: `adopter trace`, `adopter scan --model` and confirmation of
the matches extraction finds in the DPT-like fixture."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(HERE, "fixtures", "tracing", "dpt_like.py")
sys.path.insert(0, os.path.join(HERE, "fixtures", "tracing"))

import dpt_like

from adopter.cli import main


def scan(path):
    from adopter.core.scan import scan_paths

    return scan_paths([path]).matches


def by_rule_line(matches):
    return {(m.rule, m.lines[0]): m for m in matches}


@pytest.mark.parametrize("use_batch_norm", [False, True])
def test_scanned_dpt_fixture_confirmation(use_batch_norm):
    from adopter.tracing import build_model, confirm_matches

    static = scan(FIXTURE)
    assert sorted({m.rule for m in static}) == ["Conv_BatchNorm", "Linear_BatchNorm", "biased_GeLU"]
    built = build_model(dpt_like.DPTLikeModel, init_kwargs={"use_batch_norm": use_batch_norm}, device="cpu")
    out = confirm_matches(built.model, built.example_inputs, static)
    assert len(out) == len(static)  # every runtime sequence was found statically
    conv_bn = [m for m in out if m.rule == "Conv_BatchNorm"]
    assert len(conv_bn) == 2
    assert {m.status for m in conv_bn} == {"confirmed" if use_batch_norm else "not-executed"}
    others = {m.rule: m for m in out if m.rule != "Conv_BatchNorm"}
    assert others["biased_GeLU"].status == "confirmed" and "approximate='tanh'" in others["biased_GeLU"].reason
    assert others["Linear_BatchNorm"].status == "confirmed"


def test_trace_command_unknown_model(capsys):
    assert main(["trace", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adopter trace: error: unknown model id 'no-such-model'; known model ids: ")
    assert "tiny-bert" in err and err.count("\n") == 1


def test_trace_command_lists_models(capsys):
    assert main(["trace", "--list-models"]) == 0
    assert "meta-llama/Llama-2-7b-hf" in capsys.readouterr().out.split()
    assert main(["trace"]) == 2
    assert "--model ID is required" in capsys.readouterr().err


@pytest.mark.slow
def test_trace_command_json_on_tiny_bert(capsys):
    assert main(["trace", "--model", "tiny-bert", "--device", "cpu", "--format", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert {"files_scanned", "seconds", "errors", "matches", "model", "capture"} <= set(payload)
    assert payload["model"]["id"] == "tiny-bert" and payload["model"]["class"] == "BertModel"
    assert payload["capture"]["method"] == "export"
    got = {(m["rule"], m["class"] or m["function"]): m["status"] for m in payload["matches"]}
    assert got[("Dropout_LayerNorm", "BertSelfOutput")] == "confirmed"
    assert got[("Dropout_LayerNorm", "BertOutput")] == "confirmed"
    assert got[("biased_GeLU", "BertIntermediate")] == "confirmed"
    assert got[("fused_QKV", "BertSelfAttention")] == "confirmed"
    assert got[("softmax", "eager_attention_forward")] == "not-executed"
    assert got[("biased_GeLU", "BertPredictionHeadTransform")] == "untraced"  # not part of BertModel
    # the cause of each status that has several, as a code in the JSON (none for a confirmed match)
    codes = {(m["rule"], m["class"] or m["function"]): m.get("trace_code") for m in payload["matches"]}
    assert codes[("softmax", "eager_attention_forward")] == "lines-not-run"
    assert codes[("biased_GeLU", "BertPredictionHeadTransform")] == "not-in-model"
    assert codes[("fused_QKV", "BertSelfAttention")] is None
    softmax = next(m for m in payload["matches"] if m["rule"] == "softmax")
    assert "attn_implementation=sdpa" in softmax["reason"]


@pytest.mark.slow
def test_trace_command_eager_attention_confirms_softmax(capsys):
    assert main(["trace", "--model", "tiny-bert", "--device", "cpu", "--attn-implementation", "eager",
                 "--set", "num_hidden_layers=1", "--rules", "softmax"]) == 0
    out = capsys.readouterr().out
    assert "attention eager" in out
    line = next(ln for ln in out.splitlines() if "eager_attention_forward" in ln)
    assert "confirmed" in line


@pytest.mark.slow
def test_scan_with_model_uses_confirm_model_id(capsys):
    from adopter.tracing import build_model

    src = [f for f in build_model("tiny-bert", device="meta").source_files if f.endswith("modeling_bert.py")][0]
    assert main(["scan", src, "--model", "tiny-bert", "--device", "cpu", "--format", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    statuses = {m["status"] for m in payload["matches"]}
    assert "static" not in statuses and "confirmed" in statuses


REAL_SCAN_CASES = {
    "gpt2": (["n_layer=1", "n_embd=64", "n_head=2"], {
        ("softmax", "eager_attention_forward"): "not-executed",
    }),
    "t5-small": (["num_layers=1", "num_decoder_layers=1", "d_model=64", "d_ff=128", "num_heads=2", "d_kv=32"], {
        ("softmax", "eager_attention_forward"): "not-executed",
    }),
    "microsoft/resnet-50": (["depths=[1,1,1,1]", "image_size=64"], {
        ("Conv_BatchNorm", "ResNetConvLayer"): "confirmed",
        ("Conv_BatchNorm", "ResNetShortCut"): "confirmed",
    }),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_id", sorted(REAL_SCAN_CASES))
def test_trace_command_real_scan_statuses(model_id, capsys):
    overrides, expected = REAL_SCAN_CASES[model_id]
    argv = ["trace", "--model", model_id, "--device", "cpu", "--format", "json"]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    got = {(m["rule"], m["class"] or m["function"]): m["status"] for m in payload["matches"]}
    for key, status in expected.items():
        assert got.get(key) == status, (key, got)
    assert "static" not in got.values()  # every match got a runtime status
    assert not [m for m in payload["matches"] if m["status"] == "runtime-only"], "scanner missed a sequence"


@pytest.mark.slow
def test_trace_command_when_capture_fails_reports_untraced(monkeypatch, capsys):
    import adopter.tracing as tracing
    from adopter.tracing.capture import CaptureError

    def fail(model, inputs):
        raise CaptureError("could not capture BertModel (export: RuntimeError: boom)", {"export": "RuntimeError: boom"})

    monkeypatch.setattr(tracing, "capture_model", fail)
    assert main(["trace", "--model", "tiny-bert", "--device", "meta", "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert "could not trace tiny-bert" in captured.err and captured.err.count("\n") == 1
    payload = json.loads(captured.out)
    assert payload["capture"] == {"method": None, "failed": {"export": "RuntimeError: boom"}}
    # (refused matches stay refused: transformers' eager_attention_forward, sdpa_attention's probs-read)
    traced = [m for m in payload["matches"] if m["status"] != "refused"]
    assert traced and {(m["status"], m["trace_code"]) for m in traced} == {("untraced", "capture-failed")}
    assert all("RuntimeError: boom" in m["reason"] for m in traced)  # the reason carries the error
