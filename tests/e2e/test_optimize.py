"""optimize(): in-memory rewritten class, per-rule equivalence, automatic drop of a
non-equivalent rewrite, untraceable models, and the real pipeline on BERT."""

from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adopter.core.dsl import Layer, Span
from adopter.core.structures import Match, MatchedNode
from adopter.optimizing.optimize import (
    AdopterWarning,
    Pipeline,
    RewriteOutput,
    load_rewritten_modules,
    optimize,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "optimize"

# A stand-in rule set for the pipeline: rule name -> (text on the marked line, replacement).
EDITS = {
    "good": ("torch.relu(h)", "torch.clamp(h, min=0.0)"),  # equivalent
    "bad": ("self.norm(h + x)", "self.norm(h - x)"),  # computes something else
    "softmax": ("torch.softmax(", "torch.nn.functional.softmax("),  # equivalent
    "noload": ("torch.relu(h)", "torch.relu(h) +"),  # rewritten source does not compile
    # each equivalent alone, not together: "cond" reads the flag that "flag" sets
    "flag": ("_FLAG = False", "_FLAG = True"),
    "cond": ("torch.relu(h)", "torch.relu(h) * (2.0 if _FLAG else 1.0)"),
}
RIDES_ON_GOOD = {"noload", "cond"}


def _fake_scan(files, rules):
    """One match per line marked ``# MARK <rule>`` (some rules ride on the ``good`` mark)."""
    wanted = {r.name for r in rules}
    matches = []
    for path in files:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if "# MARK " not in line:
                continue
            mark = line.split("# MARK ")[1].strip()
            for rule in wanted:
                if rule == mark or (rule in RIDES_ON_GOOD and mark == "good"):
                    span = Span(number, 0, number, len(line), "forward", number, number)
                    node = Layer(type="marked", span=span)
                    matches.append(Match(rule, path, None, "forward", (MatchedNode(0, node),)))
    return matches, []


def _confirm_all(model, inputs, matches, rules=()):
    from dataclasses import replace

    return [replace(m, status="confirmed") for m in matches]


def _fake_rewrite(text, matches, filename, rules=()):
    lines = text.splitlines(keepends=True)
    applied = []
    for m in matches:
        old, new = EDITS[m.rule]
        index = m.lines[0] - 1
        if old in lines[index]:
            lines[index] = lines[index].replace(old, new)
            applied.append(m)
    return RewriteOutput("".join(lines), applied, [], f"--- {filename}\n+++ {filename}\n")


PIPELINE = Pipeline(scan=_fake_scan, confirm=_confirm_all, rewrite=_fake_rewrite)


def _rules(*names):
    return [SimpleNamespace(name=n) for n in names]


def _digest(directory: Path) -> str:
    h = hashlib.sha1()
    for path in sorted(directory.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def test_non_equivalent_rule_is_dropped_and_the_rest_applied(toy):
    before = _digest(FIXTURES)
    Optimized = optimize(
        toy.ToyModel, rules=_rules("good", "bad", "softmax"), init_kwargs={"width": 8},
        example_inputs=(torch.randn(5, 8),), pipeline=PIPELINE,
    )  # fmt: skip
    report = Optimized.adopter_report
    assert Optimized.__name__ == "ToyModel"
    assert Optimized is not toy.ToyModel
    assert Optimized.__module__.startswith("toy_pkg.model__adopter_")
    assert report.applied_rules == ["good", "softmax"]
    dropped = [s for s in report.skipped if s.rule == "bad"]
    assert len(dropped) == 1 and "not equivalent" in dropped[0].reason
    assert dropped[0].max_abs_diff is not None and dropped[0].max_abs_diff > 1e-3
    assert report.equivalence is not None and report.equivalence.equivalent
    assert {a.where.split(":")[0] for a in report.applied} == {"layers.py", "model.py"}
    assert _digest(FIXTURES) == before  # the user's files are never written


def test_rewritten_class_uses_rewritten_sibling_module_and_matches_original(toy):
    Optimized = optimize(
        toy.ToyModel, rules=_rules("good"), init_kwargs={"width": 8},
        example_inputs=(torch.randn(5, 8),), pipeline=PIPELINE,
    )  # fmt: skip
    torch.manual_seed(1)
    original = toy.ToyModel(width=8).eval()
    optimized = Optimized(width=8).eval()  # same constructor
    optimized.load_state_dict(original.state_dict(), strict=True)
    original.load_state_dict(optimized.state_dict(), strict=True)
    block_module = type(optimized.blocks[0]).__module__
    assert block_module.startswith("toy_pkg.layers__adopter_")
    assert "torch.clamp(h, min=0.0)" in sys.modules[block_module].__spec__.loader.get_source(block_module)
    assert sys.modules["toy_pkg.layers"].Block is type(original.blocks[0])  # original untouched
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), original(x), atol=1e-6, rtol=1e-5)


