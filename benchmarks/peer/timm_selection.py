"""Which of timm 1.0.31's tests the peer suite runs (``tests/test_models.py``, ``tests/test_prune.py``).

timm's per-model tests are parametrised over every model (``list_models`` with its
``EXCLUDE_*_FILTERS``; no environment variable picks models, ``TIMEOUT`` only sets the time limits),
about 18,000 tests: far beyond 2 CPU cores. The selection is by node id, from a
``pytest --collect-only`` of the pristine copy, so timm's own filters still decide which test
applies to which model (no TorchScript test for hrnet, no ``forward_features`` for ViTs...).

* ``FULL_MODELS``: one small model (fewest parameters, counted on the meta device; two where a
  module has several rewritten code paths) of every timm module ``adopter rewrite`` changes, and of
  the modules using a rewritten ``timm/layers`` file (``byoanet`` halo/lambda attention, ``byobnet``
  global context, ``sknet`` selective kernel, ``mobilenetv3`` 2d attention), each through
  ``CORE_TESTS`` (forward, backward, TorchScript, FX, forward_intermediates); ``DEEP_MODELS`` (the
  GuardedSequential and attention-heavy ones) also through the rest of ``DEEP_TESTS`` (FX backward,
  FX + TorchScript, features, intermediates as features_only, pruning, default cfgs);
  ``LIGHT_MODELS`` only forward. Left out: the modules whose smallest model is large
  (``beit``, ``vision_transformer_sam``, ``qwen3_vit`` 86-88 M parameters, ``deepseek_vit`` 412 M),
  the pretrained-weight tests (``NAMED_EXCLUDED``: Hub downloads, offline here).
* ``FULL_NAMED``: the tests with their own short model lists (TorchScript of pruned models and of
  feature getters, pruning, attention-bias caches after ``eval()`` and dtype changes, ...), where
  a parameter names a rewritten model (``NAMED_MODELS``).
* ``CI_TESTS``: 32 node ids, ~20 s a run on an idle machine (~1.5 min loaded): TorchScript, FX,
  intermediates, the GuardedSequential models (visformer, ghostnet, hrnet, xception, dla).
"""

from __future__ import annotations

CORE_TESTS = (
    "test_model_forward",
    "test_model_backward",
    "test_model_forward_torchscript",
    "test_model_forward_fx",
    "test_model_forward_intermediates",
)
DEEP_TESTS = CORE_TESTS + (
    "test_model_forward_features",
    "test_model_backward_fx",
    "test_model_forward_fx_torchscript",
    "test_model_forward_intermediates_features",
    "test_prune_intermediate_layers_contract",
    "test_model_default_cfgs",
    "test_model_default_cfgs_non_std",
)
LIGHT_TESTS = ("test_model_forward",)

