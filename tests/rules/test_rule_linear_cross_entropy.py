"""The ``linear_cross_entropy`` rule (issue 12): fixtures, the rewrite, the guarded kernel (fused vs
original, every run-time guard), the chunked op against eager forward and backward (fp32, bf16, odd
shapes, ignore_index, num_items_in_batch, shift_labels), its memory, its triton per-chunk step under
``TRITON_INTERPRET=1``, and a rewritten tiny Llama against the original (loss, every gradient,
eval logits)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import adopter.kernels.guarded_linear_cross_entropy as guarded_lce
import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls
from adopter.kernels.guarded_linear_cross_entropy import (
    KEEP_LOGITS_ENV,
    LogitsNotComputedWarning,
    keep_logits,
    linear_cross_entropy,
)
from adopter.kernels.ops.linear_cross_entropy import chunk_rows, linear_cross_entropy_sum
from adopter.rewrite import rewrite_source
from adopter.rewrite.loader import load_rewritten_module
from adopter.rewrite.scripting import python_view
from torch import nn

from adopter.core.rules.linear_cross_entropy import NOTE, RULE
from adopter.core.scan import scan_paths, scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "linear_cross_entropy"
TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

# ---------------------------------------------------------------- static: fixtures and the rewrite


def _expected(path: Path) -> Counter:
    out = Counter()
    for line in path.read_text().splitlines():
        if line.startswith("# expect:"):
            rule, where, *status = line[len("# expect:"):].split()
            out[(rule, where, *status)] += 1
    return out


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.py")), ids=lambda p: p.name)
def test_fixture(path):
    report = scan_paths([path], [RULE])
    assert report.errors == []
    found = Counter((m.rule, f"{m.class_name}.{m.function}", *(() if m.status == "static" else
                                                                (f"{m.status}:{m.code}",))) for m in report.matches)
    assert found == _expected(path)


def test_refusals_say_why():
    report = scan_paths([FIXTURES / "refused.py"], [RULE])
    reasons = {m.class_name: m.reason for m in report.matches}
    assert "logits = logits / self.config.final_logit_softcapping" in reasons["SoftcapForCausalLM"]
    assert "logits = logits * self.logit_scale" in reasons["LogitScaleForCausalLM"]
    assert "in place" in reasons["InPlaceMaskForCausalLM"]
    assert "logits.logsumexp" in reasons["ZLossForCausalLM"]
    assert "beside its logits argument" in reasons["VocabFromLogitsForCausalLM"]
    assert "logits.argmax" in reasons["ReadsLogitsForCausalLM"]


def test_rewrite_of_fixture_sites():
    text = (FIXTURES / "positive.py").read_text()
    matches = scan_source(text, "positive.py", [RULE])
    result = rewrite_source(text, matches, filename="positive.py", rules=[RULE])
    assert result.error == "" and result.skipped == [] and len(result.applied) == 4
    new = python_view(result.new_text)
    assert "from adopter.kernels import linear_cross_entropy" in new
    assert new.count(f"# {NOTE}") == 4  # the diff says where logits are not returned
    # self.loss_function read only with labels, as the source reads it
    read = "self.loss_function if labels is not None else None"
    assert f"self.lm_head, hidden_states, {read}, labels=labels, vocab_size=self.config.vocab_size, " \
           "**kwargs" in new
    assert f"self.lm_head, hidden_states[:, slice_indices, :], {read}, labels=labels" in new
    assert f"self.lm_head, hidden_states, {read}, labels, self.vocab_size, **kwargs" in new
    assert "self.lm_head(" not in new and "loss = None" not in new
    assert "output = (logits, hidden_states)" in new  # the packed return stays
    compile(new, "positive.py", "exec")


def test_rewrite_skips_shapes_it_cannot_join():
    text = '''
import torch
from torch import nn


class Unguarded(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden_states, labels, **kwargs):
        logits = self.lm_head(hidden_states)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return loss, logits
'''
    matches = scan_source(text, "m.py", [RULE])
    assert [m.status for m in matches] == ["static"]
    result = rewrite_source(text, matches, filename="m.py", rules=[RULE])
    assert not result.applied and "is not None" in result.skipped[0].reason


# ---------------------------------------------------------------- the op against eager


def _eager_loss(h, weight, bias, labels, **loss_kwargs):
    return ForCausalLMLoss(F.linear(h, weight, bias), labels, weight.shape[0], **loss_kwargs)


def _grads(fn, tensors):
    for t in tensors:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() if t.grad is not None else None for t in tensors]


def _inputs(batch, seq, hidden, vocab, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return h, w, b, labels


def _fused(h, w, b, labels, chunk=None, ignore_index=-100, num_items_in_batch=None, shift_labels=None):
    """ForCausalLMLoss's reduction on the fused sum (what the guarded kernel does)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    s, n = linear_cross_entropy_sum(h, w, b, shift_labels, ignore_index=ignore_index, chunk=chunk)
    return s / n if num_items_in_batch is None else s / num_items_in_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_op_matches_eager_forward_and_backward(dtype, chunk):
    h, w, b, labels = _inputs(3, 11, 24, 97, dtype)
    labels[0, :4] = -100  # prompt tokens masked out
    params = [h, w, b]
    ref, ref_g = _grads(lambda: _eager_loss(h, w, b, labels), params)
    out, out_g = _grads(lambda: _fused(h, w, b, labels, chunk=chunk), params)
    assert out.dtype == torch.float32 == ref.dtype  # fp32 loss, as ForCausalLMLoss upcasts
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, e in zip(out_g, ref_g):
        assert a.dtype == e.dtype == dtype
        torch.testing.assert_close(a.float(), e.float(), **TOL[dtype])


