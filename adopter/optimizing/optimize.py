"""``optimize(model_cls)``: the same model class, rebuilt from rewritten source, in memory.

Steps (ARCHITECTURE.md data flow):

1. build an instance to analyse — from ``config`` or, for transformers classes, the class's
   default config shrunk for speed — with example inputs (:func:`adopter.tracing.build_model`);
2. scan the source files that define the model's classes (the modeling file and the other
   files of the same package it draws module classes from) with the rules;
3. trace the instance and keep the ``confirmed`` matches (an untraceable model falls back to
   the static matches, with a warning);
4. per rule: rewrite those files with that rule's matches, load the rewritten modules in
   memory, build the rewritten class with the same constructor arguments, load the original
   weights strictly and check equivalence forward and backward (:mod:`adopter.verification.equivalence`);
   a rule that is not equivalent (or fails to rewrite/load) is dropped, with the reason;
5. rewrite with all the rules that passed, check the combination again (if it fails, add
   rules one at a time and keep those that stay equivalent), and return that class.

The rewritten modules are loaded by :func:`adopter.rewrite.loader.load_rewritten_modules`
under ``<package>.<module>__adopter_<hash>`` with the original's package context (relative
imports work), registered in ``sys.modules``; while they execute, imports of the other
rewritten modules resolve to their rewritten versions. Nothing is ever written to the user's files.

The returned class is a new class object built from the rewritten source, not a subclass of
the original: ``isinstance(model, Original)`` is False for its instances. Adding the original
as a base would put its methods in the MRO and change what ``super()`` calls (behaviour), so
instead the original is recorded as ``Optimized.adopter_original``; check
``isinstance(model, Optimized)``, or ``issubclass(type(model).adopter_original, Original)``
(:func:`original_class` does that lookup for any class or instance).
"""

from __future__ import annotations

import contextvars
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from adopter.core.structures import Match
from adopter.errors import AdopterWarning, OptimizeError, one_line
from adopter.kernels.telemetry import count_kernel_calls, site_function
from adopter.optimizing.config_flip import FlipCheck, constructor_arguments
from adopter.optimizing.imported_source import read_imported_source
from adopter.optimizing.main_module import MAIN, load_main_rewrite, main_source_file, source_text
from adopter.optimizing.subject import Subject, build_subject, is_transformers_class, package_files, shrink_config
from adopter.rewrite.loader import load_rewritten_modules  # the one in-memory loader (re-exported)

__all__ = [
    "AdopterWarning",
    "AppliedRewrite",
    "OptimizeError",
    "OptimizeReport",
    "Pipeline",
    "SkippedRewrite",
    "load_rewritten_modules",
    "optimize",
    "original_class",
    "shrink_config",
]




def kernel_note(kernel: str) -> str:
    """What the report says at every site rewritten to ``kernel`` (a dotted path such as a rule's
    ``kernel``): the kernel's own ``report_note`` (a fused LM-head loss: no logits in training with
    labels, and how to keep them); "" for kernels without one, or that cannot be imported."""
    import importlib

    module, _, name = kernel.rpartition(".")
    try:
        return getattr(getattr(importlib.import_module(module), name), "report_note", "") or ""
    except Exception:  # noqa: BLE001  (a plug-in rule's kernel that does not import: no note)
        return ""


def _kernel_notes(applied: list[AppliedRewrite]) -> list[str]:
    """``note: <rule> at <site>: <kernel note>`` for each applied rewrite whose kernel has a note."""
    from adopter.core.rules import find_rule

    notes = []
    for a in applied:
        rule = find_rule(a.rule)
        note = kernel_note(getattr(rule, "kernel", "")) if rule is not None else ""
        if note:
            notes.append(f"note: {a.rule} at {a.where}: {note}")
    return notes


# ---------------------------------------------------------------- report


