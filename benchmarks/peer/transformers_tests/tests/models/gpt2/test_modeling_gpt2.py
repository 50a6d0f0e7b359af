"""GPT-2 through transformers' common test mixins (peer suite, ``benchmarks/bench_peer_suites.py``).

Our own tester, in the style of transformers' ``tests/models/gpt2/test_modeling_gpt2.py``: a tiny
config (2 layers, hidden 32), every GPT-2 head (the double-heads model with multiple-choice
inputs), the KV cache, ``scale_attn_by_inverse_layer_idx`` / ``reorder_and_upcast_attn``,
``ModelTesterMixin`` + the generation / export stand-ins."""

import unittest

import torch
from transformers import (
    GPT2Config,
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)
from transformers.testing_utils import require_torch, torch_device

from ...generation.test_utils import GenerationTesterMixin
from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask


class GPT2ModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, hidden_act="gelu_new",
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
                 type_vocab_size=16, type_sequence_label_size=2, initializer_range=0.02, num_labels=3,
                 num_choices=4):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.type_sequence_label_size = type_sequence_label_size
        self.initializer_range = initializer_range
        self.num_labels = num_labels
        self.num_choices = num_choices
        self.bos_token_id = vocab_size - 1
        self.eos_token_id = vocab_size - 1
        self.pad_token_id = vocab_size - 1

    def get_config(self, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False):
        return GPT2Config(
            vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_hidden_layers,
            n_head=self.num_attention_heads, n_inner=self.intermediate_size, activation_function=self.hidden_act,
            resid_pdrop=self.hidden_dropout_prob, attn_pdrop=self.attention_probs_dropout_prob,
            n_positions=self.max_position_embeddings, initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            scale_attn_by_inverse_layer_idx=scale_attn_by_inverse_layer_idx,
            reorder_and_upcast_attn=reorder_and_upcast_attn,
        )

    def prepare_config_and_inputs(self, **config_kwargs):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length])
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        mc_token_ids = ids_tensor([self.batch_size, self.num_choices], self.seq_length)
        sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return (self.get_config(**config_kwargs), input_ids, input_mask, token_type_ids, mc_token_ids,
                sequence_labels, token_labels, choice_labels)

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, token_type_ids, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask}

    def create_and_check_model(self, config, input_ids, input_mask, token_type_ids, *_):
        model = GPT2Model(config).to(torch_device).eval()
        model(input_ids, token_type_ids=token_type_ids, attention_mask=input_mask)
        result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(len(result.past_key_values), config.n_layer)

    def create_and_check_lm_head_model(self, config, input_ids, input_mask, token_type_ids, *_):
        model = GPT2LMHeadModel(config).to(torch_device).eval()
        result = model(input_ids, token_type_ids=token_type_ids, labels=input_ids)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        expected = torch.nn.functional.cross_entropy(
            result.logits[:, :-1].reshape(-1, self.vocab_size).float(), input_ids[:, 1:].reshape(-1))
        torch.testing.assert_close(result.loss, expected, atol=1e-5, rtol=1e-5)

    def create_and_check_past_large_inputs(self, config, input_ids, input_mask, token_type_ids, *_):
        model = GPT2Model(config).to(torch_device).eval()
        outputs = model(input_ids, token_type_ids=token_type_ids, attention_mask=input_mask, use_cache=True)
        past = outputs.past_key_values
        next_tokens = ids_tensor((self.batch_size, 3), config.vocab_size)
        next_token_types = ids_tensor([self.batch_size, 3], self.type_vocab_size)
        next_mask = ids_tensor((self.batch_size, 3), vocab_size=2)
        next_input_ids = torch.cat([input_ids, next_tokens], dim=-1)
        next_token_type_ids = torch.cat([token_type_ids, next_token_types], dim=-1)
        next_attention_mask = torch.cat([input_mask, next_mask], dim=-1)
        no_past = model(next_input_ids, token_type_ids=next_token_type_ids,
                        attention_mask=next_attention_mask)["last_hidden_state"]
        with_past = model(next_tokens, token_type_ids=next_token_types, attention_mask=next_attention_mask,
                          past_key_values=past)["last_hidden_state"]
        idx = ids_tensor((1,), with_past.shape[-1]).item()
        self.parent.assertTrue(torch.allclose(no_past[:, -3:, idx].detach(), with_past[:, :, idx].detach(),
                                              atol=1e-3))

    def create_and_check_double_lm_head_model(self, config, input_ids, input_mask, token_type_ids, mc_token_ids,
                                              sequence_labels, token_labels, choice_labels):
        model = GPT2DoubleHeadsModel(config).to(torch_device).eval()

        def expand(t):
            return t.unsqueeze(1).expand(-1, self.num_choices, -1).contiguous()

        result = model(expand(input_ids), mc_token_ids=mc_token_ids, attention_mask=expand(input_mask),
                       token_type_ids=expand(token_type_ids), labels=expand(input_ids))
        self.parent.assertEqual(result.logits.shape,
                                (self.batch_size, self.num_choices, self.seq_length, self.vocab_size))
        self.parent.assertEqual(result.mc_logits.shape, (self.batch_size, self.num_choices))

    def create_and_check_gpt2_for_sequence_classification(self, config, input_ids, input_mask, token_type_ids,
                                                          mc_token_ids, sequence_labels, *_):
        config.num_labels = self.num_labels
        model = GPT2ForSequenceClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_labels))

    def create_and_check_forward_and_backwards(self, config, input_ids, input_mask, token_type_ids, *_):
        model = GPT2LMHeadModel(config).to(torch_device)
        result = model(input_ids, token_type_ids=token_type_ids, labels=input_ids)
        result.loss.backward()
        self.parent.assertEqual(result.loss.shape, ())


