"""BERT through transformers' common test mixins (peer suite, ``benchmarks/bench_peer_suites.py``).

Our own tester, in the style of transformers' ``tests/models/bert/test_modeling_bert.py``: a tiny
config (2 layers, hidden 32), every BERT head, BERT as a decoder with cross-attention and a KV
cache, ``ModelTesterMixin`` + the generation / export stand-ins."""

import unittest

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
)
from transformers.testing_utils import require_torch, torch_device

from ...generation.test_utils import GenerationTesterMixin
from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor, random_attention_mask


class BertModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, hidden_act="gelu",
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

    def get_config(self):
        return BertConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act, hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.type_vocab_size,
            is_decoder=False, initializer_range=self.initializer_range,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length])
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return self.get_config(), input_ids, token_type_ids, input_mask, sequence_labels, token_labels, choice_labels

    def prepare_config_and_inputs_for_decoder(self):
        config, *rest = self.prepare_config_and_inputs()
        config.is_decoder = True
        encoder_hidden_states = floats_tensor([self.batch_size, self.seq_length, self.hidden_size])
        encoder_attention_mask = ids_tensor([self.batch_size, self.seq_length], vocab_size=2)
        return (config, *rest, encoder_hidden_states, encoder_attention_mask)

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask}

    # -- per-head checks (shapes) --------------------------------------------------------------

    def create_and_check_model(self, config, input_ids, token_type_ids, input_mask, *_):
        model = BertModel(config).to(torch_device).eval()
        model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids)
        model(input_ids, token_type_ids=token_type_ids)
        result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(result.pooler_output.shape, (self.batch_size, self.hidden_size))

    def create_and_check_model_as_decoder(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                          token_labels, choice_labels, encoder_hidden_states, encoder_attention_mask):
        config.add_cross_attention = True
        model = BertModel(config).to(torch_device).eval()
        model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids,
              encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask)
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids,
                       encoder_hidden_states=encoder_hidden_states)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_for_causal_lm(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                       token_labels, *_):
        model = BertLMHeadModel(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertTrue(torch.isfinite(result.loss))

    def create_and_check_for_masked_lm(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                       token_labels, choice_labels):
        model = BertForMaskedLM(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))

    def create_and_check_decoder_model_past_large_inputs(self, config, input_ids, token_type_ids, input_mask,
                                                         sequence_labels, token_labels, choice_labels,
                                                         encoder_hidden_states, encoder_attention_mask):
        config.is_decoder = True
        config.add_cross_attention = True
        model = BertLMHeadModel(config).to(torch_device).eval()
        outputs = model(input_ids, attention_mask=input_mask, encoder_hidden_states=encoder_hidden_states,
                        encoder_attention_mask=encoder_attention_mask, use_cache=True)
        past_key_values = outputs.past_key_values
        next_tokens = ids_tensor((self.batch_size, 3), config.vocab_size)
        next_mask = ids_tensor((self.batch_size, 3), vocab_size=2)
        next_input_ids = torch.cat([input_ids, next_tokens], dim=-1)
        next_attention_mask = torch.cat([input_mask, next_mask], dim=-1)
        output_from_no_past = model(next_input_ids, attention_mask=next_attention_mask,
                                    encoder_hidden_states=encoder_hidden_states,
                                    encoder_attention_mask=encoder_attention_mask,
                                    output_hidden_states=True)["hidden_states"][0]
        output_from_past = model(next_tokens, attention_mask=next_attention_mask,
                                 encoder_hidden_states=encoder_hidden_states,
                                 encoder_attention_mask=encoder_attention_mask, past_key_values=past_key_values,
                                 output_hidden_states=True)["hidden_states"][0]
        random_slice_idx = ids_tensor((1,), output_from_past.shape[-1]).item()
        no_past_slice = output_from_no_past[:, -3:, random_slice_idx].detach()
        past_slice = output_from_past[:, :, random_slice_idx].detach()
        self.parent.assertTrue(past_slice.shape[1] == next_tokens.shape[1])
        self.parent.assertTrue(torch.allclose(past_slice, no_past_slice, atol=1e-3))

    def create_and_check_for_next_sequence_prediction(self, config, input_ids, token_type_ids, input_mask,
                                                      sequence_labels, *_):
        model = BertForNextSentencePrediction(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, 2))

    def create_and_check_for_pretraining(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                         token_labels, choice_labels):
        model = BertForPreTraining(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels,
                       next_sentence_label=sequence_labels)
        self.parent.assertEqual(result.prediction_logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertEqual(result.seq_relationship_logits.shape, (self.batch_size, 2))

    def create_and_check_for_question_answering(self, config, input_ids, token_type_ids, input_mask,
                                                sequence_labels, *_):
        model = BertForQuestionAnswering(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids,
                       start_positions=sequence_labels, end_positions=sequence_labels)
        self.parent.assertEqual(result.start_logits.shape, (self.batch_size, self.seq_length))
        self.parent.assertEqual(result.end_logits.shape, (self.batch_size, self.seq_length))

    def create_and_check_for_sequence_classification(self, config, input_ids, token_type_ids, input_mask,
                                                     sequence_labels, *_):
        config.num_labels = self.num_labels
        model = BertForSequenceClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=sequence_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_labels))

    def create_and_check_for_token_classification(self, config, input_ids, token_type_ids, input_mask,
                                                  sequence_labels, token_labels, choice_labels):
        config.num_labels = self.num_labels
        model = BertForTokenClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.num_labels))

    def create_and_check_for_multiple_choice(self, config, input_ids, token_type_ids, input_mask, sequence_labels,
                                             token_labels, choice_labels):
        config.num_choices = self.num_choices
        model = BertForMultipleChoice(config).to(torch_device).eval()

        def expand(t):
            return t.unsqueeze(1).expand(-1, self.num_choices, -1).contiguous()

        result = model(expand(input_ids), attention_mask=expand(input_mask), token_type_ids=expand(token_type_ids),
                       labels=choice_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_choices))


