"""What a verify result says it measured — the model, each applied rule's location and the kernel
backend that ran there — and the regression gate's checks on it."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from adopter.kernels.telemetry import source_file as site_file
from test_verify import BERT_FILE, _applied, _result
from torch import nn

from adopter import kernels
from adopter.verification.gate import evaluate_gate, format_report, load_json, write_json
from adopter.verification.run import attribute_kernel_calls, portable_path

RELU_REASON = "activation is ReLU, not a GeLU the kernel computes"


def _failures(current: dict, baseline: dict) -> list[str]:
    gate = evaluate_gate(current, baseline, 0.05, "base.json")
    assert gate.passed == (not [c for c in gate.checks if not c.ok])
    return [f"{c.name}: {c.detail}" for c in gate.checks if not c.ok]


# ---------------------------------------------------------------- the gate


def test_unedited_baseline_passes():
    assert _failures(_result(), _result()) == []


def test_different_model_id_fails():
    baseline = _result()
    baseline["model"]["id"] = "bert-base-uncased"
    assert _failures(_result(), baseline) == ["model: different model id: tiny-bert; baseline: bert-base-uncased"]


def test_different_model_class_fails_without_comparing_its_rules():
    baseline = _result(rules=("fused_QKV",))
    baseline["model"]["class"] = "RobertaModel"
    # another model's rule locations are not comparable: one line, not one per location
    assert _failures(_result(), baseline) == ["model: different model class: BertModel; baseline: RobertaModel"]


def test_rule_location_removed_fails():
    baseline = _result(rules=("Dropout_LayerNorm", "biased_GeLU", "fused_QKV"))
    assert _failures(_result(), baseline) == [
        f"applied rules: fused_QKV no longer applied at {BERT_FILE} BertSelfAttention.forward"
    ]


def test_rule_location_added_fails():
    current = _result()
    moved = _applied("Dropout_LayerNorm")
    moved.update({"class": "BertSelfOutput", "where": "modeling_bert.py:2 (BertSelfOutput.forward)"})
    current["rules_applied"].append(moved)
    assert _failures(current, _result()) == [
        f"applied rules: Dropout_LayerNorm now also applied at {BERT_FILE} BertSelfOutput.forward (not in the baseline)"
    ]


def test_rule_applied_a_different_number_of_times_at_a_location_fails():
    current = _result(rules=("Dropout_LayerNorm", "Dropout_LayerNorm", "biased_GeLU"))
    assert _failures(current, _result()) == [
        f"applied rules: Dropout_LayerNorm applied 2 time(s) at {BERT_FILE} BertOutput.forward; baseline: 1"
    ]


def test_moved_lines_and_other_absolute_paths_pass():
    current = _result()
    for entry in current["rules_applied"]:
        entry["lines"] = [n + 40 for n in entry["lines"]]
        entry["file"] = "/another/machine/site-packages/" + BERT_FILE
    assert _failures(current, _result()) == []


def test_fused_kernel_falling_back_to_the_original_fails():
    current = _result()
    gelu = current["rules_applied"][1]
    gelu["kernel_calls"] = {"kernels": ["linear_gelu"], "backends": {"original": 2}, "fallbacks": {RELU_REASON: 2}}
    assert _failures(current, _result()) == [
        f"kernel backends: biased_GeLU at {BERT_FILE} BertIntermediate.forward ran on original "
        f"(fallback: {RELU_REASON}) in the measured step; baseline: torch"
    ]


def test_kernel_no_longer_called_fails_and_a_new_backend_fails():
    current = _result()
    current["rules_applied"][0]["kernel_calls"] = {"kernels": [], "backends": {}}
    current["rules_applied"][1]["kernel_calls"]["backends"] = {"torch": 1, "triton": 1}
    assert _failures(current, _result()) == [
        f"kernel backends: Dropout_LayerNorm at {BERT_FILE} BertOutput.forward called no adopter kernel in the "
        "measured step; baseline: torch",
        f"kernel backends: biased_GeLU at {BERT_FILE} BertIntermediate.forward ran on torch, triton in the "
        "measured step; baseline: torch",
    ]


def test_call_counts_alone_do_not_fail():
    current = _result()
    current["rules_applied"][0]["kernel_calls"]["backends"] = {"torch": 7}
    assert _failures(current, _result()) == []


def test_baseline_without_locations_or_backends_asks_to_regenerate_it():
    old = _result()
    del old["kernel_calls"]
    for entry in old["rules_applied"]:
        del entry["path"], entry["kernel_calls"]
    failures = _failures(_result(), old)
    assert failures == [
        "baseline format: the baseline records no rule locations or kernel backends (written by an older "
        "adopter): regenerate it with `adopter verify --model tiny-bert --save-baseline base.json`"
    ]
    # the rules are still compared by name, so a lost rule is still named
    assert any("lost: biased_GeLU x1" in f for f in _failures(_result(rules=("Dropout_LayerNorm",)), old))


def test_result_without_a_measured_step_still_compares_locations():
    current = _result()
    del current["kernel_calls"]
    for entry in current["rules_applied"]:
        entry["kernel_calls"] = None
    assert _failures(current, _result()) == []


def test_report_shows_model_and_backend_per_rule_location():
    current = _result()
    current["rules_applied"][1]["kernel_calls"] = {
        "kernels": ["linear_gelu"], "backends": {"original": 2}, "fallbacks": {RELU_REASON: 2},
    }  # fmt: skip
    text = format_report(current, evaluate_gate(current, _result(), 0.05))
    assert "model: tiny-bert (BertModel" in text
    lines = text.splitlines()
    assert any("Dropout_LayerNorm" in line and line.endswith("confirmed  torch x2") for line in lines)
    assert any(line.endswith(f"confirmed  original x2 (fallback: {RELU_REASON})") for line in lines)
    assert f"[FAIL] kernel backends: biased_GeLU at {BERT_FILE} BertIntermediate.forward ran on original" in text


# ---------------------------------------------------------------- counting what ran where


class GeluNormBlock(nn.Module):
    """Calls two kernels from one function, as a rewrite with two rules applied there would."""

    def __init__(self, activation: nn.Module, width: int = 8):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.act = activation
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        h = kernels.linear_gelu(self.dense, self.act, x)
        return kernels.dropout_add_layer_norm(self.dropout, self.norm, h, x)


def residual_norm(dropout, norm, x, residual):
    return kernels.dropout_add_layer_norm(dropout, norm, x, residual)


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.gelu = GeluNormBlock(nn.GELU())
        self.relu = GeluNormBlock(nn.ReLU())  # same class: its linear_gelu falls back
        self.dropout = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return residual_norm(self.dropout, self.norm, self.relu(self.gelu(x)), x)


def _entry(rule: str, cls: str | None, function: str, file: str = __file__) -> dict:
    return {"rule": rule, "file": file, "lines": [1], "class": cls, "function": function, "status": "confirmed"}


def test_calls_are_attributed_to_the_rule_location_they_were_made_from():
    model = TwoBlocks().train()
    with kernels.count_kernel_calls() as counted:
        model(torch.randn(3, 8)).sum().backward()
    applied = [
        _entry("biased_GeLU", "GeluNormBlock", "forward"),
        _entry("Dropout_LayerNorm", "GeluNormBlock", "forward"),
        _entry("Dropout_LayerNorm", None, "residual_norm"),
        _entry("Dropout_LayerNorm", "Elsewhere", "forward"),  # nothing called from there
    ]
    record = attribute_kernel_calls(applied, counted.calls)
    gelu, norm, free, elsewhere = (entry["kernel_calls"] for entry in applied)
    assert gelu == {
        "kernels": ["linear_gelu"], "backends": {"original": 1, "torch": 1}, "fallbacks": {RELU_REASON: 1},
    }  # fmt: skip
    assert norm == {"kernels": ["dropout_add_layer_norm"], "backends": {"torch": 2}}
    assert free == {"kernels": ["dropout_add_layer_norm"], "backends": {"torch": 1}}
    assert elsewhere == {"kernels": [], "backends": {}}
    assert {entry["path"] for entry in applied} == {portable_path(__file__)}
    assert all(call["attributed"] for call in record["calls"])
    assert {call["function"] for call in record["calls"]} == {"GeluNormBlock.forward", "residual_norm"}
    # the result (attributed entries, the calls) is plain JSON
    assert json.loads(json.dumps({"rules_applied": applied, "kernel_calls": record}))["rules_applied"] == applied


def test_calls_of_a_site_without_an_applied_rule_are_marked_unattributed():
    with kernels.count_kernel_calls() as counted:
        GeluNormBlock(nn.GELU())(torch.randn(2, 8))
    applied = [_entry("biased_GeLU", "GeluNormBlock", "forward")]
    record = attribute_kernel_calls(applied, counted.calls)
    assert applied[0]["kernel_calls"]["kernels"] == ["linear_gelu"]
    stray = [c for c in record["calls"] if not c["attributed"]]
    assert [c["kernel"] for c in stray] == ["dropout_add_layer_norm"]
    result = _result()
    result["kernel_calls"] = record
    assert "not from an applied rule: dropout_add_layer_norm" in format_report(result)


def test_rewritten_module_pseudo_files_name_the_original_file():
    assert site_file("<adopter rewrite of /x/pkg/mod.py [0b371612fafa]>") == "/x/pkg/mod.py"
    assert site_file("/x/pkg/mod.py<adopter-rewritten _adopter_rewritten_mod_12ab>") == "/x/pkg/mod.py"
    assert site_file("/x/pkg/mod.py") == "/x/pkg/mod.py"


def test_portable_path_is_relative_to_the_longest_sys_path_root(tmp_path, monkeypatch):
    nested = tmp_path / "lib" / "site-packages"
    (nested / "pkg").mkdir(parents=True)
    source = nested / "pkg" / "mod.py"
    source.write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(nested))
    assert portable_path(str(source)) == "pkg/mod.py"
    assert portable_path(os.path.join(str(nested), "pkg", "..", "pkg", "mod.py")) == "pkg/mod.py"
    assert portable_path("<string>") == "<string>"
    import transformers.models.bert.modeling_bert as bert

    assert portable_path(bert.__file__) == BERT_FILE


def test_result_with_kernel_calls_round_trips_through_json(tmp_path):
    result = _result()
    model = GeluNormBlock(nn.ReLU()).train()
    with kernels.count_kernel_calls() as counted:
        model(torch.randn(2, 8))
    result["rules_applied"] = [_entry("biased_GeLU", "GeluNormBlock", "forward")]
    result["kernel_calls"] = attribute_kernel_calls(result["rules_applied"], counted.calls)
    path = tmp_path / "result.json"
    write_json(str(path), result)
    loaded = load_json(str(path), "baseline")
    assert loaded == json.loads(json.dumps(result))
    assert loaded["rules_applied"][0]["kernel_calls"]["fallbacks"] == {RELU_REASON: 1}
    assert evaluate_gate(loaded, result, 0.05).passed
    assert evaluate_gate(copy.deepcopy(loaded), loaded, 0.05).passed


def test_step_kernel_calls_counts_one_step():
    from adopter.verification.benchmark import step_kernel_calls

    model = GeluNormBlock(nn.GELU())
    calls = step_kernel_calls(lambda: model(torch.randn(2, 8)))
    assert sorted((c.kernel, c.backend, c.function, c.count) for c in calls) == [
        ("dropout_add_layer_norm", "torch", "GeluNormBlock.forward", 1),
        ("linear_gelu", "torch", "GeluNormBlock.forward", 1),
    ]


@pytest.mark.slow
def test_real_rewrite_is_attributed_through_the_in_memory_module(toy):
    """optimize() loads rewritten source under a pseudo file name; its calls still land on the
    applied rule's location, and a guard falling back (a hook on the LayerNorm) is recorded."""
    from adopter.optimizing.optimize import optimize

    optimized_cls = optimize(
        toy.ToyModel, rules=["Dropout_LayerNorm"], init_kwargs={"width": 8}, example_inputs=(torch.randn(5, 8),)
    )
    applied = [a.to_json() for a in optimized_cls.adopter_report.applied]
    assert [(a["rule"], a["class"], a["function"]) for a in applied] == [("Dropout_LayerNorm", "Block", "forward")]
    model = optimized_cls(width=8).train()
    model.blocks[1].norm.register_forward_hook(lambda *args: None)
    with kernels.count_kernel_calls() as counted:
        model(torch.randn(5, 8)).sum().backward()
    record = attribute_kernel_calls(applied, counted.calls)
    assert applied[0]["path"] == "toy_pkg/layers.py"
    assert applied[0]["kernel_calls"] == {
        "kernels": ["dropout_add_layer_norm"],
        "backends": {"original": 1, "torch": 1},
        "fallbacks": {"LayerNorm has hooks": 1},
    }
    assert {c["file"] for c in record["calls"]} == {"toy_pkg/layers.py"}
    assert sys.modules["toy_pkg.layers"].__file__.endswith(os.path.join("toy_pkg", "layers.py"))
