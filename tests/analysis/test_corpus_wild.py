"""The wild corpus (tests/corpus/wild/, issue 35) stays real, runnable PyTorch code: every file
imports (the two packages as packages, so their relative imports run), every model its labels
file lists builds and runs forward (train and eval mode) on a small input, the language models
also train with targets (loss finite, backward reaches every parameter), and every label's
recorded code is the text of its line. The scanner is not involved (see
tests/analysis/test_corpus.py::test_wild_* for the scores)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

WILD = (Path(__file__).parents[1] / "corpus") / "wild"
CORPUS = json.loads((WILD / "labels.json").read_text(encoding="utf-8"))
RULES = {"BertSelfAttention", "T5Attention", "GPT2Attention", "softmax", "Dropout_LayerNorm", "biased_GeLU",
         "Conv_BatchNorm", "Linear_BatchNorm", "fused_QKV", "RMSNorm", "gated_MLP", "rotary_embedding",
         "linear_cross_entropy", "Add_ReLU", "sdpa_attention"}

# language models that compute their own loss: (file, model, how the targets go in, how the loss comes back)
WITH_TARGETS = [
    ("nanogpt_train.py", "GPT", "targets", "second"),
    ("llama_train.py", "Transformer", "targets", "last_loss"),
    ("llama_rotate_half.py", "LlamaLM", "labels", "second"),
    ("transformer.py", "tiny_lm", "return_loss", "only"),
    ("transformer.py", "tiny_swiglu_lm", "return_loss", "only"),
    ("lookalikes_wild.py", "TemperatureLM", "targets", "second"),
]


def _load(name: str):
    rel = Path(CORPUS["files"][name]["path"])
    if len(rel.parts) > 1:  # a module of a package laid out in the corpus folder
        sys.path.insert(0, str(WILD))
        try:
            dotted = ".".join(rel.with_suffix("").parts)
            return importlib.import_module(dotted.removesuffix(".__init__"))
        finally:
            sys.path.remove(str(WILD))
    spec = importlib.util.spec_from_file_location(f"adopter_wild_corpus_{rel.stem}", WILD / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses with string annotations look their module up
    spec.loader.exec_module(module)
    return module


def _input(spec: dict) -> torch.Tensor:
    if spec.get("dtype") == "long":
        return torch.randint(0, spec["high"], spec["shape"])
    return torch.randn(*spec["shape"])


def test_every_wild_file_is_listed():
    on_disk = {p.relative_to(WILD).as_posix() for p in WILD.rglob("*.py")}
    assert on_disk == {info["path"] for info in CORPUS["files"].values()}
    assert 8 <= len(on_disk) <= 14
    # every module outside a package, and every package's model module, lists models to run
    with_models = [info for info in CORPUS["files"].values() if info["models"]]
    assert len(with_models) >= 7
    for info in CORPUS["files"].values():
        if "/" not in info["path"]:
            assert info["models"], info["path"]


def test_wild_labels_match_the_file_text():
    for item in CORPUS["labels"] + CORPUS["negatives"]:
        lines = (WILD / CORPUS["files"][item["file"]]["path"]).read_text(encoding="utf-8").splitlines()
        assert sorted(map(int, item["code"])) == sorted(item["lines"]), item
        for n, code in item["code"].items():
            assert lines[int(n) - 1].strip() == code, (item["file"], n)


def test_wild_labels_are_well_formed():
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
    # a softmax inside a labelled attention core is labelled under sdpa_attention only
    cores = [l for l in CORPUS["labels"] if l["rule"] == "sdpa_attention"]
    for l in CORPUS["labels"]:
        if l["rule"] == "softmax":
            assert not any((c["file"], c["class"]) == (l["file"], l["class"]) and set(c["lines"]) & set(l["lines"])
                           for c in cores), l


@pytest.mark.parametrize("name", sorted(n for n, info in CORPUS["files"].items() if not info["models"]))
def test_wild_package_module_imports(name):
    assert _load(name) is not None


@pytest.mark.parametrize("name", sorted(n for n, info in CORPUS["files"].items() if info["models"]))
def test_wild_file_imports_and_its_models_run(name):
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


@pytest.mark.parametrize("name,model_name,keyword,returns", WITH_TARGETS)
def test_wild_language_models_train_with_targets(name, model_name, keyword, returns):
    module = _load(name)
    spec = next(s for s in CORPUS["files"][name]["models"] if s["name"] == model_name)
    torch.manual_seed(0)
    model = getattr(module, model_name)().train()
    x = _input(spec)
    if keyword == "return_loss":
        out = model(x, return_loss=True)
    else:
        out = model(x, **{keyword: _input(spec)})
    loss = {"last_loss": lambda: model.last_loss, "only": lambda: out, "second": lambda: out[1]}[returns]()
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_clip_contrastive_loss_trains():
    module = _load("clip_model.py")
    torch.manual_seed(0)
    model = module.CLIPTrainer().train()
    loss = model(torch.randn(2, 3, 64, 64), torch.randint(0, 100, (2, 16)))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
