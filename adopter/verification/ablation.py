"""What each kernel contributes, measured on the optimized model itself: leave-one-out ablation.

The optimized model's step is timed beside the same step with one kernel switched off
(``adopter.kernels.policy.kernels_off``: that kernel's sites run their original math, every other
kernel stays fused), alternating, each variant's process CPU time and wall time per step (as the
main benchmark). A kernel's *speed contribution* is (step time without it) / (step time with all):
above 1 it makes the step faster. Its *memory contribution* is (peak without it) / (peak with all):
above 1 it saves memory. A kernel pays its way when it makes the step measurably faster, or saves
memory at a small cost in speed (not measurably over 3%: the upper end of the ratio's 95% interval
decides, never the median alone, so a kernel whose cost sits at the 3% line is judged the same
in every run instead of flipping with the machine's noise); it *costs more than it saves* when it
makes the step measurably slower, or takes more memory, without either gain.

Only kernels that ran fused in the measured step are ablated (a kernel that already takes the
original path here, by its run-time guard or the backend policy, has nothing to switch off).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from adopter.verification.benchmark import (
    FASTER,
    INCONCLUSIVE,
    SLOWER,
    _bootstrap_median_interval,
    decide,
    peak_step_memory,
    run_pytest_benchmark,
)

ALL = "all kernels"
# an effect smaller than this (relative) is no effect, however precisely it is measured
MIN_EFFECT = 0.01
# a memory saving pays for at most this much speed
SMALL_SPEED_COST = 0.03
PAYS, NEUTRAL, COSTS, UNDECIDED = "pays its way", "no measurable effect", "costs more than it saves", "undecided"
# benchmark.decide's verdicts on (time without) / (time with), said of the kernel
VERDICTS = {FASTER: "the kernel makes the step faster", SLOWER: "the kernel makes the step slower",
            INCONCLUSIVE: INCONCLUSIVE}


@dataclass
class KernelContribution:
    kernel: str
    speed: float  # median over blocks of (time without the kernel) / (time with all), robust figure
    speed_low: float
    speed_high: float
    speed_wall: float  # the same ratio of wall times
    memory: float  # peak memory without the kernel / with all (> 1: the kernel saves memory)
    memory_without_bytes: int
    verdict: str  # the speed ratios' verdict, in the kernel's terms (VERDICTS)
    effect: str  # PAYS, NEUTRAL, COSTS or UNDECIDED
    why: str

    @property
    def pays(self) -> bool:
        """False only when the kernel measurably costs more than it saves."""
        return self.effect != COSTS

    def to_json(self) -> dict:
        data = {k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v) for k, v in asdict(self).items()}
        return {**data, "pays": self.pays}


def _effect(speed: float, low: float, high: float, memory: float, verdict: str) -> tuple[str, str]:
    saves = memory > 1 + MIN_EFFECT
    costs_memory = memory < 1 - MIN_EFFECT
    faster = low > 1.0 and speed > 1 + MIN_EFFECT
    slower = high < 1.0 and speed < 1 - MIN_EFFECT
    if verdict.startswith("inconclusive"):
        return UNDECIDED, "the machine was too busy to measure it"
    if faster and not costs_memory:
        return PAYS, f"makes the step {100 * (speed - 1):.1f}% faster" + (
            f" and saves {100 * (1 - 1 / memory):.0f}% of peak memory" if saves else "")
    # a memory saving is given up only for a speed cost *measurably* above the small one: at
    # llama-tiny's norm kernel (x0.96-0.99 over runs, 7% memory) the median crossed 0.97 by noise
    costs_too_much_speed = high < 1 - SMALL_SPEED_COST
    if saves and not costs_too_much_speed:
        return PAYS, f"saves {100 * (1 - 1 / memory):.0f}% of peak memory" + (
            f" at {100 * (1 - speed):.1f}% of speed" if slower else ", no measurable speed cost")
    if slower or costs_memory:
        return COSTS, (f"makes the step {100 * (1 - speed):.1f}% slower" if slower else "no measurable speed gain") + (
            f" and takes {100 * (1 / memory - 1):.0f}% more peak memory" if costs_memory
            else f" for {100 * (1 - 1 / memory):.0f}% of peak memory" if saves else " and saves no memory")
    return NEUTRAL, "no measurable speed change and no memory saved"


def _ratios(without: list[list[float]], with_all: list[list[float]]) -> list[float]:
    return [statistics.median(w) / statistics.median(a) for w, a in zip(without, with_all)
            if w and a and min(min(w), min(a)) > 0]


def ablate_kernels(
    make_step: Callable[[], Callable[[], None]],
    kernels: list[str],
    *,
    device,
    json_path: str,
    time_budget_s: float = 20.0,
    robust_cpu: bool = True,
    min_blocks: int = 3,
    max_blocks: int = 12,
    progress: Callable[[str], None] | None = None,
) -> list[KernelContribution]:
    """Leave-one-out ablation of ``kernels`` (module doc). ``make_step()`` gives a fresh step of
    the optimized model (forward+backward+optimizer, or an inference forward)."""
    from adopter.kernels.policy import kernels_off

    say = progress or (lambda _msg: None)
    if not kernels:
        return []

    def without(kernel: str, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with kernels_off(kernel):
                step()

        return run

    steps: dict[str, Callable[[], None]] = {ALL: make_step()}
    for kernel in kernels:
        steps[kernel] = without(kernel, make_step())
    start = time.perf_counter()
    for step in steps.values():  # warm-up: first-call allocations, optimizer state
        step()
    step_s = (time.perf_counter() - start) / len(steps)
    blocks = max(min_blocks, min(max_blocks, int(time_budget_s / max(step_s * len(steps), 1e-9))))
    say(f"ablation: {len(kernels)} kernel(s) switched off one at a time, {blocks} alternating blocks")
    memory = {name: peak_step_memory(step, device)[0] for name, step in steps.items()}
    cpu: dict[str, list[list[float]]] = {}
    wall, _ = run_pytest_benchmark(steps, blocks=blocks, rounds_per_block=1, iterations=1, warmup_rounds=0,
                                   json_path=json_path, cpu_out=cpu)
    loads = [w / c for name in steps for wb, cb in zip(wall[name], cpu[name]) for w, c in zip(wb, cb) if c > 0]
    load = statistics.median(loads) if loads else math.nan
    out = []
    for kernel in kernels:
        wall_ratios = _ratios(wall[kernel], wall[ALL])
        cpu_ratios = _ratios(cpu[kernel], cpu[ALL])
        robust = cpu_ratios if (robust_cpu and cpu_ratios) else wall_ratios
        speed = statistics.median(robust)
        low, high = _bootstrap_median_interval(robust)
        verdict, _ = decide(robust, load=load)
        verdict = VERDICTS.get(verdict, verdict)
        mem = memory[kernel] / memory[ALL] if memory[ALL] else math.nan
        effect, why = _effect(speed, low, high, mem, verdict)
        out.append(KernelContribution(kernel, speed, low, high, statistics.median(wall_ratios), mem, memory[kernel],
                                      verdict, effect, why))
    return out


__all__ = ["KernelContribution", "ablate_kernels"]
