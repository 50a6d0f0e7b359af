"""Stand-in for transformers' ``tests/generation/test_utils.py`` (not in the sdist), written for the
peer suite (``benchmarks/bench_peer_suites.py``): ``tests/test_modeling_common.py`` imports
``GenerationTesterMixin`` from here, and its ``test_generation_tester_mixin_inheritance`` requires
testers of generative models to inherit it.

These are our own generation tests, smaller than transformers' own: greedy, sampling and beam
search shapes, greedy with and without the KV cache giving the same tokens and scores, one
decoding step from ``past_key_values`` matching the full forward, and left padding (with
position ids from the mask) leaving the last token's logits unchanged; and, as transformers' own
``test_generate_compile_model_forward_fullgraph`` does, greedy decoding with a static cache and the
decoding forward compiled by generate itself (``CompileConfig(fullgraph=True)``, on every device),
giving the eager tokens and no graph break. What they check is what a rewrite of attention, rotary
embeddings, norms or the LM head could break (a guard that dynamo cannot trace breaks the graph).
"""

from __future__ import annotations

import inspect

import torch
from transformers.testing_utils import torch_device

MAX_NEW_TOKENS = 3


class GenerationTesterMixin:
    model_tester = None
    all_model_classes = ()

    # -- helpers -------------------------------------------------------------------------------

    def _generative_classes(self):
        classes = getattr(self, "all_generative_model_classes", None)
        if classes is None:
            classes = tuple(c for c in self.all_model_classes if c.can_generate())
        if not classes:
            self.skipTest("no generative model class")
        return classes

    def _generation_setup(self, model_class):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        keep = ("input_ids", "attention_mask", "pixel_values") if config.is_encoder_decoder else (
            "input_ids", "attention_mask", "token_type_ids")
        inputs = {k: v for k, v in inputs.items() if k in keep}
        if not config.is_encoder_decoder and hasattr(config, "is_decoder"):
            config.is_decoder = True  # BertLMHeadModel generates as a decoder
        if config.pad_token_id is None:
            config.pad_token_id = 0
        config.eos_token_id = None  # no early stop: every row generates MAX_NEW_TOKENS tokens
        model = model_class(config).to(torch_device).eval()
        model.generation_config.pad_token_id = config.pad_token_id
        model.generation_config.eos_token_id = None
        return config, model, inputs

    def _expected_length(self, config, inputs):
        start = 1 if config.is_encoder_decoder else inputs["input_ids"].shape[-1]
        return start + MAX_NEW_TOKENS

    # -- tests ---------------------------------------------------------------------------------

    def test_greedy_generate(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
            self.assertEqual(out.shape, (inputs["input_ids"].shape[0], self._expected_length(config, inputs)))

    def test_greedy_generate_dict_outputs(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 return_dict_in_generate=True, output_scores=True, output_logits=True)
            self.assertEqual(len(out.scores), MAX_NEW_TOKENS)
            self.assertEqual(len(out.logits), MAX_NEW_TOKENS)
            batch = inputs["input_ids"].shape[0]
            for scores in out.scores:
                self.assertEqual(scores.shape[0], batch)
                self.assertFalse(torch.isnan(scores).any())

    def test_sample_generate(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            runs = []
            for _ in range(2):
                torch.manual_seed(0)
                runs.append(model.generate(**inputs, do_sample=True, top_k=5, max_new_tokens=MAX_NEW_TOKENS))
            self.assertEqual(runs[0].shape[-1], self._expected_length(config, inputs))
            self.assertTrue(torch.equal(runs[0], runs[1]), "seeded sampling is not reproducible")

    def test_beam_search_generate(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            out = model.generate(**inputs, do_sample=False, num_beams=2, num_return_sequences=2,
                                 max_new_tokens=MAX_NEW_TOKENS)
            self.assertEqual(out.shape, (2 * inputs["input_ids"].shape[0], self._expected_length(config, inputs)))

    def test_greedy_generate_cache_matches_no_cache(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                          output_scores=True)
            with_cache = model.generate(**inputs, use_cache=True, **kwargs)
            without = model.generate(**inputs, use_cache=False, **kwargs)
            self.assertTrue(torch.equal(with_cache.sequences, without.sequences))
            for a, b in zip(with_cache.scores, without.scores):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    def test_past_key_values_next_token_matches_full_forward(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            ids = inputs["input_ids"]
            mask = torch.ones_like(ids)
            with torch.no_grad():
                if config.is_encoder_decoder:
                    start = config.decoder_start_token_id or 0
                    dec = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :3]], dim=-1)
                    full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[:, -1]
                    first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec[:, :-1], use_cache=True)
                    step = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec[:, -1:],
                                 past_key_values=first.past_key_values, use_cache=True).logits[:, -1]
                else:
                    full = model(input_ids=ids, attention_mask=mask).logits[:, -1]
                    first = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
                    step = model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=first.past_key_values,
                                 use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)

    def test_left_padding_compatibility(self):
        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            if config.is_encoder_decoder:
                self.skipTest("left padding of the decoder: decoder-only models")
            ids = inputs["input_ids"]
            takes_positions = "position_ids" in inspect.signature(model.forward).parameters
            pad = 3
            padded_ids = torch.cat([torch.full_like(ids[:, :pad], config.pad_token_id), ids], dim=-1)
            mask = torch.cat([torch.zeros_like(ids[:, :pad]), torch.ones_like(ids)], dim=-1)
            extra, extra_padded = {}, {}
            if takes_positions:
                extra["position_ids"] = torch.arange(ids.shape[-1]).expand_as(ids)
                extra_padded["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                plain = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[:, -1]
                padded = model(input_ids=padded_ids, attention_mask=mask, **extra_padded).logits[:, -1]
            torch.testing.assert_close(padded, plain, atol=1e-4, rtol=1e-4)

    def test_generate_compile_model_forward_fullgraph(self):
        from transformers import CompileConfig

        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            if not getattr(model, "_can_compile_fullgraph", False):
                self.skipTest(f"{model_class.__name__} does not support a static cache")
            kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, cache_implementation="static")
            eager = model.generate(**inputs, **kwargs)
            compile_config = CompileConfig(fullgraph=True, dynamic=False)
            compile_config._compile_all_devices = True  # (transformers' test sets it too: CPU compiles)
            torch._dynamo.reset()
            compiled = model.generate(**inputs, compile_config=compile_config, **kwargs)
            if not hasattr(model, "_compiled_call"):
                # (generate's own criteria: an encoder-decoder's static cache is not auto-compiled)
                self.skipTest(f"generate does not compile {model_class.__name__}'s decoding forward")
            self.assertTrue(torch.equal(eager, compiled))

    def test_eager_inference_prints_nothing(self):
        """A causal LM's eager inference (a forward without labels, then a greedy generate) prints
        no log record and no warning: a rewrite that reads what the original does not (the LM
        head's ``self.loss_function`` logged ``loss_type=None`` on every call) fails here, in the
        rewritten library only."""
        import logging
        import warnings

        from transformers.utils import logging as hf_logging

        class _Records(logging.Handler):
            def __init__(self):
                super().__init__(logging.DEBUG)
                self.lines = []

            def emit(self, record):
                self.lines.append(f"{record.name}: {record.getMessage()}")

        for model_class in self._generative_classes():
            config, model, inputs = self._generation_setup(model_class)
            handler = _Records()
            root = hf_logging.get_logger()  # ("transformers": every module's logger propagates to it)
            root.addHandler(handler)
            hf_logging.warning_once.cache_clear()  # (what an earlier test printed once is printed again)
            try:
                with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                    warnings.simplefilter("always")
                    model(**inputs)
                    model(**inputs)  # (a warning per call shows on the second too)
                    model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
            finally:
                root.removeHandler(handler)
            printed = handler.lines + [f"{w.category.__name__}: {w.message}" for w in caught]
            self.assertEqual(printed, [], f"{model_class.__name__}'s eager inference printed")
