"""T5 through transformers' common test mixins (peer suite, ``benchmarks/bench_peer_suites.py``).

Our own testers, in the style of transformers' ``tests/models/t5/test_modeling_t5.py``: a tiny
config (2 encoder + 2 decoder layers, d_model 32, relative position buckets), the
encoder-decoder heads with the decoder's self- and cross-attention and its KV cache
(``T5ModelTest``), and the encoder alone (``T5EncoderOnlyModelTest``); ``ModelTesterMixin`` + the
generation / export stand-ins."""

import unittest

import torch
from transformers import (
    T5Config,
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5ForQuestionAnswering,
    T5ForSequenceClassification,
    T5ForTokenClassification,
    T5Model,
)
from transformers.testing_utils import require_torch, torch_device

from ...generation.test_utils import GenerationTesterMixin
from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, ids_tensor


class T5ModelTester:
    def __init__(self, parent, vocab_size=99, batch_size=13, encoder_seq_length=7, decoder_seq_length=7,
                 is_training=True, use_attention_mask=True, use_labels=True, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, d_ff=37, relative_attention_num_buckets=8, dropout_rate=0.1,
                 initializer_factor=0.002, eos_token_id=1, pad_token_id=0, decoder_start_token_id=0,
                 decoder_layers=None):
        self.parent = parent
        self.batch_size = batch_size
        self.encoder_seq_length = encoder_seq_length
        self.decoder_seq_length = decoder_seq_length
        self.seq_length = self.decoder_seq_length
        self.is_training = is_training
        self.use_attention_mask = use_attention_mask
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.d_ff = d_ff
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.dropout_rate = dropout_rate
        self.initializer_factor = initializer_factor
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id
        self.decoder_layers = decoder_layers
        self.num_labels = 3

    def get_config(self):
        return T5Config(
            vocab_size=self.vocab_size, d_model=self.hidden_size, d_ff=self.d_ff,
            d_kv=self.hidden_size // self.num_attention_heads, num_layers=self.num_hidden_layers,
            num_decoder_layers=self.decoder_layers, num_heads=self.num_attention_heads,
            relative_attention_num_buckets=self.relative_attention_num_buckets, dropout_rate=self.dropout_rate,
            initializer_factor=self.initializer_factor, eos_token_id=self.eos_token_id, bos_token_id=self.pad_token_id,
            pad_token_id=self.pad_token_id, decoder_start_token_id=self.decoder_start_token_id,
            use_cache=False,  # as transformers' T5 tester: the common attention-output tests count outputs
        )

    def prepare_config_and_inputs(self):
        # at least 2 (not pad 0 / eos 1) then one eos at the end: T5ForSequenceClassification pools
        # the eos token and needs the same number of them in every row
        input_ids = ids_tensor([self.batch_size, self.encoder_seq_length], self.vocab_size).clamp(2)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size).clamp(2)
        attention_mask = ids_tensor([self.batch_size, self.encoder_seq_length], vocab_size=2)
        attention_mask[:, -1] = 1
        decoder_attention_mask = ids_tensor([self.batch_size, self.decoder_seq_length], vocab_size=2)
        lm_labels = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size)
        return self.get_config(), input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, lm_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask,
                        "decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_attention_mask}

    def create_and_check_model(self, config, input_ids, decoder_input_ids, attention_mask, decoder_attention_mask,
                               lm_labels):
        model = T5Model(config).to(torch_device).eval()
        result = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, attention_mask=attention_mask,
                       decoder_attention_mask=decoder_attention_mask)
        result = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=True)
        self.parent.assertEqual(result.last_hidden_state.shape,
                                (self.batch_size, self.decoder_seq_length, self.hidden_size))
        self.parent.assertEqual(result.encoder_last_hidden_state.shape,
                                (self.batch_size, self.encoder_seq_length, self.hidden_size))
        self.parent.assertEqual(len(result.past_key_values.self_attention_cache), config.num_layers)

    def create_and_check_with_lm_head(self, config, input_ids, decoder_input_ids, attention_mask,
                                      decoder_attention_mask, lm_labels):
        model = T5ForConditionalGeneration(config).to(torch_device).eval()
        out = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                    decoder_attention_mask=decoder_attention_mask, labels=lm_labels)
        self.parent.assertEqual(out.logits.shape, (self.batch_size, self.decoder_seq_length, self.vocab_size))
        expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, self.vocab_size).float(),
                                                     lm_labels.reshape(-1), ignore_index=-100)
        torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)

    def create_and_check_decoder_model_past(self, config, input_ids, *_):
        model = T5Model(config).get_decoder().to(torch_device).eval()
        outputs = model(input_ids, use_cache=True)
        outputs_no_past = model(input_ids, use_cache=False)
        self.parent.assertTrue(len(outputs) == len(outputs_no_past) + 1)
        past = outputs.past_key_values
        next_tokens = ids_tensor((self.batch_size, 1), config.vocab_size)
        next_input_ids = torch.cat([input_ids, next_tokens], dim=-1)
        no_past = model(next_input_ids)["last_hidden_state"]
        with_past = model(next_tokens, past_key_values=past)["last_hidden_state"]
        idx = ids_tensor((1,), with_past.shape[-1]).item()
        self.parent.assertTrue(torch.allclose(no_past[:, -1, idx].detach(), with_past[:, 0, idx].detach(),
                                              atol=1e-3))

    def create_and_check_decoder_model_attention_mask_past(self, config, input_ids, *_):
        model = T5Model(config).get_decoder().to(torch_device).eval()
        attn_mask = torch.ones(input_ids.shape, dtype=torch.long, device=torch_device)
        half = input_ids.shape[-1] // 2
        attn_mask[:, half:] = 0
        past = model(input_ids, attention_mask=attn_mask, use_cache=True).past_key_values
        next_tokens = ids_tensor((self.batch_size, 1), config.vocab_size)
        random_idx = ids_tensor((1,), half).item() + 1
        random_other = ids_tensor((self.batch_size, 1), config.vocab_size).squeeze(-1)
        input_ids[:, -random_idx] = random_other
        next_input_ids = torch.cat([input_ids, next_tokens], dim=-1)
        attn_mask = torch.cat([attn_mask, torch.ones((attn_mask.shape[0], 1), dtype=torch.long,
                                                      device=torch_device)], dim=1)
        no_past = model(next_input_ids, attention_mask=attn_mask)["last_hidden_state"]
        with_past = model(next_tokens, past_key_values=past, attention_mask=attn_mask)["last_hidden_state"]
        idx = ids_tensor((1,), with_past.shape[-1]).item()
        self.parent.assertTrue(torch.allclose(no_past[:, -1, idx].detach(), with_past[:, 0, idx].detach(),
                                              atol=1e-3))

    def create_and_check_with_sequence_classification_head(self, config, input_ids, decoder_input_ids,
                                                           attention_mask, decoder_attention_mask, lm_labels):
        labels = torch.tensor([1] * self.batch_size, dtype=torch.long, device=torch_device)
        model = T5ForSequenceClassification(config).to(torch_device).eval()
        out = model(input_ids=input_ids, decoder_input_ids=input_ids, labels=labels)
        self.parent.assertEqual(out.logits.shape, (self.batch_size, config.num_labels))


