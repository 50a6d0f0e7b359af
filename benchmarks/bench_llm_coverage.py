"""Coverage of the LLM rule pack over the installed transformers (issue 12).

For each rule, the number of ``models/*/modeling_*.py`` files where it matches, where it is
confirmed by a trace, and where ``optimize()`` applies it equivalently; and every decoder-only
LLM family where it matches but is not applied, with the reason.

1. Static stage (never imports the scanned code): ``adopter.core.scan.scan_paths`` over every
   modeling file with the chosen rules (parallel jobs). Per rule: files with a match, by status
   (``static`` / ``conditional`` / ``refused`` with its codes and reasons).
2. Runtime stage: for each file with a match, the decoder-only causal LM class it defines is
   picked (the class ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` maps the family to, read from
   ``models/auto/modeling_auto.py`` with ``ast``, else a ``*ForCausalLM`` class of the file);
   families that are also masked-LM or seq2seq families (BERT, BART...) or whose config is
   ``is_encoder_decoder`` are skipped, with the reason. ``optimize(cls, rules=...)`` runs on it
   **in a process per model** (forked from a server that imported torch, transformers and adopter
   once; killed after ``--timeout`` seconds; ``--jobs`` at a time) with a small config:
   ``--config small`` (default) is the config ``optimize`` shrinks by itself
   (``adopter.optimizing.shrink.shrink_config``: vocabulary, experts, low-rank attention, per-layer
   lists shrunk, one layer of each kind kept), built once here to record what it changed (when it
   does not build, ``optimize``'s own default is tried); ``--config shrunk`` is ``optimize``'s own
   default. Per rule and file: sites matched, confirmed by the trace, applied
   (every applied site passed ``optimize``'s equivalence checks: the rule alone, all rules
   together, the flipped config), and for each site not applied, its kind and reason.
3. Output: ``benchmarks/results/llm_coverage.json`` (paths relative to site-packages) and a
   summary table per rule (files matched / confirmed / applied-equivalent) plus the list of
   decoder-only families not applied, and why::

    python benchmarks/bench_llm_coverage.py [--rules RMSNorm,gated_MLP,rotary_embedding,linear_cross_entropy]
        [--only llama,gpt2] [--jobs 2] [--timeout 120] [--config small|shrunk] [--static-only]
        [--all-decoders] [--scan-jobs N] [--out benchmarks/results/llm_coverage.json]

``--all-decoders`` also runs every decoder-only family with no static match (the trace then
reports ``runtime-only`` sites: the pattern runs there but the source analysis missed it).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "llm_coverage.json"
DEFAULT_RULES = ("RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy")
# families of these auto mappings have an encoder: their causal LM class is not a decoder-only LLM
ENCODER_MAPPINGS = {
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": "encoder-decoder (seq2seq family)",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES": "encoder-decoder (speech seq2seq family)",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": "encoder (masked-LM family)",
}
CAUSAL_MAPPING = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


# ---------------------------------------------------------------- sources (located, never imported)


def transformers_dir() -> Path:
    spec = importlib.util.find_spec("transformers")  # locate only
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def portable(path: str | os.PathLike, base: Path | None = None) -> str:
    """``path`` relative to site-packages (``transformers/models/llama/modeling_llama.py``)."""
    base = base or transformers_dir().parent
    real = os.path.realpath(path)
    try:
        rel = os.path.relpath(real, base)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel.replace(os.sep, "/")


def modeling_files(only: list[str] | None = None) -> list[Path]:
    models = transformers_dir() / "models"
    files = sorted(models.glob("*/modeling_*.py"))
    if only:
        wanted = set(only)
        files = [f for f in files if f.parent.name in wanted]
    return files


def auto_mappings(models: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """``*_MAPPING_NAMES`` of ``models/auto/modeling_auto.py`` as ``[(model_type, class name)]``,
    read with ``ast`` (a value given as a tuple of names contributes each name)."""
    models = models or transformers_dir() / "models"
    path = models / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    out: dict[str, list[tuple[str, str]]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if not name.endswith("_MAPPING_NAMES") or not isinstance(node.value, ast.Call) or not node.value.args:
            continue
        try:
            pairs = ast.literal_eval(node.value.args[0])
        except ValueError:
            continue
        entries = []
        for pair in pairs:
            if isinstance(pair, tuple) and len(pair) == 2:
                key, value = pair
                for cls in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(cls, str):
                        entries.append((key, cls))
        out[name] = entries
    return out


_CLASS_RE = re.compile(r"^class\s+(\w+)\s*[(:]", re.M)


def classify_file(path: Path, mappings: dict[str, list[tuple[str, str]]]) -> dict:
    """Is this modeling file a decoder-only LLM family, and which class represents it?

    -> ``{"family", "module", "kind": decoder-only | encoder... | no-causal-lm, "class", "why"}``."""
    text = path.read_text(encoding="utf-8", errors="replace")
    defined = _CLASS_RE.findall(text)
    family = path.parent.name
    info = {"family": family, "module": f"transformers.models.{family}.{path.stem}", "class": None}
    causal = dict((cls, key) for key, cls in mappings.get(CAUSAL_MAPPING, []))
    mapped = [c for c in defined if c in causal]
    named = [c for c in defined if c.endswith("ForCausalLM") and c not in mapped]
    # prefer the mapped *ForCausalLM (multimodal files: the text model), then any mapped class, then the name
    candidates = sorted(mapped, key=lambda c: not c.endswith("ForCausalLM")) + named
    if not candidates:
        return {**info, "kind": "no-causal-lm", "why": "no causal LM class defined in this file"}
    cls = candidates[0]
    info["class"] = cls
    model_type = causal.get(cls)
    if model_type is not None:
        for mapping, kind in ENCODER_MAPPINGS.items():
            if any(key == model_type for key, _ in mappings.get(mapping, [])):
                return {**info, "kind": kind, "why": f"model type {model_type!r} is in {mapping}"}
    return {**info, "kind": "decoder-only", "why": "" if model_type else f"{cls} is not in {CAUSAL_MAPPING}"}


# ---------------------------------------------------------------- static stage


def static_stage(files: list[Path], rules: list, jobs: int) -> dict:
    """Scan ``files`` (nothing imported) -> per-file matches and per-rule file counts by status."""
    from adopter.core.scan import scan_paths

    base = transformers_dir().parent
    start = time.perf_counter()
    report = scan_paths([str(f) for f in files], rules, jobs=jobs or None)
    seconds = time.perf_counter() - start
    per_file: dict[str, list[dict]] = {}
    for m in report.matches:
        d = m.to_json()
        site = {k: d[k] for k in ("rule", "class", "function", "lines", "status")}
        for k in ("code", "reason", "condition"):
            if d.get(k):
                site[k] = d[k]
        per_file.setdefault(portable(d["file"], base), []).append(site)
    per_rule: dict[str, dict] = {}
    for rule in (r.name for r in rules):
        by_status: dict[str, list[str]] = {"static": [], "conditional": [], "refused": []}
        codes: dict[str, dict] = {}
        sites = 0
        for rel, matches in per_file.items():
            mine = [s for s in matches if s["rule"] == rule]
            sites += len(mine)
            for status in sorted({s["status"] for s in mine}):
                by_status.setdefault(status, []).append(rel)
            for s in mine:
                if s["status"] == "refused":
                    c = codes.setdefault(s.get("code") or "?", {"files": set(), "reason": s.get("reason", "")})
                    c["files"].add(rel)
        files_matched = sorted({rel for rel, ms in per_file.items() if any(s["rule"] == rule for s in ms)})
        usable = sorted({rel for rel, ms in per_file.items()
                         if any(s["rule"] == rule and s["status"] != "refused" for s in ms)})
        per_rule[rule] = {
            "sites": sites,
            "files_matched": len(files_matched),
            "files_static_or_conditional": len(usable),
            "files_by_status": {k: len(v) for k, v in by_status.items()},
            "families_by_status": {k: sorted({Path(rel).parent.name for rel in v}) for k, v in by_status.items()},
            "refused_codes": {c: {"files": sorted(v["files"]), "example_reason": v["reason"]}
                              for c, v in sorted(codes.items())},
        }
    return {
        "files_scanned": report.files_scanned,
        "seconds": round(seconds, 2),
        "errors": [{"file": portable(e.file, base), "message": e.message} for e in report.errors],
        "per_rule": per_rule,
        "per_file": dict(sorted(per_file.items())),
    }


# ---------------------------------------------------------------- runtime stage: the worker (subprocess)


def small_config(config_cls):
    """``shrink_config`` of the default config (``adopter.optimizing.shrink``: vocabulary, experts,
    low-rank attention, per-layer lists and per-layer configs shrunk too, one layer of each kind
    kept) -> (config, {field: (default, small)} for the top-level sizes it changed)."""
    from adopter.optimizing.shrink import shrink_config

    default = config_cls()
    cfg = shrink_config(default)
    changed = {}
    for key, value in vars(default).items():
        if key.startswith("_") or not isinstance(value, int) or isinstance(value, bool):
            continue
        small = vars(cfg).get(key, value)
        if small != value:
            changed[key] = (value, small)
    return cfg, changed


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}".rstrip(": ")


def worker(spec: dict) -> dict:
    """Run ``optimize`` on one class (in this process) -> its report, paths made portable."""
    import importlib
    import warnings

    threads = os.environ.get("ADOPTER_BENCH_THREADS")
    import torch

    if threads:
        torch.set_num_threads(int(threads))
    from adopter import optimize

    out: dict = {"class": spec["class"], "module": spec["module"]}
    start = time.perf_counter()
    try:
        cls = getattr(importlib.import_module(spec["module"]), spec["class"])
        config_cls = cls.config_class
        if getattr(config_cls(), "is_encoder_decoder", False):
            return {**out, "outcome": "skipped", "why": f"{config_cls.__name__}().is_encoder_decoder is True"}
    except Exception as exc:  # noqa: BLE001
        return {**out, "outcome": "error", "why": "import: " + _one_line(exc)}
    out["import_seconds"] = round(time.perf_counter() - start, 2)
    attempts = []
    if spec.get("config", "small") == "small":
        try:
            cfg, changed = small_config(config_cls)
            cls(cfg)  # builds? (a capped size can clash with a fixed id or a derived size)
            attempts.append(("small", cfg))
            out["small_config_changes"] = changed
        except Exception as exc:  # noqa: BLE001
            out["small_config_error"] = _one_line(exc)
    if not attempts:
        # only when the small config does not even build: optimize's own shrunk default (which
        # falls back to the full-size default config when the shrunk one fails: may time out)
        attempts.append(("shrunk", None))
    for name, cfg in attempts:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                new_cls = optimize(cls, rules=spec["rules"], config=cfg)
        except Exception as exc:  # noqa: BLE001
            out.setdefault("errors", []).append(f"config {name}: {_one_line(exc)}")
            continue
        out["config"] = name
        out["optimize_seconds"] = round(time.perf_counter() - start, 2)
        report = new_cls.adopter_report.to_json()
        base = Path(spec["site_packages"])
        for item in report["applied"] + report["skipped"]:
            item["file"] = portable(item["file"], base)
        report.pop("modules", None)
        out["report"] = report
        out["outcome"] = "ran"
        return out
    return {**out, "outcome": "error", "why": "; ".join(out.get("errors", []))}


# ---------------------------------------------------------------- runtime stage: driver


PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "adopter", "adopter.optimizing.optimize", "adopter.tracing")
_CONTEXT = None


def _context():
    """Processes for the models: forked from a server that imported torch, transformers and
    adopter once (a fresh process per model without paying the imports each time); spawned
    where there is no forkserver."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing as mp

        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(list(PRELOAD))
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def _child(spec: dict, out_file: str, threads: int | None) -> None:
    if threads:
        os.environ["ADOPTER_BENCH_THREADS"] = str(threads)
    result = worker(spec)
    Path(out_file).write_text(json.dumps(result), encoding="utf-8")