@dataclass
class AppliedRewrite:
    rule: str
    file: str
    lines: list[int]
    class_name: str | None
    function: str
    status: str  # trace status of the match: "confirmed", or "static" when untraced
    # kernel calls from this site during the equivalence checks: {"analysed"|"flipped": {backend: n}}
    # (backend "original": the guard ran the original computation)
    kernel_calls: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        line = f":{self.lines[0]}" if self.lines else ""
        scope = ".".join(p for p in (self.class_name, self.function) if p)
        return f"{os.path.basename(self.file)}{line}" + (f" ({scope})" if scope else "")

    def to_json(self) -> dict:
        return {
            "rule": self.rule,
            "file": self.file,
            "lines": self.lines,
            "class": self.class_name,
            "function": self.function,
            "status": self.status,
            "where": self.where,
            "kernel_calls": self.kernel_calls,
        }

    def calls_text(self) -> str:
        parts = []
        for check, counts in self.kernel_calls.items():
            fused = sum(n for b, n in counts.items() if b != "original")
            parts.append(f"{check}: fused {fused}/{sum(counts.values())}")
        return "; ".join(parts)


# Why a match was not applied, as a code (SkippedRewrite.kind; the report's JSON carries it): a static
# precondition or precision refusal, a trace status, or a check of the rewritten class that failed.
SkipKind = Literal[
    "precondition", "refused", "conditional-untraced",
    "not-executed", "untraced", "rejected", "runtime-only", "conditional", "static",
    "rewrite-failed", "load-failed", "build-failed", "not-equivalent", "not-equivalent-combined",
    "not-equivalent-flipped",
]


@dataclass
class SkippedRewrite:
    rule: str
    file: str
    lines: list[int]
    reason: str
    kind: SkipKind  # why, as a code (the reason says it in words)
    max_abs_diff: float | None = None  # when dropped for not being equivalent

    @property
    def where(self) -> str:
        line = f":{self.lines[0]}" if self.lines else ""
        return f"{os.path.basename(self.file)}{line}" if self.file else "-"

    def to_json(self) -> dict:
        return {
            "rule": self.rule,
            "file": self.file,
            "lines": self.lines,
            "reason": self.reason,
            "kind": self.kind,
            "where": self.where,
            **({"max_abs_diff": self.max_abs_diff} if self.max_abs_diff is not None else {}),
        }


