"""The `adopter verify` pipeline, apart from argument parsing and printing.

build model -> optimize its class (per-rule equivalence on a shrunk config) -> build the
optimized model at full size -> equivalence check (same weights, forward + backward) ->
training-step benchmark -> regression gate. Produces the JSON result (format
:data:`adopter.verification.gate.RESULT_FORMAT`).

The result says what it measured: the model (``--model`` id and class), each applied rule's
location (``path`` relative to its ``sys.path`` root, so results compare across machines;
class, function, lines) and, per location, which kernel backend ran in a training step of
the optimized model (``kernel_calls``: calls per backend, ``"original"`` with the fallback
reasons when the run-time guard ran the unfused code), attributed by the call's site.
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from adopter.kernels.telemetry import site_function
from adopter.verification.gate import RESULT_FORMAT, GateResult, evaluate_gate, measured_step_name


@dataclass
class VerifyOptions:
    model: str
    rules: str | None = None
    device: str | None = None
    batch_size: int = 4
    seq_len: int = 32
    threads: int | None = None  # torch CPU threads for the whole run; None: torch's default
    attn_implementation: str | None = None  # transformers attention: eager, sdpa, ...; None: the model's default
    blocks: int | None = None  # None: as many as fit bench_seconds
    bench_seconds: float = 20.0
    rounds: int = 1
    benchmark: bool = True
    benchmark_json: str = ".benchmarks/verify.pytest-benchmark.json"
    baseline: dict | None = None
    baseline_path: str | None = None  # named in the gate's "regenerate the baseline" message
    max_regression: float = 0.05
    mode: str = "train"  # "train": forward+backward+AdamW; "inference": eval, no grad, a batch sweep
    batch_sizes: list[int] | None = None  # inference sweep (None: batch_size alone)
    max_bench_seconds: float | None = None  # extend a wide interval up to this (None: 3 x bench_seconds)
    ablation: bool = True  # per-kernel contribution (leave-one-out) after the main benchmark
    ablation_seconds: float = 20.0
    # image inputs (4-D floating tensors) in channels_last memory format for both models: the
    # layout CPU convolution inference is served in (equivalence is checked in it too)
    channels_last: bool = False
    # --model package.module:Name: the user's class with its arguments and example inputs
    # (adopter.tracing.user_model.UserModel); ``model`` is then that reference
    user_model: Any = None


def _user_subject(user, built, device: str, made: list):
    """What ``optimize`` analyses for ``--model package.module:Name``: the model verify built (its
    arguments as given), and a ``make`` that records in ``made`` the last model it built. None
    (optimize builds its own) for a transformers config, which optimize builds with ``use_cache``
    off."""
    from adopter.optimizing.subject import build_subject

    first = user.init_args[0] if user.init_args else None
    if hasattr(first, "to_dict") and hasattr(first, "use_cache"):
        return None

    subject = build_subject(type(built.model), None, built.example_inputs, device, user.init_args,
                            user.init_kwargs, built=built)
    make = subject.make

    def make_remembered(cls):
        instance = make(cls)
        made[:] = [cls, instance]
        return instance

    subject.make = make_remembered
    return subject


@dataclass
class VerifyOutcome:
    result: dict
    gate: GateResult | None
    exit_code: int


def run_verify(options: VerifyOptions, progress: Callable[[str], None]) -> VerifyOutcome:
    from adopter.core.extras import require
    from adopter.errors import UserError

    try:
        import torch
    except ImportError:
        raise UserError("adopter verify needs torch, which is not installed") from None
    require("pytest_benchmark", "verify", "adopter verify")
    previous_threads = torch.get_num_threads()
    try:
        return _run_verify(options, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _run_verify(options: VerifyOptions, progress: Callable[[str], None]) -> VerifyOutcome:
    import torch

    from adopter.errors import UserError
    from adopter.optimizing.optimize import AdopterWarning, OptimizeError, optimize, optimize_instance, shrink_config
    from adopter.tracing import TracingError, build_model, make_example_inputs
    from adopter.tracing.models import check_model_ref
    from adopter.verification.equivalence import check_equivalence

    if options.threads:
        torch.set_num_threads(options.threads)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")

    user = options.user_model
    # Everything that can be checked cheaply is checked before the first progress line.
    try:
        if user is None:
            check_model_ref(options.model)
    except TracingError as exc:
        raise UserError(str(exc)) from None
    rules = None
    if options.rules:
        from adopter.core.rules import UnknownRuleError, get_rules

        try:
            rules = get_rules(options.rules.split(","))
        except UnknownRuleError as exc:
            raise UserError(str(exc)) from None

    progress(f"building {options.model} on {device}")
    try:
        if user is not None:
            from adopter.tracing.user_model import build_user_model

            built = build_user_model(user, device=device, attn_implementation=options.attn_implementation)
        else:
            built = build_model(options.model, device=device, attn_implementation=options.attn_implementation)
    except TracingError as exc:
        raise UserError(str(exc)) from None
    original = built.model
    model_cls = type(original)
    config = built.config
    phases["build"] = time.perf_counter() - t0

    # the last model optimize built of the user's class (class, instance): built as verify builds
    # the optimized model, so the final class's instance is not built once more below
    made: list = [None, None]
    on = "shrunk config" if user is None else "the given arguments"
    progress(f"optimizing {model_cls.__name__}: scan, trace, rewrite, per-rule equivalence ({on})")
    t = time.perf_counter()
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always", AdopterWarning)
        try:
            if user is not None:  # the user's arguments as given: no config to shrink, the model built above
                optimized_cls = optimize(model_cls, rules=rules, init_args=user.init_args, init_kwargs=user.init_kwargs,
                                         example_inputs=built.example_inputs, device=device,
                                         _subject=_user_subject(user, built, device, made))
            else:
                small = shrink_config(config) if config is not None else None
                optimized_cls = optimize(model_cls, rules=rules, config=small, device=device)
        except OptimizeError as exc:
            raise UserError(f"cannot optimize {model_cls.__name__}: {exc}") from None
    caught += [str(w.message) for w in recorded if issubclass(w.category, AdopterWarning)]
    report = optimized_cls.adopter_report
    phases["optimize"] = time.perf_counter() - t

    progress(f"building the optimized {model_cls.__name__} at full size and checking equivalence")
    t = time.perf_counter()

    def make_full(cls):
        if user is not None:
            return cls(*copy.deepcopy(user.init_args), **copy.deepcopy(user.init_kwargs)).to(device).eval()
        return cls(copy.deepcopy(config)).to(device).eval()

    try:
        optimized = made[1] if made[0] is optimized_cls else make_full(optimized_cls)
        made[:] = [None, None]
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"the optimized {model_cls.__name__} cannot be built: {type(exc).__name__}: {exc}") from None
    equivalence = check_equivalence(original, optimized, built.example_inputs)
    if not equivalence.equivalent and report.applied:
        # Equivalent on the shrunk config but not at full size (numerical error that grows with
        # depth, say): decide rule by rule again, on the full model, and drop what fails.
        progress(f"not equivalent at full size ({equivalence.summary()}); re-checking each rule at full size")
        first_report = report
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always", AdopterWarning)
            try:
                optimized_cls = optimize_instance(original, built.example_inputs, make_full, rules=rules)
            except OptimizeError as exc:
                raise UserError(f"cannot optimize {model_cls.__name__}: {exc}") from None
        report = optimized_cls.adopter_report
        caught += [str(w.message) for w in recorded if issubclass(w.category, AdopterWarning)]
        caught = list(dict.fromkeys(caught))
        result_note = f"rules re-checked at full size after: {first_report.applied_rules}"
        optimized = make_full(optimized_cls)
        equivalence = check_equivalence(original, optimized, built.example_inputs)
    else:
        result_note = ""
    phases["equivalence"] = time.perf_counter() - t

    n_params = sum(p.numel() for p in original.parameters())
    result: dict[str, Any] = {
        "format": RESULT_FORMAT,
        "model": {
            "id": options.model,
            "class": f"{model_cls.__module__}.{model_cls.__qualname__}",
            "parameters": n_params,
            "device": device,
            "attn_implementation": getattr(config, "_attn_implementation", None),
        },
        "rules_applied": [{**a.to_json(), "path": portable_path(a.file)} for a in report.applied],
        "rules_skipped": [s.to_json() for s in report.skipped],
        "traced": report.traced,
        "warnings": caught,
        **({"note": result_note} if result_note else {}),
        "equivalence": {**equivalence.to_json(), "summary": equivalence.summary()},
        "per_rule_equivalence": report.equivalence.to_json() if report.equivalence is not None else None,
        "diff": report.diff,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "argv": sys.argv[1:],
        },
    }
    exit_code = 0 if equivalence.equivalent else 1
    gate = None

    if options.benchmark and equivalence.equivalent and not report.applied:
        # nothing was rewritten: the optimized model is the original, and timing it against itself
        # would only measure noise
        result["benchmark_skipped"] = "no rule applied: the optimized model is the original"
    if options.benchmark and equivalence.equivalent and report.applied:
        from adopter.verification.benchmark import benchmark_pair, merge

        if user is not None:  # the user's inputs as given (their batch size is the benchmark's)
            options.batch_size = next((int(v.shape[0]) for v in built.example_inputs.values()
                                       if isinstance(v, torch.Tensor) and v.dim()), 1)
            options.batch_sizes = None

        def inputs_for(batch_size: int):
            if user is not None:
                made = built.example_inputs
            else:
                made = make_example_inputs(original, config, batch_size=batch_size, seq_len=options.seq_len,
                                           device=device)
            return in_channels_last(made) if options.channels_last else made

        inputs = inputs_for(options.batch_size)
        uses_tokens = "input_ids" in inputs
        if options.channels_last:
            progress("checking equivalence again on channels_last inputs")
            again = check_equivalence(original, optimized, inputs)
            result["equivalence_channels_last"] = {**again.to_json(), "summary": again.summary()}
            if not again.equivalent:
                exit_code = 1
                result["benchmark_skipped"] = "not equivalent on channels_last inputs"
                phases["total"] = time.perf_counter() - t0
                result["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
                return VerifyOutcome(result, None, exit_code)
        os.makedirs(os.path.dirname(os.path.abspath(options.benchmark_json)), exist_ok=True)

        def measure(json_path: str, batch_size: int, batch_inputs):
            return benchmark_pair(
                original,
                optimized,
                batch_inputs,
                batch_size=batch_size,
                seq_len=options.seq_len if uses_tokens else None,
                blocks=options.blocks,
                time_budget_s=options.bench_seconds,
                max_time_s=options.max_bench_seconds,
                rounds_per_block=options.rounds,
                warmup_rounds=0,
                json_path=json_path,
                progress=progress,
                mode=options.mode,
            )

        def bench_json(bench) -> dict:
            return {**bench.to_json(), "threads": torch.get_num_threads(), "mode": options.mode,
                    "input_layout": "channels_last" if options.channels_last else "as built"}

        t = time.perf_counter()
        root, ext = os.path.splitext(options.benchmark_json)
        sweep = options.batch_sizes if options.mode == "inference" and options.batch_sizes else [options.batch_size]
        runs = {}
        for batch_size in sweep:
            if len(sweep) > 1:
                progress(f"inference, batch {batch_size}")
            path = options.benchmark_json if batch_size == sweep[0] else f"{root}.batch{batch_size}{ext}"
            runs[batch_size] = measure(path, batch_size, inputs if batch_size == options.batch_size
                                       else inputs_for(batch_size))
        bench = runs[sweep[0]]

        def record_benchmark() -> None:
            result["benchmark"] = bench_json(bench)
            if options.mode == "inference":
                result["benchmark"]["sweep"] = [bench_json(b) for b in runs.values()]
            result["kernel_calls"] = attribute_kernel_calls(result["rules_applied"], bench.kernel_calls, rules or (),
                                                            options.mode)

        record_benchmark()
        phases["benchmark"] = time.perf_counter() - t
        if options.ablation:
            t = time.perf_counter()
            result["ablation"] = _ablation(options, optimized, inputs, bench, result, rules or (), progress)
            phases["ablation"] = time.perf_counter() - t
        dropped = _not_applied(result)
        if dropped:
            # a rule that only adds its guard here (its kernel never ran fused) or whose kernel costs
            # more than it saves: the model is rebuilt without it and measured again
            progress(f"not applying {', '.join(dropped)} here (no gain on this model and backend): rebuilding "
                     "without and measuring again")
            from adopter.core.rules import all_rules

            kept = [r for r in (rules or all_rules()) if r.name not in dropped]
            result["benchmark_with_every_rule"] = result["benchmark"]
            if not any(a["rule"] not in dropped for a in result["rules_applied"]):
                optimized = original  # (nothing left: the optimized model is the original)
                result["diff"] = ""
                result["identical_to_original"] = True
            else:
                from adopter.kernels import unfreeze

                unfreeze(original)  # (the inference benchmark froze it: the checks train it)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", AdopterWarning)
                    try:
                        rebuilt_cls = optimize_instance(original, built.example_inputs, make_full, rules=kept)
                    except OptimizeError as exc:
                        raise UserError(f"cannot optimize {model_cls.__name__} without {', '.join(dropped)}: "
                                        f"{exc}") from None
                optimized = make_full(rebuilt_cls)
                again = check_equivalence(original, optimized, built.example_inputs)
                result["equivalence"] = {**again.to_json(), "summary": again.summary()}
                result["diff"] = rebuilt_cls.adopter_report.diff
                if not again.equivalent:
                    exit_code = 1
            for batch_size in sweep:
                path = options.benchmark_json if batch_size == sweep[0] else f"{root}.batch{batch_size}{ext}"
                runs[batch_size] = measure(f"{os.path.splitext(path)[0]}.kept{ext}", batch_size,
                                           inputs if batch_size == options.batch_size else inputs_for(batch_size))
            bench = runs[sweep[0]]
            record_benchmark()
        if options.baseline is not None:
            gate = evaluate_gate(result, options.baseline, options.max_regression, options.baseline_path)
            if gate.speed_only_failure:
                # Noise is the likelier cause of one failed speed comparison: measure again and
                # pool both runs before calling it a regression.
                progress("speed below the baseline: measuring again before deciding")
                for batch_size in sweep:
                    second = measure(f"{root}.retry{batch_size}{ext}", batch_size, inputs_for(batch_size))
                    runs[batch_size] = merge(runs[batch_size], second)
                bench = runs[sweep[0]]
                record_benchmark()
                gate = evaluate_gate(result, options.baseline, options.max_regression, options.baseline_path)
            result["gate"] = gate.to_json()
            if not gate.passed:
                exit_code = 1
    elif options.baseline is not None:
        gate = evaluate_gate(result, options.baseline, options.max_regression, options.baseline_path)
        result["gate"] = gate.to_json()
        exit_code = 1
    phases["total"] = time.perf_counter() - t0
    result["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    return VerifyOutcome(result, gate, exit_code)


def in_channels_last(inputs):
    """``inputs`` with every 4-D floating tensor in channels_last memory format (same values)."""
    import torch

    def convert(value):
        if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value

    if isinstance(inputs, dict):
        return {k: convert(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(convert(v) for v in inputs)
    return convert(inputs)


# ---------------------------------------------------------------- what each kernel contributes


def _not_applied(result: dict) -> list[str]:
    """The applied rules that bring nothing on this model and backend (rules are applied or not as a
    whole): their kernel took the original path at every call of the measured step, at every site
    (the rewrite only adds its guard), or the ablation found it costing more than it saves or
    making no measurable difference (its guard still costs). Each of
    their entries gets ``not_applied`` saying why; returns their names."""
    from adopter.verification.ablation import NEUTRAL

    # (a kernel with no measurable effect still costs its guard at every call: only what pays stays)
    costly = {k["kernel"]: k for k in (result.get("ablation") or {}).get("kernels", [])
              if not k["pays"] or k.get("effect") == NEUTRAL}
    by_rule: dict[str, list[dict]] = {}
    for entry in result["rules_applied"]:
        by_rule.setdefault(entry["rule"], []).append(entry)
    dropped = []
    for rule, entries in by_rule.items():
        calls = [e.get("kernel_calls") or {} for e in entries]
        found = [costly[k] for c in calls for k in c.get("kernels") or [] if k in costly]
        backends = [b for c in calls for b in (c.get("backends") or {})]
        if found:
            why = (f"no measurable gain here: {found[0]['why']}" if found[0].get("effect") == NEUTRAL
                   else f"costs more than it saves here: {found[0]['why']}")
        elif backends and set(backends) == {"original"}:
            # (a site without any recorded call says nothing; one that recorded only original calls
            # does, and no site ran fused)
            reasons: dict[str, int] = {}
            for c in calls:
                for reason, n in (c.get("fallbacks") or {}).items():
                    reasons[reason] = reasons.get(reason, 0) + n
            top = max(reasons.items(), key=lambda kv: kv[1])[0] if reasons else ""
            why = "its kernel took the original path at every call here" + (f" (e.g. {top})" if top else "")
        else:
            continue
        dropped.append(rule)
        for entry in entries:
            entry["not_applied"] = why
    return sorted(dropped)


def _ablation(options: VerifyOptions, optimized, inputs, bench, result: dict, rules, progress) -> dict:
    """Leave-one-out ablation of the kernels that ran fused in the measured step
    (:mod:`adopter.verification.ablation`); each applied rule's entry gets its kernel's
    ``contribution``. Returns the result's ``ablation`` record."""
    import torch

    from adopter.verification.ablation import ablate_kernels
    from adopter.verification.benchmark import _robust_cpu, make_inference_step, make_train_step

    fused = sorted({c.kernel for c in bench.kernel_calls if c.fused})
    device = next(iter(optimized.parameters())).device
    make = make_train_step if options.mode == "train" else make_inference_step
    root, ext = os.path.splitext(options.benchmark_json)
    contributions = ablate_kernels(
        lambda: make(optimized, inputs), fused, device=device, json_path=f"{root}.ablation{ext}",
        time_budget_s=options.ablation_seconds, robust_cpu=_robust_cpu(device), progress=progress,
    )
    by_kernel = {c.kernel: c.to_json() for c in contributions}
    not_fused = sorted({c.kernel for c in bench.kernel_calls} - set(fused))
    for entry in result["rules_applied"]:
        kernels = (entry.get("kernel_calls") or {}).get("kernels") or []
        found = [by_kernel[k] for k in kernels if k in by_kernel]
        if found:
            entry["contribution"] = found[0]
    return {
        "method": "leave-one-out on the optimized model: step time and peak memory with one kernel switched off "
                  "(its sites run their original math) over the same with every kernel on; > 1: the kernel helps",
        "figure": "process CPU time" if _robust_cpu(device) else "wall time",
        "threads": torch.get_num_threads(),
        "kernels": [c.to_json() for c in contributions],
        "not_fused_here": not_fused,
    }


