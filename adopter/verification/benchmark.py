"""Training-step benchmark (forward + backward + optimizer step) of an original model
against its optimized rewrite, run through pytest-benchmark, plus peak memory.

Noise control on a shared machine: the two variants *alternate* — the benchmark is a
sequence of blocks ``original, optimized, original, optimized, ...``, each block a few
rounds — and the speed ratio is the median of the per-pair ratios (pairs measured seconds
apart see the same machine load), with a bootstrap 95% interval that the regression gate
uses to tell a real regression from noise. The ratio of the two overall median throughputs
is kept too (``speed_ratio_of_medians``): it pools blocks measured under different load, so
it can differ from the per-pair median, and the report prints both, saying which is which.

pytest-benchmark runs in-process (``pytest.main`` on a generated module); the models and
their step functions are handed over through :data:`_STEPS`. Its JSON (every timing) is
kept at ``benchmark_json``.

Kernel paths: one more training step of the optimized model, right after the timed rounds
(so nothing is added inside them), runs under :class:`adopter.kernels.count_kernel_calls`;
``BenchmarkResult.kernel_calls`` says which kernel ran on which backend, or fell back to the
original computation, from which rewritten function.

Verdicts that survive load: every step's *process CPU time* is recorded beside its wall time. A
single-threaded CPU step's CPU time barely moves when other processes compete for the cores (its
wall time stretches while it waits), so on CPU with one torch thread the ratio the verdict and the
gate use (``speed_ratio``, ``speed_figure``) is the per-pair ratio of CPU times; elsewhere (CUDA,
several threads, where CPU time does not measure the step) it is wall time. Both are kept
(``speed_ratio_wall``, ``speed_ratio_cpu``). When the interval is wider than :data:`NARROW_WIDTH`
more pairs are measured, up to a time budget; a result neither narrow nor stable (its two halves
disagree) on a busy machine is reported ``inconclusive: machine too busy``, never "faster".

Memory: on CUDA the peak of ``torch.cuda.max_memory_allocated`` over one step; on CPU the
peak of the torch CPU allocator over one step, above what was allocated when the step
began (from the profiler's memory events) — allocation sizes are deterministic, so this
ratio does not depend on machine load.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from adopter.kernels import KernelCall, count_kernel_calls
from adopter.verification.equivalence import (
    call_model,
    flatten_tensors,
    model_loss,
    move_inputs,
    stored_loss_attributes,
    stored_losses,
    tensor_attributes,
)
from adopter.verification.gate import BUSY_LOAD

# variant name -> zero-argument training step; read by the generated benchmark module.
_STEPS: dict[str, Callable[[], None]] = {}
# (variant, block) the generated module is running; the CPU time of each call is filed under it
_BLOCK: list[tuple[str, int] | None] = [None]
_CPU_CALLS: dict[tuple[str, int], list[float]] = {}


def _cpu_timed(step: Callable[[], None]) -> Callable[[], None]:
    """``step``, filing the process CPU time of each call under the running (variant, block)."""

    def timed() -> None:
        start = time.process_time()
        step()
        _CPU_CALLS.setdefault(_BLOCK[0], []).append(time.process_time() - start)  # type: ignore[arg-type]

    return timed

VARIANTS = ("original", "optimized")
MIN_BLOCKS = 6
MAX_BLOCKS = 30
# An interval this narrow (high - low, relative to the ratio) settles a verdict; wider ones get
# more pairs while the time budget lasts.
NARROW_WIDTH = 0.06
# the two halves of the pairs agree within this (relative): the figure did not drift with load
STABLE_HALVES = 0.03
FASTER, SLOWER, SAME, INCONCLUSIVE = (
    "optimized faster", "optimized slower", "no measurable difference", "inconclusive: machine too busy",
)


@dataclass
class VariantTiming:
    name: str
    seconds: list[float]  # per training step, every measured round
    median_s: float
    throughput: float  # samples / s at the median step time
    # bootstrap 95% interval of that throughput (over the measured steps); the plot's error bars
    throughput_low: float = math.nan
    throughput_high: float = math.nan
    cpu_seconds: list[float] = field(default_factory=list)  # process CPU time per step, same rounds
    cpu_median_s: float = math.nan


@dataclass
class BenchmarkResult:
    batch_size: int
    seq_len: int | None
    device: str
    blocks: int  # alternations original/optimized
    rounds_per_block: int
    iterations: int  # steps per round (more than 1 only for very fast models)
    original: VariantTiming
    optimized: VariantTiming
    # median over the pairs of (optimized throughput / original throughput) (> 1: faster)
    speed_ratio: float
    speed_ratio_low: float  # bootstrap 95% interval of speed_ratio
    speed_ratio_high: float
    pair_ratios: list[float]
    memory_metric: str  # what was measured, named honestly
    memory_original_bytes: int
    memory_optimized_bytes: int
    memory_ratio: float  # optimized / original (< 1: less memory)
    benchmark_json: str | None = None
    notes: list[str] = field(default_factory=list)
    # optimized.throughput / original.throughput: the ratio of the overall medians (not paired)
    speed_ratio_of_medians: float = math.nan
    # what one un-timed training step of the optimized model called (see step_kernel_calls);
    # not in to_json: the verify result attributes them to the applied rules
    kernel_calls: list[KernelCall] = field(default_factory=list)
    # which time speed_ratio / pair_ratios are of: "process CPU time" or "wall time" (module doc)
    speed_figure: str = "wall time"
    speed_ratio_wall: float = math.nan
    speed_ratio_wall_low: float = math.nan
    speed_ratio_wall_high: float = math.nan
    pair_ratios_wall: list[float] = field(default_factory=list)
    speed_ratio_cpu: float = math.nan
    speed_ratio_cpu_low: float = math.nan
    speed_ratio_cpu_high: float = math.nan
    pair_ratios_cpu: list[float] = field(default_factory=list)
    load: float = math.nan  # median wall / CPU time of a step (1.0: never waited for a core)
    verdict: str = ""  # FASTER, SLOWER, SAME or INCONCLUSIVE
    verdict_detail: str = ""

    def to_json(self) -> dict:
        data = asdict(self)
        del data["kernel_calls"]
        for key in ("original", "optimized"):
            data[key]["seconds"] = [round(s, 6) for s in data[key]["seconds"]]
            data[key]["cpu_seconds"] = [round(s, 6) for s in data[key]["cpu_seconds"]]
        return data


# ---------------------------------------------------------------- training step


def training_step_loss(outputs: Any, stored: list[torch.Tensor] = ()) -> torch.Tensor:
    """The model's own loss when it computes one (a causal LM given labels: what training
    back-propagates), returned or, ``stored``, the losses its forward stored on a module
    (llama2.c's ``self.last_loss``); otherwise the mean of every differentiable output (cheap; the
    equivalence check uses a random projection instead, here only the cost matters and it must be
    identical for both)."""
    own = model_loss(outputs)
    if own is not None:
        return own.float()
    if stored:
        return torch.stack([t.float() for t in stored]).sum()
    terms = [
        t.float().mean() for _, t in flatten_tensors(outputs) if t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise ValueError("the model has no differentiable output to train on")
    return torch.stack(terms).sum()


def make_inference_step(model: nn.Module, example_inputs: Any) -> Callable[[], None]:
    """One forward in eval mode under ``torch.no_grad()`` of the model frozen as a deployment
    freezes it (``adopter.kernels.freeze``, like ``torch.jit.freeze`` or inductor's freezing: the
    weights are constants, so kernels keep what they derive from them between calls); synchronizes
    on CUDA."""
    from adopter.kernels import freeze

    param = next(iter(model.parameters()))
    device = param.device
    inputs = move_inputs(example_inputs, device)
    freeze(model)
    cuda = device.type == "cuda"

    def step() -> None:
        with torch.no_grad():
            call_model(model, inputs)
        if cuda:
            torch.cuda.synchronize(device)

    return step


def make_train_step(model: nn.Module, example_inputs: Any, *, lr: float = 1e-6) -> Callable[[], None]:
    """forward + backward + AdamW step, in train mode; synchronizes on CUDA."""
    param = next(iter(model.parameters()))
    device = param.device
    inputs = move_inputs(example_inputs, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    cuda = device.type == "cuda"

    stored_names: list[str] | None = None  # the losses the forward stores, found at the first step
    stored_keys: list[tuple[str, str]] = []  # their (module path, attribute)

    def step() -> None:
        nonlocal stored_names
        # the first step looks at every attribute; the others at those holding the loss
        before = tensor_attributes(model) if stored_names is None else dict(zip(
            stored_keys, stored_loss_attributes(model, stored_names, {})))
        outputs = call_model(model, inputs)
        if stored_names is None:
            stored_names = [name for name, _ in stored_losses(model, before)]
            stored_keys[:] = [tuple(name[len("self."):].rpartition(".")[::2]) for name in stored_names]
        stored = [t for t in stored_loss_attributes(model, stored_names, before) if t is not None]
        training_step_loss(outputs, stored).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)

    return step


def step_kernel_calls(step: Callable[[], None]) -> list[KernelCall]:
    """The adopter kernel calls of one call of ``step`` (kernel, backend or fallback, site)."""
    with count_kernel_calls() as counted:
        step()
    return counted.calls


# ---------------------------------------------------------------- memory


def peak_step_memory(step: Callable[[], None], device: torch.device) -> tuple[int, str]:
    """Peak memory of one call of ``step``: (bytes, what the number is)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)), "peak CUDA memory allocated (torch.cuda.max_memory_allocated)"
    return _cpu_allocator_peak(step), "peak torch CPU allocator delta over a training step (profiler, CPU)"


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's native library logs start/stop lines straight to file descriptor 2,
    in the middle of the command's report; send them to /dev/null while it runs."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_allocator_peak(step: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh).get("traceEvents", [])
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and int(e.get("args", {}).get("Device Type", 0)) == 0),
        key=lambda e: e.get("ts", 0),
    )
    if not memory:
        raise RuntimeError("the profiler recorded no CPU memory events")
    current = peak = 0
    for event in memory:
        current += int(event["args"].get("Bytes", 0))
        peak = max(peak, current)
    return peak


