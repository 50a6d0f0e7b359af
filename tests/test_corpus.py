"""The scanner against the hand-labelled corpus (tests/corpus/labels.json, guidelines in
tests/corpus/README.md): no false positive, recall >= 0.97.

Scans only the labelled transformers modeling files (static, ~2 s). The labels are tied to the
exact text of each file (sha256); files that changed since labelling are left out, and the tests
skip when none is left. Full report: ``python benchmarks/bench_corpus.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("corpus")))

import corpus_eval

RECALL_TARGET = 0.97


@pytest.fixture(scope="module")
def corpus():
    return corpus_eval.load_corpus()


@pytest.fixture(scope="module")
def files(corpus):
    f = corpus_eval.corpus_files(corpus)
    if not f.paths:
        pytest.skip("no labelled file available: " + "; ".join(sorted(set(f.stale.values())))[:300])
    return f


@pytest.fixture(scope="module")
def report(files):
    return corpus_eval.scan(files)


@pytest.fixture(scope="module")
def score(corpus, files, report):
    return corpus_eval.evaluate(corpus, report.matches, files)


def _listing(outcomes) -> str:
    return "\n".join(f"  {o.where()} {o.rule} [{o.cls}] lines {o.lines}: {o.why}" for o in outcomes)


def test_labels_point_at_the_labelled_code(corpus, files):
    # every recorded line still holds the code the labeller read (guards hand edits of labels.json)
    for entry in corpus["labels"] + corpus["negatives"]:
        path = files.paths.get(entry["file"])
        if path is None:
            continue
        text = path.read_text(encoding="utf-8").splitlines()
        assert sorted(map(int, entry["code"])) == sorted(entry["lines"]), entry
        for line, code in entry["code"].items():
            assert text[int(line) - 1].strip() == code, f"{entry['file']}:{line} {entry['rule']}"


def test_corpus_is_diverse(corpus, files):
    rules = {l["rule"] for l in corpus["labels"] if l["file"] in files.paths}
    assert rules == set(corpus_eval.RULE_ORDER)
    assert len(files.paths) >= 20


def test_scan_reads_every_corpus_file(report, files):
    assert report.errors == []
    assert report.files_scanned == len(files.paths)


def test_no_false_positives(score):
    if score.fp:
        pytest.fail(f"precision {score.precision}: {len(score.fp)} false positive(s):\n{_listing(score.fp)}")


def test_recall(score):
    if score.recall is None or score.recall < RECALL_TARGET:
        missed = _listing(score.fn)
        pytest.fail(f"recall {score.recall} < {RECALL_TARGET}; {len(score.fn)} false negative(s):\n{missed}")


# --- the yardstick itself ------------------------------------------------------------------------

_TOY = {
    "transformers_version": "test",
    "files": {"m.py": {"path": "m.py", "sha256": ""}},
    "labels": [
        {"file": "m.py", "rule": "softmax", "class": "A", "lines": [10], "doc_scope": True, "why": "a"},
        {"file": "m.py", "rule": "Conv_BatchNorm", "class": "B", "lines": [20, 21], "doc_scope": False,
         "why": "b"},
        {"file": "m.py", "rule": "fused_QKV", "class": "C", "lines": [30, 31, 32], "doc_scope": True,
         "why": "c"},
    ],
    "negatives": [{"file": "m.py", "rule": "fused_QKV", "class": "D", "lines": [40, 41], "why": "cross"}],
}


def _match(rule, cls, lines, file="/x/m.py"):
    return {"rule": rule, "file": file, "class": cls, "lines": lines}


def test_evaluator_counts_overlap_class_duplicates_and_negatives():
    files = corpus_eval.CorpusFiles(paths={"m.py": Path("m.py")})
    matches = [
        _match("softmax", "A", [10]),                 # TP
        _match("softmax", "A", [10]),                 # duplicate -> FP
        _match("fused_QKV", "C", [32, 33]),           # overlaps -> TP
        _match("fused_QKV", "D", [41]),               # labelled negative -> FP
        _match("Conv_BatchNorm", "Other", [20, 21]),  # wrong class -> FP, label stays FN
    ]
    s = corpus_eval.evaluate(_TOY, matches, files)
    assert [(o.rule, o.cls) for o in s.tp] == [("softmax", "A"), ("fused_QKV", "C")]
    assert len(s.fp) == 3
    assert "duplicate" in s.fp[0].why and "cross" in s.fp[1].why and "class" in s.fp[2].why
    assert [(o.rule, o.cls) for o in s.fn] == [("Conv_BatchNorm", "B")]
    assert s.precision == round(2 / 5, 4) and s.recall == round(2 / 3, 4)
    assert s.recall_doc_scope == 1.0  # the missed label is outside the doc scope
    assert s.per_rule()["fused_QKV"] == {
        "labels": 1, "tp": 1, "fp": 1, "fn": 0, "precision": 0.5, "recall": 1.0,
    }


def test_evaluator_counts_matches_outside_the_labelled_files_as_false_positives():
    files = corpus_eval.CorpusFiles(paths={"m.py": Path("m.py")})
    s = corpus_eval.evaluate(_TOY, [_match("softmax", "A", [10], file="/x/other.py")], files)
    assert len(s.fp) == 1 and len(s.fn) == 3
