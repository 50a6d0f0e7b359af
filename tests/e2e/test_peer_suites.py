"""benchmarks/bench_peer_suites.py (issue 21: a rewritten library passes its own test suite).

Fast tests: the pure logic (per-test outcomes from the plugin's records, groups, the pristine vs
rewritten comparison, causes, the timm and transformers selections) on synthetic data, and the
pytest plugin in a throwaway session; no network, no virtual environment. The slow tests run the
``ci`` subsets for real (virtual environments under ``benchmarks/.cache/peer``, packages from the
registry; skipped with the reason when that cannot be set up) and require no newly failing test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_peer_suites  # noqa: E402
from peer import outcomes as oc  # noqa: E402
from peer import timm_selection  # noqa: E402
from peer.transformers_tests import selection as tf_selection  # noqa: E402

T = "tests/test_models.py::"


def _rec(nodeid, when, outcome, message="", **extra):
    return {"nodeid": nodeid, "when": when, "outcome": outcome, "duration": 0.5, "message": message, **extra}


# ---------------------------------------------------------------------------------------------
# groups


@pytest.mark.parametrize("nodeid, group", [
    (T + "test_model_forward_torchscript[1-visformer_tiny]", "torchscript"),
    (T + "test_model_forward_fx_torchscript[1-test_vit]", "torchscript"),
    (T + "test_feature_getter_stage_ends_torchscript[ghostnet_050]", "torchscript"),
    (T + "test_model_forward_fx[1-hrnet_w18_small]", "fx"),
    (T + "test_model_backward_fx[2-visformer_tiny]", "fx"),
    (T + "test_model_forward_intermediates[1-hrnet_w18_small]", "intermediates"),
    (T + "test_model_forward_intermediates_features[1-hrnet_w18_small]", "intermediates"),
    (T + "test_prune_intermediate_layers_contract[test_vit]", "pruning"),
    (T + "test_forward_after_prune_intermediate_layers[legacy_xception]", "pruning"),
    (T + "test_model_forward_features[1-ghostnet_050]", "features"),
    (T + "test_model_backward[2-ghostnet_050]", "backward"),
    (T + "test_model_forward[1-test_vit]", "forward"),
    (T + "test_model_default_cfgs[1-visformer_tiny.in1k]", "other"),
    (T + "test_eval_refreshes_attention_bias_cache[levit_128s]", "other"),
    ("tests/models/llama/test_modeling_llama.py::LlamaModelTest::test_greedy_generate", "generation"),
    ("tests/models/gpt2/test_modeling_gpt2.py::GPT2ModelTest::test_past_key_values_next_token_matches_full_forward",
     "generation"),
    ("tests/models/bert/test_modeling_bert.py::BertModelTest::test_torch_export", "export"),
    ("tests/models/bert/test_modeling_bert.py::BertModelTest::test_torch_compile_aot_eager", "compile"),
    ("tests/models/bert/test_modeling_bert.py::BertModelTest::test_training_gradient_checkpointing", "backward"),
    ("tests/models/vit/test_modeling_vit.py::ViTModelTest::test_hidden_states_output", "intermediates"),
    ("tests/models/vit/test_modeling_vit.py::ViTModelTest::test_save_load", "other"),
])
def test_group_of(nodeid, group):
    assert oc.group_of(nodeid) == group


def test_every_group_is_listed():
    assert {g for g, _ in oc._GROUP_RULES} | {"other"} == set(oc.GROUPS)


# ---------------------------------------------------------------------------------------------
# outcomes of one run


def test_final_outcomes_per_phase():
    a, b, c, d, e, f = (T + n for n in ("a", "b", "c", "d", "e", "f"))
    records = [
        _rec(a, "setup", "passed"), _rec(a, "call", "passed"), _rec(a, "teardown", "passed"),
        _rec(b, "setup", "passed"), _rec(b, "call", "failed", "RuntimeError: boom", where="x.py:3"),
        _rec(b, "teardown", "passed"),
        _rec(c, "setup", "failed", "fixture broke"), _rec(c, "teardown", "passed"),
        _rec(d, "setup", "skipped", "requires GPU"),
        _rec(e, "setup", "passed"), _rec(e, "call", "skipped", "xfail reason", xfail=True),
        # a failing subtest, then the test's own (passing) call report: the failure stays
        _rec(f, "setup", "passed"), _rec(f, "call", "failed", "AssertionError: sub 1"),
        _rec(f, "call", "passed"), _rec(f, "teardown", "passed"),
    ]
    result = oc.final_outcomes(records)
    assert {k[len(T):]: v["outcome"] for k, v in result.items()} == {
        "a": "passed", "b": "failed", "c": "error", "d": "skipped", "e": "xfailed", "f": "failed"}
    assert result[b]["message"] == "RuntimeError: boom" and result[b]["where"] == "x.py:3"
    assert result[f]["message"] == "AssertionError: sub 1"
    assert result[a]["duration"] == 1.5


def test_read_outcomes_drops_a_truncated_last_line(tmp_path):
    path = tmp_path / "outcomes.jsonl"
    path.write_text(json.dumps(_rec(T + "a", "call", "passed")) + "\n" + '{"nodeid": "tests/x.py::b", "wh')
    assert list(oc.read_outcomes(path)) == [T + "a"]
    assert oc.read_outcomes(tmp_path / "absent.jsonl") == {}


# ---------------------------------------------------------------------------------------------
# pristine vs rewritten


def _run(**outcomes):
    return {T + name: ({"outcome": o} if isinstance(o, str) else o) for name, o in outcomes.items()}


def test_compare_lists_newly_failing_passing_skipped_and_missing():
    pristine = _run(**{
        "test_model_forward[1-a]": "passed",
        "test_model_forward_torchscript[1-a]": "passed",
        "test_model_forward_fx[1-a]": "passed",
        "test_model_backward[2-a]": {"outcome": "failed", "message": "RuntimeError: flaky"},
        "test_model_forward_intermediates[1-a]": "passed",
        "test_model_forward_features[1-a]": {"outcome": "failed", "message": "x"},
        "test_prune_intermediate_layers_contract[a]": "passed",
    })
    rewritten = _run(**{
        "test_model_forward[1-a]": "passed",
        "test_model_forward_torchscript[1-a]": {
            "outcome": "failed", "where": "torch/jit/frontend.py:1",
            "message": "RuntimeError: Can't redefine method: forward on class: __torch__.adopter.kernels.X"},
        "test_model_forward_fx[1-a]": {"outcome": "error", "message": "AttributeError: 'Proxy' object has no attr"},
        "test_model_backward[2-a]": "passed",
        "test_model_forward_intermediates[1-a]": {"outcome": "skipped", "message": "Skipped: no"},
        "test_model_forward_features[1-a]": {"outcome": "failed", "message": "x"},
        # test_prune_intermediate_layers_contract[a]: never reported (crash)
    })
    comp = oc.compare(pristine, rewritten)
    failing = {f["test"][len(T):]: f["cause"] for f in comp["newly_failing"]}
    assert failing == {
        "test_model_forward_torchscript[1-a]": "TorchScript: can't redefine method",
        "test_model_forward_fx[1-a]": "FX tracing error",
        "test_prune_intermediate_layers_contract[a]": "not run (missing from this run: collection error or crash)",
    }
    assert [f["test"][len(T):] for f in comp["newly_passing"]] == ["test_model_backward[2-a]"]
    assert [f["test"][len(T):] for f in comp["newly_skipped"]] == ["test_model_forward_intermediates[1-a]"]
    assert comp["both_failing"] == [T + "test_model_forward_features[1-a]"]
    counts = comp["counts"]
    assert counts["torchscript"]["pristine"] == {"passed": 1} and counts["torchscript"]["rewritten"] == {"failed": 1}
    assert counts["pruning"]["rewritten"] == {"missing": 1}
    assert counts["all"]["total"] == 7 and counts["all"]["newly_failing"] == 3
    assert counts["all"]["pristine"]["passed"] == 5 and counts["all"]["rewritten"]["passed"] == 2
    assert list(counts)[-1] == "all"
    entry = comp["tests"][T + "test_model_forward_torchscript[1-a]"]
    assert entry["pristine"] == "passed" and entry["rewritten"] == "failed"
    assert entry["rewritten_where"] == "torch/jit/frontend.py:1"
    assert comp["causes"]["FX tracing error"] == 1


def test_compare_lists_far_slower_tests():
    pristine = _run(**{"test_a": {"outcome": "passed", "duration": 2.0}, "test_b": {"outcome": "passed", "duration": 2.0},
                       "test_c": {"outcome": "passed", "duration": 30.0}, "test_d": {"outcome": "passed", "duration": 1}})
    rewritten = _run(**{"test_a": {"outcome": "passed", "duration": 169.0}, "test_b": {"outcome": "passed", "duration": 35.0},
                        "test_c": {"outcome": "passed", "duration": 150.0}, "test_d": {"outcome": "passed", "duration": 40}})
    comp = oc.compare(pristine, rewritten)
    assert [(d["test"][len(T):], d["rewritten_s"]) for d in comp["slowdowns"]] == [("test_a", 169.0), ("test_d", 40)]
    assert comp["tests"][T + "test_c"]["pristine_s"] == 30.0
    assert "169.0 s rewritten" in oc.findings_markdown(comp, "x")


def test_recompare_redoes_the_comparison_from_the_records(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_peer_suites, "CACHE", tmp_path / "cache")
    nodeid = T + "test_model_forward[1-a]"
    for side, outcome in (("pristine", "passed"), ("rewritten", "failed")):
        (tmp_path / "cache" / "timm" / side).mkdir(parents=True)
        (tmp_path / "cache" / "timm" / side / "outcomes.jsonl").write_text(
            json.dumps(_rec(nodeid, "call", outcome, "RuntimeError: Can't redefine method: forward")) + "\n")
    path = tmp_path / "peer_timm.json"
    written = {"selection": {"node_ids": [nodeid]}, "runs": {"pristine": {}, "rewritten": {}}, "newly_failing": [],
               "tests": {nodeid: {"pristine": "passed", "rewritten": "failed"}}}
    path.write_text(json.dumps(written))
    result = bench_peer_suites.recompare(path, "timm")
    assert [(f["test"], f["cause"]) for f in result["newly_failing"]] == [
        (nodeid, "TorchScript: can't redefine method")]
    # the records left behind are another run's (here: one test more than this result reported)
    written["selection"]["node_ids"].append(T + "test_model_backward[2-a]")
    written["tests"] = {T + "test_model_backward[2-a]": {"pristine": "passed", "rewritten": "passed"}}
    path.write_text(json.dumps(written))
    assert bench_peer_suites.recompare(path, "timm") is None


def test_compare_identical_runs_has_nothing_new():
    run = _run(**{"test_model_forward[1-a]": "passed", "test_model_backward[2-a]": "skipped"})
    comp = oc.compare(run, run)
    assert comp["newly_failing"] == comp["newly_passing"] == comp["newly_skipped"] == []


@pytest.mark.parametrize("message, nodeid, cause", [
    ("RuntimeError: Can't redefine method: forward on class: __torch__.x", T + "test_model_forward[1-a]",
     "TorchScript: can't redefine method"),
    ("RuntimeError: \nPython builtin <built-in function _guard> is currently not supported in Torchscript",
     T + "test_model_forward_torchscript[1-a]", "TorchScript error"),
    ("RuntimeError: Module 'GuardedSequential' has no attribute 'fused'", T + "test_model_forward[1-a]",
     "TorchScript error"),
    ("AssertionError: Tensor-likes are not close!\n\nMismatched elements: 3 / 10", T + "test_model_forward[1-a]",
     "numeric mismatch"),
    ("TraceError: symbolically traced variables cannot be used as inputs to control flow",
     T + "test_model_forward_fx[1-a]", "FX tracing error"),
    ("torch._dynamo.exc.Unsupported: call_function", "tests/models/x.py::T::test_torch_compile_aot_eager",
     "torch.export / torch.compile error"),
    ("Failed: Timeout (>120.0s) from pytest-timeout.", T + "test_model_forward[1-a]", "timeout"),
    ("RuntimeError: Error(s) in loading state_dict for X:\n\tMissing key(s)", T + "test_model_forward[1-a]",
     "state_dict / weights mismatch"),
    ("TypeError: forward() got an unexpected keyword argument 'x'", T + "test_model_forward[1-a]", "TypeError"),
])
def test_cause_of(message, nodeid, cause):
    assert oc.cause_of({"outcome": "failed", "message": message}, nodeid) == cause


def test_table_and_findings_render():
    comp = oc.compare(_run(**{"test_model_forward[1-a]": "passed"}),
                      _run(**{"test_model_forward[1-a]": {"outcome": "failed", "message": "ValueError: bad\nmore"}}))
    table = oc.table(comp, "timm (ci)")
    assert table.splitlines()[0] == "timm (ci)"
    assert any(line.startswith("forward") and line.split()[1:] == ["1", "1/0/0", "0/1/0", "1", "0"]
               for line in table.splitlines())
    md = oc.findings_markdown(comp, "timm")
    assert "### ValueError (1)" in md and "`tests/test_models.py::test_model_forward[1-a]`: ValueError: bad" in md
    assert "No newly failing tests." in oc.findings_markdown(oc.compare({}, {}), "x")


# ---------------------------------------------------------------------------------------------
# selections


def _timm_collected():
    ids = []
    for model in ("visformer_tiny", "ghostnet_050", "hrnet_w18_small", "resnet50", "test_vit", "gemma4_vit_167m"):
        for name, batch in (("test_model_forward", 1), ("test_model_backward", 2), ("test_model_forward_fx", 1),
                            ("test_model_forward_torchscript", 1), ("test_model_backward_fx", 2),
                            ("test_model_forward_intermediates", 1)):
            ids.append(f"{T}{name}[{batch}-{model}]")
        ids.append(f"{T}test_model_load_pretrained[1-{model}.a1_in1k]")
        ids.append(f"{T}test_prune_intermediate_layers_contract[{model}]")
    ids += [f"{T}test_model_default_cfgs[1-visformer_tiny.in1k]", f"{T}test_model_default_cfgs[1-visformer_tiny.x]",
            f"{T}test_feature_getter_stage_ends_torchscript[ghostnet_050]",
            f"{T}test_feature_getter_stage_ends_torchscript[inception_v4]",
            f"{T}test_eval_attention_forward_after_dtype_change", f"{T}test_swin_family_set_input_size[x-224]",
            f"{T}test_model_inference[test_vit-1]"]
    return ids


def test_timm_full_selection():
    chosen = timm_selection.select(_timm_collected(), "full")
    assert not any("load_pretrained" in t or "test_model_inference" in t or "resnet50]" in t for t in chosen)
    assert f"{T}test_model_backward_fx[2-visformer_tiny]" in chosen  # a DEEP model
    assert f"{T}test_model_backward_fx[2-test_vit]" not in chosen  # CORE only
    assert f"{T}test_model_forward_torchscript[1-test_vit]" in chosen
    assert [t for t in chosen if "gemma4" in t] == [f"{T}test_model_forward[1-gemma4_vit_167m]"]  # LIGHT
    assert [t for t in chosen if "default_cfgs" in t] == [f"{T}test_model_default_cfgs[1-visformer_tiny.in1k]"]
    assert f"{T}test_feature_getter_stage_ends_torchscript[ghostnet_050]" in chosen
    assert f"{T}test_feature_getter_stage_ends_torchscript[inception_v4]" not in chosen  # not rewritten
    assert f"{T}test_eval_attention_forward_after_dtype_change" in chosen  # named, no parameters
    assert f"{T}test_swin_family_set_input_size[x-224]" not in chosen  # not named
    assert chosen == [t for t in _timm_collected() if t in set(chosen)]  # collection order kept


def test_timm_ci_selection_is_fixed_and_small():
    collected = list(timm_selection.CI_TESTS) + [f"{T}test_model_forward[1-resnet50]"]
    assert timm_selection.select(collected, "ci") == list(timm_selection.CI_TESTS)
    assert 20 <= len(timm_selection.CI_TESTS) <= 40
    groups = {oc.group_of(t) for t in timm_selection.CI_TESTS}
    assert {"torchscript", "fx", "intermediates", "pruning", "forward", "backward"} <= groups
    assert all(m in timm_selection.FULL_MODELS for m in timm_selection.DEEP_MODELS)


def test_transformers_selection():
    base = "tests/models/llama/test_modeling_llama.py::LlamaModelTest::"
    collected = [base + n for n in ("test_model", "test_greedy_generate", "test_bc_torch_dtype",
                                    "test_eager_matches_sdpa_inference_09_fp32_pad_left",
                                    "test_eager_matches_sdpa_inference_16_bf16_pad_left_sdpa_kernels",
                                    "test_eager_matches_sdpa_inference_21_bf16_pad_right",
                                    "test_resize_tokens_embeddings")]
    full = tf_selection.select(collected, "full")
    assert [t[len(base):] for t in full] == ["test_model", "test_greedy_generate",
                                             "test_eager_matches_sdpa_inference_09_fp32_pad_left",
                                             "test_eager_matches_sdpa_inference_16_bf16_pad_left_sdpa_kernels",
                                             "test_resize_tokens_embeddings"]
    ci = tf_selection.select(collected, "ci")
    assert [t[len(base):] for t in ci] == ["test_model", "test_greedy_generate",
                                           "test_eager_matches_sdpa_inference_09_fp32_pad_left"]


def test_exit_status_when_the_environment_or_the_run_breaks(tmp_path, monkeypatch):
    def no_registry(subset, reuse):
        raise bench_peer_suites.SetupUnavailable("pip download failed: no index")

    def broken(subset, reuse):
        raise RuntimeError("collection found nothing")

    monkeypatch.setattr(bench_peer_suites, "LIBS", {"timm": no_registry, "transformers": broken})
    assert bench_peer_suites.main(["--lib", "timm", "--out", str(tmp_path)]) == 3
    assert bench_peer_suites.main(["--lib", "transformers", "--out", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []  # nothing compared, nothing written


def test_result_paths(tmp_path):
    assert bench_peer_suites.result_path(tmp_path, "timm", "full").name == "peer_timm.json"
    assert bench_peer_suites.result_path(tmp_path, "transformers", "ci").name == "peer_transformers_ci.json"


# ---------------------------------------------------------------------------------------------
# the plugin, in a throwaway pytest session


def _plugin_session(tmp_path, expect_root):
    (tmp_path / "peerpkg").mkdir()
    (tmp_path / "peerpkg" / "__init__.py").write_text("__version__ = '9.9'\nfrom adopter.kernels import softmax\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tmp_path / "conftest.py").write_text(bench_peer_suites.PLUGIN.read_text())
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    raise ValueError('no good')\n"
        "@pytest.mark.skip(reason='later')\ndef test_skip():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tmp_path), PEER_PACKAGE="peerpkg", PEER_EXPECT_ROOT=str(expect_root),
               PEER_OUTCOMES=str(tmp_path / "o.jsonl"), PEER_IMPORT_CHECK=str(tmp_path / "check.json"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "test_x.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)


def test_plugin_records_outcomes_and_checks_the_import(tmp_path):
    proc = _plugin_session(tmp_path, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_bad fails
    result = oc.read_outcomes(tmp_path / "o.jsonl")
    assert {k: v["outcome"] for k, v in result.items()} == {
        "test_x.py::test_ok": "passed", "test_x.py::test_bad": "failed", "test_x.py::test_skip": "skipped"}
    assert result["test_x.py::test_bad"]["message"].startswith("ValueError: no good")
    check = json.loads((tmp_path / "check.json").read_text())
    assert check["from_expected_root"] and check["version"] == "9.9"
    assert check["files_importing_adopter_kernels"] == 1


def test_plugin_stops_a_run_importing_the_package_from_elsewhere(tmp_path):
    elsewhere = tmp_path / "other_copy"
    elsewhere.mkdir()
    proc = _plugin_session(tmp_path, elsewhere)
    assert proc.returncode != 0 and "imported from" in proc.stdout + proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# the real thing (slow): the ci subsets, pristine vs rewritten


def _run_ci(lib, tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "bench_peer_suites.py"), "--lib", lib, "--subset", "ci",
                           "--out", str(tmp_path), "--reuse-pristine"], capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip(f"peer suite environment for {lib} not available: {proc.stdout[-800:]}")
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / f"peer_{lib}_ci.json").read_text())
    assert result["runs"]["rewritten"]["import_check"]["files_importing_adopter_kernels"] > 0
    assert result["runs"]["pristine"]["import_check"]["files_importing_adopter_kernels"] == 0
    assert result["counts"]["all"]["pristine"].get("passed", 0) > 0
    newly = [f"{f['test']} [{f['cause']}]: {f['message'][:300]}" for f in result["newly_failing"]]
    assert newly == [], "newly failing after the rewrite:\n" + "\n".join(newly)
    return result


@pytest.mark.slow
def test_timm_ci_subset_has_no_newly_failing_test(tmp_path):
    _run_ci("timm", tmp_path)


@pytest.mark.slow
def test_transformers_ci_subset_has_no_newly_failing_test(tmp_path):
    _run_ci("transformers", tmp_path)
