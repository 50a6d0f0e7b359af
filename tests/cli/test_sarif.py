"""``adopter scan --format sarif`` (issue 22, item 5): valid SARIF 2.1.0 (the OASIS schema, vendored
in ``tests/fixtures/sarif/``), one result per match with the rule, level, status message and the
matched lines as the region; ``tool.driver.rules`` from the registry with their docs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "fixtures" / "sarif" / "sarif-schema-2.1.0.json"

MODEL = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, smooth=False):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.act = nn.GELU() if smooth else nn.ReLU()
        self.fc = nn.Linear(8, 8)
        self.gelu = nn.GELU()
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.act(self.dense(x))
        h = self.gelu(self.fc(h))
        h = self.dropout(h)
        h = self.norm(h + x)
        return torch.softmax(h, dim=-2)
"""


def adopter(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "adopter", *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def validate(doc: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message[:300]}" for e in errors[:10])


@pytest.fixture()
def project(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "block.py").write_text(MODEL)
    return tmp_path


def test_scan_sarif_validates_and_has_one_result_per_match(project):
    sarif = adopter("scan", "models", "--format", "sarif", cwd=project)
    assert sarif.returncode == 0, sarif.stderr
    doc = json.loads(sarif.stdout)
    validate(doc)
    assert doc["version"] == "2.1.0"
    (run,) = doc["runs"]
    plain = json.loads(adopter("scan", "models", "--format", "json", cwd=project).stdout)
    assert len(run["results"]) == len(plain["matches"]) >= 4
    assert sorted(r["ruleId"] for r in run["results"]) == sorted(m["rule"] for m in plain["matches"])
    by_status = {r["properties"]["status"]: r for r in run["results"]}
    assert {"static", "conditional", "refused"} <= set(by_status)
    assert by_status["static"]["level"] == "warning"
    conditional = by_status["conditional"]
    assert (conditional["ruleId"], conditional["level"]) == ("biased_GeLU", "note")
    assert conditional["message"]["text"] == (
        "biased_GeLU in Block.forward: conditional (needs-config): self.act is nn.GELU only if smooth")
    refused = by_status["refused"]
    assert (refused["ruleId"], refused["level"], refused["kind"]) == ("softmax", "none", "informational")
    assert refused["properties"]["code"] == "dim-not-last"
    assert run["invocations"] == [{"executionSuccessful": True}]


def test_a_match_region_is_its_lines_relative_to_the_working_directory(project):
    doc = json.loads(adopter("scan", "models", "--format", "sarif", cwd=project).stdout)
    results = doc["runs"][0]["results"]
    (dln,) = [r for r in results if r["ruleId"] == "Dropout_LayerNorm"]
    location = dln["locations"][0]["physicalLocation"]
    assert location["artifactLocation"] == {"uri": "models/block.py", "uriBaseId": "SRCROOT"}
    lines = MODEL.splitlines()
    start = lines.index("        h = self.dropout(h)") + 1
    assert location["region"] == {"startLine": start, "endLine": start + 1}
    assert dln["locations"][0]["logicalLocations"] == [{"fullyQualifiedName": "Block.forward", "kind": "function"}]
    root = doc["runs"][0]["originalUriBaseIds"]["SRCROOT"]["uri"]
    assert root == project.resolve().as_uri() + "/"


def test_driver_rules_are_the_registry_with_their_docs(project):
    from adopter.core.rules import all_rules

    doc = json.loads(adopter("scan", "models", "--format", "sarif", cwd=project).stdout)
    driver = doc["runs"][0]["tool"]["driver"]
    assert driver["name"] == "adopter"
    rules = {r.name: r for r in all_rules()}
    assert [d["id"] for d in driver["rules"]] == list(rules)
    for d in driver["rules"]:
        assert d["fullDescription"]["text"] == rules[d["id"]].doc.strip()
        assert d["properties"]["kernel"] == rules[d["id"]].kernel
    for r in doc["runs"][0]["results"]:
        assert driver["rules"][r["ruleIndex"]]["id"] == r["ruleId"]


def test_a_file_that_does_not_parse_is_a_notification_and_exit_2(project):
    (project / "models" / "broken.py").write_text("def f(:\n")
    (project / "notes.txt").write_text("not python\n")
    r = adopter("scan", "models", "notes.txt", "--format", "sarif", "--rules", "softmax", cwd=project)
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    validate(doc)
    (invocation,) = doc["runs"][0]["invocations"]
    assert invocation["executionSuccessful"] is False
    errors = [n for n in invocation["toolExecutionNotifications"] if n["level"] == "error"]
    assert [n["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for n in errors] == ["models/broken.py"]
    assert [d["id"] for d in doc["runs"][0]["tool"]["driver"]["rules"]] == ["softmax"]


def test_a_traced_status_keeps_its_trace_code(tmp_path):
    """A match a trace left not-executed carries its cause as the ``trace_code`` property."""
    from dataclasses import replace

    from adopter.commands._sarif import to_sarif
    from adopter.core.rules import all_rules
    from adopter.core.scan import ScanReport, scan_source

    path = tmp_path / "block.py"
    path.write_text(MODEL)
    rules = all_rules()
    matches = [m for m in scan_source(MODEL, str(path), rules) if m.status == "static"]
    traced = [replace(m, status="not-executed", reason="line 18 never executes", trace_code="lines-not-run")
              for m in matches]
    doc = to_sarif(ScanReport(files_scanned=1, seconds=0.0, matches=traced), rules, root=str(tmp_path))
    validate(doc)
    results = doc["runs"][0]["results"]
    assert results and all(r["properties"]["trace_code"] == "lines-not-run" for r in results)
    plain = to_sarif(ScanReport(files_scanned=1, seconds=0.0, matches=matches), rules, root=str(tmp_path))
    assert all("trace_code" not in r["properties"] for r in plain["runs"][0]["results"])


def test_sarif_after_a_trace_validates(tmp_path):
    """With --model, every match has a runtime status: still valid SARIF."""
    pkg = tmp_path / "mymodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "block.py").write_text(MODEL)
    (tmp_path / "args.json").write_text(json.dumps({"kwargs": {"smooth": True},
                                                    "inputs": {"x": {"shape": [2, 8]}}}))
    r = adopter("scan", "mymodels", "--format", "sarif", "--model", "mymodels.block:Block", "--model-args",
                "args.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validate(doc)
    statuses = {res["properties"]["status"] for res in doc["runs"][0]["results"]}
    assert "confirmed" in statuses and "conditional" not in statuses, textwrap.shorten(str(statuses), 200)
