"""The call styles of issue 35 on the command line, run as a user runs them (``python -m adopter``
in a project directory holding copies of tests/fixtures/tracing/call_styles/): ``scan`` alone and
with ``--model`` agree on each site's status, ``--model-args`` builds a dataclass config, a wrong
input or an unbuildable config is one line and exit 2, ``verify`` builds a printing model twice
(not once per check) and keeps its prints off the report's stdout, ``rewrite --model`` writes what
``optimize()`` proved for a loss stored on ``self``. Status codes and exit codes are asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STYLES = ROOT / "tests" / "fixtures" / "tracing" / "call_styles"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    where = tmp_path_factory.mktemp("call_styles")
    for path in STYLES.glob("*.py"):
        shutil.copy(path, where / path.name)
    specs = {
        "tokens32.json": {"inputs": {"tokens": {"shape": [2, 5], "dtype": "int64", "high": 32}}},
        "lm.json": {"inputs": {"tokens": {"shape": [2, 5], "dtype": "int64", "high": 48},
                               "targets": {"shape": [2, 5], "dtype": "int64", "high": 48}}},
        "images.json": {"inputs": {"x": {"shape": [2, 3, 16, 16]}}},
        "config.json": {"kwargs": {"params": {"dim": 16, "hidden": 24, "norm": {"eps": 1e-6}}},
                        "inputs": {"x": {"shape": [2, 3, 16]}}},
        "positional.json": {"args": [{"dim": 16, "hidden": 24}], "inputs": {"x": {"shape": [2, 3, 16]}}},
        "unknown_field.json": {"kwargs": {"params": {"dim": 16, "width": 24}}, "inputs": {"x": {"shape": [2, 3, 16]}}},
        "wrong_width.json": {"inputs": {"x": {"shape": [4, 7]}}},
        "printing.json": {"inputs": {"x": {"shape": [4, 16]}}},
    }
    for name, spec in specs.items():
        (where / name).write_text(json.dumps(spec))
    return where


def adopter(*argv, cwd, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "adopter", *map(str, argv)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _statuses(stdout: str, file: str) -> list[tuple]:
    return sorted((m["rule"], m["class"], m["function"], m["status"], m.get("code") or m.get("trace_code") or "")
                  for m in json.loads(stdout)["matches"] if os.path.basename(m["file"]) == file)


def test_static_scan_names_and_keeps_each_site(project):
    r = adopter("scan", ".", "--format", "json", cwd=project)
    assert r.returncode == 0, r.stderr
    assert _statuses(r.stdout, "direct_forward.py") == [("gated_MLP", "FeedForward", "forward", "static", "")]
    stem = [s for s in _statuses(r.stdout, "stem_closure.py") if s[1] == "ModifiedResNet"]
    assert stem == [("Conv_BatchNorm", "ModifiedResNet", "forward.stem", "static", "")] * 3


@pytest.mark.parametrize(("ref", "args", "file"), [
    ("direct_forward:Transformer", "tokens32.json", "direct_forward.py"),
    ("stem_closure:ModifiedResNet", "images.json", "stem_closure.py"),
])
def test_scan_with_the_model_confirms_what_the_static_scan_found(project, ref, args, file):
    static = adopter("scan", file, "--format", "json", cwd=project)
    traced = adopter("scan", file, "--format", "json", "--model", ref, "--model-args", args, cwd=project)
    assert static.returncode == 0 and traced.returncode == 0, traced.stderr
    expected = [(rule, cls, fn, "confirmed", "") for rule, cls, fn, _, _ in _statuses(static.stdout, file)]
    assert _statuses(traced.stdout, file) == expected


@pytest.mark.parametrize("args", ["config.json", "positional.json"])
def test_model_args_build_a_dataclass_config(project, args):
    r = adopter("scan", "dataclass_config.py", "--format", "json", "--model", "dataclass_config:GatedNet",
                "--model-args", args, cwd=project)
    assert r.returncode == 0, r.stderr
    assert _statuses(r.stdout, "dataclass_config.py") == [("gated_MLP", "GatedNet", "forward", "confirmed", "")]


def test_a_config_the_json_cannot_build_is_one_line_pointing_to_a_factory(project):
    unknown = adopter("scan", "dataclass_config.py", "--model", "dataclass_config:GatedNet",
                      "--model-args", "unknown_field.json", cwd=project)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.count("\n") == 1 and "'width'" in unknown.stderr
    untyped = adopter("scan", "dataclass_config.py", "--model", "dataclass_config:UntypedNet",
                      "--model-args", "positional.json", cwd=project)
    assert untyped.returncode == 2 and untyped.stdout == ""
    assert untyped.stderr.count("\n") == 1 and "package.module:make_model" in untyped.stderr
    factory = adopter("scan", "dataclass_config.py", "--format", "json", "--model", "dataclass_config:make_model",
                      cwd=project)
    assert factory.returncode == 0, factory.stderr
    assert _statuses(factory.stdout, "dataclass_config.py") == [
        ("gated_MLP", "GatedNet", "forward", "confirmed", "")]


def test_a_forward_failing_on_the_given_inputs_says_they_were_given(project):
    r = adopter("scan", "printing_model.py", "--model", "printing_model:Net", "--model-args", "wrong_width.json",
                cwd=project)
    assert r.returncode == 2
    # (what the model prints while it is built goes to stderr too, before adopter's one line)
    error = [line for line in r.stderr.strip().splitlines() if not line.startswith("printing_model: ")]
    assert len(error) == 1 and "example inputs given (x[4, 7])" in error[0] and "generated" not in error[0]


def test_verify_builds_a_user_model_twice_and_keeps_its_prints_off_the_report(project):
    r = adopter("verify", "--model", "printing_model:Net", "--model-args", "printing.json", "--no-benchmark",
                cwd=project)
    assert r.returncode == 0, r.stderr
    assert "building Net" not in r.stdout and r.stdout.startswith("model: printing_model:Net")
    # the original (which optimize analyses) and the one optimized class proved and measured
    assert r.stderr.count("printing_model: building Net") == 2, r.stderr


def test_rewrite_model_writes_the_fused_stored_loss_that_optimize_proved(project):
    r = adopter("rewrite", "--model", "stored_loss:Transformer", "--model-args", "lm.json", cwd=project)
    assert r.returncode == 0, r.stderr
    assert "lm_head_cross_entropy(" in r.stdout and "+from adopter.kernels import lm_head_cross_entropy" in r.stdout


@pytest.mark.parametrize("command", [
    ("scan", "printing_model.py", "--format", "json"),
    ("rewrite", "--format", "json"),
])
def test_json_output_stays_json_when_the_model_prints(project, command):
    r = adopter(*command, "--model", "printing_model:Net", "--model-args", "printing.json", cwd=project)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # the model's prints went to stderr
    assert "printing_model: building Net" in r.stderr
