"""Equivalence check between an original model and its optimized rewrite.

A rewrite counts only if, with the *same weights*, the optimized model computes the same
thing as the original: eval-mode forward outputs, and in train mode (every dropout
probability set to 0 so both runs are deterministic) the forward outputs, the gradient of
every parameter, and the buffers after the step (BatchNorm running statistics).

Weights are shared by loading the original's state dict into the optimized model with
``strict=True``; that is also the state-dict compatibility check. Gradients are compared
under the *original's* state-dict names: the optimized model's gradients are mapped
through its own ``state_dict()`` (kernel modules that fuse several layers, e.g. ``FusedQKV``,
split them back to ``query.weight``/``key.weight``/... there), so fused parameters are
compared slice by slice with the layers they replace.

The benchmark, report and regression gate live in :mod:`adopter.verification.benchmark` and
:mod:`adopter.verification.gate`.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adopter.core.rules import all_rules
from adopter.errors import one_line

# ---------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


CPU_FP32 = Tolerance(atol=1e-5, rtol=1e-4)

# On GPU the kernels may use TF32 / reduced-precision accumulation and other reduction orders.
_GPU_TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-3),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=2e-2),
    torch.float64: Tolerance(atol=1e-8, rtol=1e-6),
}


def tolerance_for(dtype: torch.dtype, device: torch.device | str | None) -> Tolerance:
    """fp32 on CPU: atol 1e-5 / rtol 1e-4 (the issue's numbers); dtype-appropriate elsewhere."""
    device_type = torch.device(device).type if device is not None else "cpu"
    if device_type == "cpu":
        if dtype == torch.float64:
            return _GPU_TOLERANCES[torch.float64]
        if dtype in (torch.float16, torch.bfloat16):
            return _GPU_TOLERANCES[dtype]
        return CPU_FP32
    return _GPU_TOLERANCES.get(dtype, _GPU_TOLERANCES[torch.float32])


# ---------------------------------------------------------------- dropout off

# Attribute / config names that hold a dropout probability in user code: `p` (nn.Dropout),
# `dropout`, `attention_dropout`, `hidden_dropout_prob`, `attn_pdrop`, `dropout_rate`,
# `layerdrop`, `drop_path_rate`, `dropout_p`, ... and SpecAugment's `mask_time_prob` /
# `mask_feature_prob` (speech models mask random spans in training, drawn with numpy's RNG,
# which the seeded comparison does not control). The modules a rewrite leaves behind declare
# theirs in their rule (``Rule.stochastic_attributes``).
_DROPOUT_NAME = re.compile(
    r"^(p|dropout_p|drop_prob|mask_time_prob|mask_feature_prob)$|dropout|pdrop|layerdrop|drop_path|drop_rate"
)


def _rule_stochastic_attributes() -> frozenset[str]:
    return frozenset(a for rule in all_rules() for a in rule.stochastic_attributes)


def _is_probability(value: Any) -> bool:
    return isinstance(value, (float, int)) and not isinstance(value, bool) and value != 0


def _zero_dropout_attrs(
    obj: Any, saved: list, *, class_attributes: bool = False, exact: frozenset[str] = frozenset()
) -> None:
    names = set(vars(obj))
    if class_attributes:  # configs may keep defaults as class attributes
        names |= {n for n in dir(type(obj)) if not n.startswith("_")}
    for name in sorted(names):
        if name not in exact and not _DROPOUT_NAME.search(name):
            continue
        try:
            value = getattr(obj, name)
        except Exception:  # noqa: BLE001, S112 - a property that cannot be read is no probability
            continue
        if _is_probability(value):
            try:
                setattr(obj, name, 0.0 if isinstance(value, float) else 0)
            except (AttributeError, TypeError):
                continue
            saved.append((obj, name, value))


@contextlib.contextmanager
def dropout_disabled(*models: nn.Module) -> Iterator[None]:
    """Set every dropout probability of the models (module attributes, their configs,
    kernel modules' ``p``) to 0 for the duration; restore the original values after."""
    saved: list = []
    seen_configs: set[int] = set()
    exact = _rule_stochastic_attributes()
    try:
        for model in models:
            for module in model.modules():
                _zero_dropout_attrs(module, saved, exact=exact)
                config = getattr(module, "config", None)
                if config is not None and not isinstance(config, nn.Module) and id(config) not in seen_configs:
                    seen_configs.add(id(config))
                    with contextlib.suppress(TypeError):
                        _zero_dropout_attrs(config, saved, class_attributes=True)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# ---------------------------------------------------------------- outputs


def flatten_tensors(value: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) model output, with a readable path as its name.

    Handles tensors, tuples/lists, dicts and ``transformers`` ``ModelOutput``s (dict-like);
    other objects (caches, ``None``) are skipped.
    """
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, torch.Tensor):
        found.append((prefix, value))
    elif isinstance(value, Mapping):
        for key in list(value.keys()):
            found.extend(flatten_tensors(value[key], f"{prefix}.{key}"))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            found.extend(flatten_tensors(item, f"{prefix}[{i}]"))
    return found


def call_model(model: nn.Module, example_inputs: Any) -> Any:
    """Call with ``example_inputs``: a dict (keyword arguments), a tuple/list (positional
    arguments) or a single tensor."""
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)


def move_inputs(example_inputs: Any, device: torch.device | str | None) -> Any:
    if device is None:
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return example_inputs.to(device)
    if isinstance(example_inputs, dict):
        return {k: move_inputs(v, device) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return type(example_inputs)(move_inputs(v, device) for v in example_inputs)
    return example_inputs


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss the model computed itself (``outputs.loss``, ``outputs["loss"]``): a causal LM
    given labels. None when there is none."""
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    elif isinstance(outputs, (tuple, list)) and outputs:
        # ``return_dict=False``: transformers puts the loss first, ``(loss, logits, ...)``, and
        # only when it computed one; a scalar first output that requires grad is taken as it.
        first = outputs[0]
        loss = first if isinstance(first, torch.Tensor) and first.dim() == 0 else None
        if loss is None:
            # ``return logits, loss`` (nanoGPT, minGPT and much research code): a scalar last, the
            # only scalar of the tuple (None in its place when no targets were given)
            scalars = [o for o in outputs if isinstance(o, torch.Tensor) and o.dim() == 0]
            last = outputs[-1]
            loss = last if len(scalars) == 1 and scalars[0] is last else None
    else:
        loss = getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.requires_grad else None


def training_loss(outputs: Any, seed: int = 0) -> torch.Tensor | None:
    """What a training step back-propagates: the model's own loss when it computes one (that is
    what training does, and what a fused LM-head loss replaces); otherwise a scalar that depends
    on every differentiable output element with a distinct weight (a fixed random projection, so
    errors cannot cancel out the way they could in a plain sum)."""
    own = model_loss(outputs)
    if own is not None:
        return own.float()
    return projected(flatten_tensors(outputs), seed)


def projected(named: list[tuple[str, torch.Tensor]], seed: int = 0) -> torch.Tensor | None:
    """A fixed random projection of the differentiable tensors of ``named`` to one scalar (the same
    weights for the same names, shapes and order), None when none is differentiable."""
    total = None
    generator = torch.Generator().manual_seed(seed)
    for _, tensor in named:
        if not (tensor.is_floating_point() and tensor.requires_grad):
            continue
        weight = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        weight = weight.to(tensor.device) / math.sqrt(max(tensor.numel(), 1))
        term = (tensor.float() * weight).sum()
        total = term if total is None else total + term
    return total


# ---------------------------------------------------------------- losses a forward stores on a module


def tensor_attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every plain attribute of the model's modules (not a parameter, buffer or submodule) that
    holds a tensor or None, by ``(module path, name)``: what :func:`stored_losses` compares after
    a forward, and what :func:`restore_attributes` puts back."""
    return {
        (path, name): value
        for path, module in model.named_modules()
        for name, value in vars(module).items()
        if value is None or isinstance(value, torch.Tensor)
    }


def stored_losses(model: nn.Module, before: dict[tuple[str, str], Any]) -> list[tuple[str, torch.Tensor]]:
    """The losses the forward that ran since ``before`` (:func:`tensor_attributes`) stored on a
    module instead of returning them (llama2.c's ``self.last_loss = F.cross_entropy(...)``, the
    model returning the logits alone): attributes it set to a floating scalar that requires grad,
    named ``self.last_loss`` / ``self.<module path>.<name>``. A training loop back-propagates them."""
    found = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()
                    and value.requires_grad and before.get((path, name), None) is not value):
                found.append((".".join(("self", path, name) if path else ("self", name)), value))
    return found


def stored_loss_attributes(
    model: nn.Module, names: list[str], before: dict[tuple[str, str], Any]
) -> list[torch.Tensor | None]:
    """The tensors a forward that ran since ``before`` (:func:`tensor_attributes`) stored in the
    attributes ``names`` (:func:`stored_losses`' names) of ``model``; None where it stored none."""
    out = []
    for name in names:
        path, _, attr = name[len("self."):].rpartition(".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            out.append(None)
            continue
        value = vars(module).get(attr)
        fresh = isinstance(value, torch.Tensor) and before.get((path, attr)) is not value
        out.append(value if fresh else None)
    return out


def restore_attributes(model: nn.Module, before: dict[tuple[str, str], Any]) -> None:
    """Put back the tensor attributes a forward changed (a stored loss holds its autograd graph)."""
    for path, module in model.named_modules():
        for name, value in list(vars(module).items()):
            if not isinstance(value, torch.Tensor):
                continue
            key = (path, name)
            if key not in before:
                del module.__dict__[name]
            elif before[key] is not value:
                module.__dict__[name] = before[key]


# ---------------------------------------------------------------- comparison


@dataclass
class TensorDiff:
    """One compared tensor: ``name`` is e.g. ``eval output.logits`` or ``grad encoder.layer.0...``."""

    name: str
    max_abs: float
    ok: bool
    note: str = ""


@dataclass
class EquivalenceResult:
    equivalent: bool
    max_abs_diff: float  # largest |original - optimized| over everything compared
    worst: str  # name of the tensor with the largest failing (or, if all pass, largest) difference
    compared: int  # number of tensors compared
    tolerance: Tolerance
    error: str = ""  # a failure to load weights or to run the optimized model
    failures: list[TensorDiff] = field(default_factory=list)
    # BatchNorm running stats were at initialization and were calibrated first (see
    # _calibrate_fresh_batch_norm); the models' buffers are restored afterwards.
    calibrated_batch_norm: bool = False
    # Outputs of the original's training forward that the optimized model does not return
    # there (logits of a causal LM whose loss is fused with its head): its loss and every
    # gradient are compared instead.
    not_returned: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.error:
            return f"not equivalent: {self.error}"
        verdict = "equivalent" if self.equivalent else "NOT equivalent"
        return (
            f"{verdict}: {self.compared} tensors compared (eval outputs, train outputs, gradients, "
            f"buffers), max |diff| {self.max_abs_diff:.3g} at {self.worst or '-'} "
            f"(atol {self.tolerance.atol:g}, rtol {self.tolerance.rtol:g})"
            + ("; BatchNorm statistics calibrated first" if self.calibrated_batch_norm else "")
            + (f"; not returned in training (loss and gradients compared): {', '.join(self.not_returned)}"
               if self.not_returned else "")
        )

    def to_json(self) -> dict:
        return {
            "equivalent": self.equivalent,
            "max_abs_diff": self.max_abs_diff,
            "worst": self.worst,
            "compared": self.compared,
            "atol": self.tolerance.atol,
            "rtol": self.tolerance.rtol,
            **({"error": self.error} if self.error else {}),
            "calibrated_batch_norm": self.calibrated_batch_norm,
            **({"not_returned_in_training": self.not_returned} if self.not_returned else {}),
            "failures": [
                {"name": f.name, "max_abs": f.max_abs, **({"note": f.note} if f.note else {})}
                for f in self.failures[:20]
            ],
        }


def compare_tensor(name: str, expected: torch.Tensor, actual: torch.Tensor, tol: Tolerance) -> TensorDiff:
    if expected.shape != actual.shape:
        return TensorDiff(name, math.inf, False, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if expected.numel() == 0:
        return TensorDiff(name, 0.0, True)
    if not expected.is_floating_point() and not expected.is_complex():
        equal = torch.equal(expected, actual.to(expected.dtype))
        return TensorDiff(name, 0.0 if equal else math.inf, equal, "" if equal else "integer values differ")
    if expected.is_complex() or actual.is_complex():
        # compared as (real, imaginary) pairs: .float() would drop the imaginary part
        expected = torch.view_as_real(expected.detach().resolve_conj().to(torch.complex64))
        actual = torch.view_as_real(actual.detach().resolve_conj().to(torch.complex64))
    e = expected.detach().float()
    a = actual.detach().to(e.device).float()
    both_nan = torch.isnan(e) & torch.isnan(a)
    diff = (e - a).abs().masked_fill(both_nan, 0.0)
    max_abs = float(diff.max()) if not torch.isnan(diff).any() else math.inf
    ok = bool(torch.isclose(a, e, atol=tol.atol, rtol=tol.rtol, equal_nan=True).all())
    return TensorDiff(name, max_abs, ok)


def _grads_under_state_dict_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of every parameter, keyed like ``model.state_dict()``.

    Temporarily points each parameter's data at its gradient and asks the model for its
    state dict, so the kernel modules' save hooks do the name mapping (and slicing of fused
    weights) exactly as they do for checkpoints. Parameters without a gradient read as zeros.
    """
    params = list(model.named_parameters(remove_duplicate=True))
    saved = []
    with torch.no_grad():
        try:
            for _, param in params:
                saved.append((param, param.data))
                param.data = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        finally:
            for param, data in saved:
                param.data = data
    return state


def _run(model: nn.Module, example_inputs: Any, train: bool, seed: int):
    model.train(train)
    torch.manual_seed(seed)
    if train:
        model.zero_grad(set_to_none=True)
        return call_model(model, example_inputs)
    with torch.no_grad():
        return call_model(model, example_inputs)


def load_same_weights(original: nn.Module, optimized: nn.Module) -> None:
    """Load the original's weights into the optimized model, strictly, and check the
    optimized model's own state dict has exactly the original's keys and shapes (so that
    loading works the other way round too). Raises ``RuntimeError`` with the reason."""
    original_state = original.state_dict()
    optimized.load_state_dict(original_state, strict=True)
    back = optimized.state_dict()
    missing = sorted(set(original_state) - set(back))
    extra = sorted(set(back) - set(original_state))
    if missing or extra:
        raise RuntimeError(
            "state dict not compatible both ways: optimized model "
            + (f"lacks {missing[:3]} " if missing else "")
            + (f"adds {extra[:3]}" if extra else "")
        )
    for key, value in original_state.items():
        if back[key].shape != value.shape:
            raise RuntimeError(f"state dict key {key}: shape {tuple(back[key].shape)} != {tuple(value.shape)}")


def _restore(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, value in buffers:
            buf.copy_(value)


def _calibrate_fresh_batch_norm(model: nn.Module, example_inputs: Any, passes: int = 3) -> bool:
    """Give BatchNorm layers whose running statistics are still at initialization (mean 0,
    var 1) realistic ones, with a few train-mode forward passes without gradients.

    Why: a freshly built model (no checkpoint) in eval mode then does not normalize at all,
    activations grow layer over layer (ResNet-50: |x| ~ 360 at the output), and the
    rounding difference of a legitimate rewrite (BN folded into the conv) exceeds an
    element-wise fp32 tolerance on elements that cancel to ~0. Calibrated statistics are what
    any trained checkpoint has. The original's buffers are restored by the caller.
    """
    fresh = [
        m for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
        and bool((m.running_mean == 0).all()) and bool((m.running_var == 1).all())
    ]
    if not fresh:
        return False
    was_training = model.training
    try:
        with dropout_disabled(model):
            model.train()
            with torch.no_grad():
                for _ in range(passes):
                    call_model(model, example_inputs)
    finally:
        model.train(was_training)
    return True


def check_equivalence(
    original: nn.Module,
    optimized: nn.Module,
    example_inputs: Any,
    *,
    tolerance: Tolerance | None = None,
    seed: int = 0,
    load_weights: bool = True,
) -> EquivalenceResult:
    """Compare ``optimized`` against ``original`` (same weights), forward and backward.

    Both models are left as they were: training flag, dropout settings and buffers restored,
    gradients cleared. The original's weights are loaded into ``optimized`` (strict) unless
    ``load_weights`` is False. The kernels' fused paths run wherever their own checks allow, at
    any size (``adopter.kernels.cost.ignored``): the check proves the fused math.
    """
    from adopter.kernels.cost import ignored

    with ignored():
        return _check_equivalence(original, optimized, example_inputs, tolerance=tolerance, seed=seed,
                                  load_weights=load_weights)


def _check_equivalence(
    original: nn.Module,
    optimized: nn.Module,
    example_inputs: Any,
    *,
    tolerance: Tolerance | None,
    seed: int,
    load_weights: bool,
) -> EquivalenceResult:
    param = next(iter(original.parameters()), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    tol = tolerance or tolerance_for(dtype, device)
    inputs = move_inputs(example_inputs, device)

    original_buffers = [(buf, buf.detach().clone()) for buf in original.buffers()]
    calibrated = load_weights and _calibrate_fresh_batch_norm(original, inputs)

    def fail(message: str) -> EquivalenceResult:
        _restore(original_buffers)
        return EquivalenceResult(False, math.inf, "", 0, tol, error=message)
    if load_weights:
        try:
            load_same_weights(original, optimized)
        except Exception as exc:  # noqa: BLE001 - any failure means "not equivalent", with the reason
            return fail(f"weights do not load: {one_line(exc)}")

    diffs: list[TensorDiff] = []
    not_returned: list[str] = []
    was_training = (original.training, optimized.training)
    # The train-mode forward updates buffers (BatchNorm running stats): put them back after.
    saved_buffers = [
        [(buf, buf.detach().clone()) for buf in model.buffers()] for model in (original, optimized)
    ]
    saved_attributes = [tensor_attributes(model) for model in (original, optimized)]
    try:
        with dropout_disabled(original, optimized):
            # eval forward
            expected = flatten_tensors(_run(original, inputs, False, seed))
            try:
                actual = flatten_tensors(_run(optimized, inputs, False, seed))
            except Exception as exc:  # noqa: BLE001
                return fail(f"optimized model fails in eval mode: {one_line(exc)}")
            diffs += _compare_lists("eval ", expected, actual, tol)

            # train forward + backward
            before = tensor_attributes(original)
            expected_outputs = _run(original, inputs, True, seed)
            stored = stored_losses(original, before)
            before_optimized = tensor_attributes(optimized)
            try:
                actual_outputs = _run(optimized, inputs, True, seed)
            except Exception as exc:  # noqa: BLE001
                return fail(f"optimized model fails in train mode: {one_line(exc)}")
            expected, actual = flatten_tensors(expected_outputs), flatten_tensors(actual_outputs)
            own = model_loss(expected_outputs)
            if own is None and stored:
                # The forward stored its loss on a module and returned the rest (llama2.c's
                # ``self.last_loss``): training back-propagates that loss, with the outputs both
                # models return; an output the optimized model leaves out in training is reported.
                names = [name for name, _ in stored]
                stored_actual = [(name, t) for name, t in zip(names, stored_loss_attributes(optimized, names, before_optimized))
                                 if t is not None]
                present = {name for name, _ in actual}
                not_returned = [name for name, _ in expected if name not in present]
                expected = [(name, t) for name, t in expected if name in present]
                diffs += _compare_lists("train ", stored, stored_actual, tol)
                common = [(name, dict(actual)[name]) for name, _ in expected]
                actual_loss = projected(common, seed)
                for _, t in stored_actual:  # one left out fails above; the gradients compare the rest
                    actual_loss = t.float() if actual_loss is None else actual_loss + t.float()
                expected_loss = projected(expected, seed)
                for _, t in stored:
                    expected_loss = t.float() if expected_loss is None else expected_loss + t.float()
                losses = (expected_loss, actual_loss)
            else:
                losses = (training_loss(expected_outputs, seed), training_loss(actual_outputs, seed))
                if model_loss(actual_outputs) is not None:
                    # The loss drove the backward: an output left out in training (None) is reported,
                    # the loss and every gradient below are what must agree.
                    present = {name for name, _ in actual}
                    not_returned = [name for name, _ in expected if name not in present]
                    expected = [(name, t) for name, t in expected if name in present]
            for loss in losses:
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
            diffs += _compare_lists("train ", expected, actual, tol)

            param_names = {name for name, _ in original.named_parameters(remove_duplicate=False)}
            expected_grads = _grads_under_state_dict_names(original)
            try:
                actual_grads = _grads_under_state_dict_names(optimized)
            except Exception as exc:  # noqa: BLE001
                return fail(f"optimized model's gradients cannot be mapped to state-dict names: {one_line(exc)}")
            for key in sorted(expected_grads):
                if key not in param_names:
                    continue
                if key not in actual_grads:
                    diffs.append(TensorDiff(f"grad {key}", math.inf, False, "no such parameter"))
                    continue
                diffs.append(compare_tensor(f"grad {key}", expected_grads[key], actual_grads[key], tol))

            # buffers after the train step (BatchNorm running stats, ...)
            expected_state = original.state_dict()
            actual_state = optimized.state_dict()
            for key, value in expected_state.items():
                if key in param_names or key not in actual_state:
                    continue
                diffs.append(compare_tensor(f"buffer {key}", value, actual_state[key], tol))
    finally:
        for model, training, buffers, attributes in zip((original, optimized), was_training, saved_buffers,
                                                        saved_attributes):
            restore_attributes(model, attributes)
            model.zero_grad(set_to_none=True)
            model.train(training)
            with torch.no_grad():
                for buf, value in buffers:
                    buf.copy_(value)
        _restore(original_buffers)

    failures = [d for d in diffs if not d.ok]
    pool = failures or diffs
    worst = max(pool, key=lambda d: d.max_abs, default=None)
    max_abs = max((d.max_abs for d in diffs), default=0.0)
    return EquivalenceResult(
        equivalent=not failures and bool(diffs),
        max_abs_diff=max_abs,
        worst=worst.name if worst else "",
        compared=len(diffs),
        tolerance=tol,
        error="" if diffs else "the model produced no tensors to compare",
        failures=sorted(failures, key=lambda d: -d.max_abs),
        calibrated_batch_norm=calibrated,
        not_returned=not_returned,
    )


def _compare_lists(prefix: str, expected, actual, tol: Tolerance) -> list[TensorDiff]:
    diffs = []
    actual_by_name = dict(actual)
    for name, tensor in expected:
        if name not in actual_by_name:
            diffs.append(TensorDiff(prefix + name, math.inf, False, "missing from the optimized model's output"))
            continue
        diffs.append(compare_tensor(prefix + name, tensor, actual_by_name[name], tol))
    return diffs


ModelFactory = Callable[[type], nn.Module]
