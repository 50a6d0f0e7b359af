"""torch.compile over optimized models (issue 21, item 5): no graph break inside ``adopter.kernels``
and the compiled optimized model computes what the eager optimized model computes, forward and
backward, in training with labels.

The LLM rule pack's guarded kernels one by one (fast: every form of ``rms_norm``, ``gated_mlp``,
``rotary`` with a ``rotate_half`` never probed before, ``linear_cross_entropy`` fused and falling
back, the guards that must be re-evaluated after compilation: ``keep_logits()``, a ``rotate_half``
patched in later), then whole optimized models built from the shipped configs
(``adopter/configs/``, shrunk): llama-tiny, qwen3-tiny, gemma-tiny, tiny-bert and a torchvision-style
CNN with Conv+BN pairs in eval mode (slow). Graph breaks are counted with
``torch._dynamo.explain``; the originals of these models compile to one graph, and so must the
optimized ones. Dynamo with the ``aot_eager`` backend (AOT autograd over the captured graph: the
custom ops' fake and autograd registrations are exercised; inductor would need a C++ toolchain and
minutes of CPU).
"""
from __future__ import annotations

import os
import types

import adopter.kernels
import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import backend
from adopter.kernels.guarded_gated_mlp import gated_mlp
from adopter.kernels.guarded_linear_cross_entropy import (
    KEEP_LOGITS_ENV,
    LogitsNotComputedWarning,
    keep_logits,
    linear_cross_entropy,
)
from adopter.kernels.guarded_rms_norm import rms_norm
from adopter.kernels.guarded_rotary import rotary
from adopter.kernels.telemetry import count_kernel_calls
from torch import nn

# training with labels drops the logits, by design here (the warning has its own tests)
pytestmark = pytest.mark.filterwarnings(f"ignore::{LogitsNotComputedWarning.__module__}.LogitsNotComputedWarning")

KERNELS_DIR = os.path.dirname(os.path.abspath(adopter.kernels.__file__))
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.delenv(KEEP_LOGITS_ENV, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _in_kernels(filename: str) -> bool:
    return os.path.abspath(filename).startswith(KERNELS_DIR + os.sep)


def kernel_breaks(explanation) -> list[str]:
    """The graph breaks whose reason or user stack lies inside ``adopter.kernels``."""
    found = []
    for b in explanation.break_reasons:
        frames = [f for f in b.user_stack if _in_kernels(f.filename)]
        if frames or KERNELS_DIR in b.reason:
            where = ", ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames)
            found.append(f"{b.reason.splitlines()[0]} [{where}]")
    return found


def explain(fn, *args, **kwargs):
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    torch._dynamo.reset()
    return explanation


def graph_code(explanation) -> str:
    """The code of every captured graph, the bodies of higher-order ops (autograd Functions) included."""
    return "\n".join(m.code for g in explanation.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule))


def _grads(loss, wrt):
    return torch.autograd.grad(loss, wrt, allow_unused=True)


def assert_same(got, expected, atol=1e-5, rtol=1e-5, msg=""):
    assert len(got) == len(expected), msg
    for i, (a, e) in enumerate(zip(got, expected)):
        if a is None or e is None:
            assert a is None and e is None, f"{msg} #{i}"
            continue
        assert a.dtype == e.dtype, f"{msg} #{i}"
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=f"{msg} #{i}")


def compare_compiled(fn, make_inputs, wrt, atol=1e-6, rtol=1e-6):
    """``fn`` compiled (one graph: ``fullgraph=True``) against eager on the same inputs: outputs and
    the gradients of ``wrt(inputs)`` of a weighted sum of the floating outputs."""
    results = []
    for f in (fn, torch.compile(fn, backend=BACKEND, fullgraph=True)):
        inputs = make_inputs()
        out = f(*inputs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))]
        floats = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        gen = torch.Generator().manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in floats)
        results.append((outs, _grads(loss, wrt(inputs))))
    (outs, grads), (ref_outs, ref_grads) = results[1], results[0]
    assert_same(outs, ref_outs, atol, rtol, "outputs")
    assert_same(grads, ref_grads, atol, rtol, "gradients")


# ---------------------------------------------------------------- the kernels one by one


