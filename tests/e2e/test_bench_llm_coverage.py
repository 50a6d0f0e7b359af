"""benchmarks/bench_llm_coverage.py: family classification, reason kinds, and a real run on llama/gpt2/bert."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_llm_coverage as bench

LLAMA = "transformers/models/llama/modeling_llama.py"


def test_classify_families_from_the_auto_mappings():
    mappings = bench.auto_mappings()
    assert any(cls == "LlamaForCausalLM" for _, cls in mappings[bench.CAUSAL_MAPPING])
    files = {f.parent.name: f for f in bench.modeling_files(["llama", "gpt2", "bert", "bart", "vit"])}
    kinds = {name: bench.classify_file(path, mappings) for name, path in files.items()}
    assert kinds["llama"]["kind"] == "decoder-only" and kinds["llama"]["class"] == "LlamaForCausalLM"
    assert kinds["llama"]["module"] == "transformers.models.llama.modeling_llama"
    assert kinds["gpt2"]["kind"] == "decoder-only" and kinds["gpt2"]["class"] == "GPT2LMHeadModel"
    assert kinds["bert"]["kind"].startswith("encoder")
    assert kinds["bart"]["kind"].startswith("encoder-decoder")
    assert kinds["vit"]["kind"] == "no-causal-lm"


def test_reason_kinds_and_file_outcome():
    assert bench.reason_kind("not-executed: f line 3 never executes") == "not-executed"
    assert bench.reason_kind("refused (dim-not-last): softmax over dim 1") == "refused"
    assert bench.reason_kind("not equivalent: max |diff| 0.1 at out") == "not-equivalent"
    assert bench.reason_kind("precondition: bias is used") == "precondition"
    rel = "transformers/models/x/modeling_x.py"
    run = {"outcome": "ran", "report": {
        "traced": True,
        "applied": [{"rule": "r", "file": rel, "lines": [3], "kernel_calls": {}}],
        "skipped": [{"rule": "r", "file": rel, "lines": [9], "reason": "rewrite: overlaps"},
                    {"rule": "s", "file": rel, "lines": [5], "reason": "not-executed: never runs"},
                    {"rule": "s", "file": rel, "lines": [5], "reason": "precondition: not this rule's shape"}],
        "equivalence": {"equivalent": True, "max_abs_diff": 0.0},
        "flipped_config": {"equivalence": None}}}
    sites = [{"rule": "r", "status": "static"}, {"rule": "r", "status": "static"}, {"rule": "s", "status": "static"}]
    r = bench.file_outcome("r", rel, sites, run)
    assert (r["matched"], r["confirmed"], r["applied"], r["equivalent"], r["outcome"]) == (2, 2, 1, True, "applied")
    s = bench.file_outcome("s", rel, sites, run)
    assert (s["confirmed"], s["applied"], s["equivalent"], s["outcome"]) == (0, 0, False, "not-applied")
    assert [x["kind"] for x in s["not_applied"]] == ["not-executed"]  # the precondition record is not a site
    t = bench.file_outcome("r", rel, sites, {"outcome": "timeout", "why": "no result within 1 s"})
    assert t["outcome"] == "timeout" and t["matched"] == 2


@pytest.mark.slow
def test_run_llama_gpt2_bert_with_fused_qkv(tmp_path):
    result = bench.run(["fused_QKV"], only=["llama", "gpt2", "bert"], jobs=2, timeout=300, progress=None)
    static = result["static"]
    assert static["files_scanned"] == 3 and not static["errors"]
    assert any(s["rule"] == "fused_QKV" for s in static["per_file"][LLAMA])
    assert all(not p.startswith("/") for p in static["per_file"])  # portable paths
    runtime = result["runtime"]
    llama = runtime["per_file"][LLAMA]
    assert llama["kind"] == "decoder-only" and llama["run"]["outcome"] == "ran"
    outcome = llama["rules"]["fused_QKV"]
    assert outcome["matched"] >= 1 and outcome["confirmed"] >= 1 and outcome["applied"] >= 1
    assert outcome["equivalent"] and outcome["outcome"] == "applied"
    bert = runtime["per_file"]["transformers/models/bert/modeling_bert.py"]
    assert bert["kind"].startswith("encoder") and "run" not in bert  # matched, but not a decoder-only LLM
    row = result["summary"]["fused_QKV"]
    assert row["files_applied_equivalent"] >= 1 and row["files_confirmed"] >= row["files_applied_equivalent"]
    assert "llama" not in {x["family"] for x in row["not_applied"]}
    assert any(x.startswith("bert ") for x in row["not_decoder_only"])
    text = bench.format_summary(result)
    assert "fused_QKV" in text and "applied=" in text