# ---------------------------------------------------------------- what ran where


def measured_step(mode: str) -> str:
    """What the kernel calls of a result were counted over (``"measured"`` in its record)."""
    return f"one {measured_step_name(mode)} of the optimized model, right after the timed rounds"

def portable_path(file: str) -> str:
    """``file`` relative to the longest ``sys.path`` entry holding it (else to the working
    directory, else absolute), with ``/``: ``transformers/models/bert/modeling_bert.py``."""
    if not file or file.startswith("<"):
        return file
    real = os.path.realpath(file)

    def holding(entries: Iterable[str]) -> str:
        roots = [os.path.realpath(entry or os.curdir) for entry in entries if isinstance(entry, str)]
        return max((r for r in roots if real.startswith(r.rstrip(os.sep) + os.sep)), key=len, default="")

    root = holding(sys.path) or holding([os.curdir])
    return (os.path.relpath(real, root) if root else real).replace(os.sep, "/")


def _kernel_name(rule_name: str, rules: Iterable) -> str:
    """The telemetry name of a rule's kernel (``adopter.kernels.linear_gelu`` -> ``linear_gelu``)."""
    from adopter.core.rules import find_rule

    rule = find_rule(rule_name, rules)
    return (getattr(rule, "kernel", "") or "").rpartition(".")[2]