@pytest.mark.parametrize("n_items", [5, "tensor"])
def test_op_sum_over_num_items_in_batch_and_scaled_grad_output(n_items):
    h, w, b, labels = _inputs(2, 9, 16, 53, torch.float32, bias=False)
    n = torch.tensor(5) if n_items == "tensor" else n_items
    params = [h, w]
    ref, ref_g = _grads(lambda: 3.0 * _eager_loss(h, w, None, labels, num_items_in_batch=n), params)
    out, out_g = _grads(lambda: 3.0 * _fused(h, w, None, labels, num_items_in_batch=n, chunk=4), params)
    torch.testing.assert_close(out, ref)
    for a, e in zip(out_g, ref_g):
        torch.testing.assert_close(a, e, **TOL[torch.float32])


def test_op_ignore_index_and_shift_labels():
    h, w, b, labels = _inputs(2, 8, 16, 41, torch.float32)
    shift = torch.randint(0, 41, (2, 8))
    shift[1, 2:5] = 7
    params = [h, w, b]
    kw = {"ignore_index": 7, "shift_labels": shift}
    ref, ref_g = _grads(lambda: _eager_loss(h, w, b, labels, **kw), params)
    out, out_g = _grads(lambda: _fused(h, w, b, labels, chunk=3, **kw), params)
    torch.testing.assert_close(out, ref)
    for a, e in zip(out_g, ref_g):
        torch.testing.assert_close(a, e, **TOL[torch.float32])


def test_op_all_tokens_ignored_is_nan_with_zero_grads_as_eager():
    h, w, b, labels = _inputs(1, 5, 8, 13, torch.float32)
    labels[:] = -100
    ref, ref_g = _grads(lambda: _eager_loss(h, w, b, labels), [h, w, b])
    out, out_g = _grads(lambda: _fused(h, w, b, labels), [h, w, b])
    assert ref.isnan() and out.isnan()
    for a, e in zip(out_g, ref_g):
        torch.testing.assert_close(a, e)


def test_op_frozen_head_and_autocast():
    h, w, b, labels = _inputs(2, 6, 16, 29, torch.float32)
    w.requires_grad_(False)
    b.requires_grad_(False)
    ref, (ref_h,) = _grads(lambda: _eager_loss(h, w, b, labels), [h])
    out, (out_h,) = _grads(lambda: _fused(h, w, b, labels), [h])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out_h, ref_h, **TOL[torch.float32])
    w.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the head runs in bf16, the loss in fp32
        ref, ref_g = _grads(lambda: _eager_loss(h, w, b, labels), [h, w])
        out, out_g = _grads(lambda: _fused(h, w, b, labels), [h, w])
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
    for a, e in zip(out_g, ref_g):
        assert a.dtype == e.dtype == torch.float32
        torch.testing.assert_close(a, e, **TOL[torch.bfloat16])