def run_model(spec: dict, timeout: float, threads: int | None = None) -> dict:
    """``worker(spec)`` in a process of its own, killed after ``timeout`` seconds."""
    head = {"class": spec["class"], "module": spec["module"]}
    with tempfile.TemporaryDirectory(prefix="llm_coverage_") as tmp:
        out_file = Path(tmp) / "out.json"
        proc = _context().Process(target=_child, args=(spec, str(out_file), threads), daemon=True)
        start = time.perf_counter()
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return {**head, "outcome": "timeout", "why": f"no result within {timeout:g} s",
                    "seconds": round(time.perf_counter() - start, 1)}
        seconds = round(time.perf_counter() - start, 1)
        if out_file.is_file():
            result = json.loads(out_file.read_text(encoding="utf-8"))
        else:
            result = {**head, "outcome": "error", "why": f"model process exited with code {proc.exitcode}, no result"}
        result["seconds"] = seconds
        return result


# kinds of "not applied" reasons in an OptimizeReport, by prefix (first match wins)
_REASON_KINDS = (
    ("precondition:", "precondition"),
    ("refused (", "refused"),
    ("conditional (", "conditional-untraced"),
    ("rewrite:", "rewrite-failed"),
    ("rewritten source fails to load", "load-failed"),
    ("rewritten class cannot be built", "build-failed"),
    ("not equivalent in combination", "not-equivalent-combined"),
    ("not equivalent under the flipped config", "not-equivalent-flipped"),
    ("not equivalent", "not-equivalent"),
)
# kinds that come after the trace confirmed the site
_AFTER_CONFIRMATION = {"rewrite-failed", "load-failed", "build-failed", "not-equivalent-combined",
                       "not-equivalent-flipped", "not-equivalent"}