@dataclass
class OptimizeReport:
    """What ``optimize`` did; attached to the returned class as ``.adopter_report``."""

    model_class: str
    applied: list[AppliedRewrite] = field(default_factory=list)
    skipped: list[SkippedRewrite] = field(default_factory=list)
    diff: str = ""
    traced: bool = False
    equivalence: Any = None  # adopter.verification.equivalence.EquivalenceResult of the final class, on the analysed instance
    # the same check with every config value a rewritten site reads flipped (adopter.optimizing.config_flip)
    flipped: list[Any] = field(default_factory=list)  # ConfigFlip
    flipped_equivalence: Any = None
    flipped_note: str = ""  # why there is no flipped check, or which flips were left out
    warnings: list[str] = field(default_factory=list)
    modules: dict[str, str] = field(default_factory=dict)  # original module -> generated module name
    files: list[str] = field(default_factory=list)  # files scanned
    # file -> (the text optimize read, the rewritten text the returned class was built from and
    # checked), for each file the returned class's rewrites changed (`adopter rewrite --model` writes these)
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def applied_rules(self) -> list[str]:
        return sorted({a.rule for a in self.applied})

    def __str__(self) -> str:
        """The readable summary: applied rewrites, the others grouped (same rule, place and kind
        of reason), counts, warnings, and what to check instead of ``isinstance``."""
        name = self.model_class.rpartition(".")[2]
        eq = self.equivalence
        checked = ""
        if eq is not None:
            checked = "; equivalent to the original" if eq.equivalent else "; NOT equivalent to the original"
            if getattr(eq, "max_abs_diff", None) is not None:
                checked += f", max |diff| {eq.max_abs_diff:.2g}"
        n_rejected = sum(1 for s in self.skipped if s.kind == "precondition")
        rejected_text = f", {n_rejected} rejected by a rule precondition" if n_rejected else ""
        lines = [
            f"adopter: {self.model_class}: {len(self.applied)} rewrite(s) applied, "
            f"{len(self.skipped) - n_rejected} match(es) not applied{rejected_text} "
            f"({'traced' if self.traced else 'not traced: static matches'}{checked})"
        ]
        if self.flipped_equivalence is not None:
            verdict = "equivalent" if self.flipped_equivalence.equivalent else "NOT equivalent"
            lines.append(f"flipped config ({', '.join(map(str, self.flipped))}): {verdict}")
        if self.flipped_note:
            lines.append(f"flipped config: {self.flipped_note}")
        if self.applied:
            lines.append(f"applied ({len(self.applied)}; kernel calls in the checks, fused/all):")
            width = max(len(a.where) for a in self.applied)
            lines += [f"  {a.rule:<21} {a.where:<{width}}  {a.status}  {a.calls_text()}" for a in self.applied]
            lines += _kernel_notes(self.applied)
        groups: dict[tuple[str, str, str], list[SkippedRewrite]] = {}
        for s in self.skipped:
            groups.setdefault((s.kind, s.rule, s.where), []).append(s)
        rejected = {k: v for k, v in groups.items() if k[0] == "precondition"}
        others = {k: v for k, v in groups.items() if k[0] != "precondition"}
        if others:
            lines.append(f"not applied ({sum(len(v) for v in others.values())}):")
            for (_, rule, where), items in others.items():
                count = f" x{len(items)}" if len(items) > 1 else ""
                lines.append(f"  {rule + count:<21} {where:<20}  {items[0].reason}")
        if rejected:
            total = sum(len(v) for v in rejected.values())
            lines.append(f"rejected by a rule precondition ({total}; expected: every rule is tried on every match):")
            for (_, rule, where), items in rejected.items():
                example = items[0].reason.split(":", 1)[1].strip()
                lines.append(f"  {rule + ' x' + str(len(items)):<21} {where:<20}  e.g. {example}")
        lines += [f"warning: {w}" for w in self.warnings]
        if self.diff:
            lines.append(f"diff: {self.diff.count(chr(10))} lines in .adopter_report.diff")
        lines.append(
            f"note: the optimized class is rebuilt from the rewritten source, not a subclass: its instances are "
            f"not isinstance(..., {name}); check isinstance(model, Optimized), or "
            f"issubclass(adopter.optimizing.optimize.original_class(model), {name})"
        )
        return "\n".join(lines)

    def summary(self) -> str:
        lines = [f"{self.model_class}: {len(self.applied)} rewrite(s) applied, {len(self.skipped)} not applied"]
        width = max([18] + [len(r.rule) for r in [*self.applied, *self.skipped]])  # rule column
        lines += [f"  applied  {a.rule:<{width}} {a.where}  [{a.status}]" for a in self.applied]
        lines += [f"  skipped  {s.rule:<{width}} {s.where}  {s.reason}" for s in self.skipped]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  {note}" for note in _kernel_notes(self.applied)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "model_class": self.model_class,
            "traced": self.traced,
            "applied": [a.to_json() for a in self.applied],
            "skipped": [s.to_json() for s in self.skipped],
            "warnings": list(self.warnings),
            "modules": dict(self.modules),
            "equivalence": self.equivalence.to_json() if self.equivalence is not None else None,
            "flipped_config": {
                "flips": [f.to_json() for f in self.flipped],
                "equivalence": self.flipped_equivalence.to_json() if self.flipped_equivalence is not None else None,
                "note": self.flipped_note,
            },
        }


# ---------------------------------------------------------------- pipeline (scan, trace, rewrite)


@dataclass
class RewriteOutput:
    """What the pipeline's rewrite step returns for one file (mirrors ``adopter.rewrite.RewriteResult``)."""

    new_text: str
    applied: list[Match]
    failed: list[tuple[Match, str]]  # (match, reason)
    diff: str


def _default_scan(files: Sequence[str], rules: Sequence[Any]) -> tuple[list[Match], list[Match]]:
    """(matches, rejected-by-precondition) over the files, without importing them."""
    from adopter.core.scan import scan_source

    matches: list[Match] = []
    rejected: list[Match] = []
    for path in files:
        text = source_text(path)
        try:
            # The source enables the matcher's source-level checks (escapes through plain
            # assignments, optional modules/inputs when choosing a path variant, Conv2d subclasses).
            matches.extend(scan_source(text, path, rules, rejected))
        except SyntaxError:
            continue
    return matches, rejected


def _default_confirm(model, example_inputs, matches: list[Match], rules: Sequence[Any] = ()) -> list[Match]:
    from adopter.tracing import confirm_matches

    return list(confirm_matches(model, example_inputs, matches, rules=rules))


# optimize(torchscript=...) for the rewrite it runs (a context variable: Pipeline.rewrite keeps its
# signature)
TORCHSCRIPT_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("adopter_torchscript",
                                                                                default=None)