# ---------------------------------------------------------------- timing via pytest-benchmark

_BENCH_MODULE = '''\
"""Generated by adopter.verification.benchmark: alternating training-step benchmark."""
import pytest

from adopter.verification import benchmark as verify_bench

CASES = {cases!r}


@pytest.mark.parametrize("variant,block", CASES, ids=[f"{{v}}-{{b}}" for v, b in CASES])
def test_train_step(benchmark, variant, block):
    step = verify_bench._STEPS[variant]
    verify_bench._BLOCK[0] = (variant, block)
    benchmark.group = "train-step"
    benchmark.extra_info["variant"] = variant
    benchmark.extra_info["block"] = block
    benchmark.pedantic(step, rounds={rounds}, iterations={iterations}, warmup_rounds={warmup})
'''


def run_pytest_benchmark(
    steps: dict[str, Callable[[], None]],
    *,
    blocks: int,
    rounds_per_block: int,
    iterations: int,
    warmup_rounds: int,
    json_path: str,
    cpu_out: dict[str, list[list[float]]] | None = None,
) -> tuple[dict[str, list[list[float]]], str]:
    """Run the alternating benchmark in-process; returns per variant, per block, the
    per-step times (s), and pytest's output. The full pytest-benchmark JSON is written to
    ``json_path``. ``cpu_out`` (a dict) receives the same shape of per-step process CPU times."""
    # Alternate which variant goes first in a pair, so that neither always runs right after
    # the other (cache state, allocator state, clock ramp-up).
    names = list(steps)
    cases = [(variant, block) for block in range(blocks) for variant in (names if block % 2 == 0 else names[::-1])]
    _STEPS.clear()
    _STEPS.update({name: _cpu_timed(step) for name, step in steps.items()})
    _CPU_CALLS.clear()
    output = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="adopter-bench-") as tmp:
        # A fresh module name per run: pytest's importlib mode would otherwise hand a second
        # run in the same process the first run's cached module (its cases and rounds).
        module_name = f"bench_train_step_{uuid.uuid4().hex[:12]}"
        module_path = os.path.join(tmp, f"{module_name}.py")
        with open(module_path, "w") as fh:
            fh.write(
                _BENCH_MODULE.format(
                    cases=cases, rounds=rounds_per_block, iterations=iterations, warmup=warmup_rounds
                )
            )
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w") as fh:
            fh.write("[pytest]\n")
        argv = [
            module_path,
            "-c", ini,
            "--rootdir", tmp,
            "-q",
            "-p", "no:cacheprovider",
            "--import-mode=importlib",
            "--benchmark-json", os.path.abspath(json_path),
            # pytest-benchmark's own storage (default ./.benchmarks, created even when unused)
            "--benchmark-storage", "file://" + os.path.join(tmp, "storage"),
            "--benchmark-disable-gc",
            "--benchmark-sort", "name",
            "--benchmark-columns", "min,median,max,rounds",
        ]  # fmt: skip
        import pytest

        # Only pytest-benchmark: other installed plugins (random test order, xdist, ...) would
        # break the alternation, and loading them all costs seconds.
        argv += ["-p", "pytest_benchmark.plugin"]
        previous = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        # this run is no xdist worker even when its caller is one (verify inside a test run with
        # pytest -n): pytest-benchmark reads PYTEST_XDIST_WORKER and would skip every benchmark
        xdist = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("PYTEST_XDIST_")]}
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                # (pytest-benchmark opens --benchmark-json with argparse.FileType at each of
                # pytest's argument parses and closes only the last: a ResourceWarning, harmless.)
                code = pytest.main(argv)
        finally:
            _STEPS.clear()
            for name in [n for n in sys.modules if n == module_name or n.endswith("." + module_name)]:
                del sys.modules[name]
            if previous is None:
                os.environ.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
            else:
                os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = previous
            os.environ.update(xdist)
    text = output.getvalue()
    if code != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise RuntimeError(f"benchmark run failed (pytest exit {int(code)}):\n{tail}")
    with open(json_path) as fh:
        data = json.load(fh)
    per_block: dict[str, list[list[float]]] = {name: [[] for _ in range(blocks)] for name in steps}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        times = bench["stats"].get("data") or []
        per_block[info["variant"]][int(info["block"])] = [float(t) for t in times]
    if cpu_out is not None:
        # per round: the mean CPU time of its iterations (warm-up calls come first: dropped)
        for name in steps:
            cpu_out[name] = []
            for block in range(blocks):
                calls = _CPU_CALLS.get((name, block), [])[warmup_rounds * iterations:]
                cpu_out[name].append([
                    sum(calls[i:i + iterations]) / iterations for i in range(0, len(calls) - iterations + 1, iterations)
                ])
    _CPU_CALLS.clear()
    return per_block, text


