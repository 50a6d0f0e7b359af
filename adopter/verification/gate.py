"""The `adopter verify` result as JSON, its text report, the plot, and the CI performance
regression gate.

Gate design (see ``docs/ci-gate.md``): compare *ratios* optimized/original measured in the
same run — stable across machines, unlike absolute times — against a baseline file, and
fail when

* the optimized model is not equivalent to the original (always fatal);
* the model is not the baseline's (``--model`` id or class);
* a rule is applied at a different set of locations — (rule, file relative to its
  ``sys.path`` root, class, function); lines are left out, source edits move them — either
  lost or new: deterministic, so it is the hard signal that a change lost an optimization
  (or that the baseline is out of date);
* at a location applied in both, a different set of kernel backends ran in the measured
  training step (``torch``/``triton``/``xformers``, or ``original``: the run-time guard fell
  back to the unfused code), e.g. a fused kernel that now always falls back;
* the baseline predates these records (regenerate it);
* the memory ratio grew by more than ``max_regression`` (on CPU the torch allocator's
  peak is deterministic, so this is exact too);
* the speed ratio fell by more than ``max_regression`` *beyond the measurement's noise*:
  the upper end of the 95% bootstrap interval of the paired ratio must be below the
  baseline's ratio times ``1 - max_regression``. A loaded shared machine widens the
  interval instead of producing a false failure.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field

# median wall / CPU time of a benchmark step above this: the process waited for a core (a busy
# machine). Here, not in benchmark.py, because this module must import without torch.
BUSY_LOAD = 1.10

RESULT_FORMAT = "adopter-verify/1"


def parse_threshold(text: str) -> float:
    """``"5%"`` -> 0.05. Only a percentage: a bare number was read two ways (``1`` as 1 %, ``0.9``
    as 90 %), so it is refused with the spelling to use."""
    raw = str(text).strip()
    if not raw.endswith("%"):
        raise ValueError(f"--max-regression expects a percentage such as 5% (got {text!r}; write {raw}%?)")
    try:
        value = float(raw[:-1]) / 100.0
    except ValueError:
        raise ValueError(f"--max-regression expects a percentage like 5% (got {text!r})") from None
    if not (0.0 <= value < 1.0) or math.isnan(value):
        raise ValueError(f"--max-regression must be between 0% and 100% (got {text!r})")
    return value


# ---------------------------------------------------------------- gate


@dataclass
class GateCheck:
    name: str
    ok: bool
    detail: str


@dataclass
class GateResult:
    passed: bool
    checks: list[GateCheck] = field(default_factory=list)
    max_regression: float = 0.05
    # True when only the (noisy) speed check failed: worth one re-measurement.
    speed_only_failure: bool = False

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "max_regression": self.max_regression,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


def applied_rule_counts(result: dict) -> Counter:
    return Counter(r["rule"] for r in result.get("rules_applied", []))


# ---------------------------------------------------------------- what was measured


def rule_location(entry: dict) -> tuple[str, str, str, str]:
    """``(rule, path, class, function)`` of a ``rules_applied`` entry: where the rule was applied,
    the file relative to its ``sys.path`` root; no lines (source edits move them)."""
    return (
        entry["rule"],
        entry.get("path") or entry.get("file") or "",
        entry.get("class") or "",
        entry.get("function") or "",
    )


def describe_location(location: tuple[str, str, str, str]) -> str:
    """``transformers/models/bert/modeling_bert.py BertOutput.forward``."""
    from adopter.kernels.telemetry import site_function

    _, path, cls, function = location
    return " ".join(part for part in (path, site_function(cls or None, function)) if part)


def describe_backends(summary: dict | None, *, counts: bool = False) -> str:
    """``torch``, ``original (fallback: why)``, with ``counts``: ``torch x24``."""
    backends = (summary or {}).get("backends") or {}
    if not backends:
        return "no adopter kernel call"
    text = ", ".join(f"{name} x{n}" if counts else name for name, n in sorted(backends.items()))
    fallbacks = (summary or {}).get("fallbacks") or {}
    if fallbacks:
        text += " (fallback: " + "; ".join(sorted(fallbacks)) + ")"
    return text


def has_locations(result: dict) -> bool:
    return all("path" in r for r in result.get("rules_applied", []))


def measured_step_name(mode: str | None) -> str:
    """The step whose kernel calls a result records: one inference forward or one training step."""
    return "inference forward" if mode == "inference" else "training step"


def has_backends(result: dict) -> bool:
    """Whether ``result`` records, per applied rule, the kernel backends of its measured step."""
    return "kernel_calls" in result and all(r.get("kernel_calls") is not None for r in result.get("rules_applied", []))


def regenerate_command(baseline: dict, baseline_path: str | None) -> str:
    model_id = (baseline.get("model") or {}).get("id") or "MODEL"
    return f"adopter verify --model {model_id} --save-baseline {baseline_path or 'BASELINE.json'}"


def _model_checks(current: dict, baseline: dict) -> list[GateCheck]:
    model, base = current.get("model") or {}, baseline.get("model") or {}
    differ = [
        GateCheck("model", False, f"different model {key}: {model.get(key)}; baseline: {base.get(key)}")
        for key in ("id", "class")
        if model.get(key) != base.get(key)
    ]
    return differ or [GateCheck("model", True, f"{model.get('id')} ({model.get('class')}), as in the baseline")]


def _location_checks(current: dict, baseline: dict) -> list[GateCheck]:
    """One failing check per rule location lost, gained or applied a different number of times
    (a rule verify did not apply because it brought nothing there counts as not applied)."""
    cur = Counter(rule_location(r) for r in current.get("rules_applied", []) if not r.get("not_applied"))
    base = Counter(rule_location(r) for r in baseline.get("rules_applied", []) if not r.get("not_applied"))
    failed = []
    for location in sorted(set(cur) | set(base)):
        n, b = cur[location], base[location]
        rule, where = location[0], describe_location(location)
        if n == b:
            continue
        if not n:
            detail = f"{rule} no longer applied at {where}"
        elif not b:
            detail = f"{rule} now also applied at {where} (not in the baseline)"
        else:
            detail = f"{rule} applied {n} time(s) at {where}; baseline: {b}"
        failed.append(GateCheck("applied rules", False, detail))
    return failed or [
        GateCheck("applied rules", True, f"{sum(cur.values())} at {len(cur)} location(s), as in the baseline")
    ]


def _backend_checks(current: dict, baseline: dict) -> list[GateCheck]:
    """At each location applied in both: the same set of kernel backends ran in the measured step."""
    cur = {rule_location(r): r.get("kernel_calls") for r in current.get("rules_applied", []) if not r.get("not_applied")}
    base = {rule_location(r): r.get("kernel_calls") for r in baseline.get("rules_applied", [])
            if not r.get("not_applied")}
    failed = []
    same: Counter = Counter()
    for location in sorted(set(cur) & set(base)):
        now, then = cur[location] or {}, base[location] or {}
        if set(now.get("backends") or {}) == set(then.get("backends") or {}):
            same[describe_backends(now)] += 1
            continue
        ran = f"ran on {describe_backends(now)}" if now.get("backends") else "called no adopter kernel"
        failed.append(
            GateCheck(
                "kernel backends",
                False,
                f"{location[0]} at {describe_location(location)} {ran} in the measured step; "
                f"baseline: {describe_backends(then)}",
            )
        )
    return failed or [
        GateCheck(
            "kernel backends",
            True,
            "as in the baseline"
            + (": " + ", ".join(f"{what} at {n} location(s)" for what, n in sorted(same.items())) if same else ""),
        )
    ]


def _legacy_rule_check(current: dict, baseline: dict) -> GateCheck:
    """Rules applied per rule name (a baseline without locations)."""
    base_rules = applied_rule_counts(baseline)
    cur_rules = applied_rule_counts(current)
    lost = {rule: n - cur_rules.get(rule, 0) for rule, n in base_rules.items() if cur_rules.get(rule, 0) < n}
    gained = {rule: n - base_rules.get(rule, 0) for rule, n in cur_rules.items() if base_rules.get(rule, 0) < n}
    detail = f"{sum(cur_rules.values())} applied (baseline {sum(base_rules.values())})"
    if lost:
        detail += "; lost: " + ", ".join(f"{rule} x{n}" for rule, n in sorted(lost.items()))
    if gained:
        detail += "; new: " + ", ".join(f"{rule} x{n}" for rule, n in sorted(gained.items()))
    return GateCheck("applied rules", not lost, detail)


def identity_checks(current: dict, baseline: dict, baseline_path: str | None = None) -> list[GateCheck]:
    """Model, rule locations and kernel backends against the baseline's (one check per difference)."""
    checks = _model_checks(current, baseline)
    if not (has_locations(baseline) and has_backends(baseline)):
        checks.append(
            GateCheck(
                "baseline format",
                False,
                "the baseline records no rule locations or kernel backends (written by an older adopter): "
                f"regenerate it with `{regenerate_command(baseline, baseline_path)}`",
            )
        )
    if (current.get("model") or {}).get("class") != (baseline.get("model") or {}).get("class"):
        return checks  # another model: its rules and kernels are not comparable
    if not has_locations(baseline):
        checks.append(_legacy_rule_check(current, baseline))
        return checks
    checks += _location_checks(current, baseline)
    if has_backends(current) and has_backends(baseline):
        checks += _backend_checks(current, baseline)
    return checks


