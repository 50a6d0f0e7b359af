"""The LLM rule pack end to end (issue 12): RMSNorm, gated_MLP, rotary_embedding and
linear_cross_entropy found and applied by analysis in transformers decoder-only LLMs, with
everything checked by ``optimize`` (trace-confirmed, equivalent forward and backward), state
dicts unchanged and checkpoints loading both ways."""

from __future__ import annotations

import pytest
import torch
from adopter.kernels import count_kernel_calls

from adopter import optimize

LLM_RULES = ("RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy")

pytestmark = pytest.mark.slow


def _tiny(config_cls, **extra):
    return config_cls(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, **extra)


def _inputs(vocab=1000, batch=2, seq=12):
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[-1, -3:] = -100
    return ids, labels


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = _tiny(LlamaConfig)
    return LlamaForCausalLM, config, optimize(LlamaForCausalLM, config=config)


def test_every_llm_rule_is_applied_to_llama_and_equivalent(llama):
    _, _, optimized = llama
    report = optimized.adopter_report
    applied = {a.rule for a in report.applied}
    assert set(LLM_RULES) <= applied, report.summary()
    assert report.equivalence is not None and report.equivalence.equivalent, report.summary()


def test_optimized_llama_trains_without_logits_and_keeps_them_in_eval(llama):
    cls, config, optimized = llama
    torch.manual_seed(0)
    original = cls(config)
    model = optimized(config)
    model.load_state_dict(original.state_dict(), strict=True)
    ids, labels = _inputs()
    original.train()
    model.train()
    with count_kernel_calls() as counted:
        out = model(input_ids=ids, labels=labels)
    expected = original(input_ids=ids, labels=labels)
    assert out.logits is None  # the one observable difference: training with labels
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    expected.loss.backward()
    originals = dict(original.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, originals[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    fused = {c.kernel for c in counted.calls if c.fused}
    assert {"rms_norm", "gated_mlp", "rotary", "linear_cross_entropy"} <= fused, counted.calls
    model.eval()
    original.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        expected = original(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)


def test_optimized_llama_state_dict_and_checkpoints_round_trip(llama, tmp_path):
    cls, config, optimized = llama
    torch.manual_seed(0)
    original = cls(config).eval()
    assert list(optimized(config).state_dict()) == list(original.state_dict())
    original.save_pretrained(tmp_path / "original")
    loaded = optimized.from_pretrained(tmp_path / "original").eval()
    ids, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits, atol=1e-5, rtol=1e-4)
    loaded.save_pretrained(tmp_path / "optimized")
    back = cls.from_pretrained(tmp_path / "optimized").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, original(input_ids=ids).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma"])
def test_llm_rules_apply_to_other_families(family):
    import transformers

    config_cls = {"qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
                  "gemma": transformers.GemmaConfig}[family]
    model_cls = {"qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "gemma": transformers.GemmaForCausalLM}[family]
    extra = {"head_dim": 16} if family != "mistral" else {}
    optimized = optimize(model_cls, config=_tiny(config_cls, **extra))
    report = optimized.adopter_report
    applied = {a.rule for a in report.applied}
    assert set(LLM_RULES) <= applied, report.summary()
    assert report.equivalence is not None and report.equivalence.equivalent, report.summary()
