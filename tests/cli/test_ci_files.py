"""The files that fit adopter into the tools teams already run (issue 22, item 5): the pre-commit
hook definition names a command the CLI accepts, and the workflow in ``docs/ci-gate.md`` is
complete (installs, gates, uploads the report, the plot and the SARIF) with commands the CLI
accepts."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_yaml(text: str):
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(text)


def _console_scripts() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return {line.split("=")[0].strip() for line in lines if line.strip()}


def _parses(argv: list[str]) -> None:
    """``adopter ARGV`` is accepted by the CLI's parser (argparse exits 2 otherwise)."""
    from adopter.cli import build_parser

    parser, _ = build_parser()
    args = parser.parse_args(argv)
    assert args.command == argv[0]


def test_pre_commit_hook_parses_and_runs_rewrite_check():
    hooks = _load_yaml((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert isinstance(hooks, list)
    (hook,) = [h for h in hooks if h["id"] == "adopter-rewrite-check"]
    for key in ("id", "name", "entry", "language"):  # what pre-commit requires of a hook
        assert isinstance(hook[key], str) and hook[key]
    assert hook["language"] == "python"
    assert hook["types"] == ["python"]
    entry = shlex.split(hook["entry"]) + list(hook.get("args", []))
    assert entry[0] in _console_scripts()
    assert entry[1:] == ["rewrite", "--check"]
    _parses(entry[1:] + ["some_file.py"])  # pre-commit appends the staged file names


def test_rewrite_check_is_what_the_hook_promises(tmp_path):
    """--check writes nothing and exits 1 when a file would change (0 when none would)."""
    from adopter.cli import main

    model = tmp_path / "m.py"
    text = ("import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n    def forward(self, x):\n"
            "        return torch.softmax(x, dim=-1)\n")
    model.write_text(text)
    clean = tmp_path / "clean.py"
    clean.write_text("x = 1\n")
    assert main(["rewrite", "--check", str(model), str(clean)]) == 1
    assert model.read_text() == text
    assert main(["rewrite", "--check", str(clean)]) == 0


def _workflow() -> dict:
    doc = (ROOT / "docs" / "ci-gate.md").read_text()
    blocks = [b for b in re.findall(r"^```yaml\n(.*?)^```", doc, flags=re.S | re.M) if "jobs:" in b]
    assert len(blocks) == 1, "docs/ci-gate.md shows one complete workflow"
    return _load_yaml(blocks[0])


def test_ci_gate_doc_has_a_complete_workflow():
    workflow = _workflow()
    assert workflow["permissions"]["security-events"] == "write"
    (job,) = workflow["jobs"].values()
    steps = job["steps"]
    uses = [s.get("uses", "").split("@")[0] for s in steps]
    assert uses[:2] == ["actions/checkout", "actions/setup-python"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "pip install" in runs
    commands = [" ".join(shlex.split(line.replace("\\\n", " "))) for line in
                re.findall(r"^\s*(adopter .*?(?:\\\n.*?)*)(?:\s*\|.*)?$", runs, flags=re.M)]
    verify = next(c for c in commands if c.startswith("adopter verify"))
    for flag in ("--model", "--baseline", "--max-regression 5%", "--json", "--plot"):
        assert flag in verify, verify
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv[0] == "scan" and ">" in argv:
            argv = argv[: argv.index(">")]
        _parses(argv)
    assert any(c.startswith("adopter scan") and "--format sarif" in c for c in commands)
    artifact = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert artifact["if"] == "always()"
    paths = artifact["with"]["path"].split()
    assert {"verify-result.json", "verify-plot.png", "verify-report.txt"} <= set(paths)
    assert all(p in verify or p in runs for p in paths)
    sarif = next(s for s in steps if s.get("uses", "").startswith("github/codeql-action/upload-sarif"))
    assert sarif["with"]["sarif_file"] == "adopter.sarif" and "adopter.sarif" in runs
