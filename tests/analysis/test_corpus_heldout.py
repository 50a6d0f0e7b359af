"""The held-out corpus (tests/corpus/heldout/) stays real, runnable PyTorch code: every file
imports, and every model its labels file lists builds and runs forward (train and eval mode) on a
small input. The scanner is not involved (see tests/analysis/test_corpus.py for the scores)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

HELDOUT = (Path(__file__).parents[1] / "corpus") / "heldout"
CORPUS = json.loads((HELDOUT / "labels.json").read_text(encoding="utf-8"))


def _load(name: str):
    path = HELDOUT / CORPUS["files"][name]["path"]
    spec = importlib.util.spec_from_file_location(f"adopter_heldout_corpus_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _input(spec: dict) -> torch.Tensor:
    if spec.get("dtype") == "long":
        return torch.randint(0, spec["high"], spec["shape"])
    return torch.randn(*spec["shape"])


def test_every_heldout_file_is_listed_with_a_model():
    on_disk = {p.name for p in HELDOUT.glob("*.py")}
    assert on_disk == set(CORPUS["files"])
    assert all(info["models"] for info in CORPUS["files"].values())


def test_heldout_labels_match_the_file_text():
    for item in CORPUS["labels"] + CORPUS["negatives"]:
        lines = (HELDOUT / CORPUS["files"][item["file"]]["path"]).read_text(encoding="utf-8").splitlines()
        for n, code in item["code"].items():
            assert lines[int(n) - 1].strip() == code, (item["file"], n)


@pytest.mark.parametrize("name", sorted(CORPUS["files"]))
def test_heldout_file_imports_and_its_models_run(name):
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
