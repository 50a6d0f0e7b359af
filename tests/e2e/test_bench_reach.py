"""benchmarks/bench_reach.py: the baseline comparison (offline, synthetic results; no download, no scan)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_reach


def _site(rule, cls, function, lines, status="static"):
    return {"rule": rule, "class": cls, "function": function, "lines": lines, "status": status}


def _result(per_file, errors=()):
    return {"trees": {"timm": {"per_file": per_file, "errors": [{"file": f, "message": "x"} for f in errors]},
                      "torchvision": {"skipped": "no wheel"}}}


def test_compare_counts_gained_lost_moved_duplicated_and_status_changes():
    base = _result({
        "layers/a.py": [_site("Conv_BatchNorm", "A", "forward", [5]), _site("Conv_BatchNorm", "A", "forward", [5]),
                        _site("softmax", None, "f", [9])],
        "models/b.py": [_site("biased_GeLU", "M", "forward", [3, 4])],
    }, errors=["models/deep.py"])
    now = _result({
        "layers/a.py": [_site("Conv_BatchNorm", "A", "__init__", [2, 3]),  # moved: one lost + one gained
                        _site("Conv_BatchNorm", "A", "forward", [5]),  # the duplicate is gone: one lost
                        _site("softmax", None, "f", [9], "refused")],
        "models/b.py": [_site("biased_GeLU", "M", "forward", [3, 4])],
        "models/c.py": [_site("biased_GeLU", "N", "forward", [7])],
    })
    comp = bench_reach.compare(now, base)
    assert comp["torchvision"] == {"skipped": "no wheel"}
    rules = comp["timm"]["rules"]
    conv = rules["Conv_BatchNorm"]
    assert (conv["baseline"], conv["now"]) == (2, 2)
    assert [(s["function"], s["lines"]) for s in conv["gained"]] == [("__init__", [2, 3])]
    assert [(s["function"], s["lines"]) for s in conv["lost"]] == [("forward", [5])]
    assert rules["softmax"]["status_changed"] == [
        {"rule": "softmax", "file": "layers/a.py", "class": None, "function": "f", "lines": [9],
         "status": "refused", "was": "static"}]
    assert [s["file"] for s in rules["biased_GeLU"]["gained"]] == ["models/c.py"]
    assert rules["biased_GeLU"]["lost"] == []
    assert comp["timm"]["errors"] == {"baseline": ["models/deep.py"], "now": []}
    text = bench_reach.format_comparison(comp, "base.json")
    assert "scan errors 1 -> 0" in text and "torchvision: not compared (no wheel)" in text


def test_compare_with_itself_is_empty():
    run = _result({"a.py": [_site("softmax", "A", "forward", [1]), _site("softmax", "A", "forward", [1])]})
    comp = bench_reach.compare(run, run)["timm"]["rules"]["softmax"]
    assert (comp["baseline"], comp["now"], comp["gained"], comp["lost"], comp["status_changed"]) == (2, 2, [], [], [])
