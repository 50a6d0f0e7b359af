"""Rewritten transformers modules, loaded in their package context, are drop-in
replacements: strict state-dict loading both ways, same outputs and same gradients."""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adopter.rewrite import rewrite_source
from adopter.rewrite.loader import load_rewritten_module

from adopter.core.rules import all_rules
from adopter.core.scan import scan_source


def _rewrite_module(module_name: str, config, rules=None):
    module = importlib.import_module(module_name)
    with open(module.__file__, encoding="utf-8") as handle:
        text = handle.read()
    matches = scan_source(text, module.__file__, rules or all_rules())
    result = rewrite_source(text, matches, filename=module.__file__)
    assert not result.error, result.error
    return module, load_rewritten_module(module, result.new_text), result


def _check_equivalent(original_cls, rewritten_cls, config, make_inputs, output_of):
    torch.manual_seed(0)
    reference = original_cls(config).eval()
    candidate = rewritten_cls(config).eval()
    saved = reference.state_dict()
    candidate.load_state_dict(saved, strict=True)
    assert set(candidate.state_dict()) == set(saved)
    for key, value in candidate.state_dict().items():
        assert value.shape == saved[key].shape, key
    # and back: a checkpoint of the rewritten model loads into the original class
    original_again = original_cls(config).eval()
    original_again.load_state_dict(candidate.state_dict(), strict=True)

    inputs = make_inputs()
    out_ref = output_of(reference(**inputs))
    out_new = output_of(candidate(**inputs))
    torch.testing.assert_close(out_new, out_ref, atol=1e-5, rtol=1e-5)

    out_ref.square().sum().backward()
    out_new.square().sum().backward()
    grads_ref = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads_ref, "no gradients computed"
    _compare_grads(candidate, grads_ref)


def _compare_grads(candidate, grads_ref):
    """Gradients compared under state-dict names: the candidate's gradients are swapped in
    for its parameters and read back through ``state_dict()``, so the kernels' save hooks
    split fused parameters (qkv, folded conv+bn) into the original keys."""
    originals = {}
    for name, param in candidate.named_parameters():
        originals[name] = param.data
        param.data = param.grad if param.grad is not None else torch.zeros_like(param)
    try:
        grad_sd = candidate.state_dict()
    finally:
        for name, param in candidate.named_parameters():
            param.data = originals[name]
    for name, grad in grads_ref.items():
        # Gradients of sum(out**2) scale with the outputs: tolerance relative to their size.
        scale = max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(grad_sd[name], grad, atol=1e-5 * scale, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def _applied(result):
    return sorted({o.match.rule for o in result.outcomes if o.applied})


@pytest.mark.slow
def test_bert_model():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99
    )
    config._attn_implementation = "eager"
    original, rewritten, result = _rewrite_module("transformers.models.bert.modeling_bert", config)
    assert _applied(result) == ["BertSelfAttention", "Dropout_LayerNorm", "biased_GeLU", "fused_QKV"]
    ids = torch.randint(0, 99, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    _check_equivalent(
        original.BertModel, rewritten.BertModel, config,
        lambda: {"input_ids": ids, "attention_mask": mask}, lambda out: out.last_hidden_state,
    )


@pytest.mark.slow
def test_gpt2_model():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=16)
    config._attn_implementation = "eager"
    original, rewritten, result = _rewrite_module("transformers.models.gpt2.modeling_gpt2", config)
    assert "softmax" in _applied(result)
    ids = torch.randint(0, 99, (2, 7))
    _check_equivalent(
        original.GPT2Model, rewritten.GPT2Model, config, lambda: {"input_ids": ids}, lambda out: out.last_hidden_state
    )


@pytest.mark.slow
def test_t5_model():
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=99)
    config._attn_implementation = "eager"
    original, rewritten, result = _rewrite_module("transformers.models.t5.modeling_t5", config)
    applied = _applied(result)
    assert {"BertSelfAttention", "T5Attention"} & set(applied), result.outcomes
    ids = torch.randint(0, 99, (2, 7))
    _check_equivalent(
        original.T5Model, rewritten.T5Model, config,
        lambda: {"input_ids": ids, "decoder_input_ids": ids}, lambda out: out.last_hidden_state,
    )


@pytest.mark.slow
def test_resnet_model():
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_channels=3)
    original, rewritten, result = _rewrite_module("transformers.models.resnet.modeling_resnet", config)
    assert _applied(result) == ["Add_ReLU", "Conv_BatchNorm"]  # (the bottleneck's residual add + ReLU)
    pixels = torch.randn(2, 3, 32, 32)
    _check_equivalent(
        original.ResNetModel, rewritten.ResNetModel, config,
        lambda: {"pixel_values": pixels}, lambda out: out.last_hidden_state,
    )


@pytest.mark.slow
def test_from_pretrained_loads_original_checkpoint(tmp_path):
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37, vocab_size=99
    )
    config._attn_implementation = "eager"
    original, rewritten, result = _rewrite_module("transformers.models.bert.modeling_bert", config)
    assert {"Dropout_LayerNorm", "biased_GeLU", "fused_QKV"} <= set(_applied(result))
    torch.manual_seed(0)
    reference = original.BertModel(config).eval()
    reference.save_pretrained(tmp_path)
    loaded = rewritten.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, 99, (1, 5))
    torch.testing.assert_close(loaded(ids).last_hidden_state, reference(ids).last_hidden_state, atol=1e-5, rtol=1e-5)
    # and the other way: what the rewritten model saves loads into the original class
    loaded.save_pretrained(tmp_path / "rewritten")
    back = original.BertModel.from_pretrained(tmp_path / "rewritten", attn_implementation="eager").eval()
    torch.testing.assert_close(back(ids).last_hidden_state, reference(ids).last_hidden_state, atol=1e-5, rtol=1e-5)
