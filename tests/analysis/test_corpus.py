"""The scanner against the hand-labelled corpora: tests/corpus/labels.json (transformers files,
guidelines in tests/corpus/README.md): no false positive, recall >= 0.97; tests/corpus/styles/
(self-written non-HuggingFace files, tests/corpus/styles/README.md): no false positive, recall
>= 0.95 per rule; tests/corpus/heldout/ (self-written, labelled blind to the scanner): the same
targets, xfail (measured, not tuned); tests/corpus/llm_styles/ (self-written LLM files, labelled
blind to the scanner, scanned with the LLM rule pack too): the same targets, asserted (issue 24);
tests/corpus/wild/ (issue 35's styles, labelled blind to the scanner, scanned with every rule): the
same targets, asserted.

Scans only the labelled files (static, a few seconds). The labels are tied to the exact text of
each file (sha256); files that changed since labelling are left out, and the tests skip when none
is left. Full report: ``python benchmarks/bench_corpus.py --corpus all``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str((Path(__file__).parents[1] / "corpus")))

import corpus_eval

RECALL_TARGET = 0.97
STYLES_RECALL_TARGET = 0.95  # per rule


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


# --- styles corpus (self-written, non-HuggingFace) ------------------------------------------------


@pytest.fixture(scope="module")
def styles_corpus():
    return corpus_eval.load_corpus(corpus_eval.STYLES_LABELS_PATH)


@pytest.fixture(scope="module")
def styles_files(styles_corpus):
    f = corpus_eval.corpus_files(styles_corpus)
    assert not f.stale, f"styles corpus files changed since labelling (relabel, see its README): {f.stale}"
    return f


@pytest.fixture(scope="module")
def styles_score(styles_corpus, styles_files):
    report = corpus_eval.scan(styles_files)
    assert report.files_scanned == len(styles_files.paths)
    return corpus_eval.evaluate(styles_corpus, report.matches, styles_files), report


def test_styles_labels_point_at_the_labelled_code(styles_corpus, styles_files):
    for entry in styles_corpus["labels"] + styles_corpus["negatives"]:
        text = styles_files.paths[entry["file"]].read_text(encoding="utf-8").splitlines()
        assert sorted(map(int, entry["code"])) == sorted(entry["lines"]), entry
        for line, code in entry["code"].items():
            assert text[int(line) - 1].strip() == code, f"{entry['file']}:{line} {entry['rule']}"
    assert {l["rule"] for l in styles_corpus["labels"]} == set(corpus_eval.RULE_ORDER)


def test_styles_no_false_positive_and_recall_per_rule(styles_score):
    score, report = styles_score
    problems = [f"scan error {e.file}: {e.message}" for e in report.errors]
    if score.fp:
        problems.append(f"{len(score.fp)} false positive(s):\n{_listing(score.fp)}")
    low = {rule: r for rule, r in score.per_rule().items()
           if r["labels"] and (r["recall"] is None or r["recall"] < STYLES_RECALL_TARGET)}
    if low:
        missed = [o for o in score.fn if o.rule in low]
        problems.append("recall < %s for %s; false negative(s):\n%s" % (
            STYLES_RECALL_TARGET, ", ".join(f"{k} {v['recall']}" for k, v in low.items()), _listing(missed)))
    if problems:
        pytest.fail("\n".join(problems))


# --- held-out corpus (self-written, labelled blind to the scanner; measured, not tuned) ----------


@pytest.fixture(scope="module")
def heldout_corpus():
    return corpus_eval.load_corpus(corpus_eval.HELDOUT_LABELS_PATH)


@pytest.fixture(scope="module")
def heldout_files(heldout_corpus):
    f = corpus_eval.corpus_files(heldout_corpus)
    assert not f.stale, f"held-out corpus files changed since labelling (see its README): {f.stale}"
    return f


@pytest.fixture(scope="module")
def heldout_score(heldout_corpus, heldout_files):
    report = corpus_eval.scan(heldout_files)
    assert report.files_scanned == len(heldout_files.paths)
    return corpus_eval.evaluate(heldout_corpus, report.matches, heldout_files), report


@pytest.mark.xfail(strict=False, reason="held-out corpus: measured, not tuned")
def test_heldout_no_false_positive_and_recall_per_rule(heldout_score):
    score, report = heldout_score
    problems = [f"scan error {e.file}: {e.message}" for e in report.errors]
    if score.fp:
        problems.append(f"{len(score.fp)} false positive(s):\n{_listing(score.fp)}")
    low = {rule: r for rule, r in score.per_rule().items()
           if r["labels"] and (r["recall"] is None or r["recall"] < STYLES_RECALL_TARGET)}
    if low:
        missed = [o for o in score.fn if o.rule in low]
        problems.append("recall < %s for %s; false negative(s):\n%s" % (
            STYLES_RECALL_TARGET, ", ".join(f"{k} {v['recall']}" for k, v in low.items()), _listing(missed)))
    if problems:
        pytest.fail("\n".join(problems))


# --- LLM-styles corpus (self-written LLM files, labelled blind to the scanner; measured, not tuned) --

LLM_STYLES_LABELS_PATH = (Path(__file__).parents[1] / "corpus") / "llm_styles" / "labels.json"
LLM_RULES = ("RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy")


@pytest.fixture(scope="module")
def llm_styles_corpus():
    return corpus_eval.load_corpus(LLM_STYLES_LABELS_PATH)


@pytest.fixture(scope="module")
def llm_styles_files(llm_styles_corpus):
    f = corpus_eval.corpus_files(llm_styles_corpus)
    assert not f.stale, f"llm_styles corpus files changed since labelling (see its README): {f.stale}"
    return f


@pytest.fixture(scope="module")
def llm_styles_score(llm_styles_corpus, llm_styles_files):
    # labelled for the Table 1 rules and the LLM rule pack: scanned with both
    from adopter.core.rules import get_rules
    from adopter.core.scan import scan_paths

    rules = get_rules(list(corpus_eval.RULE_ORDER) + list(LLM_RULES))
    report = scan_paths([str(p) for _, p in sorted(llm_styles_files.paths.items())], rules)
    assert report.files_scanned == len(llm_styles_files.paths)
    return corpus_eval.evaluate(llm_styles_corpus, report.matches, llm_styles_files), report


def test_llm_styles_no_false_positive_and_recall_per_rule(llm_styles_score):
    # The bar of issue 24: no false positive, recall >= 0.95 per rule. A label missed as a
    # prediction passes only when the scanner proposed it as `conditional` (the configuration
    # decides, a trace settles it: "unknown stays unknown", never a silent miss) — today the three
    # Dropout_LayerNorm sites of a norm_first encoder layer, which optimize() confirms and applies
    # (tests/rules/test_dropout_layernorm_helper_return.py).
    score, report = llm_styles_score
    problems = [f"scan error {e.file}: {e.message}" for e in report.errors]
    if score.fp:
        problems.append(f"{len(score.fp)} false positive(s):\n{_listing(score.fp)}")
    proposed = [o for o in score.other_status if o.why.startswith("conditional")]

    def conditional(miss) -> bool:
        return any(o.rule == miss.rule and o.file == miss.file and o.cls == miss.cls
                   and set(o.lines) & set(miss.lines) for o in proposed)

    silent = [o for o in score.fn if not conditional(o)]
    low = {}
    for rule, r in score.per_rule().items():
        found = r["tp"] + sum(o.rule == rule for o in score.fn if conditional(o))
        if r["labels"] and found / r["labels"] < STYLES_RECALL_TARGET:
            low[rule] = round(found / r["labels"], 4)
    if low:
        problems.append("recall < %s for %s; false negative(s):\n%s" % (
            STYLES_RECALL_TARGET, ", ".join(f"{k} {v}" for k, v in low.items()),
            _listing([o for o in silent if o.rule in low])))
    if problems:
        pytest.fail("\n".join(problems))


# --- wild corpus (issue 35: training code in the wild styles, labelled blind to the scanner) -------

WILD_LABELS_PATH = (Path(__file__).parents[1] / "corpus") / "wild" / "labels.json"


@pytest.fixture(scope="module")
def wild_corpus():
    return corpus_eval.load_corpus(WILD_LABELS_PATH)


@pytest.fixture(scope="module")
def wild_files(wild_corpus):
    f = corpus_eval.corpus_files(wild_corpus)
    assert not f.stale, f"wild corpus files changed since labelling (see its README): {f.stale}"
    return f


@pytest.fixture(scope="module")
def wild_score(wild_corpus, wild_files):
    # labelled for every rule (sdpa_attention included): scanned with every registered rule; a
    # labelled rule the scanner does not know has its labels counted as misses
    from adopter.core.scan import scan_paths

    report = scan_paths([str(p) for _, p in sorted(wild_files.paths.items())], None)
    assert report.files_scanned == len(wild_files.paths)
    return corpus_eval.evaluate(wild_corpus, report.matches, wild_files), report


def test_wild_scan_reads_every_file(wild_score):
    _score, report = wild_score
    assert report.errors == [], [e.to_json() for e in report.errors]


def test_wild_no_false_positive_and_recall_per_rule(wild_score):
    # The bar of issue 35: per-rule precision >= 0.98 and recall >= 0.95 on this corpus. With a
    # few labels per rule a single false positive already breaks 0.98: asserted as none.
    score, report = wild_score
    problems = [f"scan error {e.file}: {e.message}" for e in report.errors]
    if score.fp:
        problems.append(f"{len(score.fp)} false positive(s):\n{_listing(score.fp)}")
    low = {rule: r for rule, r in score.per_rule().items()
           if r["labels"] and (r["recall"] is None or r["recall"] < STYLES_RECALL_TARGET)}
    if low:
        missed = [o for o in score.fn if o.rule in low]
        problems.append("recall < %s for %s; false negative(s):\n%s" % (
            STYLES_RECALL_TARGET, ", ".join(f"{k} {v['recall']}" for k, v in low.items()), _listing(missed)))
    if problems:
        pytest.fail("\n".join(problems))


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


def test_evaluator_scores_only_static_and_confirmed_matches():
    files = corpus_eval.CorpusFiles(paths={"m.py": Path("m.py")})
    matches = [
        {**_match("softmax", "A", [10]), "status": "conditional", "reason": "dim unknown"},  # not a prediction
        {**_match("softmax", "A", [10]), "status": "confirmed"},                            # TP
        {**_match("fused_QKV", "D", [41]), "status": "refused"},                            # not an FP
        {**_match("fused_QKV", "C", [30]), "status": "rejected"},                           # not a prediction
    ]
    s = corpus_eval.evaluate(_TOY, matches, files)
    assert [(o.rule, o.cls) for o in s.tp] == [("softmax", "A")]
    assert s.fp == []
    assert [(o.rule, o.why) for o in s.other_status] == [
        ("softmax", "conditional: dim unknown"), ("fused_QKV", "refused"), ("fused_QKV", "rejected")]
    assert s.other_status_counts() == {"softmax": {"conditional": 1}, "fused_QKV": {"refused": 1, "rejected": 1}}
    assert {(o.rule, o.cls) for o in s.fn} == {("Conv_BatchNorm", "B"), ("fused_QKV", "C")}


def test_in_repo_corpus_files_resolve_next_to_the_labels_file(tmp_path):
    import hashlib
    import json

    (tmp_path / "sub").mkdir()
    src = tmp_path / "sub" / "m.py"
    src.write_text("x = 1\n")
    good = hashlib.sha256(src.read_bytes()).hexdigest()
    labels = {"files": {"m.py": {"path": "sub/m.py", "sha256": good},
                        "gone.py": {"path": "gone.py", "sha256": good},
                        "old.py": {"path": "sub/m.py", "sha256": "0" * 64}},
              "labels": [], "negatives": []}
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    corpus = corpus_eval.load_corpus(tmp_path / "labels.json")
    assert corpus_eval.in_repo(corpus) and not corpus_eval.in_repo(corpus_eval.load_corpus())
    files = corpus_eval.corpus_files(corpus)
    assert files.paths == {"m.py": src.resolve()}
    assert set(files.stale) == {"gone.py", "old.py"} and "changed since labelling" in files.stale["old.py"]


def test_labels_follow_their_code_to_another_patch_release(corpus, files, tmp_path):
    # another transformers patch release shifts lines: labels are found again by their code
    import copy

    name = next(n for n in sorted(files.paths) if any(e["file"] == n for e in corpus["labels"]))
    info = corpus["files"][name]
    shifted = tmp_path / info["path"]
    shifted.parent.mkdir(parents=True)
    shifted.write_text("# a line added upstream\n" * 3 + files.paths[name].read_text(encoding="utf-8"))
    moved = copy.deepcopy(corpus)
    again = corpus_eval.corpus_files(moved, models_dir=tmp_path)
    assert name in again.paths, again.stale
    text = shifted.read_text(encoding="utf-8").splitlines()
    for before, after in zip(corpus["labels"], moved["labels"]):
        if before["file"] == name:
            assert after["lines"] == [line + 3 for line in before["lines"]]
            for line, code in after["code"].items():
                assert text[int(line) - 1].strip() == code
    gone = next(iter(next(e for e in corpus["labels"] if e["file"] == name)["code"].values()))
    shifted.write_text("\n".join(t for t in text if t.strip() != gone))
    assert name in corpus_eval.corpus_files(copy.deepcopy(corpus), models_dir=tmp_path).stale
