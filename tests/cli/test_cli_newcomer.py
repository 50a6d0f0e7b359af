"""What a new user trips on (issue "What a new user trips on", points 1-10 and the two
structural items): each point has a test here, CLI points run as a user runs them (a
subprocess of ``python -m adopter``)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REWRITE_FIXTURES = ROOT / "tests" / "fixtures" / "rewrite"
OPTIMIZE_FIXTURES = ROOT / "tests" / "fixtures" / "optimize"


def adopter(*argv, cwd=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "adopter", *map(str, argv)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _bench(**over):
    bench = {
        "speed_ratio": 0.977, "speed_ratio_low": 0.93, "speed_ratio_high": 1.04,
        "pair_ratios": [0.97, 0.98, 0.96, 1.0, 0.99, 0.95],
        "memory_ratio": 1.0, "memory_metric": "peak torch CPU allocator delta over a training step (profiler, CPU)",
        "batch_size": 4, "seq_len": 32, "device": "cpu", "blocks": 6, "rounds_per_block": 1, "iterations": 1,
        "original": {"throughput": 1.85, "median_s": 4 / 1.85, "throughput_low": 1.7, "throughput_high": 1.9,
                     "seconds": [2.1, 2.2, 2.3]},
        "optimized": {"throughput": 1.87, "median_s": 4 / 1.87, "throughput_low": 1.75, "throughput_high": 1.95,
                      "seconds": [2.1, 2.1, 2.2]},
        "memory_original_bytes": 2**20, "memory_optimized_bytes": 2**20,
    }  # fmt: skip
    bench.update(over)
    return {"model": {"id": "tiny-bert", "class": "BertModel", "parameters": 1, "device": "cpu"}, "benchmark": bench}


# ---------------------------------------------------------------- 1. the speed line


def test_speed_report_names_both_ratios_and_explains_a_disagreement():
    from adopter.verification.gate import format_report

    text = format_report(_bench())
    # throughputs say optimized is faster (1.87 > 1.85), the per-pair median says 0.977: both are
    # printed, each says what it is, and the disagreement is explained
    assert "(wall time): 0.977 = median of 6 per-pair ratios" in text
    assert "95% bootstrap interval 0.930-1.040" in text
    assert "no measurable difference" in text
    assert "ratio of the two median throughputs above: 1.011" in text
    assert "differs from the per-pair median" in text and "the gate uses" in text


def test_summarize_stores_ratio_of_medians_and_throughput_intervals():
    from adopter.verification.benchmark import summarize

    per_block = {"original": [[1.0], [1.2], [1.1], [2.0]], "optimized": [[0.9], [1.1], [1.0], [2.2]]}
    result = summarize(per_block, batch_size=4, seq_len=8, device="cpu", rounds_per_block=1, iterations=1,
                       memory_metric="m", memory_original=1, memory_optimized=1, benchmark_json=None)
    assert result.speed_ratio_of_medians == pytest.approx(1.15 / 1.05)
    for timing in (result.original, result.optimized):
        assert timing.throughput_low <= timing.throughput <= timing.throughput_high
    assert "speed_ratio_of_medians" in result.to_json()


# ---------------------------------------------------------------- 2. str(report)


def test_str_of_report_is_a_grouped_readable_summary():
    from adopter.optimizing.optimize import AppliedRewrite, OptimizeReport, SkippedRewrite

    report = OptimizeReport(model_class="transformers.models.bert.modeling_bert.BertModel", traced=True)
    report.applied.append(AppliedRewrite("fused_QKV", "/x/modeling_bert.py", [175], "BertSelfAttention", "forward",
                                         "confirmed"))
    for rule in ("T5Attention", "GPT2Attention"):
        for cls in ("BertSelfAttention", "BertCrossAttention", "(none)"):
            report.skipped.append(SkippedRewrite(rule, "/x/modeling_bert.py", [125],
                                                 f"precondition: class {cls} is not a {rule} class", "precondition"))
    report.skipped.append(SkippedRewrite("softmax", "/x/modeling_bert.py", [130], "not-executed: line 130 never runs",
                                          "not-executed"))
    text = str(report)
    assert "SkippedRewrite(" not in text and "\n" in text
    assert "1 rewrite(s) applied, 1 match(es) not applied, 6 rejected by a rule precondition" in text
    assert "T5Attention x3" in text and "GPT2Attention x3" in text
    assert "rejected by a rule precondition (6" in text
    assert text.count("is not a T5Attention class") == 1  # grouped, not six near-identical lines
    assert "softmax" in text and "never runs" in text
    assert "isinstance" in text  # point 8: says what to check instead


# ---------------------------------------------------------------- 3. and 9. rewrite --write


@pytest.fixture()
def rewritable(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    target = src / "model.py"
    target.write_text((REWRITE_FIXTURES / "dropout_layernorm.before.py").read_text())
    return target


def test_write_skips_a_read_only_file_unless_force(rewritable):
    before = rewritable.read_text()
    rewritable.chmod(0o444)
    r = adopter("rewrite", "--write", "--jobs", "1", rewritable.parent)
    assert r.returncode == 2, r.stderr
    assert "read-only (mode 0444)" in r.stderr and "--force" in r.stderr
    assert rewritable.read_text() == before
    assert "0 rewrite(s) written to disk" in r.stderr
    assert "1 file(s) not written (read-only or a link; --force writes them): exit status 2" in r.stderr

    r = adopter("rewrite", "--write", "--force", "--jobs", "1", rewritable.parent)
    assert r.returncode == 0, r.stderr
    assert rewritable.read_text() != before
    assert stat.S_IMODE(rewritable.stat().st_mode) == 0o444  # the mode is kept


def test_write_skips_a_symlink_resolving_outside_the_paths_given(rewritable, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    link = tree / "linked.py"
    link.symlink_to(rewritable)
    before = rewritable.read_text()
    r = adopter("rewrite", "--write", "--jobs", "1", tree)
    assert r.returncode == 2, r.stderr
    assert "symbolic link" in r.stderr and "outside the paths given" in r.stderr
    assert rewritable.read_text() == before and link.is_symlink()

    r = adopter("rewrite", "--write", "--force", "--jobs", "1", tree)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and rewritable.read_text() != before  # the target written, the link kept


def test_failed_write_reports_what_reached_the_disk(rewritable, monkeypatch, capsys):
    import adopter.rewrite.engine as engine

    from adopter.cli import main

    def refuse(path, data, stamp=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine, "write_atomic", refuse)
    before = rewritable.read_text()
    assert main(["rewrite", "--write", "--jobs", "1", str(rewritable)]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "0 rewrite(s) written to disk" in err
    assert main(["rewrite", "--write", "--jobs", "1", "--format", "json", str(rewritable)]) == 2
    assert json.loads(capsys.readouterr().out)["summary"]["rewrites"] == 0
    assert rewritable.read_text() == before


def test_benchmark_leaves_no_benchmarks_directory_behind(tmp_path, monkeypatch):
    from adopter.verification.benchmark import run_pytest_benchmark

    monkeypatch.chdir(tmp_path)
    steps = {"original": lambda: None, "optimized": lambda: None}
    per_block, _ = run_pytest_benchmark(steps, blocks=2, rounds_per_block=1, iterations=1, warmup_rounds=0,
                                        json_path=str(tmp_path / "b.json"))
    assert all(len(blocks) == 2 for blocks in per_block.values())
    assert not (tmp_path / ".benchmarks").exists()


# ---------------------------------------------------------------- 4. one exit-code convention


def test_every_file_command_exits_2_when_a_file_cannot_be_analysed(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "good.py").write_text((REWRITE_FIXTURES / "dropout_layernorm.before.py").read_text())
    (pkg / "broken.py").write_text("def f(:\n")
    scan = adopter("scan", pkg, "--format", "json")
    assert scan.returncode == 2, scan.stderr
    data = json.loads(scan.stdout)  # keeps going: the good file is still scanned and reported
    assert len(data["errors"]) == 1 and data["matches"]
    assert adopter("scan", pkg).returncode == 2
    assert adopter("rewrite", pkg, "--jobs", "1").returncode == 2
    assert adopter("rewrite", pkg, "--check", "--jobs", "1").returncode == 2
    (pkg / "broken.py").unlink()
    assert adopter("scan", pkg).returncode == 0


def test_exit_status_convention_is_in_help():
    for argv in (["--help"], ["scan", "--help"], ["rewrite", "--help"]):
        r = adopter(*argv)
        assert r.returncode == 0
        assert "exit status" in r.stdout and "keep going" in r.stdout.lower()


# ---------------------------------------------------------------- 5. a path that is not Python


def test_non_python_path_is_a_notice_and_counts_as_skipped(tmp_path):
    other = tmp_path / "hostname"
    other.write_text("myhost\n")
    r = adopter("scan", other)
    assert r.returncode == 0
    assert r.stderr.count("\n") == 1 and "not a Python file" in r.stderr
    assert "0 scanned, 1 skipped, " in r.stdout
    r = adopter("scan", other, "--format", "json")
    data = json.loads(r.stdout)
    assert data["files_scanned"] == 0 and data["skipped"][0]["file"] == str(other)
    r = adopter("rewrite", other, "--format", "json")
    assert r.returncode == 0
    files = json.loads(r.stdout)["files"]
    assert files[0]["status"] == "skipped" and "not a Python file" in files[0]["reason"]
    script = tmp_path / "tool"
    script.write_text("#!/usr/bin/env python3\nx = 1\n")
    assert json.loads(adopter("scan", script, "--format", "json").stdout)["files_scanned"] == 1


# ---------------------------------------------------------------- 6. the plot


def test_plot_shows_the_interval_and_titles_each_panel():
    pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer

    from adopter.verification.gate import plot_figure

    fig = plot_figure(_bench())
    speed, memory = fig.axes
    assert any(isinstance(c, ErrorbarContainer) for c in speed.containers)
    assert "throughput" in speed.get_title() and "95%" in speed.get_title()
    assert "memory" in memory.get_title()
    assert "memory" not in fig._suptitle.get_text()  # the figure title is not the memory panel's


# ---------------------------------------------------------------- 7. model ids


def test_unknown_model_id_fails_before_any_progress_and_suggests_the_nearest():
    r = adopter("verify", "--model", "bert-base-uncase")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "building" not in r.stderr
    assert "did you mean 'bert-base-uncased'?" in r.stderr
    r = adopter("verify", "--model", "./no-such-model-dir/")
    assert r.returncode == 2 and "directory not found" in r.stderr and "unknown model id" not in r.stderr


# ---------------------------------------------------------------- 8. and B: class identity, one loader


def test_optimized_class_records_its_original_and_uses_the_shared_loader(toy):
    import torch
    from adopter.rewrite.loader import RewrittenSourceLoader

    import adopter.optimizing.optimize as optimizer
    from adopter.optimizing.optimize import Pipeline, optimize, original_class

    nothing = Pipeline(scan=lambda files, rules: ([], []))
    Optimized = optimize(toy.ToyModel, rules=[], init_kwargs={"width": 8}, example_inputs=(torch.randn(2, 8),),
                         pipeline=nothing)
    model = Optimized(width=8)
    assert isinstance(model, Optimized)
    assert not isinstance(model, toy.ToyModel)  # documented: a class rebuilt from the rewritten source
    assert Optimized.adopter_original is toy.ToyModel
    assert original_class(model) is toy.ToyModel and original_class(toy.ToyModel) is toy.ToyModel
    assert isinstance(sys.modules[Optimized.__module__].__spec__.loader, RewrittenSourceLoader)
    assert not hasattr(optimizer, "_RewrittenSourceLoader")
    assert optimizer.load_rewritten_modules.__module__ == "adopter.rewrite.loader"


# ---------------------------------------------------------------- A: orchestration does not import the CLI


def test_verify_run_does_not_depend_on_the_cli():
    source = (ROOT / "adopter" / "verification" / "run.py").read_text()
    assert "adopter.cli" not in source
    from adopter.cli import UserError
    from adopter.errors import UserError as Neutral

    assert UserError is Neutral


# ---------------------------------------------------------------- 10. Makefile installs once


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_installs_once_and_again_when_the_package_metadata_changes(tmp_path):
    for name in ("Makefile", "setup.cfg", "pyproject.toml", "constraints.txt"):
        shutil.copy2(ROOT / name, tmp_path / name)

    def planned():
        r = subprocess.run(["make", "-n", "install", f"PYTHON={sys.executable}"], cwd=tmp_path, check=False,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if "pip install" in line]

    fresh = planned()  # a fresh clone: no stamp, every install, torch first
    assert len(fresh) == 3 and "torch==2.13.0" in fresh[0] and '-e ".[dev]"' in fresh[1] and "xformers" in fresh[2]
    stamp = tmp_path / "adopter.egg-info" / ".make-install-stamp"
    stamp.parent.mkdir()
    stamp.touch()
    assert planned() == []  # installed: nothing to redo
    later = time.time() + 5
    os.utime(tmp_path / "setup.cfg", (later, later))
    assert len(planned()) == 3  # dependencies may have changed: install again
