"""Backend selection for every kernel, in one place.

A kernel call asks ``select_backend(op, tensors, has_triton=..., has_xformers=...)`` and gets back
``"triton"``, ``"xformers"`` or ``"torch"``:

* ``ADOPTER_KERNEL_BACKEND=torch`` always gives torch.
* ``ADOPTER_KERNEL_BACKEND=triton|xformers`` forces that backend for every op that has a kernel of
  that kind for the given inputs (the op says so with ``has_triton``/``has_xformers``); ops without
  one use torch. Forcing a backend that cannot run here (not installed, CPU tensors without
  ``TRITON_INTERPRET=1``, xformers without an operator for the device) raises
  :class:`KernelBackendError` instead of silently measuring something else.
* Unset (auto): triton/xformers only for CUDA tensors when the package imports and supports the
  inputs; torch otherwise (CPU, unsupported dtype, xformers without operators).

Nothing here imports triton or xformers at module import time.
"""
from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable, Iterable

import torch

ENV_VAR = "ADOPTER_KERNEL_BACKEND"
BACKENDS = ("torch", "triton", "xformers")
# dtypes the triton kernels are written (and tested) for.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelBackendError(RuntimeError):
    """A forced backend (ADOPTER_KERNEL_BACKEND) cannot run the given inputs."""


def requested_backend() -> str | None:
    """The backend forced by ``ADOPTER_KERNEL_BACKEND`` (read at every call), or None for auto."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in BACKENDS:
        raise KernelBackendError(f"{ENV_VAR}={value!r} is not one of {', '.join(BACKENDS)} (or auto)")
    return value


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result(fn)``: torch.compile calls ``fn`` while tracing and
    bakes the result into the graph (tracing into importlib or an xformers probe call would break
    it). Spelled out because importing ``torch._dynamo`` here would import triton with the package.
    """
    fn._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets
    return fn


@_constant_under_compile
def _import_ok(name: str) -> bool:
    return _import_ok_cached(name)


@functools.cache
def _import_ok_cached(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001  (ImportError, or a broken install raising anything at import)
        return False
    return True


def triton_installed() -> bool:
    return _import_ok("triton")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _devices(tensors: Iterable[torch.Tensor | None]) -> set:
    return {t.device.type for t in tensors if t is not None}


def triton_can_run(tensors: Iterable[torch.Tensor | None]) -> bool:
    """triton runs on CUDA tensors, and on CPU tensors only under the interpreter."""
    devices = _devices(tensors)
    if not triton_installed() or len(devices) != 1:
        return False
    (device,) = devices
    return device == "cuda" or (device == "cpu" and triton_interpreting())


@_constant_under_compile
def xformers_supports(device_type: str, dtype: torch.dtype) -> bool:
    """Cached probe: does xformers have a memory-efficient attention operator for this device/dtype?

    xformers can import without any usable operator (e.g. built for another torch, or CPU only),
    so the only reliable test is to run a tiny call.
    """
    return _xformers_supports_cached(device_type, dtype)


@functools.cache
def _xformers_supports_cached(device_type: str, dtype: torch.dtype) -> bool:
    if device_type != "cuda" or not _import_ok("xformers.ops"):
        return False
    try:
        import xformers.ops as xops

        q = torch.zeros(1, 8, 1, 32, device=device_type, dtype=dtype)
        xops.memory_efficient_attention(q, q, q)
    except Exception:  # noqa: BLE001  (any failure means: no usable operator)
        return False
    return True


_LAST = threading.local()


def last_backend() -> str:
    """The backend the last :func:`select_backend` call of this thread chose ("torch" if none)."""
    return getattr(_LAST, "backend", "torch")


def select_backend(
    op: str,
    tensors: Iterable[torch.Tensor | None],
    *,
    has_triton: bool | Callable[[], bool] = False,
    has_xformers: bool | Callable[[], bool] = False,
) -> str:
    """Pick the backend for one call of ``op`` on ``tensors``.

    ``has_triton``/``has_xformers``: the op has a kernel of that kind for these inputs (dtype, layout
    and size checks are the op's business; device and installation checks are done here). A callable
    is evaluated only when that backend is otherwise possible, so CPU calls never pay for it.
    """
    backend = _select_backend(op, [t for t in tensors if t is not None], has_triton, has_xformers)
    if not torch.compiler.is_compiling():
        _LAST.backend = backend
    return backend


def _select_backend(op, tensors, has_triton, has_xformers) -> str:
    forced = requested_backend()
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not _truth(has_triton):
            return "torch"
        if not triton_can_run(tensors):
            raise KernelBackendError(
                f"{ENV_VAR}=triton but triton cannot run {op} on {sorted(_devices(tensors))} tensors "
                f"(triton installed: {triton_installed()}; CPU needs TRITON_INTERPRET=1)"
            )
        return "triton"
    if forced == "xformers":
        if not _truth(has_xformers):
            return "torch"
        t = tensors[0]
        if not xformers_supports(t.device.type, t.dtype):
            raise KernelBackendError(
                f"{ENV_VAR}=xformers but xformers has no operator for {op} on {t.device.type} {t.dtype}"
            )
        return "xformers"
    # auto: accelerated kernels for CUDA tensors only (the triton interpreter is a debugging tool).
    if _devices(tensors) != {"cuda"}:
        return "torch"
    if has_xformers and xformers_supports("cuda", tensors[0].dtype) and _truth(has_xformers):
        return "xformers"
    if has_triton and triton_installed() and _truth(has_triton):
        return "triton"
    return "torch"


def _truth(flag: bool | Callable[[], bool]) -> bool:
    return bool(flag()) if callable(flag) else bool(flag)


def triton_dtype_ok(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype in TRITON_DTYPES for t in tensors)


def autocast_to_fp32(device_type: str) -> bool:
    """Whether autocast runs ops on autocast's fp32 list (``layer_norm``, ``softmax``) in fp32 here.

    On CUDA it does; CPU autocast leaves them in the input's precision.
    """
    return device_type == "cuda" and torch.is_autocast_enabled(device_type)


def fresh_seed(device: torch.device | str = "cpu") -> torch.Tensor:
    """A dropout seed: a one-element int64 tensor on ``device`` that kernels load themselves.

    Drawn from torch's default generator of that device, so ``torch.manual_seed`` reproduces it;
    never read back to the host (no device sync, no graph break under torch.compile).
    """
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def seed_tensor(seed: int | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``seed`` as the one-element int64 tensor on ``device`` that :func:`fresh_seed` returns."""
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64).reshape(1)
    return torch.full((1,), int(seed), dtype=torch.int64, device=device)
