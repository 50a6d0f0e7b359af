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
from collections.abc import Iterator

import torch

OFF_ENV = "ADOPTER_KERNELS_OFF"

# kernel -> {device type: why the original path is taken there}. Filled from measurements only
# (benchmarks/bench_stacking.py --ablation writes the per-kernel numbers these rest on).
BACKEND_POLICY: dict[str, dict[str, str]] = {}

# kernel -> why torch.compile gets the original math (inductor's own fusion is at least as good).
COMPILE_POLICY: dict[str, str] = {}

_LOCAL = threading.local()


def _switched_off() -> frozenset[str]:
    names = getattr(_LOCAL, "off", frozenset())
    env = os.environ.get(OFF_ENV, "")
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


def policy_reason(kernel: str, *tensors: object) -> str:
    """Why ``kernel`` takes its original path regardless of its inputs' shapes ("" when it may
    fuse): torch.compile tracing a kernel inductor fuses better, a measured backend policy for the
    inputs' device, or a switch."""
    if torch.compiler.is_compiling():
        return COMPILE_POLICY.get(kernel, "")
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
    return ""


__all__ = ["BACKEND_POLICY", "COMPILE_POLICY", "OFF_ENV", "kernels_off", "policy_reason"]
