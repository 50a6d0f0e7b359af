"""``adopter rewrite --model ... --write`` then ``adopter rewrite --check`` (the pre-commit hook) on
the same files exits 0 (issue 35, item 3): what the trace decided against (here a softmax under a
branch the analysed config never runs) is written into the source as a suppression comment with
the reason, in the same atomic write; the diff shows it; every other byte stays."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from adopter.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "suppress" / "gated_classifier.py"
ARGS = {"inputs": {"x": {"shape": [2, 8], "dtype": "float32"}}}
BRANCH = "            logits = torch.softmax(logits * 2.0, dim=-1)  # noqa: E501"


@pytest.fixture()
def project(tmp_path, monkeypatch):
    (tmp_path / ".git").mkdir()
    package = f"gated_{uuid.uuid4().hex[:8]}"  # (a fresh module name: the class is imported in process)
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "net.py").write_text(FIXTURE.read_text())
    (tmp_path / "args.json").write_text(json.dumps(ARGS))
    monkeypatch.chdir(tmp_path)
    return tmp_path, package


def rewrite_model(package: str, *extra: str) -> int:
    return main(["rewrite", "--model", f"{package}.net:GatedClassifier", "--model-args", "args.json", *extra])


def test_check_agrees_with_what_the_trace_wrote(project, capsys):
    root, package = project
    path = root / package / "net.py"
    original = path.read_text()
    assert main(["rewrite", "--check", "--jobs", "1", str(path)]) == 1  # both softmaxes, statically
    capsys.readouterr()

    assert rewrite_model(package) == 0
    shown = capsys.readouterr()
    assert f"+{BRANCH}  # adopter: ignore[softmax]" in shown.out  # the diff says it too
    assert f"suppressed softmax at {package}/net.py:" in shown.err and "not executed under the trace" in shown.err

    assert rewrite_model(package, "--format", "json") == 0
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    assert entry["suppressions"] == [{"rule": "softmax", "line": 20, "reason": "not executed under the trace"}]

    assert rewrite_model(package, "--write") == 0
    written = path.read_text()
    assert main(["rewrite", "--check", "--jobs", "1", str(path)]) == 0
    for name in [n for n in sys.modules if n.split(".")[0] == package]:
        del sys.modules[name]  # (as a new process would: the class is imported from the file written)
    assert rewrite_model(package, "--check") == 0  # and --model itself has nothing more to do

    # the executed softmax rewritten, the other one kept with the comment after the user's own
    new_lines, old_lines = written.split("\n"), original.split("\n")
    assert f"{BRANCH}  # adopter: ignore[softmax]" in new_lines
    assert "        probs = softmax(logits, dim=-1)" in new_lines
    changed = {line for line in old_lines if line not in new_lines}
    assert changed == {BRANCH, "        probs = torch.softmax(logits, dim=-1)"}  # nothing else touched


def test_the_reason_is_written_where_the_line_length_allows(project, capsys):
    root, package = project
    (root / "pyproject.toml").write_text("[tool.ruff]\nline-length = 140\n")
    assert rewrite_model(package, "--write") == 0
    assert f"{BRANCH}  # adopter: ignore[softmax] -- not executed under the trace" in \
        (root / package / "net.py").read_text().split("\n")
    assert main(["rewrite", "--check", "--jobs", "1", str(root / package)]) == 0


def test_a_suppressed_site_stays_as_written_under_model(project, capsys):
    root, package = project
    path = root / package / "net.py"
    text = path.read_text().replace("probs = torch.softmax(logits, dim=-1)",
                                    "probs = torch.softmax(logits, dim=-1)  # adopter: ignore[softmax] -- ours")
    path.write_text(text)
    assert rewrite_model(package, "--write") == 0
    written = path.read_text()
    assert "probs = torch.softmax(logits, dim=-1)  # adopter: ignore[softmax] -- ours" in written
    assert main(["rewrite", "--check", "--jobs", "1", str(path)]) == 0
