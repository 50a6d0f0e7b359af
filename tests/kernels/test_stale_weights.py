"""Derived weights never go stale (issue: a cached BatchNorm fold, its packed oneDNN weight and the
concatenated Q/K/V weights survived weight changes no version counter sees).

``torch.optim.AdamW(fused=True)`` steps, writes through ``.data`` (EMA updates) and BatchNorm's
running statistics in a train-mode forward leave ``_version``, ``data_ptr`` and identity as they
were. So a kernel keeps what it derives from weights between calls only under
``adopter.kernels.freeze`` (the user's promise that they no longer change), a promise dropped when a
kernel sees the module in training mode, a parameter requiring grad or a parameter object that is
not the one frozen; otherwise it folds from the live tensors on every call (where that pays) or
runs the original layers. What must hold here, for ``conv_bn``, ``linear_bn``,
``GuardedSequential(Conv2d, BatchNorm2d, ReLU)``, ``FusedConv2dBatchNorm2d``,
``FusedLinearBatchNorm1d`` and ``qkv``, on shapes where the per-call fold runs and where the layers
run, frozen (the promise then broken visibly) or not:

* (a) eval, then a train-mode forward moving the running statistics, or one fused AdamW step,
  then eval again: the kernel computes what the original code computes;
* (b) the same across ``.data`` writes (EMA), ``load_state_dict`` and a ``weight_norm``
  parametrization put on the layer between calls;
* (c) a small ResNet-style model (``GuardedSequential``, ``conv_bn`` with a ReLU, ``add_relu``,
  ``linear_bn``) and a BERT-style block (``qkv``, ``dropout_add_layer_norm``, ``linear_gelu``)
  trained for 3 epochs with fused AdamW, an EMA copy updated through ``.data`` and, for the CNN,
  frozen-BatchNorm fine-tuning: the eval outputs equal the original's after every epoch;
* (d) a frozen model's outputs do not require grad, and input gradients work (twice) through a
  model whose parameters do not require grad.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import (
    FusedConv2dBatchNorm2d,
    FusedLinearBatchNorm1d,
    GuardedSequential,
    add_relu,
    conv_bn,
    count_kernel_calls,
    dropout_add_layer_norm,
    freeze,
    guarded,
    is_frozen,
    linear_bn,
    linear_gelu,
    qkv,
    unfreeze,
)
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

_BatchNorm = nn.modules.batchnorm._BatchNorm
RTOL, ATOL = 1e-4, 1e-5  # fp32: a fold rounds differently from conv-then-BatchNorm
LR = 0.05  # one fused AdamW step moves every weight by about this much: a stale fold is far off


# ---------------------------------------------------------------- the five folding forms


@pytest.fixture(autouse=True)
def _per_call_fold_on(monkeypatch):
    # the per-call fold as a user switches it on (off by default: guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE)
    monkeypatch.setattr(guarded, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", 0.01)


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.bn(self.conv(x))

    def layer(self) -> nn.Module:
        return self.conv


class ConvBNKernel(ConvBN):
    def forward(self, x):
        return conv_bn(self.conv, self.bn, x)


class LinearBN(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.fc = nn.Linear(cin, cout)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):
        return self.bn(self.fc(x))

    def layer(self) -> nn.Module:
        return self.fc


class LinearBNKernel(LinearBN):
    def forward(self, x):
        return linear_bn(self.fc, self.bn, x)


class ConvBNReLU(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.body(x)

    def layer(self) -> nn.Module:
        return self.body[0]


class ConvBNReLUKernel(ConvBNReLU):
    def __init__(self, cin: int, cout: int):
        super().__init__(cin, cout)
        self.body = GuardedSequential(*self.body)  # (what a rewrite builds in __init__)


class FusedConvBN(nn.Module):
    """``FusedConv2dBatchNorm2d`` in ``ConvBN``'s place: the same state dict keys."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = FusedConv2dBatchNorm2d(cin, cout, 3, padding=1, bn_name="bn")

    def forward(self, x):
        return self.conv(x)

    def layer(self) -> nn.Module:
        return self.conv


