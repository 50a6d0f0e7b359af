"""benchmarks/bench_zoo.py: the case list, --list, and the "never slower" summary of verify results
(fabricated result dicts: no verify runs here)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_zoo as zoo  # noqa: E402


def _bench(ratio, low, high, memory=1.0, batch=4, **extra):
    return {"batch_size": batch, "speed_ratio": ratio, "speed_ratio_low": low, "speed_ratio_high": high,
            "memory_ratio": memory, **extra}


def _result(bench=None, *, equivalent=True, applied=None, **extra):
    applied = [{"rule": "softmax", "class": "Attention"}] if applied is None else applied
    out = {"equivalence": {"equivalent": equivalent}, "rules_applied": applied, **extra}
    if bench is not None:
        out["benchmark"] = bench
    return out


def test_the_case_list_parses():
    names = [c.name for c in zoo.CASES]
    assert len(names) == len(set(names)) == 10
    assert zoo.parse_cases(None) == list(zoo.CASES) and zoo.parse_cases("") == list(zoo.CASES)
    picked = zoo.parse_cases("small-cnn-infer, llama-tiny-train,small-cnn-infer")
    assert [c.name for c in picked] == ["small-cnn-infer", "llama-tiny-train"]
    with pytest.raises(ValueError, match="unknown case.*nope"):
        zoo.parse_cases("llama-tiny-train,nope")
    for case in zoo.CASES:
        argv = case.verify_argv(json_path="r.json", benchmark_json="b.json", model_args_path="m.json",
                                ablation_seconds=10, blocks=6)
        assert argv[:3] == ["verify", "--model", case.model]
        assert argv[argv.index("--threads") + 1] == "1" and argv[-1] == "--quiet"
        assert argv[argv.index("--json") + 1] == "r.json" and argv[argv.index("--benchmark-json") + 1] == "b.json"
        assert argv[argv.index("--blocks") + 1] == "6" and argv[argv.index("--ablation-seconds") + 1] == "10"
        assert ("--model-args" in argv) == (case.model_args is not None)
        assert case.mode in ("train", "inference")
        for folder in case.pythonpath:  # user code: the module verify imports is on that path
            assert (ROOT / folder).is_dir(), folder
        if ":" in case.model:
            module = case.model.partition(":")[0]
            assert any((ROOT / folder / f"{module}.py").is_file() for folder in case.pythonpath), case.name
            assert "--batch-sizes" not in argv  # verify refuses it for user code


def test_list_prints_every_case_and_its_command():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_zoo.py"), "--list"], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    for case in zoo.CASES:
        assert f"{case.name}: " in r.stdout
    assert "python -m adopter verify --model microsoft/resnet-50 --mode inference --batch-sizes 1,8 --channels-last" \
        in r.stdout
    assert "PYTHONPATH=benchmarks:tests/corpus/llm_styles python -m adopter verify --model bench_zoo:nanogpt" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_zoo.py"), "--cases", "nope", "--list"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "unknown case(s) nope" in bad.stderr


def test_never_slower_is_the_interval_low_end():
    assert zoo.never_slower(0.99) and zoo.never_slower(1.2)
    assert not zoo.never_slower(0.989) and not zoo.never_slower(None) and not zoo.never_slower(math.nan)

    ok = zoo.summarize(_result(_bench(1.03, 0.995, 1.06, memory=0.8)), batch="4x32")
    assert ok["passed"] and ok["never_slower"] and ok["equivalent"]
    assert ok["rows"] == [{"batch": "4x32", "speed_ratio": 1.03, "speed_ratio_low": 0.995, "speed_ratio_high": 1.06,
                           "memory_ratio": 0.8, "verdict": "", "never_slower": True}]

    slower = zoo.summarize(_result(_bench(1.01, 0.98, 1.04)))
    assert not slower["never_slower"] and not slower["passed"] and slower["equivalent"]

    # an inference sweep: every batch size must be never slower
    sweep = _bench(1.1, 1.0, 1.2, batch=1, sweep=[_bench(1.1, 1.0, 1.2, batch=1), _bench(0.97, 0.95, 0.99, batch=8)])
    swept = zoo.summarize(_result({**sweep, "mode": "inference"}))
    assert [r["batch"] for r in swept["rows"]] == [1, 8] and swept["mode"] == "inference"
    assert [r["never_slower"] for r in swept["rows"]] == [True, False] and not swept["passed"]

    # fast but not equivalent: fails
    assert not zoo.summarize(_result(_bench(1.5, 1.4, 1.6), equivalent=False))["passed"]
    # channels_last equivalence counts too
    cl = zoo.summarize(_result(equivalence_channels_last={"equivalent": False},
                               benchmark_skipped="not equivalent on channels_last inputs"))
    assert not cl["equivalent"] and not cl["passed"]


def test_summary_of_skipped_dropped_and_crashed_runs():
    # nothing rewritten: the optimized model is the original, never slower by construction
    same = zoo.summarize(_result(applied=[], benchmark_skipped="no rule applied: the optimized model is the original"))
    assert same["passed"] and same["rows"] == [] and same["benchmark_skipped"].startswith("no rule applied")

    applied = [{"rule": "softmax", "class": "Attention"},
               {"rule": "RMSNorm", "class": "RMSNorm", "not_applied": "costs more than it saves here: ..."}]
    dropped = zoo.summarize(_result(_bench(1.0, 0.99, 1.01), applied=applied,
                                    benchmark_with_every_rule=_bench(0.9, 0.88, 0.92)))
    assert dropped["passed"] and dropped["rules_applied"] == 2 and dropped["rules_not_applied"] == ["RMSNorm (RMSNorm)"]
    assert dropped["benchmark_with_every_rule"][0]["speed_ratio"] == 0.9
    assert not dropped["benchmark_with_every_rule"][0]["never_slower"]

    crashed = zoo.summarize(None, mode="inference", error="exit 2: adopter: error: cannot optimize Net: boom")
    assert not crashed["passed"] and crashed["error"].endswith("boom") and crashed["equivalent"] is None

    entries = [{"case": "a", "batch": "4", "summary": dropped}, {"case": "b", "batch": "", "summary": crashed},
               {"case": "c", "batch": "", "summary": same}, {"case": "d", "batch": "", "summary": zoo.summarize(
                   _result(_bench(0.95, 0.9, 0.97)), batch="2")}]
    table = zoo.markdown_table(entries)
    lines = table.splitlines()
    assert lines[0].startswith("| case | mode | batch | speed ratio [95% low-high] | memory ratio | equivalent | never slower")
    assert "| a | train | 4 | 1.000 [0.990-1.010] | 1.000 | yes | yes | 2 (RMSNorm (RMSNorm)) |" in table
    assert "with every kernel (batch 4): 0.900 [0.880-0.920]" in table
    assert "| b | inference |  | n/a | n/a | n/a | n/a | 0 | error: exit 2: adopter: error: cannot optimize Net: boom |" \
        in table
    assert "| c | train |  | n/a | n/a | yes | yes (original model) |" in table
    assert "| d | train | 2 | 0.950 [0.900-0.970] | 1.000 | yes | **no** |" in table
    assert zoo.exit_status(entries[:1]) == 0 and zoo.exit_status(entries) == 1
    assert zoo.exit_status([entries[0], entries[2]]) == 0


def test_a_crashing_verify_is_reported_by_its_last_stderr_line(monkeypatch, tmp_path):
    class Done:
        returncode = 1
        stderr = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: kernel exploded\n"

    seen = {}
    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        if cmd[1:3] != ["-m", "adopter"]:
            return real_run(cmd, **kwargs)  # platform.platform() runs uname
        seen["cmd"], seen["env"] = cmd, kwargs["env"]
        return Done()

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    args = zoo.argparse.Namespace(ablation_seconds=10.0, blocks=None, bench_seconds=None, timeout=5)
    entry = zoo.run_case(zoo.CASES_BY_NAME["small-cnn-infer"], args, tmp_path)
    assert seen["cmd"][1:4] == ["-m", "adopter", "verify"]
    assert str(ROOT / "tests/corpus/styles") in seen["env"]["PYTHONPATH"].split(":")
    assert json.loads((tmp_path / "small-cnn-infer.model-args.json").read_text())["inputs"]["x"]["shape"][0] == 4
    assert entry["summary"]["error"] == "exit 1: RuntimeError: kernel exploded" and not entry["summary"]["passed"]
    assert entry["command"].startswith("PYTHONPATH=tests/corpus/styles python -m adopter verify --model ")
    out = tmp_path / "zoo.json"
    assert zoo.merge_entries([{"case": "llama-tiny-train", "summary": {}}, {"case": "small-cnn-infer", "summary": {}}],
                             [entry])[1] is entry
    monkeypatch.setattr(zoo.sys, "argv", ["bench_zoo.py"])
    assert zoo.main(["--cases", "small-cnn-infer", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert [e["case"] for e in doc["cases"]] == ["small-cnn-infer"] and doc["torch"]
    assert "RuntimeError: kernel exploded" in out.with_suffix(".md").read_text()


def test_the_factories_build_their_corpus_models(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "corpus" / "llm_styles"))
    model, inputs = zoo.nanogpt(vocab_size=65, n_layer=1, n_embd=32, block_size=16, batch_size=2)
    assert type(model).__name__ == "GPT" and inputs["idx"].shape == inputs["targets"].shape == (2, 16)
    logits, loss = model(**inputs)
    assert logits.shape == (2, 16, 65) and loss.dim() == 0
    model, inputs = zoo.llama2c(dim=32, n_layers=1, n_heads=4, vocab_size=50, seq_len=8, batch_size=3)
    assert type(model).__name__ == "Transformer" and inputs["tokens"].shape == (3, 8)
    assert model(**inputs).shape == (3, 8, 50)


def test_a_case_whose_rules_were_all_dropped_is_never_slower_by_construction():
    result = {"equivalence": {"equivalent": True}, "identical_to_original": True,
              "rules_applied": [{"rule": "A", "not_applied": "never fused"}],
              "benchmark": {"mode": "train", "batch_size": 4, "speed_ratio": 1.0, "speed_ratio_low": 0.98,
                            "speed_ratio_high": 1.02, "memory_ratio": 1.0}}
    s = zoo.summarize(result)
    assert s["never_slower"] and s["identical_to_original"]
    del result["identical_to_original"]
    assert not zoo.summarize(result)["never_slower"]  # (measured rows decide otherwise)


def test_a_case_measured_slower_is_run_again_up_to_retry_times_and_errors_are_not(monkeypatch, tmp_path):
    def entry(low, *, equivalent=True, error=None):
        row = {"batch": 4, "speed_ratio": 1.0, "speed_ratio_low": low, "speed_ratio_high": 1.02,
               "memory_ratio": 1.0, "verdict": "", "never_slower": zoo.never_slower(low)}
        return {"case": "small-cnn-infer", "date": "d", "summary": {
            "rows": [] if error else [row], "equivalent": equivalent, "error": error,
            "passed": bool(equivalent and not error and zoo.never_slower(low))}}

    runs = []

    def fake(lows):
        def run_case(case, args, tmp):
            runs.append(case.name)
            return lows.pop(0)
        return run_case

    case = zoo.CASES_BY_NAME["small-cnn-infer"]
    monkeypatch.setattr(zoo, "run_case", fake([entry(0.97), entry(0.995)]))
    got = zoo.run_with_retries(case, zoo.argparse.Namespace(retry=1), tmp_path)
    assert got["summary"]["passed"] and len(runs) == 2 and got["earlier_attempts"][0]["rows"][0]["speed_ratio_low"] == 0.97
    runs.clear()
    monkeypatch.setattr(zoo, "run_case", fake([entry(0.97), entry(0.96), entry(1.0)]))
    got = zoo.run_with_retries(case, zoo.argparse.Namespace(retry=1), tmp_path)
    assert not got["summary"]["passed"] and len(runs) == 2  # the last run counts
    runs.clear()
    for bad in (entry(0.97, equivalent=False), entry(1.0, error="exit 2: boom")):
        monkeypatch.setattr(zoo, "run_case", fake([bad, entry(1.0)]))
        got = zoo.run_with_retries(case, zoo.argparse.Namespace(retry=3), tmp_path)
        assert got is bad and "earlier_attempts" not in got
    assert len(runs) == 2