def test_chunk_rows_budget():
    assert chunk_rows(2048, 32000) == 262  # 32 MiB of fp32 logits
    assert chunk_rows(10, 32000) == 10 and chunk_rows(5000, 10**7) == 16


def _cpu_peak(step) -> int:
    from adopter.verification.benchmark import _cpu_allocator_peak

    return _cpu_allocator_peak(step)


def test_op_peak_memory_is_a_fraction_of_eager():
    h, w, _, labels = _inputs(2, 256, 32, 8000, torch.float32, bias=False)

    def eager():
        _grads(lambda: _eager_loss(h, w, None, labels), [h, w])

    def fused():
        _grads(lambda: _fused(h, w, None, labels, chunk=64), [h, w])

    logits_bytes = 512 * 8000 * 4
    eager_peak, fused_peak = _cpu_peak(eager), _cpu_peak(fused)
    assert eager_peak > 2 * logits_bytes  # logits and their log-softmax
    assert fused_peak < logits_bytes  # no full logits, ever


# ---------------------------------------------------------------- the guarded kernel


class _Model(nn.Module):
    """What a rewritten causal LM holds: a head and transformers' loss function."""

    def __init__(self, hidden=16, vocab=37, bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)
        self.loss_function = ForCausalLMLoss
        self.vocab_size = vocab


def _site(model, h, labels, vocab_size=None, **kwargs):
    return linear_cross_entropy(model.lm_head, h, model.loss_function, labels=labels,
                                vocab_size=vocab_size or model.vocab_size, **kwargs)


def _backends(calls):
    return [(c.backend, c.reason) for c in calls.calls if c.kernel == "linear_cross_entropy"]


def test_guard_fused_in_training_returns_no_logits_same_loss_and_grads():
    model = _Model(bias=True)
    h = torch.randn(2, 7, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 7))
    params = [h, model.lm_head.weight, model.lm_head.bias]
    ref, ref_g = _grads(lambda: ForCausalLMLoss(model.lm_head(h), labels, 37, num_items_in_batch=9), params)
    with count_kernel_calls() as calls:
        logits, loss = _site(model, h, labels, num_items_in_batch=9)
    assert logits is None and _backends(calls) == [("torch", "")]
    out, out_g = _grads(lambda: _site(model, h, labels, num_items_in_batch=9)[1], params)
    torch.testing.assert_close(out, ref)
    for a, e in zip(out_g, ref_g):
        torch.testing.assert_close(a, e, **TOL[torch.float32])


def test_guard_positional_spelling():
    model = _Model()
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 5))
    logits, loss = linear_cross_entropy(model.lm_head, h, model.loss_function, labels, model.vocab_size)
    assert logits is None
    torch.testing.assert_close(loss, ForCausalLMLoss(model.lm_head(h), labels, 37))


def _custom_loss(logits, labels, vocab_size, **kwargs):
    return logits.float().logsumexp(-1).mean()