# module (rewritten file, or user of a rewritten layer) -> models
FULL_MODELS_BY_MODULE = {
    "byoanet": ["halonet_h1", "lambda_resnet26t"],
    "byobnet": ["gcresnext26ts"],
    "cait": ["cait_xxs24_224"],
    "convit": ["convit_tiny"],
    "cpubone": ["cpubone_nano"],
    "crossvit": ["crossvit_tiny_240"],
    "csatv2": ["csatv2"],
    "davit": ["davit_tiny"],
    "dla": ["dla46x_c"],
    "edgenext": ["edgenext_xx_small"],
    "efficientformer": ["efficientformer_l1"],
    "efficientformer_v2": ["efficientformerv2_s0"],
    "efficientvim": ["efficientvim_m1"],
    "efficientvit_msra": ["efficientvit_m0"],
    "eva": ["eva02_tiny_patch14_224"],
    "fasternet": ["fasternet_t0"],
    "fastvit": ["fastvit_t8"],
    "gcvit": ["gcvit_xxtiny"],
    "ghostnet": ["ghostnet_050", "ghostnetv2_100"],
    "hiera": ["hiera_tiny_224"],
    "hieradet_sam2": ["sam2_hiera_tiny"],
    "hrnet": ["hrnet_w18_small"],
    "iformer": ["iformer_t"],
    "inception_next": ["inception_next_atto"],
    "levit": ["levit_128s", "levit_conv_128s"],
    "lowformer": ["lowformer_b0"],
    "mambaout": ["test_mambaout"],
    "maxxvit": ["test_coatnet", "test_maxvit"],
    "metaformer": ["caformer_s18"],
    "mobilenetv3": ["mobilenetv4_hybrid_medium"],
    "mobilevit": ["mobilevit_xxs", "mobilevitv2_050"],
    "mvitv2": ["mvitv2_tiny"],
    "nest": ["nest_tiny"],
    "nextvit": ["nextvit_small"],
    "pvt_v2": ["pvt_v2_b0"],
    "repghost": ["repghostnet_050"],
    "repvit": ["repvit_m0_9"],
    "resnest": ["resnest14d"],
    "resnet": ["test_resnet", "resnet10t"],
    "selecsls": ["selecsls42"],
    "senet": ["legacy_seresnet18"],
    "shvit": ["shvit_s1"],
    "sknet": ["skresnet18"],
    "starnet": ["starnet_s050"],
    "swiftformer": ["swiftformer_xs"],
    "swin_transformer": ["swin_tiny_patch4_window7_224"],
    "swin_transformer_v2": ["swinv2_tiny_window8_256"],
    "swin_transformer_v2_cr": ["swinv2_cr_tiny_224"],
    "tiny_vit": ["tiny_vit_5m_224"],
    "tnt": ["tnt_s_patch16_224"],
    "twins": ["twins_svt_small"],
    "visformer": ["visformer_tiny"],
    "vision_transformer": ["test_vit", "test_vit3"],
    "vision_transformer_relpos": ["test_vit_relpos"],
    "volo": ["volo_d1_224"],
    "xception": ["legacy_xception"],
    "xcit": ["xcit_nano_12_p16_224"],
}
FULL_MODELS = [m for models in FULL_MODELS_BY_MODULE.values() for m in models]
DEEP_MODELS = [
    "visformer_tiny", "ghostnet_050", "hrnet_w18_small", "legacy_xception", "dla46x_c", "test_vit3",
    "levit_128s", "convit_tiny", "test_resnet", "xcit_nano_12_p16_224", "swiftformer_xs", "inception_next_atto",
]
LIGHT_MODELS = ["gemma4_vit_167m"]  # the rotary_embedding rewrite; 167 M parameters

FULL_NAMED = (
    "test_pruned_features_torchscript",
    "test_feature_getter_stage_ends_torchscript",
    "test_prune_class_token_avg_pool",
    "test_catavgmax_unsupported",
    "test_forward_after_prune_intermediate_layers",
    "test_prune_intermediate_layers_last_feature",
    "test_forward_intermediates_stop_early_final_norm",
    "test_mobile_model_fusion_features",
    "test_swin_family_script_after_resize",
    "test_eval_refreshes_attention_bias_cache",
    "test_eval_attention_bias_cache_after_dtype_change",
    "test_eval_attention_forward_after_dtype_change",
    "test_gcvit_batch_consistency",
    "test_convit_dtype_change_after_forward",
)
# of FULL_NAMED's parametrised tests, those whose parameters name none of these (models, or timm
# modules for the attention-class tests) are left out: their models are not rewritten
NAMED_MODELS = (
    "ghostnet_050", "ghostnetv2_100", "ghostnetv3_050", "repghostnet_050", "hrnet_w18_small", "legacy_xception",
    "convit_tiny", "volo_d1_224", "twins_svt_small", "cait_xxs24_224", "xcit_nano_12_p16_224", "beit_base_patch16_224",
    "mambaout_femto", "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224",
    "efficientvim_m1", "efficientvim_m1_dist", "iformer_t", "repvit_m0_9", "shvit_s1", "levit_128s", "levit_conv_128s",
    "efficientformer_l1", "efficientformerv2_s0", "tiny_vit_5m_224", "efficientvit_m0", "efficientformer",
    "efficientformer_v2", "efficientvit_msra", "levit", "tiny_vit", "coat_lite_tiny",
)
NAMED_EXCLUDED = ("test_model_load_pretrained", "test_model_features_pretrained", "test_model_inference")

