"""ViT through transformers' common test mixins (peer suite, ``benchmarks/bench_peer_suites.py``).

Our own tester, in the style of transformers' ``tests/models/vit/test_modeling_vit.py``: a tiny
config (30x30 images, 2x2 patches, 2 layers, hidden 32), the model, image classification
(greyscale too), masked image modeling, position-embedding interpolation;
``ModelTesterMixin`` + the export stand-in."""

import unittest

import torch
from transformers import ViTConfig, ViTForImageClassification, ViTForMaskedImageModeling, ViTModel
from transformers.testing_utils import require_torch, torch_device

from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor


class ViTModelTester:
    def __init__(self, parent, batch_size=13, image_size=30, patch_size=2, num_channels=3, is_training=True,
                 use_labels=True, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 type_sequence_label_size=10, initializer_range=0.02, encoder_stride=2, mask_ratio=0.5,
                 attn_implementation="eager"):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.is_training = is_training
        self.use_labels = use_labels
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.type_sequence_label_size = type_sequence_label_size
        self.initializer_range = initializer_range
        self.encoder_stride = encoder_stride
        self.attn_implementation = attn_implementation
        num_patches = (image_size // patch_size) ** 2
        self.seq_length = num_patches + 1  # the [CLS] token
        self.mask_ratio = mask_ratio
        self.num_masks = int(mask_ratio * self.seq_length)
        self.mask_length = num_patches

    def get_config(self):
        return ViTConfig(
            image_size=self.image_size, patch_size=self.patch_size, num_channels=self.num_channels,
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act, hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob, is_decoder=False,
            initializer_range=self.initializer_range, encoder_stride=self.encoder_stride,
            attn_implementation=self.attn_implementation,
        )

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        labels = ids_tensor([self.batch_size], self.type_sequence_label_size) if self.use_labels else None
        return self.get_config(), pixel_values, labels

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values, _ = self.prepare_config_and_inputs()
        return config, {"pixel_values": pixel_values}

    def create_and_check_model(self, config, pixel_values, labels):
        model = ViTModel(config).to(torch_device).eval()
        result = model(pixel_values)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_for_masked_image_modeling(self, config, pixel_values, labels):
        model = ViTForMaskedImageModeling(config).to(torch_device).eval()
        result = model(pixel_values)
        self.parent.assertEqual(result.reconstruction.shape,
                                (self.batch_size, self.num_channels, self.image_size, self.image_size))
        config.num_channels = 1
        model = ViTForMaskedImageModeling(config).to(torch_device).eval()
        pixel_values = floats_tensor([self.batch_size, 1, self.image_size, self.image_size])
        result = model(pixel_values)
        self.parent.assertEqual(result.reconstruction.shape, (self.batch_size, 1, self.image_size, self.image_size))

    def create_and_check_for_image_classification(self, config, pixel_values, labels):
        config.num_labels = self.type_sequence_label_size
        model = ViTForImageClassification(config).to(torch_device).eval()
        result = model(pixel_values, labels=labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.type_sequence_label_size))
        config.num_channels = 1
        model = ViTForImageClassification(config).to(torch_device).eval()
        pixel_values = floats_tensor([self.batch_size, 1, self.image_size, self.image_size])
        result = model(pixel_values)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.type_sequence_label_size))


@require_torch
class ViTModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (ViTModel, ViTForImageClassification, ViTForMaskedImageModeling)
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = ViTModelTester(self)
        self.config_tester = ConfigTester(self, config_class=ViTConfig, has_text_modality=False, hidden_size=37)

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip(reason="ViT does not use inputs_embeds")
    def test_inputs_embeds(self):
        pass

    def test_model_get_set_embeddings(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), torch.nn.Module)
            x = model.get_output_embeddings()
            self.assertTrue(x is None or isinstance(x, torch.nn.Linear))

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_for_masked_image_modeling(self):
        self.model_tester.create_and_check_for_masked_image_modeling(*self.model_tester.prepare_config_and_inputs())

    def test_for_image_classification(self):
        self.model_tester.create_and_check_for_image_classification(*self.model_tester.prepare_config_and_inputs())

    def test_interpolate_pos_encoding(self):
        """A 40x40 image through a model configured for 30x30 (``interpolate_pos_encoding=True``)."""
        config, _, _ = self.model_tester.prepare_config_and_inputs()
        model = ViTModel(config).to(torch_device).eval()
        pixel_values = floats_tensor([2, 3, 40, 40])
        with torch.no_grad():
            out = model(pixel_values, interpolate_pos_encoding=True)
        self.assertEqual(out.last_hidden_state.shape, (2, (40 // 2) ** 2 + 1, self.model_tester.hidden_size))

    def test_eager_matches_sdpa_outputs(self):
        """The same weights under eager and SDPA attention give the same outputs (dropout off)."""
        config, pixel_values, _ = self.model_tester.prepare_config_and_inputs()
        eager = ViTModel(config).to(torch_device).eval()
        config_sdpa = self.model_tester.get_config()
        config_sdpa._attn_implementation = "sdpa"
        sdpa = ViTModel(config_sdpa).to(torch_device).eval()
        sdpa.load_state_dict(eager.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(sdpa(pixel_values).last_hidden_state, eager(pixel_values).last_hidden_state,
                                       atol=1e-5, rtol=1e-5)