def _default_rewrite(text: str, matches: list[Match], filename: str, rules: Sequence[Any] = ()) -> RewriteOutput:
    from adopter.rewrite import rewrite_source
    from adopter.rewrite.scripting import guard_options

    # No model config goes in: rewritten source must hold for every config (guarded kernels).
    # TorchScript guards as `adopter rewrite --torchscript` puts them: optimize(torchscript=...),
    # else ADOPTER_TORCHSCRIPT, else auto (only where the model's package scripts, around what
    # could be scripted).
    choice = TORCHSCRIPT_CHOICE.get() or os.environ.get("ADOPTER_TORCHSCRIPT") or "auto"
    result = rewrite_source(text, matches, filename=filename, rules=rules, **guard_options(choice, filename, text))
    applied = [o.match for o in result.outcomes if o.applied]
    failed = [(o.match, o.reason or "not applied by the rewriter") for o in result.outcomes if not o.applied]
    return RewriteOutput(result.new_text, applied, failed, result.diff or "")


@dataclass
class Pipeline:
    """The scan / trace / rewrite steps optimize() drives (replaceable in tests)."""

    scan: Callable[[Sequence[str], Sequence[Any]], tuple[list[Match], list[Match]]] = _default_scan
    # (model, example_inputs, matches, rules) -> matches with a runtime status
    confirm: Callable[..., list[Match]] = _default_confirm
    # (text, matches, filename, rules=...) -> RewriteOutput
    rewrite: Callable[..., RewriteOutput] = _default_rewrite


# ---------------------------------------------------------------- optimize


def _resolve_rules(rules) -> list[Any]:
    from adopter.core.rules import all_rules, get_rules

    if rules is None:
        return all_rules()
    if isinstance(rules, str):
        rules = [r for r in rules.split(",")]
    out = []
    names = []
    for rule in rules:
        if isinstance(rule, str):
            names.append(rule)
        else:
            out.append(rule)
    return get_rules(names) + out if names else out


def _runtime_reach(subject, files, texts, matches, confirmed, rule_objects, pipe) -> list[Match]:
    """Matches the source alone could not type, from the traced model (see
    :func:`adopter.tracing.runtime_types.runtime_reach`); part of the default scan step only."""
    if pipe.scan is not _default_scan:
        return confirmed  # a replaced scan step (tests, plug-ins) defines the matches alone
    from adopter.tracing import runtime_reach

    by_path = {os.path.realpath(path): texts[name] for name, path in files.items()}
    return runtime_reach(subject.model, subject.example_inputs, matches, confirmed, by_path, rule_objects,
                         texts=by_path, confirm=pipe.confirm)


