"""shrink_config on LLM-era transformers configs (issue 24): vocabularies, expert counts, low-rank
(MLA) attention, per-layer lists and per-layer configs shrink, and the small model still holds
every kind of layer the full-size one does; optimize() never builds a large model from a config
the user did not pass without refusing."""

from __future__ import annotations

import copy
import time
import warnings

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from adopter.errors import OptimizeError  # noqa: E402
from adopter.optimizing import subject as subject_mod  # noqa: E402
from adopter.optimizing.shrink import shrink_config  # noqa: E402

MAX_SMALL_PARAMETERS = 5_000_000


def _module_kinds(model) -> set[str]:
    # nn.Identity stands for "no projection between equal widths" (BLT's token_embedding_projection):
    # widths shrunk in different sub-configs need not stay equal, so the small model may project
    return {type(m).__name__ for m in model.modules() if type(m) is not torch.nn.Identity}


def _config(family: str, **overrides):
    return transformers.models.auto.configuration_auto.CONFIG_MAPPING[family](**overrides)


# (causal LM class, config overrides): defaults as shipped, plus hybrid layouts the defaults leave out
CASES = [
    ("LlamaForCausalLM", {}),
    ("MixtralForCausalLM", {}),  # 8 experts, 2 per token
    ("Qwen2MoeForCausalLM", {}),  # routed experts + shared expert, decoder_sparse_step
    ("DeepseekV2ForCausalLM", {}),  # MLA low-rank q/kv, first_k_dense_replace, grouped top-k
    ("DeepseekV3ForCausalLM", {}),  # 671B default
    ("Gemma3ForCausalLM", {}),  # sliding/full layer_types
    ("BambaForCausalLM", {"attn_layer_indices": [3, 11, 19, 27]}),  # mamba + attention layers by index
    ("GraniteMoeHybridForCausalLM", {"layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 26}),
    ("Dots1ForCausalLM", {}),  # expert counts left None by the default
    ("Dots3NoteForCausalLM", {}),  # heterogeneous per-layer configs
    ("BltForCausalLM", {}),  # sub-configs whose widths name a sibling (hidden_size_global)
    ("CohereCompassForCausalLM", {}),  # per-kind rotary parameters left empty by the default
]


@pytest.mark.parametrize("family,overrides", CASES, ids=[c[0] for c in CASES])
def test_shrunk_config_builds_small_model_with_every_layer_kind(family, overrides):
    model_cls = getattr(transformers, family)
    full = model_cls.config_class(**overrides)
    before = copy.deepcopy(full.to_dict())
    small = shrink_config(full)
    assert full.to_dict() == before, "shrink_config changed the config it was given"

    start = time.perf_counter()
    model = model_cls(small).eval()
    seconds = time.perf_counter() - start
    count = sum(p.numel() for p in model.parameters())
    assert count < MAX_SMALL_PARAMETERS, f"{family}: {count} parameters"
    assert seconds < 30, f"{family}: {seconds:.1f} s to build"  # a shared CI core; ~1 s alone

    # every module class of the full-size model (built on meta: no memory) is in the small one:
    # dense and MoE blocks, attention and mamba mixers, sliding and full attention
    with torch.device("meta"):
        try:
            full_model = model_cls(full)
        except Exception:  # noqa: BLE001 - defaults that do not build at full size (dots1: experts None)
            full_model = None
    if full_model is not None:
        missing = _module_kinds(full_model) - _module_kinds(model)
        assert not missing, f"{family}: layer kinds lost by shrinking: {sorted(missing)}"
        assert count < sum(p.numel() for p in full_model.parameters())

    # a forward and a loss on token ids below 1000 (the generated inputs' range)
    vocab = small.get_text_config().vocab_size
    for key, value in vars(small.get_text_config()).items():
        if key.endswith("token_id") and isinstance(value, int):
            assert value < vocab, f"{family}: {key}={value} outside the vocabulary {vocab}"
    ids = torch.randint(0, min(vocab, 1000), (2, 8))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.loss)


def test_per_layer_lists_keep_one_layer_of_each_kind():
    full = _config("gemma3_text")
    small = shrink_config(full)
    assert set(small.layer_types) == set(full.layer_types)
    assert len(small.layer_types) == small.num_hidden_layers < full.num_hidden_layers

    hybrid = _config("granitemoehybrid", layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 26)
    small = shrink_config(hybrid)
    # (the config names its kinds linear_attention / full_attention)
    assert len(set(hybrid.layer_types)) == 2 and set(small.layer_types) == set(hybrid.layer_types)
    assert small.num_hidden_layers == len(small.layer_types) <= 4


def test_experts_and_low_rank_sizes_shrink_and_stay_consistent():
    full = _config("deepseek_v3")
    small = shrink_config(full)
    assert small.n_routed_experts <= 4 and small.num_experts_per_tok <= small.n_routed_experts
    assert small.n_routed_experts % small.n_group == 0 and small.topk_group <= small.n_group
    assert small.kv_lora_rank <= 32 and small.q_lora_rank <= 32
    # qk_head_dim is derived from its parts: still their sum
    assert small.qk_head_dim == small.qk_nope_head_dim + small.qk_rope_head_dim
    # a dense layer and a MoE layer both kept
    assert 0 < small.first_k_dense_replace < small.num_hidden_layers
    assert small.vocab_size <= 1024


# ---------------------------------------------------------------- no large model without saying so


def test_large_shrunk_default_is_refused_before_allocating(monkeypatch):
    """A shrinking that misses a size must not silently build a multi-billion model."""
    monkeypatch.setattr(subject_mod, "shrink_config", lambda config, **_: config)
    start = time.perf_counter()
    with pytest.raises(OptimizeError, match=r"parameters .*not built.*config="):
        subject_mod.build_subject(transformers.LlamaForCausalLM, None, None, "cpu", None, None)
    assert time.perf_counter() - start < 60  # counted on meta, never allocated (6.7B floats)


def _unbuildable(config_cls):
    """A config that passes validation but whose model cannot be built (a negative FFN size)."""
    config = config_cls(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                        num_hidden_layers=1, vocab_size=100)
    config.intermediate_size = -1
    return config


def test_full_size_fallback_refused_when_large(monkeypatch):
    broken = _unbuildable(transformers.LlamaConfig)  # the shrunk config does not build
    monkeypatch.setattr(subject_mod, "shrink_config", lambda config, **_: broken)
    with pytest.raises(OptimizeError, match=r"full-size default config LlamaConfig\(\) has [\d,]+M parameters"):
        subject_mod.build_subject(transformers.LlamaForCausalLM, None, None, "cpu", None, None)


class _TinyDefaultConfig(transformers.LlamaConfig):
    """A family whose full-size default is small (under the limit)."""

    def __init__(self, **kwargs):
        for key, value in dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2).items():
            kwargs.setdefault(key, value)
        super().__init__(**kwargs)


class _TinyDefaultLlama(transformers.LlamaForCausalLM):
    config_class = _TinyDefaultConfig


def test_small_full_size_fallback_is_built_with_a_warning(monkeypatch):
    from adopter.optimizing.optimize import AdopterWarning

    monkeypatch.setattr(subject_mod, "shrink_config", lambda config, **_: _unbuildable(_TinyDefaultConfig))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = subject_mod.build_subject(_TinyDefaultLlama, None, None, "cpu", None, None)
    said = [str(w.message) for w in caught if issubclass(w.category, AdopterWarning)]
    assert any("full-size default" in s and "parameters" in s for s in said), said
    assert built.config.hidden_size == 32


def test_user_config_is_built_as_given_whatever_its_size(monkeypatch):
    """The limit is for configs the user did not pass: theirs is never counted or refused."""
    monkeypatch.setattr(subject_mod, "MAX_DEFAULT_PARAMETERS", 10)
    config = _TinyDefaultConfig()
    built = subject_mod.build_subject(_TinyDefaultLlama, config, None, "cpu", None, None)
    assert sum(p.numel() for p in built.model.parameters()) > 10
