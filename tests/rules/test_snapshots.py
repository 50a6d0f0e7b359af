"""Each rule's story as files (issue 34; Ruff's rule fixtures and insta snapshots as models).

Cases: every ``tests/fixtures/rules/<Rule>/*.py``. For each case the runner scans it with that rule
alone and rewrites it (``--torchscript never``), and compares with two committed snapshots in
``tests/rules/<Rule>/``:

* ``<case>.scan.txt``: one line per match — lines, status, class.function, and for a refused match
  its code (never the prose reason: reasons may be reworded, codes are the contract);
* ``<case>.rewritten.py``: the rewritten file (absent: the rewrite changes nothing).

A change in what a rule finds or writes shows as a snapshot diff in review. After a deliberate
change, write the snapshots again and review them::

    ADOPTER_UPDATE_SNAPSHOTS=1 python -m pytest tests/rules -q
    make test-rule RULE=RMSNorm                 # one rule's story: its snapshots and its tests
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from adopter.rewrite import rewrite_file

from adopter.core.rules import get_rules
from adopter.core.scan import scan_paths

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "fixtures" / "rules"
SNAPSHOTS = Path(__file__).resolve().parent
UPDATE = os.environ.get("ADOPTER_UPDATE_SNAPSHOTS") == "1"
# a fixture folder that is not one rule's name: the rules its cases are for
FOLDER_RULES = {"attention": ("BertSelfAttention", "T5Attention", "GPT2Attention")}


def rules_of(folder: str) -> list:
    return get_rules(FOLDER_RULES.get(folder, (folder,)))


def _cases() -> list:
    out = []
    for folder in sorted(p for p in CASES.iterdir() if p.is_dir()):
        for case in sorted(folder.glob("*.py")):
            out.append(pytest.param(folder.name, case, id=f"{folder.name}/{case.stem}",
                                    marks=pytest.mark.rule(folder.name)))
    return out


def scan_snapshot(rule: str, case: Path) -> str:
    report = scan_paths([case], rules_of(rule), jobs=1)
    assert not report.errors, report.errors
    lines = []
    for m in report.matches:
        span = f"{min(m.lines)}-{max(m.lines)}" if m.lines else "-"
        where = f"{m.class_name}.{m.function}" if m.class_name else m.function
        lines.append(f"{span:>9}  {m.status:<11}  {m.rule:<18}  {where}" + (f"  [{m.code}]" if m.status == "refused" else ""))
    return "\n".join(lines) + "\n" if lines else "(no match)\n"


def rewrite_snapshot(rule: str, case: Path, tmp_path: Path) -> str | None:
    copy = tmp_path / case.name
    shutil.copyfile(case, copy)
    result = rewrite_file(copy, rules_of(rule), write=True, torchscript="never")
    assert result.status in ("changed", "unchanged"), result.reason
    return copy.read_text() if result.status == "changed" else None


def _compare(path: Path, got: str | None) -> None:
    if UPDATE:
        if got is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(got)
        return
    expected = path.read_text() if path.exists() else None
    assert got == expected, (f"{path.relative_to(ROOT.parent)} differs from what the rule gives now "
                             "(ADOPTER_UPDATE_SNAPSHOTS=1 writes it; review the diff)")


@pytest.mark.parametrize("rule, case", _cases())
def test_rule_snapshot(rule, case, tmp_path):
    _compare(SNAPSHOTS / rule / f"{case.stem}.scan.txt", scan_snapshot(rule, case))
    _compare(SNAPSHOTS / rule / f"{case.stem}.rewritten.py", rewrite_snapshot(rule, case, tmp_path))


def test_every_snapshot_belongs_to_a_case():
    cases = {(folder.name, case.stem) for folder in CASES.iterdir() if folder.is_dir() for case in folder.glob("*.py")}
    orphans = [p for p in SNAPSHOTS.glob("*/*") if p.suffix in (".txt", ".py")
               and (p.parent.name, p.name.split(".")[0]) not in cases]
    assert not orphans, f"snapshots without a case (remove them): {orphans}"


def test_a_snapshot_that_differs_fails_and_names_the_update(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "UPDATE", False, raising=False)
    path = SNAPSHOTS / "RMSNorm" / "positive.scan.txt"
    with pytest.raises(AssertionError, match="ADOPTER_UPDATE_SNAPSHOTS=1"):
        _compare(path, path.read_text() + "  99-99  static  RMSNorm  New.forward\n")
    with pytest.raises(AssertionError):
        _compare(SNAPSHOTS / "RMSNorm" / "negative.rewritten.py", "x = 1\n")  # no snapshot: no rewrite expected