def summarize_calls(calls: Iterable) -> dict:
    """``{"kernels": [...], "backends": {backend: calls}, "fallbacks": {reason: calls}}``."""
    calls = list(calls)
    backends: Counter = Counter()
    fallbacks: Counter = Counter()
    for call in calls:
        backends[call.backend] += call.count
        if not call.fused:
            fallbacks[call.reason or "no reason given"] += call.count
    summary: dict[str, Any] = {
        "kernels": sorted({c.kernel for c in calls}),
        "backends": dict(sorted(backends.items())),
    }
    if fallbacks:
        summary["fallbacks"] = dict(sorted(fallbacks.items()))
    return summary


def attribute_kernel_calls(applied: list[dict], calls: Iterable, rules: Iterable = (), mode: str = "training") -> dict:
    """Give each applied rule entry (``rules_applied`` JSON) its ``path`` and ``kernel_calls``:
    the calls made from its site (same file by real path, function ``Class.function``) of its
    rule's kernel; when the rule's kernel name is not among them, the site's calls of kernels no
    other rule applied there claims. Returns the result's top-level ``kernel_calls`` record."""
    calls = list(calls)
    rules = tuple(rules)
    by_site: dict[tuple[str, str], list] = defaultdict(list)
    for call in calls:
        by_site[(os.path.realpath(call.file), call.function)].append(call)
    kernels_at: dict[tuple[str, str], set[str]] = defaultdict(set)
    sites = []
    for entry in applied:
        entry["path"] = portable_path(entry["file"])
        site = (os.path.realpath(entry["file"]), site_function(entry.get("class"), entry.get("function") or ""))
        kernel = _kernel_name(entry["rule"], rules)
        kernels_at[site].add(kernel)
        sites.append((site, kernel))
    attributed: set[int] = set()
    for entry, (site, kernel) in zip(applied, sites):
        here = by_site.get(site, [])
        mine = [c for c in here if c.kernel == kernel]
        if not mine:
            claimed = kernels_at[site] - {kernel}
            mine = [c for c in here if c.kernel not in claimed]
        attributed.update(id(c) for c in mine)
        entry["kernel_calls"] = summarize_calls(mine)
    records = []
    for call in calls:
        record = call.to_json()
        record["file"] = portable_path(call.file)
        record["attributed"] = id(call) in attributed
        records.append(record)
    return {"measured": measured_step(mode), "calls": records}