CI_TESTS = (
    "tests/test_models.py::test_model_forward_torchscript[1-visformer_tiny]",
    "tests/test_models.py::test_model_forward_torchscript[1-ghostnet_050]",
    "tests/test_models.py::test_model_forward_torchscript[1-test_vit]",
    "tests/test_models.py::test_model_forward_torchscript[1-levit_128s]",
    "tests/test_models.py::test_model_forward_torchscript[1-legacy_xception]",
    "tests/test_models.py::test_model_forward_torchscript[1-dla46x_c]",
    "tests/test_models.py::test_model_forward_torchscript[1-convit_tiny]",
    "tests/test_models.py::test_model_forward_fx[1-visformer_tiny]",
    "tests/test_models.py::test_model_forward_fx[1-hrnet_w18_small]",
    "tests/test_models.py::test_model_forward_fx[1-test_vit]",
    "tests/test_models.py::test_model_forward_fx[1-ghostnet_050]",
    "tests/test_models.py::test_model_backward_fx[2-visformer_tiny]",
    "tests/test_models.py::test_model_forward_fx_torchscript[1-test_vit]",
    "tests/test_models.py::test_model_forward_intermediates[1-hrnet_w18_small]",
    "tests/test_models.py::test_model_forward_intermediates[1-ghostnet_050]",
    "tests/test_models.py::test_model_forward_intermediates[1-legacy_xception]",
    "tests/test_models.py::test_model_forward_intermediates[1-visformer_tiny]",
    "tests/test_models.py::test_model_forward_intermediates_features[1-hrnet_w18_small]",
    "tests/test_models.py::test_model_forward[1-visformer_tiny]",
    "tests/test_models.py::test_model_forward[1-test_vit]",
    "tests/test_models.py::test_model_forward[1-dla46x_c]",
    "tests/test_models.py::test_model_backward[2-visformer_tiny]",
    "tests/test_models.py::test_model_backward[2-ghostnet_050]",
    "tests/test_models.py::test_model_forward_features[1-ghostnet_050]",
    "tests/test_models.py::test_model_forward_features[1-hrnet_w18_small]",
    "tests/test_models.py::test_feature_getter_stage_ends_torchscript[ghostnet_050]",
    "tests/test_models.py::test_forward_after_prune_intermediate_layers[hrnet_w18_small]",
    "tests/test_models.py::test_forward_after_prune_intermediate_layers[legacy_xception]",
    "tests/test_models.py::test_prune_intermediate_layers_contract[visformer_tiny]",
    "tests/test_models.py::test_prune_intermediate_layers_contract[test_vit]",
    "tests/test_models.py::test_pruned_features_torchscript[convit_tiny]",
    "tests/test_models.py::test_eval_refreshes_attention_bias_cache[levit_128s]",
)


def _params(nodeid: str) -> list[str]:
    if "[" not in nodeid:
        return []
    return nodeid[nodeid.index("[") + 1:-1].split("-")


def _model_of(nodeid: str, models: set[str]) -> str | None:
    for part in _params(nodeid):
        name = part.split(".", 1)[0]  # default_cfgs ids carry the pretrained tag: visformer_tiny.in1k
        if name in models:
            return name
    return None


def select(collected: list[str], subset: str) -> list[str]:
    """The node ids of ``subset`` (``ci``, ``full``) among ``collected`` (in collection order).
    A model's ``default_cfgs`` tests run for its first pretrained tag only."""
    if subset == "ci":
        known = set(collected)
        return [t for t in CI_TESTS if t in known]
    tiers = {m: CORE_TESTS for m in FULL_MODELS}
    tiers.update({m: DEEP_TESTS for m in DEEP_MODELS})
    tiers.update({m: LIGHT_TESTS for m in LIGHT_MODELS})
    models = set(tiers)
    chosen, seen_cfg = [], set()
    for nodeid in collected:
        name = nodeid.split("::")[-1].split("[", 1)[0]
        if name in NAMED_EXCLUDED:
            continue
        if name in FULL_NAMED:
            if not _params(nodeid) or any(p.split(".", 1)[0] in NAMED_MODELS for p in _params(nodeid)):
                chosen.append(nodeid)
            continue
        model = _model_of(nodeid, models)
        if model is None or name not in tiers[model]:
            continue
        if name.startswith("test_model_default_cfgs"):
            if (name, model) in seen_cfg:
                continue
            seen_cfg.add((name, model))
        chosen.append(nodeid)
    return chosen
