"""Guarded rewrites: a rewritten class computes what the original computed for every config and
every instance its source can build; the fused path runs only where its preconditions hold at
run time, and the kernel-call counters show which path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import count_kernel_calls
from torch import nn

from adopter import kernels

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _per_call_fold_on(monkeypatch):
    # the per-call fold as a user switches it on (off by default: guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE)
    monkeypatch.setattr(kernels.guarded, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", 0.01)


def _calls(calls, kernel: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls.calls:
        if c.kernel == kernel:
            out[c.backend] = out.get(c.backend, 0) + c.count
    return out


# ---------------------------------------------------------------- the kernels' guards


@pytest.mark.parametrize(
    "activation, fused",
    [
        (nn.GELU(), True),
        (nn.GELU(approximate="tanh"), True),
        (F.gelu, True),
        (nn.ReLU(), False),
        (nn.SiLU(), False),
        (torch.tanh, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gelu_matches_the_modules_and_fuses_only_gelu(activation, fused, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(13, 7).to(dtype)
    x = torch.randn(3, 5, 13, dtype=dtype, requires_grad=True)
    expected = activation(linear(x))
    (gx_ref, gw_ref) = torch.autograd.grad(expected.float().square().sum(), (x, linear.weight))
    with count_kernel_calls() as calls:
        out = kernels.linear_gelu(linear, activation, x)
    (gx, gw) = torch.autograd.grad(out.float().square().sum(), (x, linear.weight))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(gw, gw_ref, **tol)
    counts = _calls(calls, "linear_gelu")
    assert counts == ({"torch": 1} if fused else {"original": 1})


def test_linear_gelu_functional_approximate_argument_is_passed_on():
    linear = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with count_kernel_calls() as calls:
        out = kernels.linear_gelu(linear, F.gelu, x, approximate="tanh")
    torch.testing.assert_close(out, F.gelu(linear(x), approximate="tanh"))
    assert _calls(calls, "linear_gelu") == {"torch": 1}


def test_transformers_gelu_classes_are_recognized_by_what_they_compute():
    from transformers.activations import ACT2FN

    for key, mode in [("gelu", "none"), ("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("gelu_fast", "tanh")]:
        assert kernels.gelu_mode(ACT2FN[key])[0] == mode, key
    for key in ("relu", "silu", "quick_gelu", "gelu_10", "tanh"):
        assert kernels.gelu_mode(ACT2FN[key])[0] is None, key


class LoRALinear(nn.Linear):
    """A wrapped Linear with its own forward (as PEFT's LoRA layers): must not be fused."""

    def forward(self, x):
        return super().forward(x) + 0.5


class ConvWithoutOwnForward(nn.Conv2d):
    """A same-file subclass that only changes construction (EfficientNet's depthwise conv)."""

    def __init__(self, c):
        super().__init__(c, c, 3, padding=1, groups=c, bias=False)


def test_modules_with_their_own_forward_or_hooks_fall_back():
    x = torch.randn(4, 6)
    lora = LoRALinear(6, 6)
    with count_kernel_calls() as calls:
        out = kernels.linear_gelu(lora, nn.GELU(), x)
    torch.testing.assert_close(out, F.gelu(lora(x)))
    assert _calls(calls, "linear_gelu") == {"original": 1}
    [call] = [c for c in calls.calls if c.kernel == "linear_gelu"]
    assert "overrides forward" in call.reason

    linear, seen = nn.Linear(6, 6), []
    linear.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with count_kernel_calls() as calls:
        kernels.linear_gelu(linear, nn.GELU(), x)
    assert seen == [torch.Size([4, 6])] and _calls(calls, "linear_gelu") == {"original": 1}


def test_modules_whose_instance_has_its_own_forward_fall_back():
    # accelerate's offload hooks (device_map="auto") replace ``module.forward`` on the instance:
    # the fused path would skip what the wrapper does (here: mark the call, scale the output)
    torch.manual_seed(0)

    def wrap(module, log):
        inner = module.forward

        def forward(*args):
            log.append(type(module).__name__)
            return inner(*args) * 2
        module.forward = forward
        return module

    log: list[str] = []
    x = torch.randn(4, 6)
    linear = wrap(nn.Linear(6, 6), log)
    with count_kernel_calls() as calls:
        out = kernels.linear_gelu(linear, nn.GELU(), x)
    torch.testing.assert_close(out, F.gelu(linear(x)))
    assert _calls(calls, "linear_gelu") == {"original": 1}
    assert "has its own forward" in next(c.reason for c in calls.calls if c.kernel == "linear_gelu")

    conv, bn = nn.Conv2d(3, 4, 3).eval(), nn.BatchNorm2d(4).eval()
    image = torch.randn(2, 3, 6, 6)
    for wrapped in (conv, bn):
        c, b = (wrap(nn.Conv2d(3, 4, 3), log), bn) if wrapped is conv else (conv, wrap(nn.BatchNorm2d(4), log))
        c.load_state_dict(conv.state_dict())
        b.load_state_dict(bn.state_dict())
        c.eval(), b.eval()
        log.clear()
        with torch.no_grad(), count_kernel_calls() as calls:
            got = kernels.conv_bn(c, b, image, nn.ReLU())
        want = torch.relu(b(c(image)))
        torch.testing.assert_close(got, want)
        assert len(log) == 2  # the wrapper ran in the kernel's call and in the reference
        assert _calls(calls, "conv_bn") == {"original": 1}


def test_dropout_add_layer_norm_guards():
    torch.manual_seed(0)
    norm, drop = nn.LayerNorm(10), nn.Dropout(0.0)
    x, r = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    with count_kernel_calls() as calls:
        out = kernels.dropout_add_layer_norm(drop, norm, x, r)
        broadcast = kernels.dropout_add_layer_norm(drop, norm, x, r[:1])  # residual broadcasts
        rms = kernels.dropout_add_layer_norm(drop, nn.RMSNorm(10), x, r)  # another norm class
        inplace = kernels.dropout_add_layer_norm(nn.Dropout(0.0, inplace=True), norm, x.clone(), r)
    torch.testing.assert_close(out, norm(x + r))
    torch.testing.assert_close(broadcast, norm(x + r[:1]))
    torch.testing.assert_close(rms, nn.RMSNorm(10)(x + r))
    torch.testing.assert_close(inplace, norm(x + r))
    assert _calls(calls, "dropout_add_layer_norm") == {"torch": 1, "original": 3}


def test_dropout_add_layer_norm_training_uses_the_same_mask_as_the_modules():
    norm, drop = nn.LayerNorm(16), nn.Dropout(0.3).train()
    x = torch.randn(4, 16, requires_grad=True)
    r = torch.randn(4, 16)
    torch.manual_seed(5)
    expected = norm(drop(x) + r)
    torch.manual_seed(5)
    out = kernels.dropout_add_layer_norm(drop, norm, x, r)
    torch.testing.assert_close(out, expected)


def test_dropout_add_layer_norm_half_x_with_float_residual_on_torch_path():
    norm, drop = nn.LayerNorm(12), nn.Dropout(0.0)
    x, r = torch.randn(3, 12).to(torch.bfloat16), torch.randn(3, 12)
    out = kernels.dropout_add_layer_norm(drop, norm, x, r)
    expected = norm(drop(x) + r)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected)


