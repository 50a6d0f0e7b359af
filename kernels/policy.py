"""Whether a kernel may run fused at all, before its own checks: one place for the switches that
do not depend on the call's inputs beyond their device.

* **Measured policy** (:data:`BACKEND_POLICY`): a kernel that costs more than it saves on a backend
  (device type) takes the original path there by itself, and says why — the reason names the
  measurement (a results file under ``benchmarks/results/``). The fused LM-head loss, say, saves
  memory and time everywhere; a kernel that only re-spells what the backend already does in one
  pass does not.
* **Under torch.compile** (:data:`COMPILE_POLICY`): inductor fuses pointwise chains and
  reductions itself; an opaque kernel in its graph only stops it fusing across the kernel's edges.
  Kernels listed there run their original math while torch.compile traces, and inductor fuses it.
* **Switched off by the user or an ablation**: ``ADOPTER_KERNELS_OFF=rms_norm,rotary`` (read at
  every call), or ``with kernels_off("rms_norm"):`` in-process (the per-rule ablation of
  ``adopter verify`` measures each rule's contribution this way, on the same optimized model).

Every reason is recorded by the caller's telemetry as the fallback reason of that call.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch
import torch.autograd.forward_ad as _forward_ad

from .cost import cost_reason

OFF_ENV = "ADOPTER_KERNELS_OFF"

# kernel -> {device type: why the original path is taken there}. Filled from measurements only
# (benchmarks/bench_stacking.py --ablation writes the per-kernel numbers these rest on).
BACKEND_POLICY: dict[str, dict[str, str]] = {
    # llama-tiny training on CPU (benchmarks/results/ablation_llama-tiny.json, three runs): switching
    # the rotary kernel off changed the step time by -2.3%..+7.5% (intervals across 1.0 each time)
    # and lowered peak memory by 3% every time: the eager ops cost nothing more here. (RMSNorm and
    # the gated MLP save 7-8% of peak memory at no measurable speed cost; the LM-head loss 78%.)
    "rotary": {
        "cpu": "CPU: no faster than the original ops and 3% more peak memory in a training step "
               "(measured: benchmarks/results/ablation_llama-tiny.json)",
    },
    # Not listed: sdpa (written-out attention as SDPA) on CPU. The calibrated cost model decides per
    # call (kernels/calibration/cpu.json, measured on a quiet machine): the source's ops at
    # 1x2x16x16 (1 thread: 0.77x training, 0.83x inference; 2 threads: 0.89x, 0.78x), SDPA from
    # 2x4x64x32 in inference on one thread (1.08x) and from 4x6x197x64 otherwise (1.01-1.21x), up to
    # 2.4-4.1x at 1x8x1024x64; bfloat16 is slower as SDPA on this avx512_bf16 CPU: the source's ops.
    # An fx-traced copy of a model records the call as the adopter::sdpa op, which makes the decision
    # eager makes when the graph runs (guarded_sdpa.py), so timm's fx tests (eager against traced,
    # 1e-5) see one computation.
}

# kernel -> why torch.compile gets the original math (inductor's own fusion is at least as good).
# Measured with benchmarks/bench_stacking.py (CPU, inductor, one thread; results/stacking_*.md):
# * conv_bn, linear_bn: while compiling, the fold cannot use its eager cache, so the compiled graph
#   recomputes it (in float64) from the parameters on every call: compiled ResNet-50 inference runs
#   at 0.78x (batch 1) and 0.96x (batch 8) of compiling the original. Listed here they measured
#   0.95x and 0.99x (results/stacking_resnet-50_conv_bn_policy.md), but compiled outputs then carry
#   the unfolded rounding, which tests/kernels/test_kernels_compile.py::test_conv_bn[False] (1e-6 against the
#   eager fold) rejects; not listed until that test's tolerance or the fold under compile changes.
# * rms_norm, rotary, gated_mlp: their torch paths are autograd Functions of torch ops that dynamo
#   traces into the graph (not opaque to inductor); the original math instead bought ~2% on a
#   llama-tiny block's forward+backward and nothing measurable on its training step. On CUDA, where
#   their triton kernels are opaque to inductor, they (and dropout_add_layer_norm, linear_gelu) are
#   candidates once measured.
# * Never linear_cross_entropy: inductor cannot avoid the (tokens x vocab) logits; the custom op
#   keeps compiled training at the fused loss's memory (tests/kernels/test_compile_stacking.py).
# conv_bn / linear_bn: an eval-mode fold cannot use its eager cache while compiled, so the graph
# would recompute the fold (float64, weight-sized) at every call: compile of the optimized ResNet-50
# ran at 0.78x (batch 1) and 0.96x (batch 8) of compile of the original; with the original math
# inductor fuses the BatchNorm into the conv's epilogue itself: 0.95x / 0.99x
# (benchmarks/results/stacking_resnet-50_conv_bn_policy.md).
_FOLD_UNDER_COMPILE = "torch.compile: inductor fuses the BatchNorm after the conv itself (a traced fold is recomputed per call)"
# add_relu: inductor fuses the add and the ReLU into one loop itself (and the eager kernel's
# provenance of finite values is not traced).
COMPILE_POLICY: dict[str, str] = {
    "conv_bn": _FOLD_UNDER_COMPILE, "linear_bn": _FOLD_UNDER_COMPILE,
    "add_relu": "torch.compile: inductor fuses the add and the ReLU itself",
}

_LOCAL = threading.local()


# os.environ.get of an unset variable raises and catches a KeyError inside (~1 us, at every kernel
# call): the environment's own dict is read where the platform keeps one (os.environ stays in sync)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(OFF_ENV) if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None


def _env_off() -> str:
    if _ENV_KEY is not None:
        raw = _ENV_DATA.get(_ENV_KEY)
        return "" if raw is None else os.environ.decodevalue(raw)
    return os.environ.get(OFF_ENV, "")


def _switched_off() -> frozenset[str]:
    names = getattr(_LOCAL, "off", frozenset())
    env = _env_off()
    if env:
        names = names | {n.strip() for n in env.split(",") if n.strip()}
    return names


@contextlib.contextmanager
def kernels_off(*names: str) -> Iterator[None]:
    """Run the named kernels' original path in this thread while the block runs (eager calls;
    a graph torch.compile already traced keeps what it traced)."""
    previous = getattr(_LOCAL, "off", frozenset())
    _LOCAL.off = previous | frozenset(names)
    try:
        yield
    finally:
        _LOCAL.off = previous


def mode_reason() -> str:
    """Why no kernel may run in the current execution mode ("" in plain eager autograd): the fused
    paths implement forward and reverse-mode backward only. Under ``torch.jit.trace`` a kernel's
    Python-side choices (a packed oneDNN weight, a cached fold) would be baked into the trace as
    constants; under a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``...) and inside a
    forward-AD ``dual_level`` the autograd Functions have no vmap/jvp rules and the oneDNN ops no
    tangents. The original computation is what the user's code runs there, so it runs."""
    if torch.jit.is_tracing():
        return "torch.jit.trace: the trace records the original computation"
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "a torch.func transform (grad/vmap/jvp) is active: the original computation runs under it"
    if _forward_ad._current_level >= 0:
        return "forward-mode AD (a dual level is entered): the original computation carries tangents"
    return ""


