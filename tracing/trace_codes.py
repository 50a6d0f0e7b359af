"""Trace codes: why a trace gave a match an ``untraced``, ``not-executed`` or ``rejected`` status.

A trace sets a match's status and a prose ``reason`` for people; ``Match.trace_code`` (a key of
:data:`TRACE_CODES`) names the cause for programs and tests, as ``Match.code`` names a precision
class. Reasons may be reworded; codes are the contract. Every match of those three statuses
carries one (``rejected`` has a single cause, named all the same, so that a reader keys on the
code alone); ``confirmed`` and ``runtime-only`` matches carry none, nor does one the trace left
as it was (``refused``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from adopter.core.structures import Match, MatchStatus

TraceCode = Literal[
    "capture-failed", "not-in-model", "sequential-unrecorded",
    "lines-not-run", "not-fed", "inputs-differ", "out-of-order", "sequential-not-built", "sequential-pair-not-run",
    "runtime-check",
]

# Code -> (the status it goes with, what it means).
TRACE_CODES: dict[TraceCode, tuple[MatchStatus, str]] = {
    "capture-failed": ("untraced", "the model could not be traced (neither torch.fx nor torch.export captured it)"),
    "not-in-model": ("untraced", "the match's class (or file) has no instance in this model"),
    "sequential-unrecorded": ("untraced", "where the model's nn.Sequentials were built is known only for models "
                                          "adopter instantiates"),
    "lines-not-run": ("not-executed", "the class or function runs, but the matched lines never execute under this "
                                      "configuration"),
    "not-fed": ("not-executed", "the matched lines run, but one does not feed the next at runtime"),
    "inputs-differ": ("not-executed", "the matched lines run, but do not read the same tensor at runtime"),
    "out-of-order": ("not-executed", "the matched lines run, in the other order"),
    "sequential-not-built": ("not-executed", "no nn.Sequential of this model is built at the matched line under "
                                             "this configuration"),
    "sequential-pair-not-run": ("not-executed", "the nn.Sequential built there does not run two such consecutive "
                                                "children"),
    "runtime-check": ("rejected", "the matched lines run, but the rule's runtime check fails on what they run "
                                  "(the activation is not a GeLU, the projections differ in shape...)"),
}


CODED_STATUSES = frozenset(status for status, _ in TRACE_CODES.values())


def traced(match: Match, status: MatchStatus, reason: str, code: TraceCode | None = None) -> Match:
    """``match`` with the status a trace gave it, its reason and its trace code: one of
    :data:`TRACE_CODES` of that status for a status of :data:`CODED_STATUSES`, else none."""
    if (code is not None or status in CODED_STATUSES) and TRACE_CODES.get(code, ("",))[0] != status:
        raise ValueError(f"trace code {code!r} is not one of status {status!r}")
    return replace(match, status=status, reason=reason, trace_code=code or "")