@require_torch
class BertModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (
        BertModel,
        BertLMHeadModel,
        BertForMaskedLM,
        BertForMultipleChoice,
        BertForNextSentencePrediction,
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
    )
    model_split_percents = [0.5, 0.8, 0.9]

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class is BertForPreTraining:
            inputs_dict["labels"] = torch.zeros((self.model_tester.batch_size, self.model_tester.seq_length),
                                                dtype=torch.long, device=torch_device)
            inputs_dict["next_sentence_label"] = torch.zeros(self.model_tester.batch_size, dtype=torch.long,
                                                             device=torch_device)
        return inputs_dict

    def setUp(self):
        self.model_tester = BertModelTester(self)
        self.config_tester = ConfigTester(self, config_class=BertConfig, hidden_size=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_model_as_decoder(self):
        self.model_tester.create_and_check_model_as_decoder(*self.model_tester.prepare_config_and_inputs_for_decoder())

    def test_for_causal_lm(self):
        self.model_tester.create_and_check_for_causal_lm(*self.model_tester.prepare_config_and_inputs_for_decoder())

    def test_for_masked_lm(self):
        self.model_tester.create_and_check_for_masked_lm(*self.model_tester.prepare_config_and_inputs())

    def test_decoder_model_past_with_large_inputs(self):
        self.model_tester.create_and_check_decoder_model_past_large_inputs(
            *self.model_tester.prepare_config_and_inputs_for_decoder())

    def test_for_multiple_choice(self):
        self.model_tester.create_and_check_for_multiple_choice(*self.model_tester.prepare_config_and_inputs())

    def test_for_next_sequence_prediction(self):
        self.model_tester.create_and_check_for_next_sequence_prediction(*self.model_tester.prepare_config_and_inputs())

    def test_for_pretraining(self):
        self.model_tester.create_and_check_for_pretraining(*self.model_tester.prepare_config_and_inputs())

    def test_for_question_answering(self):
        self.model_tester.create_and_check_for_question_answering(*self.model_tester.prepare_config_and_inputs())

    def test_for_sequence_classification(self):
        self.model_tester.create_and_check_for_sequence_classification(*self.model_tester.prepare_config_and_inputs())

    def test_for_token_classification(self):
        self.model_tester.create_and_check_for_token_classification(*self.model_tester.prepare_config_and_inputs())

    def test_training_step_matches_pristine_shapes(self):
        """One optimizer step of BertForMaskedLM in train mode (dropout on): finite loss, every
        parameter with a gradient gets one."""
        config, input_ids, token_type_ids, input_mask, _, token_labels, _ = self.model_tester.prepare_config_and_inputs()
        model = BertForMaskedLM(config).to(torch_device).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=token_labels).loss
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None
                   and "pooler" not in n]
        self.assertEqual(missing, [])
        opt.step()
        self.assertTrue(torch.isfinite(loss))
