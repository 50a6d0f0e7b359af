"""``adopter scan --model ID``: build a known model, confirm static matches against its trace,
and type from it what the scanned source left untyped (:func:`runtime_reach`)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from adopter.core.rule import Rule
from adopter.core.rules import all_rules
from adopter.core.structures import Match

from .confirm import confirm_matches, with_config_note
from .models import build_model
from .runtime_types import runtime_reach


def confirm_model_id(
    matches: Sequence[Match],
    model_id: str,
    device: str | None = None,
    *,
    scanned_files: Iterable[str] | None = None,
    rules: Sequence[Rule] = (),
    **build_kwargs,
) -> list[Match]:
    """Build ``model_id`` (see :func:`adopter.tracing.models.build_model`) and confirm ``matches``
    (raises :class:`~adopter.tracing.models.TracingError` when the model cannot be built or fed).
    With ``scanned_files``, those files are also scanned again with the layer types of the built
    model for what their source left untyped (``rules``: the rules in use, default all)."""
    built = build_model(model_id, device=device, **build_kwargs)
    attn = getattr(built.config, "_attn_implementation", None)
    out = confirm_matches(built.model, built.example_inputs, matches, scanned_files=scanned_files)
    if scanned_files is not None:
        # what the source left untyped, typed by the built model (issue 11: runtime reach)
        out = runtime_reach(built.model, built.example_inputs, matches, out, scanned_files, rules or all_rules())
    if attn:
        out = [with_config_note(m, attn) for m in out]
    return out
