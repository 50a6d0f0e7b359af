"""``adopter scan --format sarif``: the scan report as SARIF 2.1.0 (code-scanning uploads).

One result per match: ``ruleId`` the rule's name, ``level`` from its status (:data:`LEVELS`), the
message saying the status and its reason or condition, and the matched lines as the region of
the file (a URI relative to the working directory, ``%SRCROOT%``, when the file lies under it).
``tool.driver.rules`` lists the rules in use with their docs and kernels. Files that could not
be analysed are ``toolExecutionNotifications`` of the invocation, which then did not succeed.
Not a command (``adopter.cli.COMMANDS`` lists those).
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_VERSION = "2.1.0"

# status -> SARIF level: a place a kernel fits (rewrite applies it) is a warning; one that holds
# only under a configuration the source does not settle is a note; the others are for the record.
LEVELS = {
    "static": "warning",
    "confirmed": "warning",
    "runtime-only": "warning",
    "conditional": "note",
    "refused": "none",
    "rejected": "none",
    "not-executed": "none",
    "untraced": "none",
}


def _uri(path: str, root: str) -> tuple[str, str | None]:
    """(uri, uriBaseId): relative to ``root`` with ``SRCROOT`` when under it, else a file URI."""
    real = os.path.abspath(path)
    if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
        rel = os.path.relpath(real, root).replace(os.sep, "/")
        return urllib.parse.quote(rel), "SRCROOT"
    return Path(real).as_uri(), None


def _location(path: str, root: str, region: dict | None = None) -> dict:
    uri, base = _uri(path, root)
    artifact = {"uri": uri, **({"uriBaseId": base} if base else {})}
    physical: dict = {"artifactLocation": artifact}
    if region:
        physical["region"] = region
    return {"physicalLocation": physical}


def region_of(match) -> dict | None:
    """``{"startLine", "endLine"}`` of the matched calls (whole statements' extent), or None."""
    spans = [mn.node.span for mn in match.nodes if getattr(mn.node, "span", None) is not None]
    if match.sequential is not None and not spans:
        spans = [match.sequential]
    starts = [s.line for s in spans if s.line and s.line > 0]
    if not starts:
        return None
    ends = [max(s.line, getattr(s, "end_line", 0) or s.line) for s in spans if s.line and s.line > 0]
    return {"startLine": min(starts), "endLine": max(ends)}


def message_of(match) -> str:
    """``<rule> in <Class.function>: <status> (<code>): <condition or reason>``."""
    where = ".".join(p for p in (match.class_name, match.function) if p)
    text = f"{match.rule}" + (f" in {where}" if where else "") + f": {match.status}"
    if match.status == "conditional":
        text += f" ({match.code}): {match.condition}" + (f" [{match.reason}]" if match.reason else "")
    elif match.status == "refused":
        text += f" ({match.code}): {match.reason}"
    else:
        detail = [match.reason] if match.reason else []
        if match.condition:
            detail.append(f"{match.code or 'condition'}: {match.condition}")
        if detail:
            text += f" ({'; '.join(detail)})"
    return text


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    cut = text.find(". ")
    return text[: cut + 1] if cut > 0 else text


def rule_descriptor(rule) -> dict:
    doc = (getattr(rule, "doc", "") or "").strip() or rule.name
    kernel = getattr(rule, "kernel", "") or ""
    help_text = doc + (f"\n\nKernel: {kernel}" if kernel else "") + (
        f"\n\nPattern (adopter DSL):\n{rule.dsl.strip()}" if getattr(rule, "dsl", "") else "")
    return {
        "id": rule.name,
        "name": rule.name,
        "shortDescription": {"text": _first_sentence(doc)},
        "fullDescription": {"text": doc},
        "help": {"text": help_text},
        "defaultConfiguration": {"level": "warning"},
        "properties": {"kernel": kernel, "tags": ["performance", "pytorch"]},
    }


def _tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("adopter")
    except PackageNotFoundError:
        return "0"


def to_sarif(report, rules, *, root: str | None = None, skipped: list[dict] | None = None,
             suppressed: dict[int, str] | None = None) -> dict:
    """The SARIF log of a scan ``report`` made with ``rules``; ``suppressed``: index of a match in
    ``report.matches`` -> why the project suppresses it (a SARIF ``suppressions`` entry: ``inSource``
    for a comment, ``external`` for ``[tool.adopter]``)."""
    suppressed = suppressed or {}
    root = os.path.abspath(root or os.getcwd())
    descriptors = [rule_descriptor(r) for r in rules]
    index = {d["id"]: i for i, d in enumerate(descriptors)}
    for m in report.matches:  # a match of a rule not in use (a plug-in's): still described
        if m.rule not in index:
            from adopter.core.rules import find_rule

            rule = find_rule(m.rule, rules)
            index[m.rule] = len(descriptors)
            descriptors.append(rule_descriptor(rule) if rule is not None else {"id": m.rule, "name": m.rule})
    results = []
    order = sorted(range(len(report.matches)), key=lambda i: (report.matches[i].file,
                                                               report.matches[i].lines[:1] or [0], report.matches[i].rule))
    for i in order:
        m = report.matches[i]
        level = LEVELS.get(m.status, "note")
        result = {
            "ruleId": m.rule,
            "ruleIndex": index[m.rule],
            "level": level,
            "kind": "fail" if level != "none" else "informational",
            "message": {"text": message_of(m)},
            "locations": [_location(m.file, root, region_of(m))],
            "properties": {
                "status": m.status,
                **({"code": m.code} if m.code else {}),
                **({"condition": m.condition} if m.condition else {}),
                **({"reason": m.reason} if m.reason else {}),
                **({"trace_code": m.trace_code} if m.trace_code else {}),
                **({"class": m.class_name} if m.class_name else {}),
                "function": m.function,
            },
        }
        if i in suppressed:
            from adopter.core.suppress import COMMENT_REASON

            kind = "inSource" if suppressed[i].startswith(COMMENT_REASON) else "external"
            result["suppressions"] = [{"kind": kind, "justification": suppressed[i]}]
        if m.class_name or m.function:
            result["locations"][0]["logicalLocations"] = [{
                "fullyQualifiedName": ".".join(p for p in (m.class_name, m.function) if p),
                "kind": "function",
            }]
        results.append(result)
    notifications = [
        {"level": "error", "message": {"text": e.message}, "locations": [_location(str(e.file), root)]}
        for e in report.errors
    ] + [
        {"level": "note", "message": {"text": f"skipped: {s['reason']}"}, "locations": [_location(s["file"], root)]}
        for s in skipped or []
    ]
    return {
        "$schema": SCHEMA_URI,
        "version": SARIF_VERSION,
        "runs": [{
            "tool": {"driver": {
                "name": "adopter",
                "version": _tool_version(),
                "rules": descriptors,
            }},
            "originalUriBaseIds": {"SRCROOT": {"uri": Path(root).as_uri() + "/"}},
            "invocations": [{
                "executionSuccessful": not report.errors,
                **({"toolExecutionNotifications": notifications} if notifications else {}),
            }],
            "results": results,
        }],
    }  # fmt: skip