@require_torch
class GPT2ModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (
        GPT2Model,
        GPT2LMHeadModel,
        GPT2DoubleHeadsModel,
        GPT2ForQuestionAnswering,
        GPT2ForSequenceClassification,
        GPT2ForTokenClassification,
    )
    test_missing_keys = False
    # GPT2DoubleHeadsModel's `loss` is the LM loss alone (`mc_loss` apart): its multiple-choice head
    # gets no gradient from the training tests' `loss.backward()`
    test_all_params_have_gradient = False
    model_split_percents = [0.5, 0.6, 0.7]

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class.__name__ == "GPT2DoubleHeadsModel":
            batch, choices, seq = (self.model_tester.batch_size, self.model_tester.num_choices,
                                   self.model_tester.seq_length)
            inputs_dict["labels"] = torch.zeros((batch, choices, seq), dtype=torch.long, device=torch_device)
            inputs_dict["input_ids"] = inputs_dict["labels"]
            inputs_dict["token_type_ids"] = inputs_dict["labels"]
            inputs_dict["attention_mask"] = torch.ones_like(inputs_dict["labels"])
            inputs_dict["mc_token_ids"] = torch.zeros((batch, choices), dtype=torch.long, device=torch_device)
            inputs_dict["mc_labels"] = torch.zeros(batch, dtype=torch.long, device=torch_device)
        return inputs_dict

    def setUp(self):
        self.model_tester = GPT2ModelTester(self)
        self.config_tester = ConfigTester(self, config_class=GPT2Config, n_embd=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_gpt2_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_gpt2_model_past_large_inputs(self):
        self.model_tester.create_and_check_past_large_inputs(*self.model_tester.prepare_config_and_inputs())

    def test_gpt2_lm_head_model(self):
        self.model_tester.create_and_check_lm_head_model(*self.model_tester.prepare_config_and_inputs())

    def test_gpt2_double_lm_head_model(self):
        self.model_tester.create_and_check_double_lm_head_model(*self.model_tester.prepare_config_and_inputs())

    def test_gpt2_sequence_classification_model(self):
        self.model_tester.create_and_check_gpt2_for_sequence_classification(
            *self.model_tester.prepare_config_and_inputs())

    def test_gpt2_gradient_checkpointing(self):
        config, *rest = self.model_tester.prepare_config_and_inputs()
        config.gradient_checkpointing = True
        self.model_tester.create_and_check_forward_and_backwards(config, *rest)

    def test_gpt2_scale_attn_by_inverse_layer_idx(self):
        self.model_tester.create_and_check_forward_and_backwards(
            *self.model_tester.prepare_config_and_inputs(scale_attn_by_inverse_layer_idx=True))

    def test_gpt2_reorder_and_upcast_attn(self):
        self.model_tester.create_and_check_forward_and_backwards(
            *self.model_tester.prepare_config_and_inputs(reorder_and_upcast_attn=True))

    def test_gpt2_reorder_and_upcast_attn_matches_plain(self):
        """``reorder_and_upcast_attn`` computes the same attention in float32 by another route: with the
        same weights, both configurations give the same outputs (eager attention)."""
        config, input_ids, input_mask, *_ = self.model_tester.prepare_config_and_inputs()
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        plain = GPT2Model(config).to(torch_device).eval()
        config.reorder_and_upcast_attn = True
        upcast = GPT2Model(config).to(torch_device).eval()
        upcast.load_state_dict(plain.state_dict())
        with torch.no_grad():
            a = plain(input_ids, attention_mask=input_mask).last_hidden_state
            b = upcast(input_ids, attention_mask=input_mask).last_hidden_state
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    def test_lm_head_returns_logits_when_training_with_labels(self):
        """``CausalLMOutputWithCrossAttentions`` carries the logits with the loss, in train mode too."""
        config, input_ids, *_ = self.model_tester.prepare_config_and_inputs()
        model = GPT2LMHeadModel(config).to(torch_device).train()
        out = model(input_ids, labels=input_ids)
        self.assertIsNotNone(out.logits)
        self.assertEqual(out.logits.shape, (*input_ids.shape, config.vocab_size))
