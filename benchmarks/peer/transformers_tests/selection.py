"""Which transformers tests the peer suite runs: the model testers of
``benchmarks/peer/transformers_tests/tests/models`` (bert, llama, gpt2, t5 and its encoder, vit)
through transformers' ``ModelTesterMixin`` + our generation / export stand-ins.

* ``full``: every collected test of those testers (those that need a GPU, flash attention,
  DeepSpeed, accelerate, several devices or the Hub skip themselves), except ``FULL_EXCLUDED``:
  12 of the 16 fp16 / bf16 variants of ``test_eager_matches_sdpa_inference`` (half precision on
  CPU is slow; kept: left padding with and without the SDPA kernels, in each dtype, plus every
  fp32 variant) and
  ``test_bc_torch_dtype`` (dtype arguments of ``from_pretrained``, the slowest common test).
* ``ci``: ``CI_TESTS`` of each tester class: forward, save/load, attention and hidden-state
  outputs, training, generation with and without the cache, generation with a static cache and the
  decoding forward compiled ``fullgraph=True``, eager inference that prints nothing, ``torch.export``, a ``torch.compile`` training step,
  eager vs SDPA.
"""

from __future__ import annotations

import re

FULL_EXCLUDED = re.compile(r"test_eager_matches_sdpa_inference_(0[2-7]|1[89]|2[0-3])_(fp16|bf16)|test_bc_torch_dtype$")

CI_TESTS = (
    "test_model",
    "test_save_load",
    "test_determinism",
    "test_batching_equivalence",
    "test_attention_outputs",
    "test_hidden_states_output",
    "test_training",
    "test_for_causal_lm",
    "test_with_lm_head",
    "test_greedy_generate",
    "test_greedy_generate_cache_matches_no_cache",
    "test_past_key_values_next_token_matches_full_forward",
    "test_torch_export",
    "test_torch_compile_aot_eager_training",
    "test_generate_compile_model_forward_fullgraph",
    "test_eager_inference_prints_nothing",
    "test_eager_matches_sdpa_inference_09_fp32_pad_left",
)


def test_function(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[", 1)[0]


def select(collected: list[str], subset: str) -> list[str]:
    if subset == "full":
        return [t for t in collected if not FULL_EXCLUDED.search(test_function(t))]
    return [t for t in collected if test_function(t) in CI_TESTS]
