"""The wild2 corpus (tests/corpus/wild2/: fairseq, whisper, mmdet, detectron2, SAM/DINOv2, MoE,
diffusion, Mamba/RWKV, audio/graph/U-Net and look-alike code, labelled blind to the scanner) stays
real, runnable PyTorch code: every file imports, every model its labels file lists builds and runs
forward (train and eval mode) on a small input, the language models train with targets (loss
finite, backward reaches every parameter), and every label's recorded code is the text of its
lines. The last tests scan the files (statically, every registered rule) and score the scanner
against the labels: the scan must read every file; the per-rule bar (no false positive, recall
>= 0.95) is measured, ``xfail`` for now (``python benchmarks/bench_corpus.py --corpus wild2`` prints
the full report)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

CORPUS_DIR = Path(__file__).parents[1] / "corpus"
WILD2 = CORPUS_DIR / "wild2"
LABELS_PATH = WILD2 / "labels.json"
CORPUS = json.loads(LABELS_PATH.read_text(encoding="utf-8"))
RULES = {"BertSelfAttention", "T5Attention", "GPT2Attention", "softmax", "Dropout_LayerNorm", "biased_GeLU",
         "Conv_BatchNorm", "Linear_BatchNorm", "fused_QKV", "RMSNorm", "gated_MLP", "rotary_embedding",
         "linear_cross_entropy", "Add_ReLU", "sdpa_attention"}
RECALL_TARGET = 0.95  # per rule, as for the wild corpus

# language models that compute their own loss: (file, model, targets keyword)
WITH_TARGETS = [
    ("moe_router.py", "MoETransformer", "targets"),
    ("mamba_rwkv.py", "Mamba", "labels"),
    ("mamba_rwkv.py", "RWKV", "targets"),
]


def _load(name: str):
    rel = Path(CORPUS["files"][name]["path"])
    spec = importlib.util.spec_from_file_location(f"adopter_wild2_corpus_{rel.stem}", WILD2 / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _input(spec: dict) -> torch.Tensor:
    if spec.get("dtype") == "long":
        return torch.randint(0, spec["high"], spec["shape"])
    return torch.randn(*spec["shape"])


def test_every_wild2_file_is_listed():
    on_disk = {p.relative_to(WILD2).as_posix() for p in WILD2.rglob("*.py")}
    assert on_disk == {info["path"] for info in CORPUS["files"].values()}
    assert 8 <= len(on_disk) <= 10
    for info in CORPUS["files"].values():
        assert info["models"], info["path"]


def test_wild2_labels_match_the_file_text():
    for item in CORPUS["labels"] + CORPUS["negatives"]:
        lines = (WILD2 / CORPUS["files"][item["file"]]["path"]).read_text(encoding="utf-8").splitlines()
        assert sorted(map(int, item["code"])) == sorted(item["lines"]), item
        for n, code in item["code"].items():
            assert lines[int(n) - 1].strip() == code, (item["file"], n)


def test_wild2_labels_are_well_formed():
    for item in CORPUS["labels"]:
        assert item["rule"] in RULES and item["why"], item
        assert isinstance(item["doc_scope"], bool), item
    for item in CORPUS["negatives"]:
        assert item["rule"] in RULES and item["why"], item
    assert 50 <= len(CORPUS["labels"]) <= 110
    for l in CORPUS["labels"]:
        for n in CORPUS["negatives"]:
            if (l["file"], l["rule"], l["class"]) == (n["file"], n["rule"], n["class"]):
                assert not set(l["lines"]) & set(n["lines"]), (l, n)
    # a softmax inside a labelled attention core is labelled under sdpa_attention only (and listed
    # as a softmax negative)
    cores = [l for l in CORPUS["labels"] if l["rule"] == "sdpa_attention"]
    softmax_negatives = [n for n in CORPUS["negatives"] if n["rule"] == "softmax"]
    for l in CORPUS["labels"]:
        if l["rule"] == "softmax":
            assert not any((c["file"], c["class"]) == (l["file"], l["class"]) and set(c["lines"]) & set(l["lines"])
                           for c in cores), l
    for c in cores:
        assert any((n["file"], n["class"]) == (c["file"], c["class"]) and set(n["lines"]) & set(c["lines"])
                   for n in softmax_negatives), c


@pytest.mark.parametrize("name", sorted(CORPUS["files"]))
def test_wild2_file_imports_and_its_models_run(name):
    module = _load(name)
    for spec in CORPUS["files"][name]["models"]:
        torch.manual_seed(0)
        model = getattr(module, spec["name"])()
        assert isinstance(model, torch.nn.Module), spec
        x = _input(spec)
        for training in (True, False):
            model.train(training)
            with torch.no_grad():
                out = model(x)
            first = out[0] if isinstance(out, tuple) else out
            assert torch.isfinite(first).all(), (name, spec["name"], training)


@pytest.mark.parametrize("name,model_name,keyword", WITH_TARGETS)
def test_wild2_language_models_train_with_targets(name, model_name, keyword):
    module = _load(name)
    spec = next(s for s in CORPUS["files"][name]["models"] if s["name"] == model_name)
    torch.manual_seed(0)
    model = getattr(module, model_name)().train()
    out = model(_input(spec), **{keyword: _input(spec)})
    loss = out[1]
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_whisper_decoder_trains_with_teacher_forcing():
    module = _load("whisper_style.py")
    torch.manual_seed(0)
    model = module.WhisperTrainer().train()
    loss = model(torch.randn(2, 16, 32), torch.randint(0, 96, (2, 9)))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_dense_models_train():
    # the vision / audio / graph models have no loss of their own: a squared output is one
    for name, model_name, shape in [("detectron2_style.py", "TinyRCNN", (2, 3, 32, 32)),
                                    ("audio_graph_unet.py", "GraphNet", (6, 12)),
                                    ("sam_dinov2.py", "DinoVisionTransformer", (2, 3, 32, 32))]:
        torch.manual_seed(0)
        model = getattr(_load(name), model_name)().train()
        loss = model(torch.randn(*shape)).pow(2).mean()
        assert torch.isfinite(loss), model_name
        loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()), model_name


# --- the scanner against the labels ---------------------------------------------------------------

@pytest.fixture(scope="module")
def wild2_score():
    sys.path.insert(0, str(CORPUS_DIR))
    try:
        import corpus_eval
    finally:
        sys.path.remove(str(CORPUS_DIR))
    from adopter.core.scan import scan_paths

    corpus = corpus_eval.load_corpus(LABELS_PATH)
    files = corpus_eval.corpus_files(corpus)
    assert not files.stale, f"wild2 corpus files changed since labelling (see its README): {files.stale}"
    # labelled for every rule: scanned with every registered rule (as the wild corpus)
    report = scan_paths([str(p) for _, p in sorted(files.paths.items())], None)
    assert report.files_scanned == len(files.paths)
    return corpus_eval.evaluate(corpus, report.matches, files), report


def test_wild2_scan_reads_every_file(wild2_score):
    _score, report = wild2_score
    assert report.errors == [], [e.to_json() for e in report.errors]


def _listing(outcomes) -> str:
    return "\n".join(f"  {o.where()} {o.rule} [{o.cls}] lines {o.lines}: {o.why}" for o in outcomes)


@pytest.mark.xfail(strict=False, reason="wild2 corpus: measured (labelled blind to the scanner), not tuned on")
def test_wild2_no_false_positive_and_recall_per_rule(wild2_score):
    score, report = wild2_score
    problems = [f"scan error {e.file}: {e.message}" for e in report.errors]
    if score.fp:
        problems.append(f"{len(score.fp)} false positive(s):\n{_listing(score.fp)}")
    low = {rule: r for rule, r in score.per_rule().items()
           if r["labels"] and (r["recall"] is None or r["recall"] < RECALL_TARGET)}
    if low:
        missed = [o for o in score.fn if o.rule in low]
        problems.append("recall < %s for %s; false negative(s):\n%s" % (
            RECALL_TARGET, ", ".join(f"{k} {v['recall']}" for k, v in low.items()), _listing(missed)))
    if problems:
        pytest.fail("\n".join(problems))