def test_rewrite_that_does_not_load_is_dropped_with_reason(toy):
    Optimized = optimize(
        toy.ToyModel, rules=_rules("noload", "softmax"), init_kwargs={"width": 8},
        example_inputs=(torch.randn(5, 8),), pipeline=PIPELINE,
    )  # fmt: skip
    report = Optimized.adopter_report
    assert report.applied_rules == ["softmax"]
    assert any(s.rule == "noload" and s.kind == "load-failed" for s in report.skipped)


def test_rules_equivalent_alone_but_not_together_keep_the_first(toy):
    Optimized = optimize(
        toy.ToyModel, rules=_rules("cond", "flag", "softmax"), init_kwargs={"width": 8},
        example_inputs=(torch.randn(5, 8),), pipeline=PIPELINE,
    )  # fmt: skip
    report = Optimized.adopter_report
    assert report.applied_rules == ["cond", "softmax"]
    assert any(s.rule == "flag" and s.kind == "not-equivalent-combined" for s in report.skipped)
    assert report.equivalence.equivalent


def test_untraceable_model_gives_static_result_with_warning(toy):
    def cannot_trace(model, inputs, matches, rules=()):
        raise RuntimeError("symbolic tracing failed: data-dependent control flow")

    pipeline = Pipeline(scan=_fake_scan, confirm=cannot_trace, rewrite=_fake_rewrite)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Optimized = optimize(
            toy.ToyModel, rules=_rules("good", "bad"), init_kwargs={"width": 8},
            example_inputs=(torch.randn(5, 8),), pipeline=pipeline,
        )  # fmt: skip
    report = Optimized.adopter_report
    assert not report.traced
    assert any(issubclass(w.category, AdopterWarning) and "could not be traced" in str(w.message) for w in caught)
    assert report.applied_rules == ["good"]  # static matches, still equivalence-checked
    assert all(a.status == "static" for a in report.applied)
    assert any(s.rule == "bad" for s in report.skipped)


def test_not_confirmed_matches_are_skipped_with_status(toy):
    from dataclasses import replace

    def only_softmax_executes(model, inputs, matches, rules=()):
        return [
            replace(m, status="confirmed")
            if m.rule == "softmax"
            else replace(m, status="not-executed", reason="no traced node")
            for m in matches
        ]

    pipeline = Pipeline(scan=_fake_scan, confirm=only_softmax_executes, rewrite=_fake_rewrite)
    Optimized = optimize(
        toy.ToyModel, rules=_rules("good", "softmax"), init_kwargs={"width": 8},
        example_inputs=(torch.randn(5, 8),), pipeline=pipeline,
    )  # fmt: skip
    report = Optimized.adopter_report
    assert report.applied_rules == ["softmax"]
    assert any(s.rule == "good" and s.kind == "not-executed" for s in report.skipped)


def test_load_rewritten_modules_restores_original_imports(toy):
    import toy_pkg.layers

    original_layers = sys.modules["toy_pkg.layers"]
    path = Path(toy_pkg.layers.__file__)
    text = path.read_text().replace("torch.relu(h)", "torch.clamp(h, min=0.0)")
    model_path = Path(toy.__file__)
    modules = load_rewritten_modules(
        {"toy_pkg.layers": (str(path), text), "toy_pkg.model": (str(model_path), model_path.read_text())}
    )
    assert sys.modules["toy_pkg.layers"] is original_layers
    assert sys.modules["toy_pkg"].layers is original_layers
    assert modules["toy_pkg.model"].Block is modules["toy_pkg.layers"].Block
    assert modules["toy_pkg.model"].__package__ == "toy_pkg"
    # identical rewrites share the generated modules
    again = load_rewritten_modules(
        {"toy_pkg.layers": (str(path), text), "toy_pkg.model": (str(model_path), model_path.read_text())}
    )
    assert again["toy_pkg.model"] is modules["toy_pkg.model"]