def _without_logits_warnings(fn):
    """optimize() trains rewritten models with labels in its own equivalence checks: the kernel's
    LogitsNotComputedWarning is for the user's training code (the report carries the note
    instead), so those checks do not show it (and the user's first model still does)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from adopter.kernels import LogitsNotComputedWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LogitsNotComputedWarning)
            return fn(*args, **kwargs)

    return wrapper


@_without_logits_warnings
def optimize(
    model_cls: type,
    *,
    rules=None,
    config=None,
    example_inputs=None,
    device=None,
    init_args: tuple = (),
    init_kwargs: dict | None = None,
    pipeline: Pipeline | None = None,
    torchscript: str | None = None,
    _subject: Subject | None = None,
) -> type:
    """Return ``model_cls`` rebuilt from its rewritten source (same name and constructor),
    with ``.adopter_report`` (:class:`OptimizeReport`).

    ``rules``: rule names or rule objects (default: every built-in rule).
    ``config``: what to build the analysed instance from — a transformers config (default for
    transformers classes: ``model_cls.config_class()`` shrunk), or for plain modules a dict of
    keyword / tuple of positional constructor arguments (or use ``init_args``/``init_kwargs``).
    A model built from a config the user did not give is counted on the ``meta`` device first:
    over 200M parameters ``optimize`` refuses (``OptimizeError``: pass ``config=``), a smaller
    full-size default is built with an ``AdopterWarning`` (:mod:`adopter.optimizing.subject`).
    ``example_inputs``: a dict of forward keyword arguments (generated for transformers models).
    Every rule is checked for equivalence alone and all together (:mod:`adopter.verification.equivalence`);
    rules that fail are dropped and reported, so the class never holds a non-equivalent rewrite.
    ``torchscript``: ``auto`` (default; ``ADOPTER_TORCHSCRIPT`` sets another), ``always`` or ``never``:
    where the rewritten source keeps the original beside each rewritten region for TorchScript
    (``adopter rewrite --torchscript``).
    """
    import torch  # noqa: F401  (optimize always needs torch; import errors surface here)

    from adopter.rewrite.scripting import TORCHSCRIPT_CHOICES

    if torchscript is not None and torchscript not in TORCHSCRIPT_CHOICES:
        raise OptimizeError(f"torchscript must be one of {', '.join(TORCHSCRIPT_CHOICES)}, got {torchscript!r}")
    token = TORCHSCRIPT_CHOICE.set(torchscript)
    try:
        return _optimize(model_cls, rules, config, example_inputs, device, init_args, init_kwargs, pipeline,
                         _subject)
    finally:
        TORCHSCRIPT_CHOICE.reset(token)


def _optimize(model_cls, rules, config, example_inputs, device, init_args, init_kwargs, pipeline,
              _subject) -> type:
    if not (isinstance(model_cls, type)):
        raise OptimizeError(f"optimize() expects a model class, got {type(model_cls).__name__}")
    if model_cls.__module__ == MAIN and _subject is None:
        # the script being run, or a notebook: its source must be had before anything is built
        main_source_file(model_cls, [model_cls])
    subject = _subject or build_subject(model_cls, config, example_inputs, device, init_args, init_kwargs)
    # the constructor arguments locate a plain config object (dataclass, namespace, dict) for the flipped check
    # (a subject handed over with the arguments it was built with keeps them)
    given = _subject is None or init_args or init_kwargs
    arguments = constructor_arguments(model_cls, config, init_args, init_kwargs) if given else None
    run = _OptimizeRun(model_cls, subject, pipeline or Pipeline(), _resolve_rules(rules), arguments)
    matches = run.scan()
    candidates = run.confirm(matches)
    accepted = run.check_each_rule(candidates)
    final_rules = run.combine_equivalent(accepted)
    final_rules = run.check_flipped_config(accepted, final_rules)
    return run.finish()


class _OptimizeRun:
    """The stages of one :func:`optimize` call over the state they share: the class and the
    instance analysed, its source files and texts, the rules, the report being filled, and the
    class built last (with the matches it applied, its diff and the kernel calls of its checks)."""

    def __init__(self, model_cls: type, subject: Subject, pipe: Pipeline, rule_objects: list,
                 arguments: tuple[tuple, dict] | None = None) -> None:
        self.model_cls, self.subject, self.pipe, self.rule_objects = model_cls, subject, pipe, rule_objects
        self.arguments = arguments  # (args, kwargs) the analysed instance was built with, when known
        self.report = OptimizeReport(model_class=f"{model_cls.__module__}.{model_cls.__qualname__}")
        if model_cls.__module__ == MAIN:
            # only its definitions are rewritten and run again (adopter.optimizing.main_module)
            self.files = {MAIN: main_source_file(model_cls, [type(m) for m in subject.model.modules()])}
        else:
            self.files = package_files(subject.model, model_cls)
        self.report.files = list(self.files.values())
        # Decoded exactly as the scan reads it (coding cookie, newlines), so match positions agree.
        self.texts = {name: source_text(path) if name == MAIN else read_imported_source(name, path, source_text)
                      for name, path in self.files.items()}
        self.built_sources: dict[type, dict[str, tuple[str, str]]] = {}  # class -> the texts it was built from
        self.flip_check: FlipCheck | None = None
        self.final: tuple = ()  # (class, modules, applied, diff, equivalence, its kernel calls)
        # rule -> the same tuple for the class of that rule alone, when it was proved equivalent
        self.alone: dict[str, tuple] = {}
        self.final_error = ""  # why the final class could not be checked (it cannot be built)
        self.flipped: tuple = (None, None)  # (equivalence under the flipped config, its kernel calls)

    def skip(self, rule: str, m: Match, kind: SkipKind, reason: str, diff: float | None = None) -> None:
        self.report.skipped.append(SkippedRewrite(rule, m.file, m.lines, reason, kind, diff))

    # ---------------------------------------------------------------- stages

    def scan(self) -> list[Match]:
        """Static matches in the class's files; the refused and rejected ones go to the report."""
        matches, rejected = self.pipe.scan(list(self.files.values()), self.rule_objects)
        for m in rejected:
            # refused: the pattern fits but a precision precondition of the kernel fails (its code says which)
            if m.status == "refused":
                self.skip(m.rule, m, "refused", f"refused ({m.code}): {m.reason}")
            else:
                self.skip(m.rule, m, "precondition", f"precondition: {m.reason}")
        return matches

    def confirm(self, matches: list[Match]) -> list[Match]:
        """The matches a trace confirms; a model that cannot be traced keeps its static matches
        (each still checked for equivalence), with a warning."""
        report, model_cls = self.report, self.model_cls
        untraceable = ""
        try:
            confirmed = (self.pipe.confirm(self.subject.model, self.subject.example_inputs, matches,
                                           self.rule_objects) if matches else [])
        except Exception as exc:  # noqa: BLE001 - any tracing failure: static result with a warning
            untraceable = one_line(exc)
        else:
            static = [m for m in confirmed if m.status != "runtime-only"]
            if static and all(m.status == "untraced" for m in static):
                # the tracing API reports a model it cannot capture as every match "untraced"
                untraceable = static[0].reason or "no trace"
        if untraceable:
            message = (
                f"{model_cls.__name__} could not be traced ({untraceable}); "
                "using the static matches, each still checked for equivalence"
            )
            warnings.warn(message, AdopterWarning, stacklevel=4)  # the user's optimize() call
            report.warnings.append(message)
            # a conditional match needs the trace to settle it: without one it is not applied
            candidates = [m for m in matches if m.status != "conditional"]
            for m in matches:
                if m.status == "conditional":
                    self.skip(m.rule, m, "conditional-untraced", f"conditional ({m.code}): {m.condition}; no trace settled it")
        else:
            report.traced = True
            confirmed = _runtime_reach(self.subject, self.files, self.texts, matches, confirmed, self.rule_objects,
                                       self.pipe)
            candidates = [m for m in confirmed if m.status == "confirmed"]
            for m in confirmed:
                if m.status != "confirmed":
                    self.skip(m.rule, m, m.status, m.status + (f": {m.reason}" if m.reason else ""))  # type: ignore[arg-type]
        in_files = set(self.files.values())
        return [m for m in candidates if os.path.realpath(m.file) in in_files]

    def check_each_rule(self, candidates: list[Match]) -> dict[str, list[Match]]:
        """Rule -> its applied matches, for every rule whose rewrite alone loads and is equivalent;
        rules in the order given (their priority when two do not combine), then any others."""
        order = {getattr(r, "name", str(r)): i for i, r in enumerate(self.rule_objects)}
        by_rule: dict[str, list[Match]] = {}
        for m in sorted(candidates, key=lambda m: order.get(m.rule, len(order))):
            by_rule.setdefault(m.rule, []).append(m)
        accepted: dict[str, list[Match]] = {}
        self.alone = {}
        for rule, rule_matches in by_rule.items():
            try:
                new_cls, modules, applied, failed, diff = self.build(rule_matches)
            except Exception as exc:  # noqa: BLE001 - a rewrite that does not load is dropped
                for m in rule_matches:
                    self.skip(rule, m, "load-failed", f"rewritten source fails to load: {one_line(exc)}")
                continue
            for m, reason in failed:
                self.skip(rule, m, "rewrite-failed", f"rewrite: {reason}")
            if not applied:
                continue
            with count_kernel_calls() as calls:
                result, error = self.equivalent(new_cls)
            if result is None or not result.equivalent:
                reason = error or (
                    f"not equivalent: max |diff| {result.max_abs_diff:.3g} at {result.worst}"
                    if not result.error
                    else f"not equivalent: {result.error}"
                )
                kind: SkipKind = "build-failed" if result is None else "not-equivalent"
                for m in applied:
                    self.skip(rule, m, kind, reason, None if result is None else result.max_abs_diff)
                continue
            accepted[rule] = applied
            self.alone[rule] = (new_cls, modules, applied, diff, result, calls)
        return accepted

    def combine_equivalent(self, accepted: dict[str, list[Match]]) -> list[str]:
        """All accepted rules together; when they are not equivalent together, rules are added one
        at a time and kept while the class stays equivalent. Returns the rules kept."""
        final_rules = list(accepted)
        if len(final_rules) == 1:
            # one rule: the class its own check built and proved is the final one (built from the
            # same matches, it would be the same source; the model is not built once more)
            self.final = self.alone[final_rules[0]]
            return final_rules
        result = self.build_final(accepted, final_rules)
        if result is None or not result.equivalent:
            kept: list[str] = []
            for rule in final_rules:
                trial, _ = self.equivalent(self.combine(accepted, kept + [rule])[0])
                if trial is not None and trial.equivalent:
                    kept.append(rule)
                else:
                    for m in accepted[rule]:
                        self.skip(rule, m, "not-equivalent-combined", "not equivalent in combination with the other rules",
                                  None if trial is None else trial.max_abs_diff)
            final_rules = kept
            result = self.build_final(accepted, final_rules)
            if result is None or not result.equivalent:
                error = self.final_error if result is None else result.summary()
                raise OptimizeError(
                    f"the rewritten {self.model_cls.__name__} is not equivalent even with the remaining rules "
                    f"({error})"
                )
        return final_rules

    def check_flipped_config(self, accepted: dict[str, list[Match]], final_rules: list[str]) -> list[str]:
        """The second check, on a configuration whose values the rewritten sites read flipped
        (:mod:`adopter.optimizing.config_flip`); rules wrong there are dropped."""
        new_cls, _, applied = self.final[:3]
        flip_check = self.flip_check = FlipCheck(self.model_cls, self.subject, self.files, self.texts, self.arguments)
        flip_check.choose(applied)
        self.flipped = flip_check.run(new_cls)
        if self.flipped[0] is None or self.flipped[0].equivalent:
            return final_rules
        wrong = [r for r in final_rules if not flip_check.equivalent(self.combine(accepted, [r])[0])]
        for rule in wrong:
            for m in accepted[rule]:
                self.skip(rule, m, "not-equivalent-flipped",
                          f"not equivalent under the flipped config ({flip_check.flips_text})")
        final_rules = [r for r in final_rules if r not in wrong]
        result = self.build_final(accepted, final_rules)
        self.flipped = flip_check.run(self.final[0])
        if result is None or not result.equivalent or (self.flipped[0] is not None and not self.flipped[0].equivalent):
            raise OptimizeError(f"the rewritten {self.model_cls.__name__} is not equivalent under the flipped config "
                                f"({flip_check.flips_text}) even without the rules that fail it alone")
        return final_rules

    def finish(self) -> type:
        """The report filled in (per applied site: its kernel calls in the checks) and attached."""
        new_cls, modules, applied, diff, result, analysed_calls = self.final
        flipped_result, flipped_calls = self.flipped
        report, model_cls = self.report, self.model_cls
        report.equivalence = result
        report.flipped, report.flipped_equivalence, report.flipped_note = (
            self.flip_check.flips, flipped_result, self.flip_check.note)
        for m in applied:
            calls = {"analysed": _site_counts(analysed_calls, m)}
            if flipped_calls is not None:
                calls["flipped"] = _site_counts(flipped_calls, m)
            report.applied.append(AppliedRewrite(m.rule, m.file, m.lines, m.class_name, m.function, m.status,
                                                 {k: v for k, v in calls.items() if v}))
        report.diff = diff
        report.sources = self.built_sources[new_cls]
        report.modules = {name: module.__name__ for name, module in modules.items()}
        new_cls.adopter_report = report
        # Not a subclass of model_cls (see the module docstring): record the original instead.
        new_cls.adopter_original = model_cls
        if is_transformers_class(model_cls) and hasattr(model_cls, "from_pretrained"):
            new_cls.from_pretrained = _from_pretrained_via(model_cls)
        return new_cls

    # ---------------------------------------------------------------- building and checking

    def build(self, selected: list[Match]):
        """Rewrite, load and instantiate with ``selected`` matches -> (class, modules, applied,
        failed, diff)."""
        by_file: dict[str, list[Match]] = {}
        for m in selected:
            by_file.setdefault(os.path.realpath(m.file), []).append(m)
        sources = {}
        applied: list[Match] = []
        failed: list[tuple[Match, str]] = []
        diffs = []
        for name, path in self.files.items():
            file_matches = by_file.get(path, [])
            if file_matches:
                out = self.pipe.rewrite(self.texts[name], file_matches, path, rules=self.rule_objects)
                applied += out.applied
                failed += out.failed
                if out.applied:
                    sources[name] = (path, out.new_text)
                    if out.diff:
                        diffs.append(out.diff)
        root = self.model_cls.__module__
        changed = {path: (self.texts[name], new_text) for name, (path, new_text) in sources.items()}
        if root not in sources:
            sources[root] = (self.files[root], self.texts[root])
        if root == MAIN:
            modules = {MAIN: load_main_rewrite(*sources[MAIN])}
        else:
            modules = load_rewritten_modules(sources)
        new_cls = getattr(modules[root], self.model_cls.__qualname__.split(".")[0])
        for part in self.model_cls.__qualname__.split(".")[1:]:
            new_cls = getattr(new_cls, part)
        self.built_sources[new_cls] = changed
        return new_cls, modules, applied, failed, "".join(diffs)

    def combine(self, accepted: dict[str, list[Match]], rules_in_order: list[str]):
        return self.build([m for r in rules_in_order for m in accepted[r]])

    def equivalent(self, new_cls):
        from adopter.verification.equivalence import check_equivalence

        try:
            candidate = self.subject.make(new_cls)
        except Exception as exc:  # noqa: BLE001
            return None, f"rewritten class cannot be built: {one_line(exc)}"
        return check_equivalence(self.subject.model, candidate, self.subject.example_inputs), ""

    def build_final(self, accepted: dict[str, list[Match]], rules_in_order: list[str]):
        """Build the class of ``rules_in_order`` and check it, counting the kernel calls of the
        check (fused or fallback, per site): recorded as the final class; returns its equivalence."""
        new_cls, modules, applied, _, diff = self.combine(accepted, rules_in_order)
        with count_kernel_calls() as calls:
            result, error = self.equivalent(new_cls)
        self.final = (new_cls, modules, applied, diff, result, calls)
        self.final_error = error
        return result


