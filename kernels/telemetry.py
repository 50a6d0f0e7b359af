"""Which path each kernel call took: fused (and on which backend) or the original computation.

Every public entry point of :mod:`adopter.kernels` that a rewrite emits records one
:class:`KernelCall` per call: its kernel name, ``backend`` (``"torch"``, ``"triton"``,
``"xformers"``, or ``"original"`` when the guard sent the call to the unfused code), the fallback
``reason``, and the *site*: file and qualified function name of the first frame outside
``adopter.kernels`` and ``nn.Module.__call__``'s machinery (the rewritten ``forward`` that called
the kernel, or the kernel module), a nested function named as the analysis names it
(``Net.forward.stem``). Reports attribute calls
to rewrites by that site, so a rule whose fused path never ran is visible.

Recording is a dict increment (plus a short frame walk) and is skipped while ``torch.compile``
traces, so it adds no graph break and no guard (calls inside compiled code are not counted;
:func:`record_backend` does not even read the thread's last backend there). Counting is process-global and always on; read it with
:func:`kernel_calls` or, for one measured region, :class:`count_kernel_calls`;
:func:`fallback_summary` condenses either into one line per site (fused vs original, and why).
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch

from .backend import last_backend

__all__ = [
    "FUSED_BACKENDS", "KernelCall", "count_kernel_calls", "kernel_calls", "record", "record_backend",
    "reset_kernel_calls", "SiteSummary", "fallback_summary",
    "calling_frame", "calls_made_at", "site_function", "source_file",
]

FUSED_BACKENDS = ("torch", "triton", "xformers")
ORIGINAL = "original"  # the guard ran the unfused computation of the rewritten site

# (kernel, backend, reason, file, function) -> count
_COUNTS: dict[tuple[str, str, str, str, str], int] = {}
_LOCK = threading.Lock()
_PACKAGE = __name__.rpartition(".")[0]  # "adopter.kernels"
# in-memory rewritten modules are compiled as "<original file><adopter-rewritten mod>" (the
# package loader) or "<adopter rewrite of <original file> [tag]>" (single-module loader)
_REWRITTEN_SUFFIX = "<adopter-rewritten"
_REWRITTEN_PREFIX = "<adopter rewrite of "


@dataclass(frozen=True)
class KernelCall:
    """``count`` calls of ``kernel`` from ``function`` in ``file`` that took ``backend``."""

    kernel: str
    backend: str
    reason: str
    file: str
    function: str
    count: int

    @property
    def fused(self) -> bool:
        return self.backend != ORIGINAL

    def to_json(self) -> dict:
        return {
            "kernel": self.kernel,
            "backend": self.backend,
            "fused": self.fused,
            **({"reason": self.reason} if self.reason else {}),
            "file": self.file,
            "function": self.function,
            "count": self.count,
        }


def source_file(filename: str) -> str:
    """The user's file behind a code object's file name (in-memory rewritten modules carry it in
    a pseudo name); other names unchanged."""
    cut = filename.find(_REWRITTEN_SUFFIX)
    if cut > 0:
        return filename[:cut]
    if filename.startswith(_REWRITTEN_PREFIX) and filename.endswith("]>"):
        return filename[len(_REWRITTEN_PREFIX):filename.rindex(" [")]
    return filename


def site_function(class_name: str | None, function: str) -> str:
    """The qualified name a site's calls are recorded under (``co_qualname``): ``Class.method``
    for a method given as (class, method), the name itself when already qualified or a function."""
    if class_name and not function.startswith(f"{class_name}."):
        return f"{class_name}.{function}"
    return function


class _SiteOverride(threading.local):
    site: tuple[str, str] | None = None


_OVERRIDE = _SiteOverride()


class calls_made_at:  # noqa: N801 - a context manager
    """``with calls_made_at(file, function):`` counts the kernel calls inside under that site
    instead of the caller's frame: a module of ours that runs the user's layers
    (``GuardedSequential``) reports them where the user's source built it."""

    def __init__(self, site: tuple[str, str] | None) -> None:
        self.site = site
        self._saved: tuple[str, str] | None = None

    def __enter__(self) -> None:
        self._saved = _OVERRIDE.site
        if self.site is not None:
            _OVERRIDE.site = self.site

    def __exit__(self, *exc) -> None:
        _OVERRIDE.site = self._saved


# Frames of a module's ``__call__`` (``_wrapped_call_impl``, ``_call_impl``, hook wrappers): a
# kernel module (``adopter.kernels.Softmax``) is called through them from the user's line.
_MODULE_CALL = "torch.nn.modules.module"


