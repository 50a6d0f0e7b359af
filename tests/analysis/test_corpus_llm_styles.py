"""The LLM-styles corpus (tests/corpus/llm_styles/) stays real, runnable PyTorch code: every file
imports, every model its labels file lists builds and runs forward (train and eval mode) on a
small input, the language models also run with targets (loss finite, backward reaches every
parameter), and every label's recorded code is the text of its line. The scanner is not involved
(see tests/analysis/test_corpus.py::test_llm_styles_* for the scores)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

LLM_STYLES = (Path(__file__).parents[1] / "corpus") / "llm_styles"
CORPUS = json.loads((LLM_STYLES / "labels.json").read_text(encoding="utf-8"))
CLASSIC_RULES = {"BertSelfAttention", "T5Attention", "GPT2Attention", "softmax", "Dropout_LayerNorm",
                 "biased_GeLU", "Conv_BatchNorm", "Linear_BatchNorm", "fused_QKV"}
LLM_RULES = {"RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy"}

# models that compute their own loss: (file, model, keyword of the targets, how the loss comes back)
WITH_TARGETS = [
    ("nanogpt_llm.py", "GPT", "targets", "second"),
    ("llama_meta.py", "Transformer", "targets", "second"),
    ("llama2c_model.py", "Transformer", "targets", "last_loss"),
    ("litgpt_model.py", "GPT", "targets", "second"),
    ("neox_gptj.py", "GPTNeoXForCausalLM", "labels", "second"),
    ("phi3_fused.py", "Phi3ForCausalLM", "labels", "second"),
    ("postnorm_encoder.py", "EncoderForMaskedLM", "labels", "second"),
]


def _load(name: str):
    path = LLM_STYLES / CORPUS["files"][name]["path"]
    spec = importlib.util.spec_from_file_location(f"adopter_llm_styles_corpus_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _input(spec: dict) -> torch.Tensor:
    if spec.get("dtype") == "long":
        return torch.randint(0, spec["high"], spec["shape"])
    return torch.randn(*spec["shape"])


def test_every_llm_styles_file_is_listed_with_a_model():
    on_disk = {p.name for p in LLM_STYLES.glob("*.py")}
    assert on_disk == set(CORPUS["files"])
    assert 8 <= len(on_disk) <= 12
    assert all(info["models"] for info in CORPUS["files"].values())


def test_llm_styles_labels_match_the_file_text():
    for item in CORPUS["labels"] + CORPUS["negatives"]:
        lines = (LLM_STYLES / CORPUS["files"][item["file"]]["path"]).read_text(encoding="utf-8").splitlines()
        assert sorted(map(int, item["code"])) == sorted(item["lines"]), item
        for n, code in item["code"].items():
            assert lines[int(n) - 1].strip() == code, (item["file"], n)


def test_llm_styles_labels_are_well_formed():
    for item in CORPUS["labels"]:
        assert item["rule"] in CLASSIC_RULES | LLM_RULES, item
        assert isinstance(item["doc_scope"], bool) and isinstance(item["in_rule_doc"], bool), item
        assert item["why"], item
    for item in CORPUS["negatives"]:
        assert item["rule"] in CLASSIC_RULES | LLM_RULES and item["why"], item
    # every LLM rule has labels and look-alikes
    assert LLM_RULES <= {l["rule"] for l in CORPUS["labels"]}
    assert LLM_RULES <= {n["rule"] for n in CORPUS["negatives"]}
    # one location is never both a label and a negative of the same rule and class
    for l in CORPUS["labels"]:
        for n in CORPUS["negatives"]:
            if (l["file"], l["rule"], l["class"]) == (n["file"], n["rule"], n["class"]):
                assert not set(l["lines"]) & set(n["lines"]), (l, n)


@pytest.mark.parametrize("name", sorted(CORPUS["files"]))
def test_llm_styles_file_imports_and_its_models_run(name):
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
def test_llm_styles_language_models_train_with_targets(name, model_name, keyword, returns):
    module = _load(name)
    spec = next(s for s in CORPUS["files"][name]["models"] if s["name"] == model_name)
    torch.manual_seed(0)
    model = getattr(module, model_name)().train()
    x = _input(spec)
    targets = _input(spec)
    out = model(x, **{keyword: targets})
    loss = model.last_loss if returns == "last_loss" else out[1]
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
