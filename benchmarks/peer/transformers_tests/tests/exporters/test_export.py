"""Stand-in for transformers' ``tests/exporters/test_export.py`` (not in the sdist), written for the
peer suite (``benchmarks/bench_peer_suites.py``): ``tests/test_modeling_common.py`` makes
``ModelTesterMixin`` a subclass of ``ExportTesterMixin``.

Our own export tests: ``torch.export.export`` (non-strict, as transformers exports) of every model
class of a tester in eval mode, without the KV cache, and the exported program's outputs equal
to eager ones; and ``torch.compile`` (the default inductor backend would need a C compiler per
graph on CPU: ``aot_eager`` traces through dynamo and AOT autograd, which is where a rewritten
kernel's guards and custom autograd functions meet the compiler) of the base model and the first
head giving eager's outputs; and one training step of the first head (labels, dropout off) under
``torch.compile(backend="aot_eager")`` giving eager's loss and gradients (transformers' own
``test_torch_compile_for_training`` needs an accelerator).
``test_torch_exportable = False`` on a tester skips both.
"""

from __future__ import annotations

import torch
from transformers.testing_utils import torch_device

_DROPOUT_ATTRIBUTES = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "hidden_dropout",
                       "resid_pdrop", "attn_pdrop", "embd_pdrop", "summary_first_dropout", "dropout_rate",
                       "classifier_dropout", "dropout")


def _tensors(value, prefix="out"):
    """(name, tensor) pairs of a model output, nested tuples / ModelOutput / caches flattened."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif hasattr(value, "to_tuple"):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}")


class ExportTesterMixin:
    test_torch_exportable = True

    def _export_cases(self, limit=None):
        if not self.test_torch_exportable:
            self.skipTest("test_torch_exportable is False")
        for model_class in self.all_model_classes[:limit]:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            if hasattr(config, "use_cache"):
                config.use_cache = False
            model = model_class(config).to(torch_device).eval()
            inputs = self._prepare_for_class(inputs, model_class)
            yield model_class, model, inputs

    def _assert_same_outputs(self, model_class, eager, other):
        expected = dict(_tensors(eager))
        got = dict(_tensors(other))
        self.assertTrue(expected, f"{model_class.__name__}: no tensor output")
        for name, tensor in expected.items():
            self.assertIn(name, got, f"{model_class.__name__}: {name} missing")
            torch.testing.assert_close(got[name], tensor, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=f"{model_class.__name__} {name}": f"{n}: {m}")

    def test_torch_export(self):
        for model_class, model, inputs in self._export_cases():
            with torch.no_grad():
                eager = model(**inputs)
                program = torch.export.export(model, args=(), kwargs=inputs, strict=False)
                exported = program.module()(**inputs)
            self._assert_same_outputs(model_class, eager, exported)

    def test_torch_compile_aot_eager(self):
        # the base model and the first head: compiling is the slowest test of a tester
        for model_class, model, inputs in self._export_cases(limit=2):
            torch._dynamo.reset()
            with torch.no_grad():
                eager = model(**inputs)
                compiled = torch.compile(model, backend="aot_eager")(**inputs)
            self._assert_same_outputs(model_class, eager, compiled)

    def test_torch_compile_aot_eager_training(self):
        if not self.test_torch_exportable:
            self.skipTest("test_torch_exportable is False")
        heads = self.all_model_classes[1:2] or self.all_model_classes[:1]
        for model_class in heads:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            for name in _DROPOUT_ATTRIBUTES:
                if isinstance(getattr(config, name, None), float):
                    setattr(config, name, 0.0)
            if hasattr(config, "use_cache"):
                config.use_cache = False
            torch.manual_seed(0)
            model = model_class(config).to(torch_device).train()
            inputs = self._prepare_for_class(inputs, model_class, return_labels=True)
            loss = model(**inputs).loss
            if loss is None:
                self.skipTest(f"{model_class.__name__} returns no loss")
            loss.backward()
            eager_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            compiled_loss = torch.compile(model, backend="aot_eager")(**inputs).loss
            compiled_loss.backward()
            torch.testing.assert_close(compiled_loss, loss, atol=1e-5, rtol=1e-4)
            for name, grad in eager_grads.items():
                param = dict(model.named_parameters())[name]
                self.assertIsNotNone(param.grad, f"{model_class.__name__} {name}: no gradient under torch.compile")
                torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-4,
                                           msg=lambda m, n=f"{model_class.__name__} {name}": f"{n}: {m}")