def test_shrink_config_keeps_heads_dividing_hidden():
    from transformers import BertConfig, T5Config

    from adopter.optimizing.optimize import shrink_config

    small = shrink_config(BertConfig())
    assert small.num_hidden_layers == 2 and small.hidden_size % small.num_attention_heads == 0
    assert BertConfig().hidden_size == 768  # original untouched
    t5 = shrink_config(T5Config())
    assert t5.d_model == 64 and t5.d_kv * t5.num_heads == 64


@pytest.mark.parametrize("name", ["SwinModel", "ConvNextModel", "EfficientNetModel"])
def test_shrink_config_stage_based_models_still_run(name):
    """Regression (equivalence sweep): shrinking the stage count / derived widths of
    stage-based configs alone (ConvNext num_stages, Swin hidden_size and per-stage heads,
    EfficientNet hidden_dim) built models whose forward failed."""
    import transformers
    from adopter.tracing import build_model

    from adopter.optimizing.optimize import shrink_config

    cls = getattr(transformers, name)
    full = cls.config_class()
    small = shrink_config(full)
    assert small.image_size < full.image_size
    built = build_model(cls, init_args=(small,))  # runs a forward on generated inputs
    assert built.model.config.image_size == small.image_size


def test_example_inputs_for_speech_encoder_decoder():
    """Regression (equivalence sweep): WhisperModel got no input_features and its forward failed."""
    import transformers
    from adopter.tracing import build_model

    from adopter.optimizing.optimize import shrink_config

    config = shrink_config(transformers.WhisperConfig())
    built = build_model(transformers.WhisperModel, init_args=(config,))
    features = built.example_inputs["input_features"]
    assert features.shape == (2, config.num_mel_bins, 2 * config.max_source_positions)


# ---------------------------------------------------------------- the real pipeline


def _real_pipeline_available() -> bool:
    try:
        import adopter.rewrite
        from adopter.rewrite import rewrite_source  # noqa: F401
        from adopter.tracing import confirm_matches  # noqa: F401

        import adopter.core.extract  # noqa: F401
    except ImportError:
        return False
    return True


needs_pipeline = pytest.mark.skipif(not _real_pipeline_available(), reason="scan/rewrite/tracing not installed")