FORMS = {
    "llama": {},
    "olmo2": {"weight_before_cast": True},
    "gemma": {"offset": 1.0, "weight_before_cast": True, "weight_fp32": True},
    "t5": {"cast_to_half_weight": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_rms_norm_is_one_graph_and_matches_eager(form, dtype):
    weight = nn.Parameter(torch.randn(32).to(dtype))

    def fn(x):
        return rms_norm(x, weight, 1e-6, **FORMS[form])

    x = torch.randn(3, 5, 32).to(dtype).requires_grad_()
    explanation = explain(fn, x)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert "_fused_rms_norm" in graph_code(explanation)  # the fused kernel, in the graph
    compare_compiled(fn, lambda: (x.detach().clone().requires_grad_(),), lambda i: (i[0], weight))


@pytest.mark.parametrize("act", [nn.SiLU(), F.silu, nn.GELU(approximate="tanh"), nn.ReLU()])
def test_gated_mlp_is_one_graph_and_matches_eager(act):
    torch.manual_seed(0)
    gate, up, down = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False)

    def fn(x):
        return gated_mlp(gate, up, down, act, x)

    x = torch.randn(2, 5, 16, requires_grad=True)
    explanation = explain(fn, x)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    params = (gate.weight, up.weight, down.weight)
    compare_compiled(fn, lambda: (x.detach().clone().requires_grad_(),), lambda i: (i[0], *params))


def _fresh_rotate_half():
    """A ``rotate_half`` function object the kernel has never probed (its own code object)."""
    namespace = {"torch": torch}
    exec("def rotate_half(x):\n    h = x.shape[-1] // 2\n    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)\n",
         namespace)
    return namespace["rotate_half"]


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def test_rotary_probe_of_a_new_rotate_half_does_not_break_the_graph():
    rotate_half = _fresh_rotate_half()
    site = types.SimpleNamespace(rotate_half=rotate_half)

    def fn(x, cos, sin):
        return rotary(x, cos, sin, site.rotate_half)

    def inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(2, 3, 5, 8, generator=g).requires_grad_(), torch.randn(2, 1, 5, 8, generator=g),
                torch.randn(2, 1, 5, 8, generator=g))

    explanation = explain(fn, *inputs())
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert "addcmul" in graph_code(explanation)  # the fused rotation, not rotate_half's cat
    compare_compiled(fn, inputs, lambda i: (i[0],))


def test_rotary_recompiles_for_a_rotate_half_patched_in_after_compiling():
    """The probe runs while tracing; the compiled code is guarded on the function it probed, so an
    interleaved rotation patched in later is probed again and runs as written."""
    site = types.SimpleNamespace(rotate_half=_fresh_rotate_half())

    def fn(x, cos, sin):
        return rotary(x, cos, sin, site.rotate_half)

    x, cos, sin = torch.randn(2, 2, 4, 8), torch.randn(4, 8), torch.randn(4, 8)
    compiled = torch.compile(fn, backend=BACKEND)
    torch.testing.assert_close(compiled(x, cos, sin), x * cos + site.rotate_half(x) * sin)
    site.rotate_half = rotate_every_two
    torch.testing.assert_close(compiled(x, cos, sin), x * cos + rotate_every_two(x) * sin)


class _Head(nn.Module):
    """What a rewritten causal LM's forward does with its head and transformers' loss."""

    def __init__(self, hidden=16, vocab=37, bias=False):
        super().__init__()
        from transformers.loss.loss_utils import ForCausalLMLoss

        torch.manual_seed(0)
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)
        self.loss_function = ForCausalLMLoss
        self.vocab_size = vocab

    def forward(self, h, labels, **kwargs):
        return linear_cross_entropy(self.lm_head, h, self.loss_function, labels=labels, vocab_size=self.vocab_size,
                                    **kwargs)


def _lce_inputs(ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 37, (2, 9), generator=g)
    labels[0, :4] = ignore_index  # a prompt masked out: the eager op skips those rows (data-dependent)
    return h, labels


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": 11}, {"ignore_index": 5}])
def test_linear_cross_entropy_is_one_graph_and_matches_eager(bias, kwargs):
    pytest.importorskip("transformers")
    site = _Head(bias=bias)

    def fn(h, labels):
        return site(h, labels, **kwargs)

    def inputs():
        return _lce_inputs(kwargs.get("ignore_index", -100))

    explanation = explain(fn, *inputs())
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert "adopter.linear_cross_entropy" in graph_code(explanation)  # the chunked op, one node
    params = tuple(site.parameters())
    compare_compiled(lambda h, labels: fn(h, labels)[1], inputs, lambda i: (i[0], *params),
                     atol=2e-6, rtol=1e-5)