def _site_counts(calls, m: Match) -> dict[str, int]:
    """{backend: calls} made from the rewritten function of ``m`` (by file and qualified name)."""
    out: dict[str, int] = {}
    for c in calls.at(m.file, site_function(m.class_name, m.function)):
        out[c.backend] = out.get(c.backend, 0) + c.count
    return out


def _from_pretrained_via(original_cls: type):
    """``from_pretrained`` for an optimized transformers class.

    transformers 5 loads checkpoints parameter by parameter (``set_param_for_module``),
    bypassing ``load_state_dict`` and therefore the kernel modules' key-mapping hooks (a
    ``FusedQKV`` has no ``query``/``key``/``value`` submodules to put ``query.weight`` in).
    So load with the original class, then move the weights over with a strict
    ``load_state_dict``, which goes through the hooks.
    """

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        import torch

        original = original_cls.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if isinstance(original, tuple):  # output_loading_info=True
            original, *extra = original
        else:
            extra = None
        param = next(iter(original.parameters()), None)
        instance = cls(original.config)
        if param is not None:
            instance = instance.to(device=param.device, dtype=param.dtype if param.is_floating_point() else None)
        with torch.no_grad():
            instance.load_state_dict(original.state_dict(), strict=True)
        if getattr(original, "generation_config", None) is not None and hasattr(instance, "generation_config"):
            instance.generation_config = original.generation_config
        instance.train(original.training)
        return (instance, *extra) if extra is not None else instance

    return classmethod(from_pretrained)


def original_class(obj) -> type:
    """The class ``optimize`` started from, for an optimized class or instance (and the class
    itself for anything else): ``issubclass(original_class(model), BertModel)`` holds for
    an optimized BertModel where ``isinstance(model, BertModel)`` does not."""
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "adopter_original", cls)


def optimize_instance(model, example_inputs, make: Callable[[type], Any], **kwargs) -> type:
    """``optimize`` for an already-built instance (``adopter verify``): ``make(cls)`` builds a
    new instance of a class the same way ``model`` was built."""
    return optimize(
        type(model), _subject=Subject(model, example_inputs, make, getattr(model, "config", None)), **kwargs
    )
