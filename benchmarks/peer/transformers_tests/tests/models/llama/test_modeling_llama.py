"""Llama through transformers' common test mixins (peer suite, ``benchmarks/bench_peer_suites.py``).

Our own tester, in the style of transformers' causal-LM testers: a tiny config (2 layers, hidden
32, 4 query heads over 2 key/value heads, so grouped-query attention runs), every Llama head,
the KV cache, RoPE scaling from the config (``ModelTesterMixin``'s rope tests), ``ModelTesterMixin``
+ the generation / export stand-ins."""

import unittest

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)
from transformers.testing_utils import require_torch, torch_device

from ...generation.test_utils import GenerationTesterMixin
from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, ids_tensor


class LlamaModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
                 hidden_act="silu", max_position_embeddings=512, type_sequence_label_size=2, initializer_range=0.02,
                 num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=2):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.type_sequence_label_size = type_sequence_label_size
        self.initializer_range = initializer_range
        self.num_labels = num_labels
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def get_config(self):
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings, initializer_range=self.initializer_range,
            pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = torch.tril(torch.ones_like(input_ids).to(torch_device))
        sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        return self.get_config(), input_ids, input_mask, sequence_labels, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}

    def create_and_check_model(self, config, input_ids, input_mask, *_):
        model = LlamaModel(config).to(torch_device).eval()
        model(input_ids, attention_mask=input_mask)
        result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_for_causal_lm(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = LlamaForCausalLM(config).to(torch_device).eval()
        labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        result = model(input_ids, attention_mask=input_mask, labels=labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        # the loss against the logits the model returns: a fused linear + cross-entropy must agree
        expected = torch.nn.functional.cross_entropy(
            result.logits[:, :-1].reshape(-1, self.vocab_size).float(), labels[:, 1:].reshape(-1))
        torch.testing.assert_close(result.loss, expected, atol=1e-5, rtol=1e-5)

    def create_and_check_decoder_model_past_large_inputs(self, config, input_ids, input_mask, *_):
        model = LlamaForCausalLM(config).to(torch_device).eval()
        input_mask = torch.ones_like(input_ids)
        outputs = model(input_ids, attention_mask=input_mask, use_cache=True)
        past_key_values = outputs.past_key_values
        next_tokens = ids_tensor((self.batch_size, 3), config.vocab_size)
        next_mask = ids_tensor((self.batch_size, 3), vocab_size=2)
        next_mask[:, -1] = 1
        next_input_ids = torch.cat([input_ids, next_tokens], dim=-1)
        next_attention_mask = torch.cat([input_mask, next_mask], dim=-1)
        no_past = model(next_input_ids, attention_mask=next_attention_mask, output_hidden_states=True)
        past = model(next_tokens, attention_mask=next_attention_mask, past_key_values=past_key_values,
                     output_hidden_states=True)
        idx = ids_tensor((1,), self.hidden_size).item()
        a = no_past.hidden_states[-1][:, -3:, idx].detach()
        b = past.hidden_states[-1][:, :, idx].detach()
        self.parent.assertTrue(torch.allclose(a, b, atol=1e-3))

    def create_and_check_for_sequence_classification(self, config, input_ids, input_mask, sequence_labels, *_):
        config.num_labels = self.num_labels
        model = LlamaForSequenceClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_labels))


@require_torch
class LlamaModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (
        LlamaModel,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        LlamaForQuestionAnswering,
        LlamaForTokenClassification,
    )
    model_split_percents = [0.5, 0.7, 0.8]

    def setUp(self):
        self.model_tester = LlamaModelTester(self)
        self.config_tester = ConfigTester(self, config_class=LlamaConfig, hidden_size=32, num_attention_heads=4)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_for_causal_lm(self):
        self.model_tester.create_and_check_for_causal_lm(*self.model_tester.prepare_config_and_inputs())

    def test_decoder_model_past_with_large_inputs(self):
        self.model_tester.create_and_check_decoder_model_past_large_inputs(
            *self.model_tester.prepare_config_and_inputs())

    def test_for_sequence_classification(self):
        self.model_tester.create_and_check_for_sequence_classification(*self.model_tester.prepare_config_and_inputs())

    def test_causal_lm_loss_backward_matches_unfused(self):
        """Gradients of the LM loss reach every parameter and match a plain
        ``cross_entropy(lm_head(hidden))`` recomputed from the same model's hidden states."""
        config, input_ids, input_mask, *_ = self.model_tester.prepare_config_and_inputs()
        model = LlamaForCausalLM(config).to(torch_device).train()
        labels = ids_tensor(list(input_ids.shape), config.vocab_size)
        out = model(input_ids, labels=labels, output_hidden_states=True)
        out.loss.backward()
        fused = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]
        logits = model.lm_head(hidden).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size),
                                                 labels[:, 1:].reshape(-1))
        loss.backward()
        torch.testing.assert_close(out.loss, loss, atol=1e-5, rtol=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(fused[name], param.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    def test_causal_lm_returns_logits_when_training_with_labels(self):
        """``CausalLMOutputWithPast`` carries the logits with the loss, in train mode too (transformers'
        own tests read only the loss there; Trainer's ``prediction_loss_only=False`` evaluation and
        custom training loops read the logits)."""
        config, input_ids, *_ = self.model_tester.prepare_config_and_inputs()
        model = LlamaForCausalLM(config).to(torch_device).train()
        out = model(input_ids, labels=input_ids)
        self.assertIsNotNone(out.logits)
        self.assertEqual(out.logits.shape, (*input_ids.shape, config.vocab_size))