_TRACE_STATUSES = ("not-executed", "untraced", "rejected", "runtime-only", "conditional", "static", "refused")
# which reason explains a file best when no site of the rule was applied (earlier = more telling)
_KIND_ORDER = ("not-equivalent", "not-equivalent-flipped", "not-equivalent-combined", "build-failed", "load-failed",
               "rewrite-failed", "rejected", "untraced", "conditional-untraced", "not-executed", "runtime-only",
               "refused", "conditional", "static", "other")


def reason_kind(reason: str) -> str:
    for prefix, kind in _REASON_KINDS:
        if reason.startswith(prefix):
            return kind
    head = reason.split(":", 1)[0].strip()
    return head if head in _TRACE_STATUSES else "other"


def file_outcome(rule: str, rel: str, static_sites: list[dict], run: dict | None) -> dict:
    """One rule in one modeling file: matched (static), confirmed, applied, equivalent, and why not."""
    mine = [s for s in static_sites if s["rule"] == rule]
    out = {
        "matched": len([s for s in mine if s["status"] != "refused"]),
        "refused_static": len([s for s in mine if s["status"] == "refused"]),
    }
    if run is None:
        return out
    if run.get("outcome") != "ran":
        return {**out, "outcome": run.get("outcome"), "why": run.get("why", "")}
    report = run["report"]
    applied = [a for a in report["applied"] if a["rule"] == rule and a["file"] == rel]
    skipped = [s for s in report["skipped"] if s["rule"] == rule and s["file"] == rel]
    not_applied = []
    runtime_only = 0
    confirmed_after = 0
    for s in skipped:
        kind = s.get("kind") or reason_kind(s["reason"])  # (reports before the kind field: from the prose)
        if kind == "precondition":
            continue  # every rule is tried on every candidate: not a match of this rule
        if kind == "runtime-only":
            runtime_only += 1
        if kind in _AFTER_CONFIRMATION:
            confirmed_after += 1
        not_applied.append({"lines": s["lines"], "kind": kind, "reason": s["reason"]})
    eq = report.get("equivalence") or {}
    flipped = (report.get("flipped_config") or {}).get("equivalence")
    equivalent = bool(applied) and bool(eq.get("equivalent")) and (flipped is None or bool(flipped.get("equivalent")))
    out.update({
        "traced": report["traced"],
        "confirmed": (len(applied) + confirmed_after) if report["traced"] else 0,
        "applied": len(applied),
        "equivalent": equivalent,
        "runtime_only": runtime_only,
        "not_applied": not_applied,
    })
    if applied:
        out["outcome"] = "applied" if equivalent else "applied-not-equivalent"
        out["kernel_calls"] = [a.get("kernel_calls", {}) for a in applied]
        if equivalent:
            out["max_abs_diff"] = eq.get("max_abs_diff")
    elif not_applied:
        best = min(not_applied, key=lambda s: _KIND_ORDER.index(s["kind"]) if s["kind"] in _KIND_ORDER else 99)
        out["outcome"] = "not-applied"
        out["why"] = best["reason"]
    else:
        out["outcome"] = "no-site"
        out["why"] = "no match of this rule in the file reached optimize"
    return out