@require_torch
class T5ModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (T5Model, T5ForConditionalGeneration, T5ForSequenceClassification, T5ForQuestionAnswering)
    is_encoder_decoder = True
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = T5ModelTester(self)
        self.config_tester = ConfigTester(self, config_class=T5Config, d_model=37)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if model_class is T5ForSequenceClassification:
            # pooled on the eos tokens of decoder_input_ids: the same count in every row
            inputs_dict["decoder_input_ids"] = inputs_dict["input_ids"]
            inputs_dict.pop("decoder_attention_mask", None)
        return inputs_dict

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_with_lm_head(self):
        self.model_tester.create_and_check_with_lm_head(*self.model_tester.prepare_config_and_inputs())

    def test_with_sequence_classification_head(self):
        self.model_tester.create_and_check_with_sequence_classification_head(
            *self.model_tester.prepare_config_and_inputs())

    def test_decoder_model_past(self):
        self.model_tester.create_and_check_decoder_model_past(*self.model_tester.prepare_config_and_inputs())

    def test_decoder_model_past_with_attn_mask(self):
        self.model_tester.create_and_check_decoder_model_attention_mask_past(
            *self.model_tester.prepare_config_and_inputs())

    def test_inputs_embeds(self):
        # T5ForSequenceClassification raises NotImplementedError for inputs_embeds
        classes = self.all_model_classes
        self.all_model_classes = tuple(c for c in classes if c is not T5ForSequenceClassification)
        try:
            super().test_inputs_embeds()
        finally:
            self.all_model_classes = classes

    @unittest.skip(reason="T5ForConditionalGeneration is its own base model (shared embeddings, encoder, decoder)")
    def test_model_base_model_prefix(self):
        pass

    def test_v1_1_gated_gelu(self):
        """T5 v1.1 (gated-gelu feed-forward, untied head): one forward + backward with labels."""
        config, input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, lm_labels = (
            self.model_tester.prepare_config_and_inputs())
        config.feed_forward_proj = "gated-gelu"
        config.tie_word_embeddings = False
        config.__init__(**config.to_dict())
        model = T5ForConditionalGeneration(config).to(torch_device).train()
        out = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                    labels=lm_labels)
        out.loss.backward()
        self.assertTrue(torch.isfinite(out.loss))

    def test_encoder_decoder_shared_weights(self):
        """Decoder-only evaluation of the same weights: the decoder of T5Model given the encoder's
        outputs equals the full model's decoder outputs."""
        config, input_ids, decoder_input_ids, attention_mask, *_ = self.model_tester.prepare_config_and_inputs()
        model = T5Model(config).to(torch_device).eval()
        with torch.no_grad():
            full = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
            enc = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            dec = model.get_decoder()(input_ids=decoder_input_ids, encoder_hidden_states=enc,
                                      encoder_attention_mask=attention_mask).last_hidden_state
        torch.testing.assert_close(dec, full.last_hidden_state, atol=1e-5, rtol=1e-5)