def evaluate_gate(
    current: dict, baseline: dict, max_regression: float, baseline_path: str | None = None
) -> GateResult:
    """Compare a verify result (JSON dict) with a baseline (same format); ``baseline_path`` is
    named in the message asking to regenerate an outdated baseline."""
    checks: list[GateCheck] = []

    equivalence = current.get("equivalence") or {}
    checks.append(
        GateCheck(
            "equivalence",
            bool(equivalence.get("equivalent")),
            "optimized model equivalent to the original"
            if equivalence.get("equivalent")
            else f"optimized model NOT equivalent ({equivalence.get('error') or equivalence.get('worst', '')})",
        )
    )

    checks += identity_checks(current, baseline, baseline_path)

    bench = current.get("benchmark")
    base_bench = baseline.get("benchmark")
    speed_failed = False
    if not bench or not base_bench:
        checks.append(GateCheck("benchmark", False, "no benchmark in the current result or the baseline"))
    else:
        differ = [
            f"{key} {bench.get(key)} vs {base_bench.get(key)}"
            for key in ("batch_size", "seq_len", "threads", "device")
            if base_bench.get(key) is not None and bench.get(key) != base_bench.get(key)
        ]
        if (bench.get("mode") or "train") != (base_bench.get("mode") or "train"):
            differ.append(f"mode {bench.get('mode') or 'train'} vs {base_bench.get('mode') or 'train'}")
        base_attn = (baseline.get("model") or {}).get("attn_implementation")
        attn = (current.get("model") or {}).get("attn_implementation")
        if base_attn is not None and attn != base_attn:
            differ.append(f"attn_implementation {attn} vs {base_attn}")
        checks.append(
            GateCheck(
                "benchmark settings",
                not differ,
                "same as the baseline's"
                if not differ
                else "differ from the baseline's (" + ", ".join(differ) + "): ratios are not comparable; "
                "use the baseline's settings or record a new baseline",
            )
        )
        pairs = [("", bench, base_bench)]
        if bench.get("mode") == "inference" or base_bench.get("mode") == "inference":
            current_sweep = {int(b["batch_size"]): b for b in bench.get("sweep") or [bench]}
            pairs = [
                (f" (batch {size})", current_sweep.get(size), base)
                for size, base in sorted({int(b["batch_size"]): b for b in base_bench.get("sweep") or [base_bench]}.items())
            ]
        for label, now, base in pairs:
            if now is None:
                checks.append(GateCheck(f"speed ratio{label}", False, "not measured in this run (batch sizes differ "
                                        "from the baseline's)"))
                continue
            failed = _ratio_checks(checks, label, now, base, max_regression)
            speed_failed = speed_failed or failed

    passed = all(c.ok for c in checks)
    others_ok = all(c.ok for c in checks if not c.name.startswith("speed ratio"))
    return GateResult(passed, checks, max_regression, speed_only_failure=speed_failed and others_ok)


