"""The `adopter verify` result as JSON, its text report, the plot, and the CI performance
regression gate.

Gate design (see ``docs/ci-gate.md``): compare *ratios* optimized/original measured in the
same run — stable across machines, unlike absolute times — against a baseline file, and
fail when

* the optimized model is not equivalent to the original (always fatal);
* a rule applied in the baseline is no longer applied (or applied at fewer places) —
  deterministic, so it is the hard signal that a change lost an optimization;
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

RESULT_FORMAT = "adopter-verify/1"


def parse_threshold(text: str) -> float:
    """``"5%"`` -> 0.05, ``"0.05"`` -> 0.05, ``"5"`` -> 0.05 (values above 1 are percents)."""
    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100.0
        else:
            value = float(raw)
            if value >= 1.0:
                value /= 100.0
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


def evaluate_gate(current: dict, baseline: dict, max_regression: float) -> GateResult:
    """Compare a verify result (JSON dict) with a baseline (same format)."""
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

    base_rules = applied_rule_counts(baseline)
    cur_rules = applied_rule_counts(current)
    lost = {rule: n - cur_rules.get(rule, 0) for rule, n in base_rules.items() if cur_rules.get(rule, 0) < n}
    gained = {rule: n - base_rules.get(rule, 0) for rule, n in cur_rules.items() if base_rules.get(rule, 0) < n}
    detail = f"{sum(cur_rules.values())} applied (baseline {sum(base_rules.values())})"
    if lost:
        detail += "; lost: " + ", ".join(f"{rule} x{n}" for rule, n in sorted(lost.items()))
    if gained:
        detail += "; new: " + ", ".join(f"{rule} x{n}" for rule, n in sorted(gained.items()))
    checks.append(GateCheck("applied rules", not lost, detail))

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
        base_speed = float(base_bench["speed_ratio"])
        speed = float(bench["speed_ratio"])
        high = float(bench.get("speed_ratio_high", speed))
        floor = base_speed * (1.0 - max_regression)
        ok = high >= floor
        speed_failed = not ok
        checks.append(
            GateCheck(
                "speed ratio",
                ok,
                f"{speed:.3f} (95% interval {float(bench.get('speed_ratio_low', speed)):.3f}-{high:.3f}) vs "
                f"baseline {base_speed:.3f}: "
                + (
                    f"change {100 * (speed / base_speed - 1):+.1f}%, within {100 * max_regression:g}% or noise"
                    if ok
                    else f"regressed {100 * (1 - high / base_speed):.1f}% beyond noise (> {100 * max_regression:g}%)"
                ),
            )
        )
        if bench.get("memory_metric") != base_bench.get("memory_metric"):
            checks.append(
                GateCheck(
                    "memory ratio",
                    True,
                    f"not compared: measured {bench.get('memory_metric')!r}, baseline has "
                    f"{base_bench.get('memory_metric')!r}",
                )
            )
        else:
            base_mem = float(base_bench["memory_ratio"])
            mem = float(bench["memory_ratio"])
            ceiling = base_mem * (1.0 + max_regression)
            ok = mem <= ceiling
            checks.append(
                GateCheck(
                    "memory ratio",
                    ok,
                    f"{mem:.3f} vs baseline {base_mem:.3f}: change {100 * (mem / base_mem - 1):+.1f}%"
                    + ("" if ok else f" (> {100 * max_regression:g}% worse)"),
                )
            )

    passed = all(c.ok for c in checks)
    others_ok = all(c.ok for c in checks if c.name != "speed ratio")
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
    lines.append(f"rules applied ({len(applied)}):")
    for r in applied:
        lines.append(f"  {r['rule']:<18} {r['where']:<52} {r.get('status', '')}")
    if not applied:
        lines.append("  (none)")
    skipped = result.get("rules_skipped", [])
    # Pattern matches rejected by a rule's preconditions are many and expected (every attention
    # rule tried on every attention); list the rest, count those (all are in the JSON).
    rejected = [r for r in skipped if r["reason"].startswith("precondition:")]
    listed = [r for r in skipped if not r["reason"].startswith("precondition:")]
    if listed:
        lines.append(f"rules not applied ({len(listed)}):")
        for r in listed:
            lines.append(f"  {r['rule']:<18} {r['where']:<24} {r['reason']}")
    if rejected:
        lines.append(f"({len(rejected)} pattern matches rejected by rule preconditions; see --json)")
    for warning in result.get("warnings", []):
        lines.append(f"warning: {warning}")
    eq = result.get("equivalence")
    if eq:
        lines.append("equivalence: " + eq.get("summary", "equivalent" if eq.get("equivalent") else "NOT equivalent"))
    bench = result.get("benchmark")
    if bench:
        shape = f"batch {bench['batch_size']}" + (f", seq {bench['seq_len']}" if bench.get("seq_len") else "")
        if bench.get("threads"):
            shape += f", {bench['threads']} thread(s)"
        lines.append(
            f"training step (forward+backward+AdamW, {shape}, {bench['device']}, "
            f"{bench['blocks']} alternating blocks x {bench['rounds_per_block']} round(s) x "
            f"{bench['iterations']} step(s)):"
        )
        lines += format_speed(bench)
        lines.append(
            f"  memory, {bench['memory_metric']}: original {_mb(bench['memory_original_bytes'])}, "
            f"optimized {_mb(bench['memory_optimized_bytes'])}, ratio {bench['memory_ratio']:.3f}"
        )
        if bench.get("benchmark_json"):
            lines.append(f"  pytest-benchmark data: {bench['benchmark_json']}")
    if gate is not None:
        lines.append(f"regression gate (max regression {100 * gate.max_regression:g}%): "
                     + ("PASS" if gate.passed else "FAIL"))
        for c in gate.checks:
            lines.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return "\n".join(lines)


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
    verdict = (
        "no measurable difference (the interval contains 1.0)" if low <= 1.0 <= high
        else "optimized faster" if low > 1.0 else "optimized slower"
    )
    lines.append(
        f"  speed ratio optimized/original: {ratio:.3f} = median of {pairs} per-pair throughput ratios, "
        f"95% bootstrap interval {low:.3f}-{high:.3f}: {verdict}"
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
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None


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
