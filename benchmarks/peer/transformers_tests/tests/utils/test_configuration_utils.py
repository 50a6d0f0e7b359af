"""Stand-in for transformers' ``tests/utils/test_configuration_utils.py`` (not in the sdist), written for
the peer suite: ``tests/test_configuration_common.py`` imports ``config_common_kwargs`` (common
``PreTrainedConfig`` arguments, each set to a non-default value; ``ConfigTester`` checks a config
keeps them). Our own short list."""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "is_decoder": True,
    "add_cross_attention": True,
    "chunk_size_feed_forward": 5,
    "problem_type": "regression",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "bos_token_id": 6,
    "pad_token_id": 7,
    "eos_token_id": 8,
}