def runtime_stage(static: dict, files: list[Path], rule_names: list[str], *, jobs: int, timeout: float,
                  config: str, all_decoders: bool, progress=print) -> dict:
    models_dir = transformers_dir() / "models"
    base = transformers_dir().parent
    mappings = auto_mappings(models_dir)
    by_rel = {portable(f, base): f for f in files}
    families: dict[str, dict] = {}
    for rel, path in by_rel.items():
        matched = rel in static["per_file"]
        if not matched and not all_decoders:
            continue
        info = classify_file(path, mappings)
        info["static_match"] = matched
        if not matched and info["kind"] != "decoder-only":
            continue
        families[rel] = info
    todo = [rel for rel, info in families.items() if info["kind"] == "decoder-only"]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus // max(1, jobs))
    runs: dict[str, dict] = {}

    def one(rel: str) -> tuple[str, dict]:
        info = families[rel]
        spec = {"module": info["module"], "class": info["class"], "rules": rule_names, "config": config,
                "site_packages": str(base)}
        return rel, run_model(spec, timeout, threads)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for i, (rel, run) in enumerate(pool.map(one, todo), 1):
            runs[rel] = run
            if progress:
                progress(f"[{i}/{len(todo)}] {families[rel]['family']}.{families[rel]['class']}: "
                         f"{run.get('outcome')} {run.get('why', '')[:100]} ({run.get('seconds')} s)")
    seconds = time.perf_counter() - start
    per_file = {}
    for rel, info in sorted(families.items()):
        entry = {**info}
        run = runs.get(rel)
        if run is not None:
            entry["run"] = {k: v for k, v in run.items() if k != "report"}
            if "report" in run:
                entry["run"]["equivalence"] = run["report"].get("equivalence")
                entry["run"]["flipped_config"] = run["report"].get("flipped_config")
                entry["run"]["warnings"] = run["report"].get("warnings")
                # sites applied in other files of the model (shared transformers modules)
                entry["run"]["applied_elsewhere"] = [
                    {k: a[k] for k in ("rule", "file", "lines", "class", "function")}
                    for a in run["report"]["applied"] if a["file"] != rel]
        entry["rules"] = {r: file_outcome(r, rel, static["per_file"].get(rel, []), run) for r in rule_names}
        per_file[rel] = entry
    return {"seconds": round(seconds, 1), "jobs": jobs, "timeout_s": timeout, "config": config,
            "models_run": len(todo), "per_file": per_file}