def _bootstrap_median_interval(values: list[float], *, samples: int = 2000, seed: int = 0) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (math.nan, math.nan)
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(samples))
    return medians[int(0.025 * samples)], medians[int(0.975 * samples) - 1]


def calibrate_iterations(step: Callable[[], None], *, min_round_s: float = 0.1) -> tuple[int, float]:
    """Steps per round so that one round lasts at least ``min_round_s`` (timer resolution and
    scheduler jitter matter for tiny models); also returns one step's time."""
    start = time.perf_counter()
    step()
    elapsed = max(time.perf_counter() - start, 1e-6)
    return max(1, math.ceil(min_round_s / elapsed)), elapsed


def _robust_cpu(device: torch.device) -> bool:
    """Whether process CPU time measures a step here: CPU tensors on one torch thread (on CUDA
    the step waits for the device; with several threads CPU time adds up their work)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def benchmark_pair(
    original: nn.Module,
    optimized: nn.Module,
    example_inputs: Any,
    *,
    batch_size: int,
    seq_len: int | None = None,
    blocks: int | None = None,
    rounds_per_block: int = 1,
    time_budget_s: float = 20.0,
    max_time_s: float | None = None,
    warmup_rounds: int = 1,
    json_path: str,
    progress: Callable[[str], None] | None = None,
    mode: str = "train",
) -> BenchmarkResult:
    """Benchmark training steps (``mode="train"``) or no-grad eval forwards (``"inference"``) of
    both models, alternating, and their peak memory.

    ``blocks`` (pairs of original/optimized rounds) defaults to what fits ``time_budget_s``
    of timed steps, between :data:`MIN_BLOCKS` and :data:`MAX_BLOCKS`; while the interval of the
    ratio is wider than :data:`NARROW_WIDTH`, more blocks are measured until ``max_time_s`` of
    timed steps (default three times ``time_budget_s``; a given ``blocks`` is not extended)."""
    say = progress or (lambda _msg: None)
    device = next(iter(original.parameters())).device
    make = make_train_step if mode == "train" else make_inference_step
    steps = {"original": make(original, example_inputs), "optimized": make(optimized, example_inputs)}
    # Warm both up (first-call allocations, optimizer state) and pick iterations per round.
    say("warming up")
    iterations = 1
    step_s = 0.0
    for step in steps.values():
        n, elapsed = calibrate_iterations(step)
        iterations = max(iterations, n)
        step_s = max(step_s, elapsed)
    extend = blocks is None
    pair_s = 2 * rounds_per_block * iterations * step_s
    if blocks is None:
        # As many alternating pairs as fit the time budget, at least 6 (an interval needs
        # pairs), at most 30 (more buys little).
        blocks = max(MIN_BLOCKS, min(MAX_BLOCKS, int(time_budget_s / max(pair_s, 1e-9))))

    say("measuring peak memory")
    mem: dict[str, int] = {}
    metric = ""
    for name, step in steps.items():
        mem[name], metric = peak_step_memory(step, device)
    if mode != "train":
        metric = metric.replace("a training step", "an inference forward")

    per_block: dict[str, list[list[float]]] = {name: [] for name in steps}
    cpu_block: dict[str, list[list[float]]] = {name: [] for name in steps}
    budget = max_time_s if max_time_s is not None else 3 * time_budget_s
    spent = 0.0
    part = 0
    result = None
    while True:
        say(f"timing {blocks} alternating blocks x {rounds_per_block} round(s) x {iterations} step(s) per variant")
        root, ext = os.path.splitext(json_path)
        started = time.perf_counter()
        cpu: dict[str, list[list[float]]] = {}
        wall, _ = run_pytest_benchmark(
            steps,
            blocks=blocks,
            rounds_per_block=rounds_per_block,
            iterations=iterations,
            warmup_rounds=warmup_rounds,
            json_path=json_path if part == 0 else f"{root}.more{part}{ext}",
            cpu_out=cpu,
        )
        spent += time.perf_counter() - started
        for name in steps:
            per_block[name] += wall[name]
            cpu_block[name] += cpu[name]
        result = summarize(
            per_block,
            batch_size=batch_size,
            seq_len=seq_len,
            device=str(device),
            rounds_per_block=rounds_per_block,
            iterations=iterations,
            memory_metric=metric,
            memory_original=mem["original"],
            memory_optimized=mem["optimized"],
            benchmark_json=json_path,
            cpu_per_block=cpu_block,
            robust_cpu=_robust_cpu(device),
        )
        part += 1
        if not extend or _narrow(result.speed_ratio, result.speed_ratio_low, result.speed_ratio_high):
            break
        left = budget - spent
        more = min(MAX_BLOCKS, int(left / max(pair_s, 1e-9)))
        if more < 2:
            break
        say(f"speed ratio interval {result.speed_ratio_low:.3f}-{result.speed_ratio_high:.3f} is wide: more pairs")
        blocks = more if more < MIN_BLOCKS else max(MIN_BLOCKS, min(more, len(result.pair_ratios)))
    if part > 1:
        result.notes.append(f"measured in {part} runs of alternating blocks (the interval was wide)")
    if mode == "train":
        say("one more training step of the optimized model, counting its kernel calls")
    kernel_calls = step_kernel_calls(steps["optimized"])
    result.kernel_calls = kernel_calls
    return result


def _narrow(ratio: float, low: float, high: float) -> bool:
    return ratio > 0 and (high - low) / ratio <= NARROW_WIDTH


def _pair_ratios(per_block: dict[str, list[list[float]]]) -> list[float]:
    return [
        statistics.median(orig) / statistics.median(opt)
        for orig, opt in zip(per_block["original"], per_block["optimized"])
        if orig and opt
    ]


def decide(ratios: list[float], *, load: float) -> tuple[str, str]:
    """The verdict on per-pair ratios (> 1: optimized faster) and why; ``load`` is the median
    wall / CPU time of the steps. Narrow interval: its side of 1.0 decides. Wide: decided only
    when the two halves of the pairs agree (the figure did not drift with the load) or the
    machine was quiet; otherwise inconclusive."""
    if not ratios:
        return INCONCLUSIVE, "no pairs measured"
    ratio = statistics.median(ratios)
    low, high = _bootstrap_median_interval(ratios)
    side = SAME if low <= 1.0 <= high else FASTER if low > 1.0 else SLOWER
    if _narrow(ratio, low, high):
        return side, f"narrow interval (width <= {100 * NARROW_WIDTH:g}%)"
    half = len(ratios) // 2
    first, second = (statistics.median(ratios[:half]), statistics.median(ratios[half:])) if half else (ratio, ratio)
    stable = half >= 3 and abs(first / second - 1.0) <= STABLE_HALVES
    if stable:
        return side, f"interval {low:.3f}-{high:.3f} wide, but both halves of the pairs agree ({first:.3f}, {second:.3f})"
    if math.isnan(load) or load <= BUSY_LOAD:
        return side, f"interval {low:.3f}-{high:.3f} wide on a quiet machine (wall/CPU {load:.2f})"
    return INCONCLUSIVE, (
        f"interval {low:.3f}-{high:.3f} wide and its halves disagree ({first:.3f}, {second:.3f}) while the "
        f"process waited for a core (wall/CPU {load:.2f})"
    )


def summarize(
    per_block: dict[str, list[list[float]]],
    *,
    batch_size: int,
    seq_len: int | None,
    device: str,
    rounds_per_block: int,
    iterations: int,
    memory_metric: str,
    memory_original: int,
    memory_optimized: int,
    benchmark_json: str | None,
    cpu_per_block: dict[str, list[list[float]]] | None = None,
    robust_cpu: bool = False,
) -> BenchmarkResult:
    """Turn per-block timings into throughputs, the paired speed ratios (wall, and CPU time when
    ``cpu_per_block`` is given), their intervals and the verdict; ``robust_cpu``: the CPU-time
    ratio is the one ``speed_ratio`` reports (module doc)."""
    timings = {}
    for name in VARIANTS:
        seconds = [t for block in per_block[name] for t in block]
        if not seconds:
            raise RuntimeError(f"no timings recorded for the {name} model")
        median = statistics.median(seconds)
        low_s, high_s = _bootstrap_median_interval(seconds)  # of the median step time
        timings[name] = VariantTiming(name, seconds, median, batch_size / median, batch_size / high_s, batch_size / low_s)
        cpu = [t for block in (cpu_per_block or {}).get(name, []) for t in block]
        if cpu:
            timings[name].cpu_seconds = cpu
            timings[name].cpu_median_s = statistics.median(cpu)
    wall_ratios = _pair_ratios(per_block)
    cpu_ratios = _pair_ratios(cpu_per_block) if cpu_per_block else []
    cpu_ok = bool(cpu_ratios) and all(r > 0 and math.isfinite(r) for r in cpu_ratios)
    use_cpu = robust_cpu and cpu_ok
    loads = [
        w / c for name in VARIANTS for w, c in zip(timings[name].seconds, timings[name].cpu_seconds) if c > 0
    ]
    load = statistics.median(loads) if loads else math.nan
    pair_ratios = cpu_ratios if use_cpu else wall_ratios
    low, high = _bootstrap_median_interval(pair_ratios)
    wall_low, wall_high = _bootstrap_median_interval(wall_ratios)
    verdict, detail = decide(pair_ratios, load=load)
    result = BenchmarkResult(
        batch_size=batch_size,
        seq_len=seq_len,
        device=device,
        blocks=len(pair_ratios),
        rounds_per_block=rounds_per_block,
        iterations=iterations,
        original=timings["original"],
        optimized=timings["optimized"],
        speed_ratio=statistics.median(pair_ratios),
        speed_ratio_low=low,
        speed_ratio_high=high,
        pair_ratios=[round(r, 5) for r in pair_ratios],
        memory_metric=memory_metric,
        memory_original_bytes=memory_original,
        memory_optimized_bytes=memory_optimized,
        memory_ratio=memory_optimized / memory_original if memory_original else math.nan,
        benchmark_json=benchmark_json,
        speed_ratio_of_medians=timings["original"].median_s / timings["optimized"].median_s,
        speed_figure="process CPU time" if use_cpu else "wall time",
        speed_ratio_wall=statistics.median(wall_ratios),
        speed_ratio_wall_low=wall_low,
        speed_ratio_wall_high=wall_high,
        pair_ratios_wall=[round(r, 5) for r in wall_ratios],
        load=round(load, 4) if not math.isnan(load) else load,
        verdict=verdict,
        verdict_detail=detail,
    )
    if cpu_ok:
        cpu_low, cpu_high = _bootstrap_median_interval(cpu_ratios)
        result.speed_ratio_cpu = statistics.median(cpu_ratios)
        result.speed_ratio_cpu_low, result.speed_ratio_cpu_high = cpu_low, cpu_high
        result.pair_ratios_cpu = [round(r, 5) for r in cpu_ratios]
    return result


def merge(first: BenchmarkResult, second: BenchmarkResult) -> BenchmarkResult:
    """Pool two runs' pairs (the gate's re-measurement before it declares a regression)."""
    per_block = {
        name: [[t] for t in getattr(first, name).seconds] + [[t] for t in getattr(second, name).seconds]
        for name in VARIANTS
    }
    # Throughputs from all the seconds; the ratios from the recorded pair ratios (re-pairing
    # flattened seconds across runs would pair unrelated rounds).
    merged = summarize(
        per_block,
        batch_size=first.batch_size,
        seq_len=first.seq_len,
        device=first.device,
        rounds_per_block=first.rounds_per_block,
        iterations=max(first.iterations, second.iterations),
        memory_metric=first.memory_metric,
        memory_original=first.memory_original_bytes,
        memory_optimized=first.memory_optimized_bytes,
        benchmark_json=second.benchmark_json,
    )
    for name in VARIANTS:
        timing = getattr(merged, name)
        timing.cpu_seconds = getattr(first, name).cpu_seconds + getattr(second, name).cpu_seconds
        timing.cpu_median_s = statistics.median(timing.cpu_seconds) if timing.cpu_seconds else math.nan
    ratios = first.pair_ratios + second.pair_ratios
    low, high = _bootstrap_median_interval(ratios)
    merged.pair_ratios = ratios
    merged.blocks = len(ratios)
    merged.speed_ratio = statistics.median(ratios)
    merged.speed_ratio_low, merged.speed_ratio_high = low, high
    merged.speed_figure = first.speed_figure
    wall = first.pair_ratios_wall + second.pair_ratios_wall
    merged.pair_ratios_wall = wall
    merged.speed_ratio_wall = statistics.median(wall)
    merged.speed_ratio_wall_low, merged.speed_ratio_wall_high = _bootstrap_median_interval(wall)
    cpu = first.pair_ratios_cpu + second.pair_ratios_cpu
    if cpu:
        merged.pair_ratios_cpu = cpu
        merged.speed_ratio_cpu = statistics.median(cpu)
        merged.speed_ratio_cpu_low, merged.speed_ratio_cpu_high = _bootstrap_median_interval(cpu)
    loads = [x.load for x in (first, second) if not math.isnan(x.load)]
    merged.load = max(loads) if loads else math.nan
    merged.verdict, merged.verdict_detail = decide(ratios, load=merged.load)
    merged.notes = first.notes + second.notes + ["pooled two measurement runs"]
    merged.kernel_calls = second.kernel_calls or first.kernel_calls
    return merged


__all__ = [
    "BenchmarkResult",
    "VariantTiming",
    "benchmark_pair",
    "decide",
    "make_inference_step",
    "make_train_step",
    "merge",
    "peak_step_memory",
    "run_pytest_benchmark",
    "step_kernel_calls",
    "summarize",
]