def test_linear_cross_entropy_one_graph_for_every_sequence_length():
    """With dynamic shapes the token count is symbolic: no specialization on it (the chunk size
    comes from the vocabulary), one graph for every length, each equal to eager."""
    pytest.importorskip("transformers")
    site = _Head()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(site, backend=count, dynamic=True)
    for seq in (5, 9, 40):
        h = torch.randn(2, seq, 16, requires_grad=True)
        labels = torch.randint(0, 37, (2, seq))
        labels[0, :3] = -100
        logits, loss = compiled(h, labels)
        assert logits is None
        ref = site(h, labels)[1]
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(_grads(loss, (h,))[0], _grads(ref, (h,))[0])
    assert len(graphs) == 1


def test_linear_cross_entropy_all_tokens_ignored_compiled_is_nan_with_zero_grads():
    pytest.importorskip("transformers")
    site = _Head()
    h, labels = _lce_inputs()
    labels[:] = -100
    compiled = torch.compile(site, backend=BACKEND, fullgraph=True)
    logits, loss = compiled(h, labels)
    assert logits is None and loss.isnan()
    for g in _grads(loss, (h, site.lm_head.weight)):
        assert torch.equal(g, torch.zeros_like(g))


def test_linear_cross_entropy_compiled_honours_keep_logits_and_eval():
    """What decides between fused and original is guarded: a ``keep_logits()`` block, eval mode
    and no_grad after compilation get the logits, as in eager."""
    pytest.importorskip("transformers")
    site = _Head()
    h, labels = _lce_inputs()
    compiled = torch.compile(site, backend=BACKEND)
    assert compiled(h, labels)[0] is None
    with keep_logits():
        logits, loss = compiled(h, labels)
    torch.testing.assert_close(logits, site.lm_head(h))
    assert compiled(h, labels)[0] is None
    with torch.no_grad():
        assert compiled(h, labels)[0] is not None
    site.eval()
    assert compiled(h, labels)[0] is not None


def test_keep_logits_env_is_read_when_compiling(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv(KEEP_LOGITS_ENV, "1")
    site = _Head()
    h, labels = _lce_inputs()
    explanation = explain(site, h, labels)
    assert explanation.graph_break_count == 0
    assert torch.compile(site, backend=BACKEND, fullgraph=True)(h, labels)[0] is not None


def test_fallbacks_and_telemetry_do_not_break_the_graph():
    """The original computation (a hooked head, an interleaved rotation, a ReLU MLP) is traced like
    the fused one; telemetry counts eager calls only, and counting adds no graph break."""
    pytest.importorskip("transformers")
    site = _Head()
    site.lm_head.register_forward_hook(lambda *a: None)
    gate, up, down = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)

    def fn(h, labels, cos, sin):
        logits, loss = site(h, labels)
        x = gated_mlp(gate, up, down, nn.ReLU(), h)
        r = rotary(x, cos, sin, rotate_every_two)
        return logits, loss, r

    h, labels = _lce_inputs()
    cos, sin = torch.randn(9, 16), torch.randn(9, 16)
    with count_kernel_calls() as counted:
        explanation = explain(fn, h, labels, cos, sin)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert counted.calls == []
    with count_kernel_calls() as counted:
        fn(h, labels, cos, sin)
    assert {c.kernel for c in counted.calls if not c.fused} == {"linear_cross_entropy", "gated_mlp", "rotary"}


# ---------------------------------------------------------------- optimized models, whole


LLM_CLASSES = {"llama-tiny": "LlamaForCausalLM", "qwen3-tiny": "Qwen3ForCausalLM", "gemma-tiny": "GemmaForCausalLM"}
SHRINK = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "vocab_size": 1000}