@pytest.fixture()
def qkv_fused_on_cpu(monkeypatch):
    from adopter.kernels import guarded

    monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", True)


def test_qkv_runs_the_three_modules_on_cpu_by_default():
    q, k, v = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
    x = torch.randn(2, 6)
    with count_kernel_calls() as calls:
        outs = kernels.qkv(q, k, v, x)
    assert all(torch.equal(o, m(x)) for o, m in zip(outs, (q, k, v)))
    [call] = calls.calls
    assert call.backend == "original" and call.reason.startswith("CPU:")


def test_qkv_matches_three_linears_and_caches_only_without_grad(qkv_fused_on_cpu):
    torch.manual_seed(0)
    q, k, v = nn.Linear(9, 8), nn.Linear(9, 4), nn.Linear(9, 4)  # GQA-like widths
    x = torch.randn(2, 5, 9, requires_grad=True)
    outs = kernels.qkv(q, k, v, x)
    for out, layer in zip(outs, (q, k, v)):
        torch.testing.assert_close(out, layer(x))
    grads = torch.autograd.grad(sum(o.square().sum() for o in outs), (x, q.weight, k.bias))
    expected = torch.autograd.grad(sum(layer(x).square().sum() for layer in (q, k, v)), (x, q.weight, k.bias))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        first = kernels.qkv(q, k, v, x)
        q.weight.add_(1.0)  # a parameter update must invalidate the cached concatenation
        second = kernels.qkv(q, k, v, x)
    torch.testing.assert_close(second[0], first[0] + x.sum(-1, keepdim=True))
    with count_kernel_calls() as calls:
        kernels.qkv(q, k, nn.Linear(9, 4, bias=False), x)  # biases differ: the three modules run
    assert _calls(calls, "qkv") == {"original": 1}


def _reasons(calls, kernel: str) -> list[str]:
    return sorted(c.reason for c in calls.calls if c.kernel == kernel and not c.fused)