class T5EncoderOnlyModelTester:
    def __init__(self, parent, vocab_size=99, batch_size=13, encoder_seq_length=7, is_training=False,
                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4, d_ff=37,
                 relative_attention_num_buckets=8, dropout_rate=0.1, initializer_factor=0.002, eos_token_id=1,
                 pad_token_id=0):
        self.parent = parent
        self.batch_size = batch_size
        self.encoder_seq_length = encoder_seq_length
        self.seq_length = encoder_seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.d_ff = d_ff
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.dropout_rate = dropout_rate
        self.initializer_factor = initializer_factor
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.num_labels = 3

    def get_config(self):
        return T5Config(
            vocab_size=self.vocab_size, d_model=self.hidden_size, d_ff=self.d_ff,
            d_kv=self.hidden_size // self.num_attention_heads, num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads, relative_attention_num_buckets=self.relative_attention_num_buckets,
            dropout_rate=self.dropout_rate, initializer_factor=self.initializer_factor,
            eos_token_id=self.eos_token_id, bos_token_id=self.pad_token_id, pad_token_id=self.pad_token_id,
            is_encoder_decoder=False,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.encoder_seq_length], self.vocab_size)
        attention_mask = ids_tensor([self.batch_size, self.encoder_seq_length], vocab_size=2)
        attention_mask[:, 0] = 1
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def create_and_check_model(self, config, input_ids, attention_mask):
        model = T5EncoderModel(config).to(torch_device).eval()
        result = model(input_ids=input_ids, attention_mask=attention_mask)
        result = model(input_ids=input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape,
                                (self.batch_size, self.encoder_seq_length, self.hidden_size))

    def create_and_check_with_token_classification_head(self, config, input_ids, attention_mask):
        labels = torch.tensor([1] * self.encoder_seq_length * self.batch_size, dtype=torch.long,
                              device=torch_device).view(self.batch_size, self.encoder_seq_length)
        model = T5ForTokenClassification(config).to(torch_device).eval()
        out = model(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        self.parent.assertEqual(out.logits.shape, (self.batch_size, self.encoder_seq_length, config.num_labels))


@require_torch
class T5EncoderOnlyModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (T5EncoderModel, T5ForTokenClassification)
    test_resize_embeddings = False
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = T5EncoderOnlyModelTester(self)
        self.config_tester = ConfigTester(self, config_class=T5Config, d_model=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_with_token_classification_head(self):
        self.model_tester.create_and_check_with_token_classification_head(
            *self.model_tester.prepare_config_and_inputs())