def policy_reason(kernel: str, *tensors: object, size: int | Callable[[], int | None] | None = None,
                  variant: str | Callable[[], str] = "") -> str:
    """Why ``kernel`` takes its original path before its own checks ("" when it may fuse):
    torch.compile tracing a kernel inductor fuses better, a measured backend policy for the inputs'
    device, a switch, or the calibrated cost model (:mod:`adopter.kernels.cost`: the fused path
    does not pay at a call of this size — ``size`` elements, default the first tensor's — on this
    device, grad mode and thread count; ``variant`` names a form calibrated apart, such as a conv's
    ``channels_last`` input; both may be callables, read only when the cost model is asked)."""
    if torch.compiler.is_compiling():
        return COMPILE_POLICY.get(kernel, "")
    mode = mode_reason()
    if mode:
        return mode
    if kernel in _switched_off():
        return f"switched off ({OFF_ENV} or kernels_off)"
    policy = BACKEND_POLICY.get(kernel)
    if policy:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                why = policy.get(t.device.type, "")
                if why:
                    return why
                break
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None:
        return ""
    return cost_reason(kernel, first, size, variant)


__all__ = ["BACKEND_POLICY", "COMPILE_POLICY", "OFF_ENV", "kernels_off", "mode_reason", "policy_reason"]
