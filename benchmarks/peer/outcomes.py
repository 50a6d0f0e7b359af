"""Pure logic of the peer-suite benchmark: per-test outcomes from the plugin's JSON lines, the
test groups, the pristine vs rewritten comparison and the causes of new failures. No network,
no virtual environment, no torch: ``tests/e2e/test_peer_suites.py`` runs it on synthetic data."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

GROUPS = ("torchscript", "fx", "export", "compile", "generation", "pruning", "intermediates", "features",
          "backward", "forward", "other")
FAILED = ("failed", "error", "missing")
# a test is listed as a slowdown when its rewritten run took SLOWDOWN_FACTOR times its pristine
# run plus SLOWDOWN_MIN_S seconds (both runs on the same loaded machine: only large ratios mean much)
SLOWDOWN_FACTOR = 5.0
SLOWDOWN_MIN_S = 30.0
# outcome of a test in one run; "missing": collected in the other run, never reported in this one
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "missing")

# (group, pattern over the test function's name, without parameters or class), first match wins:
# a test named after two groups (test_model_forward_fx_torchscript) counts where it can break
# last, the TorchScript compilation of the traced graph
_GROUP_RULES = (
    ("torchscript", re.compile(r"torchscript|jit|script")),
    ("fx", re.compile(r"(^|_)fx(_|$)|symbolic_trace|graph_node")),
    ("export", re.compile(r"export")),
    ("compile", re.compile(r"compile")),
    ("generation", re.compile(r"generat|greedy|beam|_sampl|past_key|decoder_model_past|(?<!bias_)cache")),
    ("pruning", re.compile(r"prune|pruned|pruning")),
    ("intermediates", re.compile(r"intermediate|hidden_states_output")),
    ("features", re.compile(r"feature")),
    ("backward", re.compile(r"backward|training|grad")),
    ("forward", re.compile(r"forward|inference|determinism|batching|outputs_equivalence|attention_outputs")),
)


def test_name(nodeid: str) -> str:
    """The test function's name: ``tests/test_models.py::test_model_forward[1-resnet18]`` and
    ``tests/m/test_x.py::BertModelTest::test_forward_signature`` give ``test_model_forward``,
    ``test_forward_signature``."""
    return nodeid.split("::")[-1].split("[", 1)[0]


def group_of(nodeid: str) -> str:
    name = test_name(nodeid)
    for group, pattern in _GROUP_RULES:
        if pattern.search(name):
            return group
    return "other"


def final_outcomes(records: list[dict]) -> dict[str, dict]:
    """One outcome per node id from the per-phase records (setup, call, teardown) of
    ``conftest_plugin``: a failed setup or teardown is ``error``, a failed call ``failed``; a skip
    in any phase ``skipped``; xfail marks give ``xfailed`` / ``xpassed``. Keeps the first
    failing phase's message and location, and the summed duration."""
    result: dict[str, dict] = {}
    for rec in records:
        cur = result.setdefault(rec["nodeid"], {"outcome": "passed", "duration": 0.0})
        cur["duration"] = round(cur["duration"] + rec.get("duration", 0.0), 3)
        when, outcome = rec.get("when"), rec.get("outcome")
        if outcome == "passed":
            if rec.get("xfail") and when == "call":
                cur["outcome"] = "xpassed"
            continue
        if cur["outcome"] in ("failed", "error"):
            continue  # the first failure is the one to report
        if outcome == "skipped":
            cur["outcome"] = "xfailed" if rec.get("xfail") else "skipped"
        else:
            cur["outcome"] = "failed" if when == "call" else "error"
        cur["message"] = rec.get("message", "")
        if rec.get("where"):
            cur["where"] = rec["where"]
    return result


def read_outcomes(path: Path) -> dict[str, dict]:
    """The plugin's JSON lines file (a missing file: nothing ran); a truncated last line (the
    run was killed while writing) is dropped."""
    if not Path(path).exists():
        return {}
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return final_outcomes(records)