# ---------------------------------------------------------------- summary


def summarize(static: dict, runtime: dict | None, rule_names: list[str]) -> dict:
    out = {}
    for rule in rule_names:
        s = static["per_rule"][rule]
        row = {"files_matched": s["files_static_or_conditional"], "files_refused_only":
               s["files_matched"] - s["files_static_or_conditional"],
               "files_by_status": s["files_by_status"], "refused_codes": {c: len(v["files"])
                                                                          for c, v in s["refused_codes"].items()}}
        if runtime is not None:
            decoders = {rel: e for rel, e in runtime["per_file"].items() if e["kind"] == "decoder-only"}
            matched = {rel: e for rel, e in decoders.items() if e["rules"][rule]["matched"]
                       or e["rules"][rule]["refused_static"]}
            row["decoder_only_files_matched"] = len(matched)
            row["files_confirmed"] = len([e for e in decoders.values() if e["rules"][rule].get("confirmed")])
            row["files_applied_equivalent"] = len([e for e in decoders.values() if e["rules"][rule].get("equivalent")])
            row["files_runtime_only"] = sorted(e["family"] for e in decoders.values()
                                               if e["rules"][rule].get("runtime_only"))
            row["not_applied"] = [
                {"family": e["family"], "class": e["class"], "outcome": e["rules"][rule].get("outcome"),
                 "why": e["rules"][rule].get("why", "")}
                for rel, e in sorted(matched.items()) if not e["rules"][rule].get("equivalent")]
            row["not_decoder_only"] = sorted(
                {f"{e['family']} ({e['kind']})" for rel, e in runtime["per_file"].items()
                 if e["kind"] != "decoder-only" and any(x["rule"] == rule for x in static["per_file"].get(rel, []))})
        out[rule] = row
    return out