class FusedLinearBN(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.fc = FusedLinearBatchNorm1d(cin, cout, bn_name="bn")

    def forward(self, x):
        return self.fc(x)

    def layer(self) -> nn.Module:
        return self.fc


KINDS = {  # kind -> (original, kernel form, conv or linear)
    "conv_bn": (ConvBN, ConvBNKernel, "conv"),
    "linear_bn": (LinearBN, LinearBNKernel, "linear"),
    "GuardedSequential": (ConvBNReLU, ConvBNReLUKernel, "conv"),
    "FusedConv2dBatchNorm2d": (ConvBN, FusedConvBN, "conv"),
    "FusedLinearBatchNorm1d": (LinearBN, FusedLinearBN, "linear"),
}
# per_call: the weight is a small share of the output (the fold runs on every call unfrozen);
# layers: it is not (unfrozen, the two layers run)
SIZES = {
    "conv": {"per_call": ((3, 4), (8, 3, 32, 32)), "layers": ((16, 32), (2, 16, 8, 8))},
    "linear": {"per_call": ((6, 4), (1024, 6)), "layers": ((64, 32), (16, 64))},
}


def _randomize(model: nn.Module) -> None:
    """BatchNorm statistics and affine parameters a fold visibly depends on."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                m.running_mean.normal_(0.0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)


def _make(kind: str, size: str, *, seed: int = 0) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """(original, kernel form with the original's state, an input), both in eval."""
    original_cls, kernel_cls, layer = KINDS[kind]
    dims, shape = SIZES[layer][size]
    torch.manual_seed(seed)
    original = original_cls(*dims)
    _randomize(original)
    kernel = kernel_cls(*dims)
    kernel.load_state_dict(original.state_dict())
    x = torch.randn(shape)
    assert guarded._fold_pays_per_call(kernel.layer().weight, x) == (size == "per_call")
    return original.eval(), kernel.eval(), x


def _eval_equal(original: nn.Module, kernel: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Both models' eval outputs on ``x``, equal within fp32 rounding; returns the original's."""
    original.eval(), kernel.eval()
    with torch.no_grad():
        want = original(x.clone())
        got = kernel(x.clone())
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    return want


def _folds_kept(kernel: nn.Module) -> bool:
    """Whether the kernel form holds a fold kept between calls (only under freeze)."""
    bns = [m for m in kernel.modules() if isinstance(m, _BatchNorm)]
    fused = [m for m in kernel.modules() if isinstance(m, (FusedConv2dBatchNorm2d, FusedLinearBatchNorm1d))]
    if fused:
        return all(m._fold_cache is not None and m._fold_key is not None for m in fused)
    return bool(bns) and all(bn in guarded._FOLD_CACHE for bn in bns)


def _all_frozen(kernel: nn.Module) -> bool:
    """Whether every layer a kernel derives weights from is under the promise (a kernel keeps a
    derived weight only then)."""
    return all(is_frozen(m) for m in kernel.modules() if isinstance(m, (nn.Conv2d, nn.Linear, _BatchNorm)))


def _adamw_step(model: nn.Module, x: torch.Tensor, *, seed: int = 5) -> None:
    """One training step (train mode, MSE to a seeded random target) with fused AdamW."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=True)
    out = model(x.clone())
    torch.manual_seed(seed)
    (out - torch.randn_like(out)).square().mean().backward()
    optimizer.step()
    model.eval()


def _break_promise(how: str, original: nn.Module, kernel: nn.Module, x: torch.Tensor) -> None:
    """Break ``freeze``'s promise visibly, the way ``how`` says, before the weights change; both
    models see the same forwards."""
    if how == "train":  # a train-mode forward (moves the running statistics of both alike)
        original.train(), kernel.train()
        with torch.no_grad():
            original(x.clone()), kernel(x.clone())
        kernel.requires_grad_(True)  # (to train it next)
    elif how == "requires_grad":
        kernel.requires_grad_(True)
        _eval_equal(original, kernel, x)  # (a kernel call sees the parameter requiring grad)
    elif how == "unfreeze":
        unfreeze(kernel)
    else:
        raise AssertionError(how)
    assert not _all_frozen(kernel), f"{how}: the promise is dropped"


def _assert_changed(before: torch.Tensor, after: torch.Tensor) -> None:
    # the weights changed what eval computes by far more than the tolerance: a stale fold fails
    assert (after - before).abs().max() > 100 * ATOL


# ---------------------------------------------------------------- (a) the three stale-cache sequences

MODES = ["not_frozen", "frozen"]
BREAKS = ["not_frozen", "train", "requires_grad", "unfreeze"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", ["per_call", "layers"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_train_mode_forward_then_eval(kind, size, mode):
    """Frozen conv/BN trained in train mode (the running statistics move, no version change),
    then eval: the kernel computes what the original computes."""
    original, kernel, x = _make(kind, size)
    if mode == "frozen":
        freeze(kernel)
    before = _eval_equal(original, kernel, x)
    assert _folds_kept(kernel) == (mode == "frozen")
    original.train(), kernel.train()
    torch.manual_seed(2)
    with torch.no_grad():
        for _ in range(3):
            batch = torch.randn_like(x) * 2.0 + 1.0
            torch.testing.assert_close(kernel(batch.clone()), original(batch.clone()), rtol=RTOL, atol=ATOL)
    assert not _all_frozen(kernel), "a kernel saw training mode: the promise is dropped"
    for key, value in original.state_dict().items():
        torch.testing.assert_close(kernel.state_dict()[key], value, msg=key)
    after = _eval_equal(original, kernel, x)
    _assert_changed(before, after)


@pytest.mark.parametrize("how", BREAKS)
@pytest.mark.parametrize("size", ["per_call", "layers"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fused_adamw_step_then_eval(kind, size, how):
    """eval -> one AdamW(fused=True) step -> eval: the second eval sees the stepped weights."""
    original, kernel, x = _make(kind, size)
    if how != "not_frozen":
        freeze(kernel)
    before = _eval_equal(original, kernel, x)
    assert _folds_kept(kernel) == (how != "not_frozen")
    if how != "not_frozen":
        _break_promise(how, original, kernel, x)
    with count_kernel_calls() as calls:
        _adamw_step(original, x)
        _adamw_step(kernel, x)
        after = _eval_equal(original, kernel, x)
    for key, value in original.state_dict().items():
        torch.testing.assert_close(kernel.state_dict()[key], value, msg=key)  # (training ran the layers)
    _assert_changed(before, after)
    counted = [c for c in calls.calls if c.kernel in ("conv_bn", "linear_bn")]
    if kind in ("conv_bn", "linear_bn", "GuardedSequential"):
        # the eval after the step: folded on the call where that pays, else the two layers
        assert [c.fused for c in counted if not c.reason.startswith("BatchNorm in training")] == [size == "per_call"]


class QKV(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return torch.cat((self.query(x), self.key(x), self.value(x)), -1)


class QKVKernel(QKV):
    def forward(self, x):
        return torch.cat(qkv(self.query, self.key, self.value, x), -1)


def _qkv_pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    original = QKV()
    kernel = QKVKernel()
    kernel.load_state_dict(original.state_dict())
    return original.eval(), kernel.eval(), torch.randn(4, 6, 16)


@pytest.mark.parametrize("how", BREAKS)
def test_qkv_after_a_fused_adamw_step(how, monkeypatch):
    monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", True)
    original, kernel, x = _qkv_pair()
    if how != "not_frozen":
        freeze(kernel)
    with count_kernel_calls() as calls:
        before = _eval_equal(original, kernel, x)
    assert [c.backend for c in calls.calls if c.kernel == "qkv"] == ["torch"], "the concatenated path ran"
    assert (kernel.query in guarded._QKV_CACHE) == (how != "not_frozen")
    if how != "not_frozen":
        _break_promise(how, original, kernel, x)
    _adamw_step(original, x)
    _adamw_step(kernel, x)
    with count_kernel_calls() as calls:
        after = _eval_equal(original, kernel, x)
    assert [c.backend for c in calls.calls if c.kernel == "qkv"] == ["torch"]
    _assert_changed(before, after)


# A promise renewed after the weights changed: ``unfreeze``, a change no version counter sees (a
# fused AdamW step, a ``.data`` write, a train-mode BatchNorm forward), ``freeze`` again (evaluating
# each epoch frozen). The fold kept under the first promise has the same tensor key (identity,
# version, data pointer of each tensor): only the new promise's token tells it apart.

def _change_unseen(change: str, original: nn.Module, kernel: nn.Module, x: torch.Tensor) -> None:
    if change == "adamw":
        _adamw_step(original, x)
        _adamw_step(kernel, x)
    elif change == "data":
        for model in (original, kernel):
            for p in model.parameters():
                p.data.mul_(0.5).add_(1.0)
    elif change == "bn_train":
        original.train(), kernel.train()
        with torch.no_grad():
            original(x.clone() + 1.0), kernel(x.clone() + 1.0)
        original.eval(), kernel.eval()


@pytest.mark.parametrize("change", ["adamw", "data", "bn_train"])
@pytest.mark.parametrize("kind", sorted(KINDS) + ["qkv"])
def test_freeze_again_after_unfreeze_and_a_change(kind, change, monkeypatch):
    if kind == "qkv":
        if change == "bn_train":
            pytest.skip("no BatchNorm")
        monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", True)
        original, kernel, x = _qkv_pair()
    else:
        original, kernel, x = _make(kind, "layers")
    freeze(kernel)
    before = _eval_equal(original, kernel, x)
    unfreeze(kernel)
    _change_unseen(change, original, kernel, x)
    freeze(kernel)
    _assert_changed(before, _eval_equal(original, kernel, x))


# ---------------------------------------------------------------- (b) .data, load_state_dict, weight_norm


@pytest.mark.parametrize("mode", ["not_frozen", "unfreeze"])
@pytest.mark.parametrize("size", ["per_call", "layers"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ema_update_through_data(kind, size, mode):
    """``p.data.mul_(0.9).add_(q.data, alpha=0.1)`` (no version change) between eval calls; a
    frozen model is unfrozen before its weights are written (the contract: a ``.data`` write
    breaks a promise silently)."""
    original, kernel, x = _make(kind, size)
    source, _, _ = _make(kind, size, seed=1)
    if mode == "unfreeze":
        freeze(kernel)
    before = _eval_equal(original, kernel, x)
    if mode == "unfreeze":
        unfreeze(kernel)
    for model in (original, kernel):
        for p, q in zip(model.state_dict().values(), source.state_dict().values()):
            if p.is_floating_point():
                p.data.mul_(0.9).add_(q.data, alpha=0.1)
    after = _eval_equal(original, kernel, x)
    _assert_changed(before, after)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("frozen", [False, True], ids=["not_frozen", "frozen"])
@pytest.mark.parametrize("size", ["per_call", "layers"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_load_state_dict_between_calls(kind, size, frozen, assign):
    """A checkpoint loaded between eval calls: copied in place (a version change, seen even under
    the promise) or assigned (new parameter objects: the promise is dropped)."""
    original, kernel, x = _make(kind, size)
    source, _, _ = _make(kind, size, seed=1)
    if frozen:
        freeze(kernel)
    before = _eval_equal(original, kernel, x)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    original.load_state_dict(state)
    kernel.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)
    after = _eval_equal(original, kernel, x)
    _assert_changed(before, after)
    if frozen:
        # copied in place the promise holds (and the version change refolds); assigned, the new
        # parameter objects drop it
        assert is_frozen(kernel.layer()) != assign


@pytest.mark.parametrize("frozen", [False, True], ids=["not_frozen", "frozen"])
@pytest.mark.parametrize("size", ["per_call", "layers"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_weight_norm_put_on_the_layer_between_calls(kind, size, frozen):
    """``weight_norm`` parametrizes the layer between calls (its weight is then computed from new
    parameters on every access); the parametrized model then trains one fused AdamW step."""
    original, kernel, x = _make(kind, size)
    if frozen:
        freeze(kernel)
    before = _eval_equal(original, kernel, x)
    weight_norm(original.layer())
    weight_norm(kernel.layer())
    torch.testing.assert_close(_eval_equal(original, kernel, x), before, rtol=RTOL, atol=ATOL)
    assert not is_frozen(kernel.layer()), "the layer's weight is no parameter frozen any more"
    kernel.requires_grad_(True)  # (frozen: the rest trains too)
    _adamw_step(original, x)
    _adamw_step(kernel, x)
    _assert_changed(before, _eval_equal(original, kernel, x))


# ---------------------------------------------------------------- (c) training loops


class ResNetOriginal(nn.Module):
    """A stem and one basic residual block, then a Linear+BatchNorm1d head."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(width, 16)
        self.fc_bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.stem(x)
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out += identity
        out = self.relu(out)
        h = self.fc_bn(self.fc(out.mean((2, 3))))
        return self.head(F.relu(h))


class ResNetRewritten(ResNetOriginal):
    """What the rewrite emits for :class:`ResNetOriginal` (``__init__`` keeps the modules)."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__(width, classes)
        self.stem = GuardedSequential(*self.stem)

    def forward(self, x):
        x = self.stem(x)
        identity = x
        out = conv_bn(self.conv1, self.bn1, x, self.relu)
        out = conv_bn(self.conv2, self.bn2, out)
        out = add_relu(self.relu, out, identity, in_place=True)
        h = linear_bn(self.fc, self.fc_bn, out.mean((2, 3)))
        return self.head(F.relu(h))


class BertOriginal(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.query, self.key, self.value = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, 4 * hidden)
        self.intermediate_act_fn = nn.GELU()
        self.output = nn.Linear(4 * hidden, hidden)
        self.output_dropout = nn.Dropout(0.1)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def split(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_size).transpose(1, 2)

    def attend(self, q, k, v):
        scores = torch.matmul(self.split(q), self.split(k).transpose(-1, -2)) / math.sqrt(self.head_size)
        return torch.matmul(F.softmax(scores, dim=-1), self.split(v)).transpose(1, 2).flatten(2)

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        h = self.dense(self.attend(q, k, v))
        a = self.LayerNorm(self.dropout(h) + x)
        inter = self.intermediate_act_fn(self.intermediate(a))
        return self.output_norm(self.output_dropout(self.output(inter)) + a)


class BertRewritten(BertOriginal):
    def forward(self, x):
        q, k, v = qkv(self.query, self.key, self.value, x)
        h = self.dense(self.attend(q, k, v))
        a = dropout_add_layer_norm(self.dropout, self.LayerNorm, h, x)
        inter = linear_gelu(self.intermediate, self.intermediate_act_fn, a)
        return dropout_add_layer_norm(self.output_dropout, self.output_norm, self.output(inter), a)


def _ema_update(ema: nn.Module, model: nn.Module, decay: float = 0.9) -> None:
    """timm-style EMA through ``.data``: no version counter moves."""
    for e, m in zip(ema.parameters(), model.parameters()):
        e.data.mul_(decay).add_(m.data, alpha=1 - decay)
    for e, m in zip(ema.buffers(), model.buffers()):
        e.data.copy_(m.data)


def _train_and_compare(make_original, make_rewritten, batches, targets, loss_fn, *, frozen_bn_from: int | None,
                       refreeze: bool = False):
    """Train the original and the rewritten model alike (same init, data, seeds) for 3 epochs
    with fused AdamW, an EMA copy of each updated through ``.data``; from epoch ``frozen_bn_from``
    on the BatchNorms stay in eval with frozen affine parameters. After each epoch: eval outputs
    of the rewritten model (unfrozen, and a frozen deep copy of it as deployed) and of its EMA
    (never frozen, weights written through ``.data``) equal the original's. ``refreeze``: the
    rewritten model itself is also evaluated frozen, then unfrozen and trained on."""
    torch.manual_seed(0)
    original = make_original()
    _randomize(original)
    rewritten = make_rewritten()
    rewritten.load_state_dict(original.state_dict())
    emas = []
    for model in (original, rewritten):
        ema = make_original() if model is original else make_rewritten()
        ema.load_state_dict(model.state_dict())
        emas.append(ema.eval().requires_grad_(False))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (original, rewritten)]
    probe = batches[0][:4]
    previous = None
    for epoch in range(3):
        frozen_bn = frozen_bn_from is not None and epoch >= frozen_bn_from
        for model in (original, rewritten):
            model.train()
            for m in model.modules():
                if isinstance(m, _BatchNorm) and frozen_bn:  # frozen-BN fine-tuning
                    m.eval()
                    m.requires_grad_(False)
        for step, (x, target) in enumerate(zip(batches, targets)):
            for model, ema, optimizer in zip((original, rewritten), emas, optimizers):
                optimizer.zero_grad()
                torch.manual_seed(100 * epoch + step)  # (the same dropout masks)
                loss_fn(model(x.clone()), target).backward()
                optimizer.step()
                _ema_update(ema, model)
        outputs = []
        for ema in emas:
            with torch.no_grad():
                outputs.append(ema(probe.clone()))
        torch.testing.assert_close(outputs[1], outputs[0], rtol=RTOL, atol=ATOL, msg=f"EMA, epoch {epoch}")
        want = _eval_equal(original, rewritten, probe)
        deployed = freeze(copy.deepcopy(rewritten))
        torch.testing.assert_close(_eval_equal(original, deployed, probe), want, rtol=RTOL, atol=ATOL)
        assert _folds_kept(deployed) == any(isinstance(m, _BatchNorm) for m in deployed.modules())
        if refreeze:
            freeze(rewritten)  # evaluated frozen ...
            torch.testing.assert_close(_eval_equal(original, rewritten, probe), want, rtol=RTOL, atol=ATOL,
                                       msg=f"frozen again, epoch {epoch}")
            unfreeze(rewritten)  # ... and trained on
        if previous is not None:
            _assert_changed(previous, want)
        previous = want
    for key, value in original.state_dict().items():
        torch.testing.assert_close(rewritten.state_dict()[key], value, rtol=RTOL, atol=ATOL, msg=key)
    return original, rewritten


@pytest.mark.parametrize("refreeze", [False, True], ids=["deployed_copy", "refreeze"])
def test_resnet_style_training_loop(refreeze):
    torch.manual_seed(1)
    batches = [torch.randn(16, 3, 32, 32) for _ in range(3)]
    targets = [torch.randint(0, 10, (16,)) for _ in range(3)]
    with count_kernel_calls() as calls:
        _train_and_compare(ResNetOriginal, ResNetRewritten, batches, targets, F.cross_entropy, frozen_bn_from=1,
                           refreeze=refreeze)
    fused = {c.kernel for c in calls.calls if c.fused}
    assert {"conv_bn", "add_relu"} <= fused, calls.calls


@pytest.mark.parametrize("refreeze", [False, True], ids=["deployed_copy", "refreeze"])
def test_bert_style_training_loop(refreeze, monkeypatch):
    monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", True)
    torch.manual_seed(1)
    batches = [torch.randn(8, 6, 32) for _ in range(3)]
    targets = [torch.randn(8, 6, 32) for _ in range(3)]
    with count_kernel_calls() as calls:
        _train_and_compare(BertOriginal, BertRewritten, batches, targets, F.mse_loss, frozen_bn_from=None,
                           refreeze=refreeze)
    fused = {c.kernel for c in calls.calls if c.fused}
    assert {"qkv", "dropout_add_layer_norm", "linear_gelu"} <= fused, calls.calls


# ---------------------------------------------------------------- (d) gradients through frozen models


@pytest.mark.parametrize("kind", sorted(KINDS) + ["qkv", "resnet", "bert"])
def test_frozen_outputs_do_not_require_grad_and_input_gradients_work_twice(kind, monkeypatch):
    monkeypatch.setattr(guarded, "QKV_FUSE_ON_CPU", True)
    if kind == "qkv":
        original, kernel, x = _qkv_pair()
    elif kind in ("resnet", "bert"):
        torch.manual_seed(0)
        original = ResNetOriginal() if kind == "resnet" else BertOriginal()
        _randomize(original)
        kernel = ResNetRewritten() if kind == "resnet" else BertRewritten()
        kernel.load_state_dict(original.state_dict())
        original.eval(), kernel.eval()
        x = torch.randn(4, 3, 16, 16) if kind == "resnet" else torch.randn(2, 5, 32)
    else:
        original, kernel, x = _make(kind, "layers")
    want = _eval_equal(original, kernel, x)
    original.requires_grad_(False)
    for frozen in (True, False):
        if frozen:
            freeze(kernel)
            out = kernel(x.clone())  # (grad mode on, the input requires none)
            assert not out.requires_grad
            torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
        else:
            unfreeze(kernel)
            kernel.requires_grad_(False)  # eval, parameters without grad, no promise
        for _ in range(2):  # backward twice, each on a fresh forward (nothing kept holds a graph)
            xk, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
            got = kernel(xk)
            assert got.requires_grad
            grad = torch.randn_like(got)
            got.backward(grad)
            original(xo).backward(grad)
            torch.testing.assert_close(xk.grad, xo.grad, rtol=RTOL, atol=ATOL)
        assert all(p.grad is None for p in kernel.parameters())