def _outside_kernels(frame):
    """``frame`` or the first frame out from it that is neither adopter.kernels code nor a
    module's call machinery: the user's code that called the kernel (function or module)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(_PACKAGE) or name == _MODULE_CALL):
            return frame
        frame = frame.f_back
    return None


def _site() -> tuple[str, str]:
    if _OVERRIDE.site is not None:
        return _OVERRIDE.site
    frame = _outside_kernels(sys._getframe(2))
    if frame is None:
        return "", ""
    code = frame.f_code
    # a function nested in a method is its site as the analysis names it: ``Net.forward.stem``
    qualname = getattr(code, "co_qualname", code.co_name).replace(".<locals>.", ".")
    return source_file(code.co_filename), qualname


def calling_frame():
    """The first frame outside ``adopter.kernels`` and a module's call machinery (the rewritten
    code that called the kernel), or None."""
    return _outside_kernels(sys._getframe(1))


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def record(kernel: str, backend: str, reason: str = "") -> None:
    """Count one call of ``kernel`` that ran on ``backend`` (``"original"``: fell back, ``reason``)."""
    if _compiling():
        return
    key = (kernel, backend, reason, *_site())
    with _LOCK:
        _COUNTS[key] = _COUNTS.get(key, 0) + 1


def record_backend(kernel: str) -> None:
    """Count one fused call of ``kernel`` on the backend its op chose (:func:`last_backend`). Under
    torch.compile nothing is read: tracing the thread-local backend would add a guard on it, and a
    recompilation whenever an eager call in between changed it."""
    if _compiling():
        return
    record(kernel, last_backend())


def kernel_calls() -> list[KernelCall]:
    """Every call counted since the start (or :func:`reset_kernel_calls`), one entry per kind."""
    with _LOCK:
        items = list(_COUNTS.items())
    return [KernelCall(*key, count) for key, count in sorted(items)]


def reset_kernel_calls() -> None:
    with _LOCK:
        _COUNTS.clear()


class count_kernel_calls:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with count_kernel_calls() as calls: ...`` -> ``calls.calls``: what ran inside the block."""

    def __init__(self) -> None:
        self.calls: list[KernelCall] = []
        self._before: dict = {}

    def __enter__(self) -> count_kernel_calls:
        with _LOCK:
            self._before = dict(_COUNTS)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            after = dict(_COUNTS)
        self.calls = [
            KernelCall(*key, n - self._before.get(key, 0))
            for key, n in sorted(after.items())
            if n > self._before.get(key, 0)
        ]

    def at(self, file: str, function: str) -> list[KernelCall]:
        """Calls made from ``function`` (qualified, ``Class.method``) of ``file`` (compared by real path)."""
        import os

        real = os.path.realpath(file)
        return [c for c in self.calls if c.function == function and os.path.realpath(c.file) == real]


@dataclass
class SiteSummary:
    """The calls of one ``kernel`` at one site (``function`` of ``file``): how many took the fused
    path (per backend) and how many the original computation (per fallback reason)."""

    kernel: str
    file: str
    function: str
    backends: dict[str, int]
    reasons: dict[str, int]

    @property
    def fused(self) -> int:
        return sum(self.backends.values())

    @property
    def original(self) -> int:
        return sum(self.reasons.values())

    def __str__(self) -> str:
        import os

        where = f"{self.function} ({os.path.basename(self.file)})" if self.file else self.function
        why = "; ".join(f"{reason or 'no reason given'}: {n}" for reason, n in self.reasons.items())
        return f"{where} {self.kernel}: {self.fused} fused, {self.original} original" + (f" ({why})" if why else "")

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "file": self.file, "function": self.function, "fused": self.fused,
                "original": self.original, "backends": dict(self.backends), "reasons": dict(self.reasons)}


def fallback_summary(calls=None) -> list[SiteSummary]:
    """Per site, fused vs original: ``calls`` (:func:`kernel_calls` when None, or a
    ``count_kernel_calls().calls`` list) grouped by (kernel, file, function), e.g. after wrapping
    an optimized model in PEFT LoRA and training it::

        with count_kernel_calls() as counted:
            trainer.train()
        for site in fallback_summary(counted.calls):
            print(site)  # BertIntermediate.forward (modeling_bert.py) linear_gelu: 0 fused, 6 original (Linear is not a Linear: 6)

    (``Linear`` there is PEFT's ``lora.Linear``: the guard runs the original code for a module that is
    not the plain torch class). Sites are sorted by file, function and kernel."""
    sites: dict[tuple[str, str, str], SiteSummary] = {}
    for c in kernel_calls() if calls is None else calls:
        site = sites.setdefault((c.file, c.function, c.kernel), SiteSummary(c.kernel, c.file, c.function, {}, {}))
        counts, key = (site.backends, c.backend) if c.fused else (site.reasons, c.reason)
        counts[key] = counts.get(key, 0) + c.count
    return [sites[key] for key in sorted(sites)]
