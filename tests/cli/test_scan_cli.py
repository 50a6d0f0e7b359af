"""`adopter scan` / `adopter rules` through adopter.cli.main and one real subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adopter.cli import main

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules"
FIG1 = FIXTURES / "Dropout_LayerNorm" / "positive_fig1.py"


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "good.py").write_text(FIG1.read_text())
    (tmp_path / "pkg" / "broken.py").write_text("def f(:\n    pass\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not python")
    return tmp_path


def test_json_shape_and_syntax_error_entry(tree, capsys):
    rc = main(["scan", str(tree / "pkg"), "--format", "json"])
    out = capsys.readouterr().out
    assert rc == 2  # a file could not be analysed: reported, the others scanned, exit 2
    data = json.loads(out)
    assert set(data) == {"files_scanned", "seconds", "errors", "matches", "skipped"}
    assert data["files_scanned"] == 2
    assert isinstance(data["seconds"], float)
    (err,) = data["errors"]
    assert err["file"].endswith("broken.py") and "syntax error" in err["message"] and "line 1" in err["message"]
    rules = sorted(m["rule"] for m in data["matches"])
    assert rules == ["Dropout_LayerNorm", "Dropout_LayerNorm"]
    m = data["matches"][0]
    assert set(m) >= {"rule", "file", "class", "function", "lines", "status"}
    assert m["class"] == "BertSelfOutput" and m["function"] == "forward" and m["status"] == "static"
    assert all(isinstance(x, int) for x in m["lines"])


def test_rules_filter_and_text_output(tree, capsys):
    rc = main(["scan", str(tree / "pkg" / "good.py"), "--rules", "softmax,Conv_BatchNorm"])
    out = capsys.readouterr().out
    assert rc == 0 and "0 matches" in out
    rc = main(["scan", str(tree / "pkg" / "good.py")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "good.py" in out and "Dropout_LayerNorm" in out and "BertSelfOutput.forward" in out
    assert "2 matches in 1 file" in out


def test_unknown_rule_is_a_usage_error(tree, capsys):
    rc = main(["scan", str(tree), "--rules", "nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown rule 'nope'" in err and "softmax" in err


def test_nonexistent_path_exit_2(tmp_path, capsys):
    rc = main(["scan", str(tmp_path / "missing.py")])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and "missing.py" in captured.err


def test_rules_file(tree, tmp_path, capsys):
    rules = tmp_path / "mine.rules"
    rules.write_text(
        "rule LinearThenDropout\nforward:\n"
        "    torch.nn.Linear@$l($x) -> $h; torch.nn.Dropout@$d($h) -> $y\n    => my.Fused@$l($x) -> $y\n"
    )
    rc = main(["scan", str(tree / "pkg" / "good.py"), "--rules-file", str(rules), "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and sorted(m["rule"] for m in data["matches"]) == ["LinearThenDropout"] * 2
    bad = tmp_path / "bad.rules"
    bad.write_text("rule X\nforward:\n    torch.nn.Linear($x -> $y => a() -> $y\n")
    rc = main(["scan", str(tree / "pkg" / "good.py"), "--rules-file", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.rules:3:" in err


def test_rules_command(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert "Dropout_LayerNorm" in out and "adopter.kernels.dropout_add_layer_norm" in out
    assert main(["rules", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data) == 15 and {"name", "kernel", "summary"} <= set(data[0])
    assert main(["rules", "Conv_BatchNorm"]) == 0
    out = capsys.readouterr().out
    assert "rule Conv_BatchNorm" in out and "torch.nn.BatchNorm2d@$bn($c) -> $out" in out
    assert main(["rules", "nope"]) == 2


def test_model_option_calls_tracing(tree, capsys, monkeypatch):
    import types

    calls = {}

    def confirm_model_id(matches, model_id, device=None):
        calls["args"] = (len(matches), model_id, device)
        from dataclasses import replace

        return [replace(m, status="confirmed") for m in matches[:1]] + [
            replace(m, status="not-executed", reason="branch not taken", trace_code="lines-not-run")
            for m in matches[1:]
        ]

    fake = types.ModuleType("adopter.tracing")
    fake.confirm_model_id = confirm_model_id
    monkeypatch.setitem(sys.modules, "adopter.tracing", fake)
    rc = main(["scan", str(tree / "pkg" / "good.py"), "--model", "bert-base-uncased", "--device", "cpu",
               "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and calls["args"] == (2, "bert-base-uncased", "cpu")
    assert [m["status"] for m in data["matches"]] == ["confirmed", "not-executed"]
    assert data["matches"][1]["reason"] == "branch not taken"  # as the tracing said it
    assert data["matches"][1]["trace_code"] == "lines-not-run" and "trace_code" not in data["matches"][0]
    rc = main(["scan", str(tree / "pkg" / "good.py"), "--model", "bert-base-uncased"])
    out = capsys.readouterr().out
    assert "confirmed" in out and "not-executed (branch not taken)" in out


def test_subprocess_json_and_exit_codes(tree):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "adopter", "scan", str(tree / "pkg"), "--format", "json"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr  # broken.py could not be analysed
    data = json.loads(r.stdout)  # exactly one JSON object
    assert data["files_scanned"] == 2 and len(data["errors"]) == 1 and len(data["matches"]) == 2
    cmd = [sys.executable, "-m", "adopter", "scan", str(tree / "nope")]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_scan_never_imports_torch_or_the_scanned_code(tmp_path):
    victim = tmp_path / "victim.py"
    victim.write_text("raise SystemExit('scanned code was executed')\nimport torch\n")
    code = (
        "import sys; from adopter.cli import main; rc = main(['scan', sys.argv[1], '--format', 'json']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-c", code, str(victim)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_scanned"] == 1


def test_parallel_scan_gives_the_in_process_result(tmp_path, capsys):
    """-j 2 forks workers (largest files first, results back in file order): same JSON as -j 1."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for i in range(10):
        (pkg / f"m{i}.py").write_text(FIG1.read_text() * (1 + i % 3))
    (pkg / "broken.py").write_text("def f(:\n    pass\n")
    outputs = []
    for jobs in ("1", "2"):
        rc = main(["scan", str(pkg), "-j", jobs, "--format", "json"])
        assert rc == 2  # broken.py
        data = json.loads(capsys.readouterr().out)
        data.pop("seconds")
        outputs.append(data)
    assert outputs[0] == outputs[1]
    assert len(outputs[0]["matches"]) >= 10 and len(outputs[0]["errors"]) == 1


def test_scan_help_sets_every_code_apart_from_its_text():
    from adopter.commands.scan import DESCRIPTION
    from adopter.core.structures import PRECISION_CODES

    lines = DESCRIPTION.splitlines()
    for code in PRECISION_CODES:
        (line,) = [ln for ln in lines if ln.startswith(f"  {code} ")]
        assert line[len(code) + 2:].startswith("  ")  # (two spaces at least, the longest code too)


def test_the_rewrite_command_offers_the_torchscript_choices_the_rewriter_knows():
    import argparse

    from adopter.rewrite.scripting import TORCHSCRIPT_CHOICES

    from adopter.commands import rewrite as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    (action,) = [a for a in parser._actions if "--torchscript" in a.option_strings]
    assert tuple(action.choices) == TORCHSCRIPT_CHOICES