def load_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or data.get("format") != RESULT_FORMAT:
        raise ValueError(f"{what} {path} is not an `adopter verify` result (format {RESULT_FORMAT})")
    return data


def write_json(path: str, data: dict) -> None:
    """Atomic write (temporary file + rename) so a crash never leaves half a baseline."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=False)
        fh.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- text report


def _ratio_checks(checks: list[GateCheck], label: str, bench: dict, base_bench: dict, max_regression: float) -> bool:
    """Append the speed and memory checks of one benchmark against its baseline; True when the
    speed check failed. Speed uses the robust figure (``speed_ratio``: process CPU time on one CPU
    thread, see adopter.verification.benchmark) and its interval's upper end: a regression must be
    beyond noise."""
    base_speed = float(base_bench["speed_ratio"])
    speed = float(bench["speed_ratio"])
    high = float(bench.get("speed_ratio_high", speed))
    floor = base_speed * (1.0 - max_regression)
    ok = high >= floor
    figure = bench.get("speed_figure") or "wall time"
    checks.append(
        GateCheck(
            f"speed ratio{label}",
            ok,
            f"{speed:.3f} ({figure}, 95% interval {float(bench.get('speed_ratio_low', speed)):.3f}-{high:.3f}) vs "
            f"baseline {base_speed:.3f}: "
            + (
                f"change {100 * (speed / base_speed - 1):+.1f}%, within {100 * max_regression:g}% or noise"
                if ok
                else f"regressed {100 * (1 - high / base_speed):.1f}% beyond noise (> {100 * max_regression:g}%)"
            )
            + (f"; verdict: {bench['verdict']}" if str(bench.get("verdict", "")).startswith("inconclusive") else ""),
        )
    )
    if bench.get("memory_metric") != base_bench.get("memory_metric"):
        checks.append(
            GateCheck(
                f"memory ratio{label}",
                True,
                f"not compared: measured {bench.get('memory_metric')!r}, baseline has "
                f"{base_bench.get('memory_metric')!r}",
            )
        )
    else:
        base_mem = float(base_bench["memory_ratio"])
        mem = float(bench["memory_ratio"])
        ceiling = base_mem * (1.0 + max_regression)
        mem_ok = mem <= ceiling
        checks.append(
            GateCheck(
                f"memory ratio{label}",
                mem_ok,
                f"{mem:.3f} vs baseline {base_mem:.3f}: change {100 * (mem / base_mem - 1):+.1f}%"
                + ("" if mem_ok else f" (> {100 * max_regression:g}% worse)"),
            )
        )
    return not ok


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_report(result: dict, gate: GateResult | None = None) -> str:
    lines = []
    model = result.get("model", {})
    lines.append(
        f"model: {model.get('id')} ({model.get('class')}, {model.get('parameters', 0) / 1e6:.1f}M parameters, "
        f"{model.get('device')})"
    )
    applied = result.get("rules_applied", [])
    measured = has_backends(result) and bool(applied)
    step = measured_step_name((result.get("benchmark") or {}).get("mode"))
    lines.append(
        f"rules applied ({len(applied)})" + (f", with the kernel backends of one {step}" if measured else "") + ":"
    )
    skipped = result.get("rules_skipped", [])
    width = max([18] + [len(r["rule"]) for r in applied + skipped])  # rule column
    for r in applied:
        ran = f"  {describe_backends(r['kernel_calls'], counts=True)}" if measured else ""
        if r.get("not_applied"):
            ran = "  not applied here (below)"
        lines.append(f"  {r['rule']:<{width}} {r['where']:<52} {r.get('status', '')}{ran}")
    if not applied:
        lines.append("  (none)")
    stray = [c for c in (result.get("kernel_calls") or {}).get("calls", []) if not c.get("attributed", True)]
    for c in stray:
        lines.append(
            f"  (not from an applied rule: {c['kernel']} from {c['file']} {c['function']}, {c['backend']} x{c['count']})"
        )
    # Pattern matches rejected by a rule's preconditions are many and expected (every attention
    # rule tried on every attention); list the rest, count those (all are in the JSON).
    rejected = [r for r in skipped if r["reason"].startswith("precondition:")]
    listed = [r for r in skipped if not r["reason"].startswith("precondition:")]
    if listed:
        lines.append(f"rules not applied ({len(listed)}):")
        for r in listed:
            lines.append(f"  {r['rule']:<{width}} {r['where']:<24} {r['reason']}")
    if rejected:
        lines.append(f"({len(rejected)} pattern matches rejected by rule preconditions; see --json)")
    for warning in result.get("warnings", []):
        lines.append(f"warning: {warning}")
    eq = result.get("equivalence")
    if eq:
        lines.append("equivalence: " + eq.get("summary", "equivalent" if eq.get("equivalent") else "NOT equivalent"))
    eq_cl = result.get("equivalence_channels_last")
    if eq_cl:
        lines.append("equivalence on channels_last inputs: " + eq_cl.get("summary", ""))
    bench = result.get("benchmark")
    for one in (bench.get("sweep") or [bench]) if bench else []:
        lines += _format_benchmark(one)
    every = result.get("benchmark_with_every_rule")
    if every:
        for a in result.get("rules_applied", []):
            if a.get("not_applied"):
                lines.append(f"not applied: {a['rule']} at {a.get('where', '?')}: {a['not_applied']}")
        if result.get("identical_to_original"):
            lines.append(f"  (no rule pays here: the optimized model is the original, and the figures above time the "
                         f"same model twice — their spread is the machine's noise; with every rule the speed ratio "
                         f"was {every['speed_ratio']:.3f})")
        else:
            lines.append(f"  (the figures above are of the model rebuilt without those; with every rule the speed "
                         f"ratio was {every['speed_ratio']:.3f})")
    if result.get("benchmark_skipped"):
        lines.append(f"benchmark skipped: {result['benchmark_skipped']}")
    ablation = result.get("ablation")
    if ablation and ablation.get("kernels"):
        lines.append(f"what each kernel contributes ({ablation['figure']}; time and peak memory without it / with all):")
        for k in ablation["kernels"]:
            lines.append(
                f"  {k['kernel']:<24} speed x{k['speed']:.3f} [{k['speed_low']:.3f}-{k['speed_high']:.3f}]  "
                f"memory x{k['memory']:.3f}  {k['effect'] if k['pays'] else k['effect'].upper()}: {k['why']}"
            )
            if not k["pays"]:
                lines.append("    not applied: costs more than it saves here (see above)")
    if ablation and ablation.get("not_fused_here"):
        lines.append("kernels taking the original path here (see each rule's fallback reason above): "
                     + ", ".join(ablation["not_fused_here"]))
    if gate is not None:
        lines.append(f"regression gate (max regression {100 * gate.max_regression:g}%): "
                     + ("PASS" if gate.passed else "FAIL"))
        for c in gate.checks:
            lines.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return "\n".join(lines)


def _format_benchmark(bench: dict) -> list[str]:
    shape = f"batch {bench['batch_size']}" + (f", seq {bench['seq_len']}" if bench.get("seq_len") else "")
    if bench.get("threads"):
        shape += f", {bench['threads']} thread(s)"
    what = ("inference (eval forward under no_grad" if bench.get("mode") == "inference"
            else "training step (forward+backward+AdamW")
    lines = [
        f"{what}, {shape}, {bench['device']}, "
        f"{bench['blocks']} alternating blocks x {bench['rounds_per_block']} round(s) x "
        f"{bench['iterations']} step(s)):"
    ]
    lines += format_speed(bench)
    if bench.get("mode") == "inference":
        lines.append(
            f"  latency (median forward): original {1000 * bench['original']['median_s']:.1f} ms, "
            f"optimized {1000 * bench['optimized']['median_s']:.1f} ms"
        )
    lines.append(
        f"  memory, {bench['memory_metric']}: original {_mb(bench['memory_original_bytes'])}, "
        f"optimized {_mb(bench['memory_optimized_bytes'])}, ratio {bench['memory_ratio']:.3f}"
    )
    if bench.get("benchmark_json"):
        lines.append(f"  pytest-benchmark data: {bench['benchmark_json']}")
    return lines


def ratio_of_medians(bench: dict) -> float:
    """optimized / original median throughput (results written before it was stored: recomputed)."""
    value = bench.get("speed_ratio_of_medians")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        value = bench["optimized"]["throughput"] / bench["original"]["throughput"]
    return float(value)


def format_speed(bench: dict) -> list[str]:
    """The throughput lines and the speed ratio, saying what each number is. Two ratios exist
    and both are printed: the per-pair median (what the gate uses: each pair is one block of
    each variant run back to back, so both see the same machine load) and the ratio of the two
    overall medians (the throughputs printed above it); under changing load they can disagree."""
    lines = []
    for name in ("original", "optimized"):
        t = bench[name]
        interval = ""
        low, high = t.get("throughput_low"), t.get("throughput_high")
        if low is not None and high is not None and not (math.isnan(low) or math.isnan(high)):
            interval = f", 95% interval {low:.2f}-{high:.2f}"
        steps = len(t.get("seconds") or [])
        lines.append(
            f"  {name:<10} {t['throughput']:10.2f} samples/s  (median step {1000 * t['median_s']:.1f} ms"
            + (f" over {steps} steps" if steps else "") + f"{interval})"
        )
    ratio, low, high = bench["speed_ratio"], bench["speed_ratio_low"], bench["speed_ratio_high"]
    pairs = len(bench.get("pair_ratios") or []) or bench.get("blocks")
    verdict = bench.get("verdict") or (
        "no measurable difference" if low <= 1.0 <= high else "optimized faster" if low > 1.0 else "optimized slower"
    )
    why = bench.get("verdict_detail") or ("the interval contains 1.0" if low <= 1.0 <= high else "")
    figure = bench.get("speed_figure") or "wall time"
    lines.append(
        f"  speed ratio optimized/original ({figure}): {ratio:.3f} = median of {pairs} per-pair ratios, "
        f"95% bootstrap interval {low:.3f}-{high:.3f}: {verdict}" + (f" ({why})" if why else "")
    )
    wall = bench.get("speed_ratio_wall")
    if figure != "wall time" and wall is not None and not math.isnan(wall):
        load = bench.get("load")
        lines.append(
            f"  wall-time ratio beside it: {wall:.3f} (interval {bench['speed_ratio_wall_low']:.3f}-"
            f"{bench['speed_ratio_wall_high']:.3f}); wall/CPU time of a step {load:.2f}: "
            + ("the machine was busy, wall time waited for a core" if load and load > BUSY_LOAD else "quiet machine")
        )
    pooled = ratio_of_medians(bench)
    note = ""
    if (pooled - 1.0) * (ratio - 1.0) < 0 or abs(pooled - ratio) > 0.01:
        note = (
            "; it differs from the per-pair median because it pools blocks run under different machine load, "
            "which pairing cancels; the per-pair median is the one the gate uses"
        )
    lines.append(f"  ratio of the two median throughputs above: {pooled:.3f}{note}")
    return lines


# ---------------------------------------------------------------- plot


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> None:
    from adopter.core.extras import MissingExtra, require

    try:
        require("matplotlib", "verify", "--plot")
    except MissingExtra as exc:
        raise PlotUnavailable(str(exc)) from None


def plot_figure(result: dict):
    """Bar chart: training throughput with its 95% interval, and peak memory, original vs
    optimized; each panel titled by what it measures. Returns the matplotlib figure."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import textwrap

    import matplotlib.pyplot as plt

    bench = result["benchmark"]
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(9, 4))
    names = ["original", "optimized"]
    colors = ["#8c8c8c", "#2a7ab9"]
    values = [bench[n]["throughput"] for n in names]
    errors = [[], []]
    for n, v in zip(names, values):
        low, high = bench[n].get("throughput_low"), bench[n].get("throughput_high")
        if low is None or high is None or math.isnan(low) or math.isnan(high):
            low = high = v  # results written before intervals were stored
        errors[0].append(max(v - low, 0.0))
        errors[1].append(max(high - v, 0.0))
    ax_speed.bar(names, values, color=colors, yerr=errors, capsize=6, ecolor="black")
    ax_speed.set_title("training throughput, samples/s\n(median, 95% interval)", fontsize=9)
    ax_speed.set_ylabel("samples / s")
    ax_speed.set_xlabel(
        f"speed ratio {bench['speed_ratio']:.3f} (per-pair median,\n95% interval "
        f"{bench['speed_ratio_low']:.3f}-{bench['speed_ratio_high']:.3f})",
        fontsize=8,
    )
    ax_mem.bar(names, [bench[f"memory_{n}_bytes"] / 2**20 for n in names], color=colors)
    ax_mem.set_title("peak memory over one training step, MiB", fontsize=9)
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel(
        f"ratio {bench['memory_ratio']:.3f}; " + "\n".join(textwrap.wrap(bench["memory_metric"], 50)), fontsize=8
    )
    shape = f"batch {bench['batch_size']}" + (f", seq {bench['seq_len']}" if bench.get("seq_len") else "")
    fig.suptitle(f"{result['model']['id']}: training step (forward+backward+AdamW), {shape}, {bench['device']}",
                 fontsize=9)
    fig.tight_layout()
    return fig


def write_plot(result: dict, path: str) -> None:
    """:func:`plot_figure`, saved as ``path``."""
    import matplotlib.pyplot as plt

    fig = plot_figure(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)