def cause_of(record: dict, nodeid: str = "") -> str:
    """A short class for a failure's error head, to group new failures by what broke."""
    message = record.get("message", "") or ""
    group = group_of(nodeid) if nodeid else ""
    if record.get("outcome") == "missing":
        return "not run (missing from this run: collection error or crash)"
    if "Can't redefine method" in message:
        return "TorchScript: can't redefine method"
    if re.search(r"Timeout|timed out", message):
        return "timeout"
    if re.search(r"not close|allclose|Mismatched elements|[Aa]bsolute difference|max abs|atol|rtol", message):
        return "numeric mismatch"
    if re.search(r"torch\.jit|TorchScript|frontend\.|Compiled functions can't|jit_internal|"
                 r"Unknown type annotation|Expected a value of type|is not supported in TorchScript|"
                 r"Python builtin|Module '\w+' has no attribute|Tried to access nonexistent attribute|"
                 r"RuntimeError:\s*\n?\s*(?:Arguments for call are not valid|undefined value)", message) \
            or group == "torchscript" and "RuntimeError" in message:
        return "TorchScript error"
    if re.search(r"symbolically traced|Proxy|torch\.fx|fx\.", message) or group == "fx":
        return "FX tracing error"
    if re.search(r"torch\._dynamo|Dynamo|torch\.export|GuardOnDataDependent|Unsupported:", message) \
            or group in ("export", "compile"):
        return "torch.export / torch.compile error"
    if re.search(r"state_dict|Missing key|Unexpected key|size mismatch for", message):
        return "state_dict / weights mismatch"
    head = message.strip().splitlines()[0] if message.strip() else ""
    match = re.match(r"([A-Za-z_][\w.]*(?:Error|Exception|Warning))\b", head)
    return match.group(1) if match else (head[:60] or "no message")


def compare(pristine: dict[str, dict], rewritten: dict[str, dict]) -> dict:
    """Per test outcome pristine vs rewritten (the union of node ids; a test absent from one run is
    ``missing`` there), counts per group, and the lists of tests newly failing (passed pristine,
    failed / error / missing rewritten), newly passing (the reverse) and newly skipped (passed
    pristine, skipped rewritten), each with its error head; ``slowdowns``: tests far slower
    rewritten (``SLOWDOWN_FACTOR``, ``SLOWDOWN_MIN_S``), slowest first."""
    tests: dict[str, dict] = {}
    counts: dict[str, dict] = {}
    newly_failing, newly_passing, newly_skipped, both_failing = [], [], [], []
    for nodeid in sorted(set(pristine) | set(rewritten)):
        before = pristine.get(nodeid, {"outcome": "missing"})
        after = rewritten.get(nodeid, {"outcome": "missing"})
        group = group_of(nodeid)
        entry = {"group": group, "pristine": before["outcome"], "rewritten": after["outcome"]}
        for side, rec in (("pristine", before), ("rewritten", after)):
            if "duration" in rec:
                entry[f"{side}_s"] = rec["duration"]
        for side, rec in (("pristine", before), ("rewritten", after)):
            if rec["outcome"] in FAILED and rec.get("message"):
                entry[f"{side}_message"] = rec["message"]
                if rec.get("where"):
                    entry[f"{side}_where"] = rec["where"]
        tests[nodeid] = entry
        per = counts.setdefault(group, _empty_counts())
        per["pristine"][before["outcome"]] += 1
        per["rewritten"][after["outcome"]] += 1
        per["total"] += 1
        if before["outcome"] == "passed" and after["outcome"] in FAILED:
            cause = cause_of(after, nodeid)
            entry["cause"] = cause
            newly_failing.append({"test": nodeid, "group": group, "cause": cause,
                                  "outcome": after["outcome"], "message": after.get("message", ""),
                                  "where": after.get("where", "")})
            per["newly_failing"] += 1
        elif before["outcome"] in FAILED and after["outcome"] == "passed":
            newly_passing.append({"test": nodeid, "group": group, "pristine_message": before.get("message", "")})
            per["newly_passing"] += 1
        elif before["outcome"] == "passed" and after["outcome"] == "skipped":
            newly_skipped.append({"test": nodeid, "group": group, "message": after.get("message", "")})
            per["newly_skipped"] += 1
        elif before["outcome"] in FAILED and after["outcome"] in FAILED:
            both_failing.append(nodeid)
    slowdowns = sorted(
        ({"test": t, "group": e["group"], "pristine_s": e["pristine_s"], "rewritten_s": e["rewritten_s"]}
         for t, e in tests.items()
         if "pristine_s" in e and "rewritten_s" in e and e["rewritten_s"] >= SLOWDOWN_FACTOR * e["pristine_s"]
         + SLOWDOWN_MIN_S),
        key=lambda d: d["pristine_s"] - d["rewritten_s"])
    total = _empty_counts()
    for per in counts.values():
        for side in ("pristine", "rewritten"):
            total[side].update(per[side])
        for key in ("total", "newly_failing", "newly_passing", "newly_skipped"):
            total[key] += per[key]
    ordered = {g: counts[g] for g in GROUPS if g in counts}
    ordered["all"] = total
    return {
        "counts": {g: _plain(c) for g, c in ordered.items()},
        "newly_failing": newly_failing,
        "newly_passing": newly_passing,
        "newly_skipped": newly_skipped,
        "both_failing": both_failing,
        "causes": dict(collections.Counter(f["cause"] for f in newly_failing).most_common()),
        "slowdowns": slowdowns,
        "tests": tests,
    }