@pytest.mark.slow
@needs_pipeline
def test_optimize_bert_for_sequence_classification_from_a_user_script():
    from transformers import BertConfig, BertForSequenceClassification

    Optimized = optimize(BertForSequenceClassification)
    report = Optimized.adopter_report
    assert Optimized.__name__ == "BertForSequenceClassification"
    assert report.applied, report.summary()
    assert report.traced
    assert all(a.status == "confirmed" for a in report.applied)
    assert "Dropout_LayerNorm" in report.applied_rules
    config = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    torch.manual_seed(0)
    original = BertForSequenceClassification(config).eval()
    optimized = Optimized(config).eval()
    optimized.load_state_dict(original.state_dict(), strict=True)
    original.load_state_dict(optimized.state_dict(), strict=True)
    ids = torch.randint(5, 1000, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(optimized(input_ids=ids).logits, original(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-4)  # fmt: skip


@pytest.mark.slow
@needs_pipeline
def test_optimized_transformers_class_round_trips_from_pretrained(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    Optimized = optimize(BertModel, config=config)
    torch.manual_seed(0)
    original = BertModel(config).eval()
    original.save_pretrained(tmp_path)
    loaded = Optimized.from_pretrained(tmp_path).eval()
    assert type(loaded) is Optimized
    ids = torch.randint(5, 1000, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, original(input_ids=ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-4)  # fmt: skip
    # and back: a checkpoint saved by the optimized model loads into the original class
    loaded.save_pretrained(tmp_path / "optimized")
    back = BertModel.from_pretrained(tmp_path / "optimized").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).last_hidden_state, original(input_ids=ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-4)  # fmt: skip


@pytest.mark.slow
@needs_pipeline
def test_deliberately_wrong_user_rule_is_dropped_automatically(monkeypatch):
    """A user rule (fixture DSL file + codemod) whose kernel is built with the wrong eps: it
    rewrites, loads and runs, but is not equivalent and must be dropped automatically."""
    from dataclasses import replace as dc_replace

    from transformers import BertConfig, BertModel

    from adopter.core.rules import get_rules, load_rules_file

    monkeypatch.syspath_prepend(str(FIXTURES))
    import wrong_rule

    wrong = [dc_replace(r, codemod=wrong_rule.WrongLayerNorm()) for r in load_rules_file(FIXTURES / "wrong_rule.dsl")]
    config = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    Optimized = optimize(BertModel, config=config, rules=wrong + get_rules(["biased_GeLU"]))
    report = Optimized.adopter_report
    dropped = [s for s in report.skipped if s.rule == "Wrong_LayerNorm"]
    assert dropped, report.summary()
    assert "Wrong_LayerNorm" not in report.applied_rules
    assert any("not equivalent" in s.reason for s in dropped), report.summary()
    assert report.equivalence.equivalent


@pytest.mark.slow
@needs_pipeline
def test_rule_whose_kernel_computes_something_else_is_dropped(monkeypatch):
    """A built-in rule whose target kernel is made wrong (off by 1e-3): dropped, others kept."""
    from adopter.kernels import guarded
    from transformers import BertConfig, BertModel

    right = guarded._dropout_add_layer_norm

    def wrong(*args, **kwargs):
        return right(*args, **kwargs) + 1e-3

    monkeypatch.setattr(guarded, "_dropout_add_layer_norm", wrong)
    config = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    Optimized = optimize(BertModel, config=config, rules=["Dropout_LayerNorm", "biased_GeLU"])
    report = Optimized.adopter_report
    assert "Dropout_LayerNorm" not in report.applied_rules, report.summary()
    dropped = [s for s in report.skipped if s.rule == "Dropout_LayerNorm"]
    assert dropped and all("not equivalent" in s.reason for s in dropped)
    assert dropped[0].max_abs_diff == pytest.approx(1e-3, rel=0.05)


@pytest.mark.slow
@needs_pipeline
def test_untraceable_class_gives_static_result_with_warning_real_pipeline(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import untraceable

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Optimized = optimize(
            untraceable.DataDependentModel, rules=["Dropout_LayerNorm"], init_kwargs={"width": 16},
            example_inputs={"hidden_states": torch.randn(3, 5, 16)},
        )  # fmt: skip
    report = Optimized.adopter_report
    assert any(issubclass(w.category, AdopterWarning) for w in caught), [str(w.message) for w in caught]
    assert not report.traced
    assert report.applied_rules == ["Dropout_LayerNorm"], report.summary()
    assert report.applied[0].status == "static"
    assert report.equivalence.equivalent
    original = untraceable.DataDependentModel(16).eval()
    optimized = Optimized(16).eval()
    optimized.load_state_dict(original.state_dict(), strict=True)
    x = torch.randn(2, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), original(x), atol=1e-5, rtol=1e-4)


def test_class_defined_in_main_script_is_refused():
    from adopter.optimizing.optimize import OptimizeError

    Script = type("Script", (torch.nn.Module,), {"__module__": "__main__"})
    with pytest.raises(OptimizeError, match="__main__"):
        optimize(Script, example_inputs={}, pipeline=PIPELINE)


def test_shrink_config_keeps_embedding_equal_to_hidden_where_it_was():
    """Regression (equivalence sweep): SQUEEZEBERT asserts embedding_size == hidden_size;
    ALBERT's factorised embedding still shrinks on its own."""
    from transformers import AlbertConfig, SqueezeBertConfig

    from adopter.optimizing.optimize import shrink_config

    squeeze = shrink_config(SqueezeBertConfig())
    assert squeeze.embedding_size == squeeze.hidden_size == 64
    albert = shrink_config(AlbertConfig())
    assert (albert.embedding_size, albert.hidden_size) == (32, 64)


def test_speech_model_with_spec_augment_is_equivalent_to_itself():
    """Regression (equivalence sweep): Wav2Vec2 had no generated input_values, and in training
    mode SpecAugment (mask_time_prob, numpy RNG) made even an unchanged copy "not equivalent"."""
    import copy

    import transformers
    from adopter.tracing import build_model

    from adopter.optimizing.optimize import shrink_config
    from adopter.verification.equivalence import check_equivalence

    config = shrink_config(transformers.Wav2Vec2Config())
    assert config.mask_time_prob > 0
    built = build_model(transformers.Wav2Vec2Model, init_args=(config,))
    assert built.example_inputs["input_values"].shape[0] == 2
    result = check_equivalence(built.model, copy.deepcopy(built.model), built.example_inputs)
    assert result.equivalent, result.summary()
    assert built.model.config.mask_time_prob == config.mask_time_prob  # restored afterwards