@pytest.mark.parametrize("case, reason", [
    ("no labels", "no labels"),
    ("eval", "eval mode"),
    ("no_grad", "grad disabled"),
    ("hook", "has hooks"),
    ("custom loss", "not transformers' ForCausalLMLoss"),
    ("extra kwarg", "does not implement: output_router_logits"),
    ("vocab mismatch", "vocab_size 36"),
    ("env", KEEP_LOGITS_ENV),
    ("context", "keep_logits()"),
])
def test_guard_falls_back_to_the_original_computation(case, reason, monkeypatch):
    model = _Model()
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = None if case == "no labels" else torch.randint(0, 36, (2, 5))
    kwargs, vocab = {}, model.vocab_size
    if case == "eval":
        model.eval()
    if case == "hook":
        model.lm_head.register_forward_hook(lambda *a: None)
    if case == "custom loss":
        model.loss_function = _custom_loss
    if case == "extra kwarg":
        # a transformers whose loss reads keywords it does not name (the installed one drops them)
        monkeypatch.setattr(guarded_lce, "_extra_keywords_ignored", lambda: False)
        kwargs["output_router_logits"] = True
    if case == "vocab mismatch":
        vocab = 36
    if case == "env":
        monkeypatch.setenv(KEEP_LOGITS_ENV, "1")
    grad = torch.no_grad() if case == "no_grad" else torch.enable_grad()
    keep = keep_logits() if case == "context" else contextlib.nullcontext()
    with grad, keep, count_kernel_calls() as calls:
        if case == "vocab mismatch":  # the original computation raises, and so does the site
            with pytest.raises(RuntimeError, match="invalid for input"):
                _site(model, h, labels, vocab_size=vocab)
        else:
            logits, loss = linear_cross_entropy(model.lm_head, h, model.loss_function, labels=labels,
                                                vocab_size=vocab, **kwargs)
    ((backend, why),) = _backends(calls)
    assert backend == "original" and reason in why
    if case == "vocab mismatch":
        return
    torch.testing.assert_close(logits, model.lm_head(h))  # the original computation, logits returned
    if labels is None:
        assert loss is None
    else:
        torch.testing.assert_close(loss, model.loss_function(model.lm_head(h), labels, vocab, **kwargs))


def test_guard_under_fx_trace_keeps_the_users_head():
    model = _Model()

    class Site(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = model.lm_head

        def forward(self, h, labels):
            return linear_cross_entropy(self.lm_head, h, ForCausalLMLoss, labels=labels, vocab_size=37)

    graph = torch.fx.symbolic_trace(Site()).graph
    assert any(n.op == "call_module" and n.target == "lm_head" for n in graph.nodes)


@pytest.mark.slow  # a fresh interpreter importing torch
def test_importing_kernels_needs_neither_triton_nor_transformers():
    code = ("import sys; import adopter.kernels as k; k.linear_cross_entropy; "
            "import adopter.kernels.ops.linear_cross_entropy; "
            "assert 'triton' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------- triton per-chunk step (interpreter)

_TRITON_CHILD = os.environ.get("ADOPTER_LCE_TRITON_CHILD") == "1"


@pytest.mark.slow
def test_triton_softmax_grad_in_fresh_interpreter_process():
    """Runs the ``triton_child`` tests with TRITON_INTERPRET=1 set before triton is imported."""
    pytest.importorskip("triton")
    if _TRITON_CHILD:
        pytest.skip("this is the child")
    env = dict(os.environ, TRITON_INTERPRET="1", ADOPTER_LCE_TRITON_CHILD="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "triton_child",
                           __file__], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.skipif(not _TRITON_CHILD, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 5000])  # one block, several blocks with a ragged tail
def test_triton_child_matches_eager(dtype, vocab, monkeypatch):
    from adopter.kernels import backend

    monkeypatch.setenv(backend.ENV_VAR, "triton")
    h, w, b, labels = _inputs(2, 5, 16, vocab, dtype)
    labels[1, :2] = -100
    params = [h, w, b]
    ref, ref_g = _grads(lambda: _eager_loss(h, w, b, labels), params)
    out, out_g = _grads(lambda: _fused(h, w, b, labels, chunk=3), params)
    assert backend.last_backend() == "triton"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, e in zip(out_g, ref_g):
        torch.testing.assert_close(a.float(), e.float(), **TOL[dtype])


# ---------------------------------------------------------------- a rewritten tiny Llama


def _llama_classes():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    text = Path(modeling_llama.__file__).read_text()
    matches = [m for m in scan_source(text, modeling_llama.__file__, [RULE]) if m.status == "static"]
    assert [m.class_name for m in matches] == ["LlamaForCausalLM"]
    result = rewrite_source(text, matches, filename=modeling_llama.__file__, rules=[RULE])
    assert len(result.applied) == 1 and "linear_cross_entropy(" in result.new_text
    rewritten = load_rewritten_module(modeling_llama, result.new_text)
    config = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    return modeling_llama.LlamaForCausalLM, rewritten.LlamaForCausalLM, config


@pytest.mark.slow
def test_rewritten_llama_same_loss_gradients_and_eval_logits():
    original_cls, rewritten_cls, config = _llama_classes()
    torch.manual_seed(0)
    original = original_cls(config)
    rewritten = rewritten_cls(config)
    rewritten.load_state_dict(original.state_dict())
    ids = torch.randint(0, 1000, (2, 13))
    labels = ids.clone()
    labels[0, :4] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(17)}):
        grads = []
        for model in (original, rewritten):
            model.train()
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, **kwargs)
            out.loss.backward()
            grads.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
        (ref, ref_g), (new, new_g) = grads
        assert ref.logits is not None and new.logits is None  # the documented difference
        torch.testing.assert_close(new.loss, ref.loss, atol=1e-6, rtol=1e-6)
        assert ref_g.keys() == new_g.keys()
        for name in ref_g:
            torch.testing.assert_close(new_g[name], ref_g[name], atol=1e-6, rtol=1e-5, msg=name)
    with keep_logits():
        kept = rewritten(input_ids=ids, labels=labels)
    torch.testing.assert_close(kept.logits, original(input_ids=ids, labels=labels).logits)
    original.eval()
    rewritten.eval()
    with torch.no_grad():
        ref, new = original(input_ids=ids, labels=labels), rewritten(input_ids=ids, labels=labels)
        torch.testing.assert_close(new.logits, ref.logits)
        torch.testing.assert_close(new.loss, ref.loss)
        torch.testing.assert_close(rewritten(input_ids=ids).logits, original(input_ids=ids).logits)