def _empty_counts() -> dict:
    return {"pristine": collections.Counter(), "rewritten": collections.Counter(), "total": 0,
            "newly_failing": 0, "newly_passing": 0, "newly_skipped": 0}


def _plain(c: dict) -> dict:
    return {k: ({o: v[o] for o in OUTCOMES if v[o]} if isinstance(v, collections.Counter) else v) for k, v in c.items()}


def table(comparison: dict, title: str) -> str:
    """The short text table the script prints: per group, pristine and rewritten passed / failed
    (failed + error + missing) / skipped, then newly failing / passing."""
    rows = [title, f"{'group':<14}{'tests':>6}  {'pristine p/f/s':>16}  {'rewritten p/f/s':>16}  {'new fail':>8}"
                   f"  {'new pass':>8}"]
    def pfs(s):
        return f"{s.get('passed', 0)}/{sum(s.get(o, 0) for o in FAILED)}/{s.get('skipped', 0) + s.get('xfailed', 0)}"

    for group, c in comparison["counts"].items():
        rows.append(f"{group:<14}{c['total']:>6}  {pfs(c['pristine']):>16}  {pfs(c['rewritten']):>16}  "
                    f"{c['newly_failing']:>8}  {c['newly_passing']:>8}")
    return "\n".join(rows)


def findings_markdown(comparison: dict, title: str, limit: int = 400) -> str:
    """The newly failing tests grouped by cause, with their error heads (for the engineers fixing
    the rewrite)."""
    out = [f"## {title}", ""]
    by_cause: dict[str, list] = collections.defaultdict(list)
    for f in comparison["newly_failing"]:
        by_cause[f["cause"]].append(f)
    if not by_cause:
        out.append("No newly failing tests.")
    for cause, items in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
        out.append(f"### {cause} ({len(items)})")
        for f in items[:limit]:
            head = " | ".join(ln.strip() for ln in f["message"].strip().splitlines()[:3])[:400]
            where = f" @ {f['where']}" if f.get("where") else ""
            out.append(f"- `{f['test']}`: {head}{where}")
        out.append("")
    if comparison["newly_passing"]:
        out.append(f"### newly passing ({len(comparison['newly_passing'])})")
        out.extend(f"- `{f['test']}`" for f in comparison["newly_passing"])
        out.append("")
    if comparison.get("slowdowns"):
        out.append(f"### far slower rewritten ({len(comparison['slowdowns'])})")
        out.extend(f"- `{f['test']}`: {f['pristine_s']:.1f} s pristine, {f['rewritten_s']:.1f} s rewritten"
                   for f in comparison["slowdowns"])
        out.append("")
    if comparison["newly_skipped"]:
        out.append(f"### passed pristine, skipped rewritten ({len(comparison['newly_skipped'])})")
        out.extend(f"- `{f['test']}`: {f['message'][:200]}" for f in comparison["newly_skipped"])
        out.append("")
    return "\n".join(out)