def _shipped_config(model_id: str, **overrides):
    from adopter.tracing.models import _config_from_dict

    from adopter.configs import load_config_dict

    data = load_config_dict(model_id)
    config = _config_from_dict(data)
    for key, value in overrides.items():
        setattr(config, key, value)
    if data.get("head_dim"):
        config.head_dim = config.hidden_size // config.num_attention_heads
    return config


_OPTIMIZED: dict = {}


def _optimized(name: str):
    """(original class, optimized class, config), optimized once per test session."""
    if name not in _OPTIMIZED:
        import transformers

        from adopter import optimize

        if name == "tiny-bert":
            cls, config = transformers.BertForSequenceClassification, _shipped_config("tiny-bert", vocab_size=1000)
        elif name == "cnn":
            from tests.fixtures.reach.tv_resnet import ResNet

            cls, config = ResNet, None
        else:
            cls, config = getattr(transformers, LLM_CLASSES[name]), _shipped_config(name, **SHRINK)
        if config is None:
            optimized = optimize(cls, example_inputs={"x": torch.randn(2, 3, 16, 16)})
        else:
            optimized = optimize(cls, config=config)
        _OPTIMIZED[name] = (cls, optimized, config)
    return _OPTIMIZED[name]


def _build(name: str):
    """A fresh optimized instance with the original's weights, and a function of the inputs giving
    the loss of one training step (labels for the language models; a sum for the CNN in eval)."""
    cls, optimized, config = _optimized(name)
    torch.manual_seed(0)
    if name == "cnn":
        original = cls()
        model = optimized()
        model.load_state_dict(original.state_dict())
        model.eval()  # Conv+BN fold: eval mode
        return model, {"x": torch.randn(2, 3, 16, 16, requires_grad=True)}
    original = cls(config)
    model = optimized(config)
    model.load_state_dict(original.state_dict())
    model.train()
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    if name == "tiny-bert":
        labels = torch.tensor([0, 1])
    else:
        labels = ids.clone()
        labels[-1, -3:] = -100
    return model, {"input_ids": ids, "labels": labels}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out.float().square().sum()


def _step(model, inputs, seed=0):
    inputs = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inputs.items()}
    torch.manual_seed(seed)  # the same dropout masks in both runs (tiny-bert trains with dropout)
    out = model(**inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    wrt = [*params, *[v for v in inputs.values() if v.requires_grad]]
    loss = _loss(out)
    grads = _grads(loss, wrt)
    return out, loss, grads


MODELS = ["llama-tiny", "qwen3-tiny", "gemma-tiny", "tiny-bert", "cnn"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_optimized_model_compiles_without_graph_breaks_and_matches_eager(name):
    if name != "cnn":
        pytest.importorskip("transformers")
    import adopter.kernels.guarded_rotary as guarded_rotary

    model, inputs = _build(name)
    applied = set(type(model).adopter_report.applied_rules)
    assert applied, type(model).adopter_report.summary()
    # as when a model is compiled before it ever ran: nothing probed or cached yet
    guarded_rotary._PROBED.clear()
    explanation = explain(model, **inputs)
    assert kernel_breaks(explanation) == []
    # the originals compile to one graph (checked when this test was written), so must these
    assert explanation.graph_break_count == 0, [b.reason.splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_count == 1
    code = graph_code(explanation)
    if "linear_cross_entropy" in applied:
        assert "adopter.linear_cross_entropy" in code  # the fused loss is what was compiled
    if "RMSNorm" in applied:
        assert "_fused_rms_norm" in code

    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)
    out, loss, grads = _step(model, inputs)
    out_c, loss_c, grads_c = _step(compiled, inputs)
    if "linear_cross_entropy" in applied:
        assert out.logits is None and out_c.logits is None  # fused in both
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5)
    names = [n for n, p in model.named_parameters() if p.requires_grad] + [k for k, v in inputs.items()
                                                                         if v.requires_grad]
    assert len(grads_c) == len(grads)
    for n, a, e in zip(names, grads_c, grads):
        if a is None or e is None:
            assert a is None and e is None, n
            continue
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4, msg=n)
    if name != "cnn":  # eval, no labels: the logits, compiled and eager
        model.eval()
        with torch.no_grad():
            ids = inputs["input_ids"]
            torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits,
                                       atol=1e-5, rtol=1e-4)
