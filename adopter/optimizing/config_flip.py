"""The second configuration ``optimize()`` checks a rewritten class under.

A rewrite must be right for every configuration its source can build, not only the analysed
one. So besides the analysed instance, optimize builds original and optimized classes with a
*flipped* configuration — every config value a rewritten site reads (activation, eps, bias
flags, attention implementation, dropout probabilities) changed — and compares them. Which
values a site reads is found statically: ``config.<name>`` / ``self.config.<name>`` /
``getattr(config, "<name>", ...)`` in the ``__init__`` of the class owning the rewritten
function (and its same-file bases) and in the rewritten function itself.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from adopter.core.structures import Match
from adopter.errors import one_line
from adopter.kernels.telemetry import count_kernel_calls
from adopter.optimizing.subject import Subject

__all__ = ["ConfigFlip", "FlipCheck", "config_fields_read", "flips_for"]

_CONFIG_NAMES = ("config", "cfg")
# transformers stores the attention implementation in a private field with a public meaning
_ATTN_IMPL = {"eager": "sdpa", "sdpa": "eager"}


@dataclass(frozen=True)
class ConfigFlip:
    field: str
    original: Any
    flipped: Any

    def __str__(self) -> str:
        return f"{self.field}={self.flipped!r} (was {self.original!r})"

    def to_json(self) -> dict:
        return {"field": self.field, "original": self.original, "flipped": self.flipped}


def _is_config(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _CONFIG_NAMES or node.id.endswith("_config")
    return isinstance(node, ast.Attribute) and node.attr in _CONFIG_NAMES and isinstance(node.value, ast.Name)


def _reads(node: ast.AST) -> set[str]:
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and _is_config(sub.value):
            out.add(sub.attr)
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("getattr", "hasattr")
              and len(sub.args) >= 2 and _is_config(sub.args[0]) and isinstance(sub.args[1], ast.Constant)
              and isinstance(sub.args[1].value, str)):
            out.add(sub.args[1].value)
    return out


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def config_fields_read(texts: dict[str, str], applied: Iterable[Match]) -> set[str]:
    """Config attribute names read by the rewritten functions and their classes' ``__init__``.

    ``texts``: file path -> source text of the files the matches lie in."""
    trees: dict[str, ast.Module] = {}
    fields: set[str] = set()
    for m in applied:
        path = os.path.realpath(m.file)
        if path not in trees:
            if path not in texts:
                continue
            try:
                trees[path] = ast.parse(texts[path])
            except SyntaxError:
                continue
        tree = trees[path]
        classes = _classes(tree)
        function = m.function.rpartition(".")[2]
        if m.class_name and m.class_name.split(".")[-1] in classes:
            todo, seen = [m.class_name.split(".")[-1]], set()
            while todo:  # the class and its same-file bases: their __init__ builds the modules
                name = todo.pop()
                if name in seen or name not in classes:
                    continue
                seen.add(name)
                init = _method(classes[name], "__init__")
                if init is not None:
                    fields |= _reads(init)
                todo += [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in classes[name].bases]
            fn = _method(classes[m.class_name.split(".")[-1]], function)
        else:
            fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function), None)
        if fn is not None:
            fields |= _reads(fn)
    return fields


def _activation_names() -> set[str]:
    try:
        from transformers.activations import ACT2FN
    except Exception:  # noqa: BLE001 - transformers absent or broken: torch names only
        return {"gelu", "relu", "silu", "swish", "tanh", "sigmoid"}
    return set(ACT2FN)


def flip_value(field: str, value: Any, activations: set[str]) -> Any:
    """A different value of the same kind, or None when the field is not flipped (sizes, counts
    and free-form strings change shapes or are not ours to guess)."""
    if isinstance(value, bool):
        return not value
    if field == "_attn_implementation" and value in _ATTN_IMPL:
        return _ATTN_IMPL[value]
    if isinstance(value, str) and value in activations and ("act" in field.lower() or value.startswith("gelu")):
        return "relu" if value.startswith("gelu") else "gelu"
    if isinstance(value, float):
        lowered = field.lower()
        if "drop" in lowered or "prob" in lowered:
            return 0.0 if value > 0 else 0.1
        if "eps" in lowered or "epsilon" in lowered:
            return value * 10 if value > 0 else 1e-5
    return None


def flips_for(settings: Any, fields: Iterable[str]) -> list[ConfigFlip]:
    """The flips of ``fields`` that ``settings`` (a config object or constructor keyword dict) holds."""
    activations = _activation_names()
    out = []
    for name in sorted(fields):
        try:
            value = settings[name] if isinstance(settings, dict) else getattr(settings, name)
        except (KeyError, AttributeError):
            continue
        flipped = flip_value(name, value, activations)
        if flipped is not None and flipped != value:
            out.append(ConfigFlip(name, value, flipped))
    return out


class FlipCheck:
    """Equivalence under the flipped configuration (:mod:`adopter.optimizing.config_flip`): every config value
    the rewritten sites read, changed, for both the original class and the rewritten one."""

    def __init__(self, model_cls: type, subject: Subject, files: dict[str, str], texts: dict[str, str]):
        self.model_cls, self.subject = model_cls, subject
        self.texts = {path: texts[name] for name, path in files.items()}
        self.flips: list = []
        self.note = ""

    @property
    def flips_text(self) -> str:
        return ", ".join(map(str, self.flips))

    @staticmethod
    def _values(flips) -> dict:
        return {f.field: f.flipped for f in flips}

    def _original_runs(self, flips) -> str:
        """Why the original class does not run with ``flips`` ("" when it does)."""
        from adopter.verification.equivalence import call_model

        try:
            call_model(self.subject.make_with(self.model_cls, self._values(flips)), self.subject.example_inputs)
        except Exception as exc:  # noqa: BLE001 - a flip the original itself does not accept
            return one_line(exc)
        return ""

    def choose(self, applied: list[Match]) -> None:
        """Pick the flips for the rewritten sites of ``applied`` (or say in ``note`` why none)."""
        settings = self.subject.settings
        if self.subject.make_with is None or settings is None:
            self.note = "no configuration to flip (the model takes no config or keyword arguments)"
            return
        fields = set(settings) if isinstance(settings, dict) else config_fields_read(self.texts, applied)
        candidates = flips_for(settings, fields)
        if not candidates:
            self.note = "the rewritten sites read no config value that can be flipped"
            return
        if not self._original_runs(candidates):
            self.flips = candidates
            return
        # All at once the original fails: keep each flip the original accepts on its own.
        self.flips = [f for f in candidates if not self._original_runs([f])]
        if self.flips and self._original_runs(self.flips):
            self.flips = self.flips[:1]
        left_out = [f.field for f in candidates if f not in self.flips]
        self.note = f"left out (the original does not run with them): {', '.join(left_out)}"

    def equivalent(self, new_cls: type) -> bool:
        return self._check(new_cls).equivalent

    def _check(self, new_cls: type):
        from adopter.verification.equivalence import EquivalenceResult, check_equivalence, tolerance_for

        values = self._values(self.flips)
        original = self.subject.make_with(self.model_cls, values)
        try:
            candidate = self.subject.make_with(new_cls, values)
        except Exception as exc:  # noqa: BLE001
            error = f"rewritten class cannot be built with the flipped config: {one_line(exc)}"
            param = next(iter(original.parameters()), None)
            tol = tolerance_for(param.dtype, param.device) if param is not None else tolerance_for(None, None)
            return EquivalenceResult(False, float("inf"), "", 0, tol, error=error)
        return check_equivalence(original, candidate, self.subject.example_inputs)

    def run(self, new_cls: type):
        """(EquivalenceResult, the kernel calls it made), or (None, None) when nothing is flipped."""
        if not self.flips:
            return None, None
        with count_kernel_calls() as calls:
            result = self._check(new_cls)
        return result, calls
