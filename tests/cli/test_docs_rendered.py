"""The outputs and figures README.md and docs/*.md show are rendered from recorded runs
(``benchmarks/render_docs.py``), not pasted: every marker has its results file and holds exactly
what rendering that file produces, and every results file the documents name exists. Runs nothing."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


render_docs = _load_render_docs()
DOCUMENTS = render_docs.documents()
IDS = [path.relative_to(ROOT).as_posix() for path in DOCUMENTS]


def test_the_documents_have_rendered_blocks():
    names = {name for path in DOCUMENTS for name, figure in render_docs.markers(path.read_text()) if figure is None}
    assert {"readme-verify-bert", "readme-python-api", "gate-tiny-bert"} <= names


@pytest.mark.parametrize("path", DOCUMENTS, ids=IDS)
def test_markers_are_paired(path):
    text = path.read_text()
    found = len(render_docs.markers(text))
    assert text.count("<!-- render_docs:") == found
    assert text.count("<!-- /render_docs -->") == found


@pytest.mark.parametrize("path", DOCUMENTS, ids=IDS)
def test_every_marker_has_a_results_file_of_a_known_entry(path):
    for name, figure in render_docs.markers(path.read_text()):
        assert name in render_docs.BY_NAME, f"{name}: no entry in benchmarks/render_docs.py runs it"
        record = render_docs.load_record(name)
        for key in ("command", "date", "git_commit", "python", "torch", "wall_s", "exit_status", "output"):
            assert key in record, f"{name}: {key} missing from its results file"
        assert record["command"] == render_docs.BY_NAME[name].command
        if figure is not None:
            assert figure in record["figures"], f"{name}#{figure}: no such figure in its results file"


@pytest.mark.parametrize("path", DOCUMENTS, ids=IDS)
def test_marker_text_is_what_rendering_its_results_file_produces(path):
    text = path.read_text()
    assert render_docs.render(text) == text, (
        f"{path.name} differs from its results files: run python benchmarks/render_docs.py --render-only")


@pytest.mark.parametrize("path", DOCUMENTS, ids=IDS)
def test_every_results_file_named_exists(path):
    named = set(re.findall(r"benchmarks/(?:results|baselines)/[A-Za-z0-9_./-]+\.(?:json|md|txt)", path.read_text()))
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    assert not missing


def test_files_kept_by_a_run_exist():
    for record_path in sorted(render_docs.RESULTS.glob("*.json")):
        record = json.loads(record_path.read_text())
        if record.get("format") != render_docs.FORMAT:
            continue  # a kept file (e.g. a verify JSON), not a record
        for kept in record["kept_files"].values():
            assert (ROOT / kept).is_file(), f"{record_path.name}: {kept} missing"


def test_rendering_replaces_stale_text_and_names_the_run():
    record = {
        "name": "readme-scan", "shown": "`adopter scan x`", "date": "2026-01-02T03:04:05Z",
        "git_commit": "0123456789abcdef", "uncommitted_code_changes": ["adopter/cli.py"], "python": "3.11.7",
        "torch": "2.13.0+cpu", "cpu_count": 2, "exit_status": 0, "wall_s": 1.2,
        "output": "line one  \nline two\n", "figures": {"wall": "1 s"},
    }
    stale = ("a <!-- render_docs: readme-scan#wall -->99 s<!-- /render_docs --> b\n"
             "<!-- render_docs: readme-scan -->\npasted by hand\n<!-- /render_docs -->\n")
    rendered = render_docs.render(stale, lambda name: record)
    assert "99 s" not in rendered and "pasted by hand" not in rendered
    assert "a <!-- render_docs: readme-scan#wall -->1 s<!-- /render_docs --> b" in rendered
    assert "\n```\nline one\nline two\n```\n" in rendered
    assert ("(output of `adopter scan x`, run 2026-01-02 03:04 UTC at 0123456 plus uncommitted changes to 1 file(s); "
            "Python 3.11.7, torch 2.13.0+cpu, 2 CPUs; exit status 0, 1 s; "
            "results file benchmarks/results/docs/readme-scan.json)") in rendered
    assert render_docs.render(rendered, lambda name: record) == rendered