def test_lazy_export_is_the_guarded_kernel():
    from adopter import kernels

    assert kernels.linear_cross_entropy is linear_cross_entropy


# ---------------------------------------------------------------- logits=None cannot be missed (issue 21, item 4)


def _dropping_calls(model, h, labels, n=2):
    """``n`` fused training calls of ``_site``, with the LogitsNotComputedWarnings they issued."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [_site(model, h, labels) for _ in range(n)]
    assert all(logits is None for logits, _ in outs)
    return [w for w in caught if issubclass(w.category, LogitsNotComputedWarning)]


def test_dropped_logits_warn_once_per_model_naming_the_site_and_the_opt_out():
    from adopter import kernels

    assert issubclass(LogitsNotComputedWarning, UserWarning)
    assert kernels.LogitsNotComputedWarning is LogitsNotComputedWarning and kernels.keep_logits is keep_logits
    model = _Model()
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 5))
    (warning,) = _dropping_calls(model, h, labels)  # the first call only
    text = str(warning.message)
    # the site: the function that called the kernel (here the test's _site), where it calls it
    site_line = _site.__code__.co_firstlineno + 1
    assert f"{Path(__file__).name}:{site_line} (_site)" in text
    assert warning.filename == __file__ and warning.lineno == site_line  # attributed to that line
    assert "logits=None" in text and "training with labels" in text
    assert f"{KEEP_LOGITS_ENV}=1" in text and "adopter.kernels.keep_logits()" in text
    assert _dropping_calls(model, h, labels) == []  # once per model
    assert len(_dropping_calls(_Model(), h, labels)) == 1  # another model: warned again


def test_calls_that_return_the_logits_do_not_warn():
    import warnings

    model = _Model()
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LogitsNotComputedWarning)
        assert _site(model, h, None)[0] is not None
        with keep_logits():
            assert _site(model, h, labels)[0] is not None
        with torch.no_grad():
            assert _site(model, h, labels)[0] is not None
        model.eval()
        assert _site(model, h, labels)[0] is not None
    model.train()
    assert len(_dropping_calls(model, h, labels)) == 1  # the first call that drops them warns


def test_dropped_logits_warning_under_torch_compile_breaks_no_graph():
    """Issued while dynamo traces the call (once), not in the graph: no graph break, and it still
    names the rewritten site."""
    import warnings

    class Site(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _Model()

        def forward(self, h, labels):
            return _site(self.inner, h, labels)

    model = Site()
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 5))
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(Site())(h, labels)
        assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert compiled(h, labels)[0] is None and compiled(h, labels)[0] is None
    finally:
        torch._dynamo.reset()
    (warning,) = [w for w in caught if issubclass(w.category, LogitsNotComputedWarning)]
    assert f"{Path(__file__).name}:{_site.__code__.co_firstlineno + 1} (_site)" in str(warning.message)


def test_optimize_report_and_rewrite_summary_say_training_calls_return_no_logits(tmp_path, capsys):
    import json

    from adopter.cli import main
    from adopter.optimizing.optimize import AppliedRewrite, OptimizeReport

    report = OptimizeReport(model_class="m.LlamaForCausalLM", applied=[
        AppliedRewrite("linear_cross_entropy", "/x/modeling_llama.py", [468], "LlamaForCausalLM", "forward",
                       "confirmed"),
        AppliedRewrite("RMSNorm", "/x/modeling_llama.py", [64], "LlamaRMSNorm", "forward", "confirmed"),
    ])
    for text in (str(report), report.summary()):
        (note,) = [line for line in text.splitlines() if "logits=None" in line]  # not at the RMSNorm site
        assert "note: linear_cross_entropy at modeling_llama.py:468 (LlamaForCausalLM.forward)" in note
        assert "training with labels" in note and f"{KEEP_LOGITS_ENV}=1" in note and "keep_logits()" in note
    path = tmp_path / "positive.py"
    path.write_text((FIXTURES / "positive.py").read_text())
    assert main(["rewrite", "--jobs", "1", "--rules", "linear_cross_entropy", str(path)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 4  # one per rewritten site: the comment the rewrite leaves on its line
    assert all(n.endswith(NOTE.removeprefix("adopter: ")) for n in notes)
    assert "logits None when training with labels" in NOTE and f"{KEEP_LOGITS_ENV}=1 keeps them" in NOTE
    assert main(["rewrite", "--jobs", "1", "--rules", "linear_cross_entropy", "--format", "json", str(path)]) == 0
    assert len(json.loads(capsys.readouterr().out)["notes"]) == 4
    # under --write, at the line of the file written
    assert main(["rewrite", "--write", "--jobs", "1", "--rules", "linear_cross_entropy", str(path)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    written = path.read_text().splitlines()
    for note in notes:
        number = int(note.removeprefix(f"note: {path}:").split(":", 1)[0])
        assert f"# {NOTE}" in written[number - 1]


@pytest.mark.slow
def test_rewritten_llama_warns_at_its_forward_and_keeps_the_output_contract():
    import linecache
    import warnings

    _, rewritten_cls, config = _llama_classes()
    torch.manual_seed(0)
    model = rewritten_cls(config).train()
    ids = torch.randint(0, 1000, (2, 9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids, labels=ids)
    (warning,) = [w for w in caught if issubclass(w.category, LogitsNotComputedWarning)]
    # rewritten in memory: the file and function (lines are the rewritten source's, which the
    # warning's location shows: the loader puts it in linecache)
    assert "at modeling_llama.py (LlamaForCausalLM.forward)" in str(warning.message)
    assert os.path.basename(warning.filename).startswith("modeling_llama.py<adopter")
    assert "linear_cross_entropy(" in linecache.getline(warning.filename, warning.lineno)
    # what transformers' output contract lets callers do still works: logits is Optional there
    assert out.logits is None and out[0] is out.loss and out.to_tuple()[0] is out.loss
    assert "logits" not in out.keys()
    out.loss.backward()



def test_keywords_the_loss_ignores_keep_the_fused_path():
    # PEFT's causal-LM wrapper passes output_attentions=None and Llama hands it on to the loss:
    # transformers' ForCausalLMLoss drops it (its bytecode never reads it), so the kernel may too
    assert guarded_lce._extra_keywords_ignored()
    model = _Model()
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 36, (2, 5))
    with count_kernel_calls() as calls:
        _, loss = linear_cross_entropy(model.lm_head, h, model.loss_function, labels=labels,
                                       vocab_size=model.vocab_size, output_attentions=None)
    ((backend, _),) = _backends(calls)
    assert backend != "original"
    torch.testing.assert_close(loss, model.loss_function(model.lm_head(h), labels, model.vocab_size))
