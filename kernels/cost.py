"""Whether a kernel's fused path pays for a call of this size, on this backend, at this thread count,
in this grad mode: read from a calibration measured on the backend (``adopter calibrate``).

A calibration holds, per thread count, kernel and mode (``train``: grad enabled, forward and
backward timed; ``infer``: forward under no_grad), points measured side by side: at an input of
``size`` elements, the original path's time over the fused path's (``ratio`` > 1: fused faster) and
the 95 % interval of that median (``low``, ``high``). Along a kernel's sizes the medians are made
non-decreasing (pool-adjacent-violators): a fused call saves work in proportion to its size and
costs its guard's constant overhead, so its gain grows with size, and one noisy point (a busy
machine) must not switch off the sizes around it. Between measured sizes the fitted ratio is
interpolated on log size. A point does *not pay* when that fitted ratio is
more than :data:`NOISE` below 1: the fused path was measured slower there. (Not "only where
measurably faster": a kernel's gain in a network — the BatchNorm fold's ReLU epilogue, memory
traffic saved between layers — can exceed what one call measured alone shows, and the model-level
ablation of ``adopter verify`` drops a kernel that costs there.) Beyond the measured sizes, the nearest one's fitted ratio holds.

Which calibration: the file named by ``ADOPTER_CALIBRATION`` (``none``: no calibration), else the user's own
(``adopter calibrate`` writes ``$XDG_CACHE_HOME/adopter/calibration-<device>.json``), else the one
shipped for the device type (``calibration/<device>.json``, fitted on the project's CI machine:
``benchmarks/results/calibration_<device>.json``). A device type, kernel or mode without a
calibration keeps the fused path (nothing measured says otherwise: CUDA's triton kernels today).

Decisions are cached per (kernel, device, mode, thread count, power-of-two size bucket), decided at
the bucket's geometric middle, so the check costs a dict lookup per call.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ENV = "ADOPTER_CALIBRATION"
FORMAT = "adopter-calibration/1"
# a median ratio further than this below 1 is a measured slowdown
NOISE = 0.01
SHIPPED = Path(__file__).parent / "calibration"

# tests switch the cost model off to reach the fused paths at small shapes (tests/conftest.py)
ENABLED = True
_LOCAL = threading.local()


@contextlib.contextmanager
def ignored() -> Iterator[None]:
    """Every kernel's fused path where its own checks allow, whatever the calibration says, in this
    thread while the block runs: equivalence checks prove the fused math at the small sizes they
    run (a user's production sizes are where it pays)."""
    previous = getattr(_LOCAL, "ignored", False)
    _LOCAL.ignored = True
    try:
        yield
    finally:
        _LOCAL.ignored = previous


@dataclass(frozen=True)
class Point:
    """One measured size: original time / fused time, median and 95 % interval; ``fitted``: the
    median made non-decreasing along the kernel's sizes (module doc; the median when alone)."""

    size: int
    ratio: float
    low: float
    high: float
    fitted: float | None = None

    @property
    def pays(self) -> bool:
        """False where the fused path was measured slower (module doc)."""
        return (self.ratio if self.fitted is None else self.fitted) >= 1.0 - NOISE


def monotone(points: list[Point]) -> tuple[Point, ...]:
    """``points`` by size with ``fitted`` set: the non-decreasing least-squares fit of their medians
    (pool adjacent violators)."""
    ordered = sorted(points, key=lambda p: p.size)
    blocks: list[list[float]] = []  # [sum, count]
    for p in ordered:
        blocks.append([p.ratio, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return tuple(Point(p.size, p.ratio, p.low, p.high, round(f, 4)) for p, f in zip(ordered, fitted))


@dataclass(frozen=True)
class Calibration:
    """Points per thread count, kernel and mode, for one device type; ``source`` names the file."""

    device: str
    source: str
    points: dict[int, dict[str, dict[str, tuple[Point, ...]]]]

    def curve(self, kernel: str, mode: str, threads: int) -> tuple[Point, ...]:
        # the nearest thread count *that measured this kernel in this mode*: a section calibrating
        # only some kernels (a 2-thread run of two new kernels) must not leave every other kernel
        # with no curve at that count, which reads as "pays" and runs it fused everywhere
        measured = [n for n, kernels in self.points.items() if kernels.get(kernel, {}).get(mode)]
        if not measured:
            return ()
        nearest = min(measured, key=lambda n: (abs(math.log(n) - math.log(max(threads, 1))), n))
        return self.points[nearest][kernel][mode]


def parse(data: dict, source: str) -> Calibration:
    """A calibration from its JSON form (``adopter calibrate``'s output); ValueError when malformed."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{source}: not an {FORMAT} file")
    points: dict[int, dict[str, dict[str, tuple[Point, ...]]]] = {}
    for threads, kernels in data.get("threads", {}).items():
        per_kernel = points.setdefault(int(threads), {})
        for kernel, modes in kernels.items():
            per_kernel[kernel] = {
                mode: monotone([Point(int(p["size"]), float(p["ratio"]), float(p["low"]), float(p["high"]))
                                for p in measured])
                for mode, measured in modes.items()
            }
    return Calibration(str(data.get("device", "")), source, points)


def user_path(device: str) -> Path:
    """Where ``adopter calibrate`` keeps this user's calibration for ``device``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "adopter" / f"calibration-{device}.json"


_LOADED: dict[str, Calibration | None] = {}
_DECIDED: dict[tuple, str] = {}


def calibration(device: str) -> Calibration | None:
    """The calibration in force for ``device`` (see the module doc), None when there is none."""
    if device in _LOADED:
        return _LOADED[device]
    found = None
    named = os.environ.get(ENV)
    if named == "none":  # (no calibration: every fused path where its own checks allow)
        _LOADED[device] = None
        return None
    for path in ([Path(named)] if named else [user_path(device), SHIPPED / f"{device}.json"]):
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                found = parse(json.load(f), str(path))
            if found.device != device:
                found = None
            break
    _LOADED[device] = found
    return found


def reload() -> None:
    """Forget loaded calibrations and cached decisions (after ``adopter calibrate`` wrote one)."""
    _LOADED.clear()
    _DECIDED.clear()


def estimate(curve: tuple[Point, ...], size: float) -> float | None:
    """The fitted ratio at ``size``: interpolated on log size between the measured sizes around it,
    the nearest one's beyond them; None when nothing is measured."""
    if not curve:
        return None
    fitted = [p.ratio if p.fitted is None else p.fitted for p in curve]
    if size <= curve[0].size:
        return fitted[0]
    for (a, fa), (b, fb) in zip(zip(curve, fitted), zip(curve[1:], fitted[1:])):
        if size <= b.size:
            t = math.log(size / a.size) / math.log(b.size / a.size) if b.size > a.size else 1.0
            return fa + t * (fb - fa)
    return fitted[-1]


def verdict(curve: tuple[Point, ...], size: float) -> Point | None:
    """None when the fused path pays at ``size`` on ``curve`` (or nothing is measured), else the
    measured point nearest to ``size`` (on log scale), whose figures say why not."""
    value = estimate(curve, size)
    if value is None or value >= 1.0 - NOISE:
        return None
    return min(curve, key=lambda p: abs(math.log(max(size, 1) / p.size)))


def cost_reason(kernel: str, x: object, size: int | Callable[[], int | None] | None = None,
                variant: str | Callable[[], str] = "") -> str:
    """Why ``kernel``'s fused path does not pay for a call on ``x`` (``size`` elements, default
    ``x.numel()``; ``variant``: a form calibrated apart, read as ``kernel@variant``) in the current
    grad mode and thread count: "" when it pays or nothing is known. ``size`` and ``variant`` may be
    callables, called only when the cost model is consulted (after the caller's mode checks: under
    jit.trace, vmap or compile they are never read)."""
    if not ENABLED or not isinstance(x, torch.Tensor) or getattr(_LOCAL, "ignored", False):
        return ""
    if callable(size):
        size = size()
    if callable(variant):
        variant = variant()
    if variant:
        kernel = f"{kernel}@{variant}"
    device = x.device.type
    mode = "train" if torch.is_grad_enabled() else "infer"
    threads = torch.get_num_threads()
    n = x.numel() if size is None else size
    bucket = max(int(n), 1).bit_length()
    key = (kernel, device, mode, threads, bucket)
    why = _DECIDED.get(key)
    if why is None:
        why = ""
        found = calibration(device)
        if found is not None:
            curve = found.curve(kernel, mode, threads)
            middle = 2 ** (bucket - 0.5)
            point = verdict(curve, middle)
            if point is not None:
                why = (f"{device}, {mode}, {threads} thread(s): the fused path does not pay at this size "
                       f"(an estimated {estimate(curve, middle):.2f}x; measured {point.ratio:.2f}x "
                       f"[{point.low:.2f}-{point.high:.2f}] at {point.size:,} elements: {Path(found.source).name})")
        _DECIDED[key] = why
    return why


__all__ = ["ENABLED", "ENV", "FORMAT", "NOISE", "Calibration", "Point", "calibration", "cost_reason", "estimate", "ignored", "monotone", "parse",
           "reload", "user_path", "verdict"]