def format_summary(result: dict) -> str:
    st = result["static"]
    lines = [f"transformers {result['transformers']}: {st['files_scanned']} modeling files scanned in "
             f"{st['seconds']} s ({len(st['errors'])} scan errors); rules {', '.join(result['rules'])}"]
    rt = result.get("runtime")
    if rt:
        lines.append(f"runtime: {rt['models_run']} decoder-only models, optimize() in a process each "
                     f"(config {rt['config']}, timeout {rt['timeout_s']:g} s, {rt['jobs']} jobs): {rt['seconds']} s")
    head = f"  {'rule':<22}{'matched':>8}{'refused':>8}"
    if rt:
        head += f"{'dec-only':>9}{'confirmed':>10}{'applied=':>9}{'runtime-only':>13}"
    lines.append(head)
    for rule, row in result["summary"].items():
        line = f"  {rule:<22}{row['files_matched']:>8}{row['files_refused_only']:>8}"
        if rt:
            line += (f"{row['decoder_only_files_matched']:>9}{row['files_confirmed']:>10}"
                     f"{row['files_applied_equivalent']:>9}{len(row['files_runtime_only']):>13}")
        lines.append(line)
    lines.append("  (files: matched = static/conditional match; refused = only refused matches; dec-only = decoder-only"
                 " LLM files matched; applied= = applied and equivalent)")
    for rule, row in result["summary"].items():
        for code, n in row["refused_codes"].items():
            lines.append(f"  {rule}: refused {code} in {n} file(s)")
        if not rt:
            continue
        if row["not_applied"]:
            lines.append(f"{rule}: decoder-only families matched but not applied ({len(row['not_applied'])}):")
            for item in row["not_applied"]:
                lines.append(f"  {item['family']:<24}{str(item['outcome']):<14}{item['why'][:160]}")
        if row["files_runtime_only"]:
            lines.append(f"{rule}: runtime-only (the trace saw the pattern, no static match): "
                         + ", ".join(row["files_runtime_only"]))
        if row["not_decoder_only"]:
            lines.append(f"{rule}: matched in {len(row['not_decoder_only'])} file(s) not run (not decoder-only LLMs): "
                         + ", ".join(row["not_decoder_only"][:30])
                         + (" ..." if len(row["not_decoder_only"]) > 30 else ""))
    return "\n".join(lines)


def analyzer_info() -> dict:
    import adopter

    pkg = Path(adopter.__file__).resolve().parent
    proc = subprocess.run(["git", "-C", str(pkg.parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(pkg.parent), "status", "--porcelain", "--", "adopter", "tracing",
                            "rewrite", "kernels"], capture_output=True, text=True)
    return {"git_commit": proc.stdout.strip() if proc.returncode == 0 else None,
            "analyzer_tree_modified": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def _transformers_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def run(rule_names: list[str], *, only=None, jobs=2, timeout=120.0, config="small", static_only=False,
        all_decoders=False, scan_jobs=0, progress=print) -> dict:
    from adopter.core.rules import get_rules

    rules = get_rules(rule_names)
    files = modeling_files(only)
    static = static_stage(files, rules, scan_jobs)
    runtime = None if static_only else runtime_stage(static, files, [r.name for r in rules], jobs=jobs,
                                                     timeout=timeout, config=config, all_decoders=all_decoders,
                                                     progress=progress)
    return {
        "what": "LLM rule coverage over the installed transformers: static scan, trace, optimize() per model",
        "rules": [r.name for r in rules],
        "only": only,
        "transformers": _transformers_version(),
        "analyzer": analyzer_info(),
        "summary": summarize(static, runtime, [r.name for r in rules]),
        "static": static,
        "runtime": runtime,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES), help="comma-separated rule names (default %(default)s)")
    ap.add_argument("--only", default="", help="comma-separated model directory names (llama,gpt2); default all")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="models optimized at a time (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per model (default %(default)s)")
    ap.add_argument("--config", choices=("small", "shrunk"), default="small",
                    help="small: the shrunk default config, checked to build first (default); shrunk: optimize's own default")
    ap.add_argument("--static-only", action="store_true", help="scan only (nothing imported)")
    ap.add_argument("--all-decoders", action="store_true",
                    help="also run decoder-only families without a static match (finds runtime-only sites)")
    ap.add_argument("--scan-jobs", type=int, default=0, help="scan_paths jobs (default 0: one per CPU)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file (default %(default)s)")
    args = ap.parse_args(argv)
    from adopter.core.rules import UnknownRuleError, get_rules

    names = [r.strip() for r in args.rules.split(",") if r.strip()]
    try:
        get_rules(names)
    except UnknownRuleError as exc:
        ap.error(str(exc))
    only = [o.strip() for o in args.only.split(",") if o.strip()] or None
    if only:
        known = {f.parent.name for f in modeling_files()}
        unknown = sorted(set(only) - known)
        if unknown:
            ap.error(f"no models/<name>/modeling_*.py for: {', '.join(unknown)}")
    result = run(names, only=only, jobs=args.jobs, timeout=args.timeout, config=args.config,
                 static_only=args.static_only, all_decoders=args.all_decoders, scan_jobs=args.scan_jobs)
    print(format_summary(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