def test_conv_bn_folds_in_eval_only_and_accepts_conv_subclasses():
    torch.manual_seed(0)
    conv, bn = ConvWithoutOwnForward(4), nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    small, large = torch.randn(2, 4, 7, 7), torch.randn(2, 4, 32, 32)
    # not frozen, the fold runs per call only where the weight is a small share of the output
    assert kernels.guarded._fold_pays_per_call(conv.weight, large)
    assert not kernels.guarded._fold_pays_per_call(conv.weight, small)
    with count_kernel_calls() as calls:
        train = kernels.conv_bn(conv, bn.train(), small)
        bn.eval()
        evald = kernels.conv_bn(conv, bn, large)
        unfrozen_small = kernels.conv_bn(conv, bn, small)
        kernels.freeze(conv), kernels.freeze(bn)
        frozen_small = kernels.conv_bn(conv, bn, small)
    with torch.no_grad():
        torch.testing.assert_close(evald, bn(conv(large)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(unfrozen_small, bn(conv(small)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(frozen_small, bn(conv(small)), atol=1e-5, rtol=1e-5)
    assert train.shape == small.shape
    assert _calls(calls, "conv_bn") == {"original": 2, "torch": 2}
    training, not_frozen = _reasons(calls, "conv_bn")
    assert training.startswith("BatchNorm in training mode") and not_frozen.startswith("weights not frozen")


def test_linear_bn_folds_2d_inputs_in_eval():
    lin, bn = nn.Linear(5, 3), nn.BatchNorm1d(3).eval()
    x, large = torch.randn(4, 5), torch.randn(512, 5)
    with count_kernel_calls() as calls:
        out_large = kernels.linear_bn(lin, bn, large)  # folded on this call (15 weights, 1536 outputs)
        out_unfrozen = kernels.linear_bn(lin, bn, x)  # a fold per call would cost more: the layers
        kernels.freeze(lin), kernels.freeze(bn)
        out = kernels.linear_bn(lin, bn, x)
        seq = kernels.linear_bn(lin, bn, torch.randn(4, 3, 5).transpose(1, 2).transpose(1, 2))
    with torch.no_grad():
        torch.testing.assert_close(out, bn(lin(x)), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out_unfrozen, bn(lin(x)), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out_large, bn(lin(large)), atol=1e-6, rtol=1e-5)
    assert seq.shape == (4, 3, 3)
    assert _calls(calls, "linear_bn") == {"torch": 2, "original": 2}
    rank, not_frozen = _reasons(calls, "linear_bn")
    assert rank.startswith("input of rank 3") and not_frozen.startswith("weights not frozen")


# ---------------------------------------------------------------- optimize() on BERT


def _bert_config(**overrides):
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, hidden_act="gelu",
    )  # fmt: skip
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def optimized_bert():
    from adopter import optimize

    return optimize(transformers.BertModel, config=_bert_config())


def _compare(original, optimized, inputs):
    from adopter.verification.equivalence import check_equivalence

    with count_kernel_calls() as calls:
        result = check_equivalence(original, optimized, inputs)
    return result, calls


def _inputs():
    torch.manual_seed(0)
    return {"input_ids": torch.randint(0, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "act, fused", [("gelu", True), ("relu", False), ("gelu_new", True), ("gelu_pytorch_tanh", True), ("silu", False)]
)
def test_class_optimized_with_gelu_is_right_for_every_activation(optimized_bert, act, fused):
    assert "biased_GeLU" in optimized_bert.adopter_report.applied_rules
    config = _bert_config(hidden_act=act)
    original = transformers.BertModel(config).eval()
    optimized = optimized_bert(config).eval()
    result, calls = _compare(original, optimized, _inputs())
    assert result.equivalent, result.summary()
    counts = _calls(calls, "linear_gelu")
    assert sum(counts.values()) > 0
    if fused:
        assert set(counts) == {"torch"}, counts
    else:
        assert set(counts) == {"original"}, counts


@pytest.mark.slow
def test_mixed_instances_of_one_class(optimized_bert):
    # Two BertIntermediate instances in one model: one GeLU, one ReLU; two BertOutput instances
    # with different eps. Each instance takes its own path.
    original = transformers.BertModel(_bert_config()).eval()
    optimized = optimized_bert(_bert_config()).eval()
    for model in (original, optimized):
        model.encoder.layer[1].intermediate.intermediate_act_fn = nn.ReLU()
        model.encoder.layer[1].output.LayerNorm.eps = 1e-3
    result, calls = _compare(original, optimized, _inputs())
    assert result.equivalent, result.summary()
    counts = _calls(calls, "linear_gelu")
    assert counts.get("torch", 0) > 0 and counts.get("original", 0) > 0, counts
    assert set(_calls(calls, "dropout_add_layer_norm")) == {"torch"}


@pytest.mark.slow
def test_optimize_report_has_flipped_config_check_and_counts(optimized_bert):
    report = optimized_bert.adopter_report
    assert report.flipped_equivalence is not None and report.flipped_equivalence.equivalent
    flipped = {f.field: f.flipped for f in report.flipped}
    assert flipped["hidden_act"] == "relu" and flipped["layer_norm_eps"] != 1e-12
    gelu = next(a for a in report.applied if a.rule == "biased_GeLU")
    # two layers; one eval and one train forward in each check
    assert gelu.kernel_calls["analysed"] == {"torch": 4}
    assert gelu.kernel_calls["flipped"] == {"original": 4}
    assert "flipped config (" in str(report)
    # state dict unchanged by the rewrite
    assert list(optimized_bert(_bert_config()).state_dict()) == list(transformers.BertModel(_bert_config()).state_dict())
