"""Analysis reach: what ``adopter scan`` finds in model code outside transformers.

Scans three source trees statically with ``adopter.core.scan.scan_paths`` (all built-in rules,
nothing imported or run):

* timm (``timm/models/*.py``, ``timm/layers/*.py``) from the ``timm==1.0.31`` wheel;
* torchvision (``torchvision/models/**/*.py`` and ``ops/misc.py``, home of Conv2dNormActivation) from the ``torchvision==0.29.2`` wheel
  (skipped, with the reason recorded, when the wheel cannot be downloaded);
* the installed transformers (``models/*/modeling_*.py``, located, never imported).

Wheels are fetched with ``python -m pip download <pkg>==<version> --no-deps`` into
``benchmarks/.cache/wheels`` (gitignored; ``--cache`` another folder; a wheel already there is
reused) and unzipped there. Prints and writes (``benchmarks/results/reach.json``) the number of
matches per rule and status for each tree, and per file the matches (rule, class, function,
lines, status)::

    python benchmarks/bench_reach.py [--out benchmarks/results/reach.json]
                                     [--compare benchmarks/results/reach_baseline_pre_issue11.json]
                                     [--trees timm,torchvision,transformers] [--jobs N]

``--compare BASELINE.json``: sites gained and lost per tree and rule against a saved run; a site
is keyed by (rule, file, class, function, lines), the file being its path inside the tree
(``models/resnet.py``, ``bert/modeling_bert.py``: basenames repeat inside torchvision and timm);
a site present in both with another status is listed as a status change; a site whose reported
location moved (e.g. a Sequential pair reported where it is built instead of where it is called)
is one lost and one gained site. Scan errors are compared per file. Which analyzer ran
(``adopter`` package path, its git commit and whether its tree had local changes) is recorded.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "reach.json"
TIMM_VERSION = "1.0.31"
TORCHVISION_VERSION = "0.29.2"
TREES = ("timm", "torchvision", "transformers")


# ---------------------------------------------------------------- sources


def fetch_wheel(package: str, version: str, cache: Path = CACHE) -> Path:
    """The wheel of ``package==version`` in ``cache/wheels`` (downloaded with pip when missing)."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{package}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps", "-q", "-d", str(wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(pattern))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"pip download {package}=={version} failed: {(proc.stderr or proc.stdout)[-500:]}")
    return found[-1]


def unpack(wheel: Path, cache: Path = CACHE) -> Path:
    """Unzip ``wheel`` once into ``cache/<wheel stem>`` -> that folder."""
    dest = cache / wheel.stem
    stamp = dest / ".unpacked"
    if not stamp.is_file():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)
        stamp.write_text(wheel.name + "\n")
    return dest


def transformers_models_dir() -> Path:
    spec = importlib.util.find_spec("transformers")  # locate only: transformers is not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def _version_of_dist(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def tree_files(name: str, cache: Path = CACHE) -> tuple[Path, list[Path], dict]:
    """(tree root, files to scan, provenance) for one source tree; raises RuntimeError when unavailable."""
    if name == "timm":
        wheel = fetch_wheel("timm", TIMM_VERSION, cache)
        root = unpack(wheel, cache) / "timm"
        files = sorted(root.glob("models/*.py")) + sorted(root.glob("layers/*.py"))
        return root, files, {"wheel": wheel.name, "version": TIMM_VERSION, "globs": ["models/*.py", "layers/*.py"]}
    if name == "torchvision":
        wheel = fetch_wheel("torchvision", TORCHVISION_VERSION, cache)
        root = unpack(wheel, cache) / "torchvision"
        # ops/misc.py holds Conv2dNormActivation, the conv+norm+act block the model files build on
        files = sorted(root.glob("models/**/*.py")) + [root / "ops" / "misc.py"]
        return root, files, {"wheel": wheel.name, "version": TORCHVISION_VERSION,
                             "globs": ["models/**/*.py", "ops/misc.py"]}
    if name == "transformers":
        root = transformers_models_dir()
        files = sorted(root.glob("*/modeling_*.py"))
        return root, files, {"version": _version_of_dist("transformers"), "globs": ["*/modeling_*.py"]}
    raise ValueError(name)


# ---------------------------------------------------------------- scanning


def analyzer_info() -> dict:
    """Which adopter is imported (the baseline is made from a separate clone)."""
    import adopter
    import adopter.core.scan as scan_mod

    pkg = Path(adopter.__file__).resolve().parent
    repo = pkg.parent
    info = {"adopter": str(pkg), "scan_module": str(Path(scan_mod.__file__).resolve())}

    def git(*args):
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    info["git_commit"] = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "adopter", "tracing", "rewrite", "kernels")
    info["analyzer_tree_modified"] = None if status is None else bool(status)
    return info


def scan_tree(name: str, jobs: int, cache: Path = CACHE) -> dict:
    from adopter.core.rules import all_rules
    from adopter.core.scan import scan_paths

    try:
        root, files, prov = tree_files(name, cache)
    except (RuntimeError, OSError, zipfile.BadZipFile) as exc:
        return {"skipped": str(exc)}
    start = time.perf_counter()
    report = scan_paths([str(f) for f in files], all_rules(), jobs=jobs)
    wall = time.perf_counter() - start
    per_rule: dict[str, dict[str, int]] = {}
    per_file: dict[str, list] = {}
    for m in report.matches:
        d = m.to_json()
        rel = os.path.relpath(d["file"], root)
        per_rule.setdefault(d["rule"], {})
        per_rule[d["rule"]][d["status"]] = per_rule[d["rule"]].get(d["status"], 0) + 1
        site = {k: d.get(k) for k in ("rule", "class", "function", "lines", "status")}
        if d.get("reason"):
            site["reason"] = d["reason"]
        per_file.setdefault(rel, []).append(site)
    return {
        **prov,
        "root": str(root),
        "files": len(files),
        "files_scanned": report.files_scanned,
        "errors": [{**e.to_json(), "file": os.path.relpath(e.to_json()["file"], root)} for e in report.errors],
        "seconds": round(wall, 2),
        "matches": len(report.matches),
        "files_with_matches": len(per_file),
        "per_rule": {r: dict(sorted(s.items())) for r, s in sorted(per_rule.items())},
        "per_file": dict(sorted(per_file.items())),
    }


# ---------------------------------------------------------------- comparison


def _sites(tree: dict) -> dict[tuple, list[str]]:
    """site key -> the statuses of the matches reported there (a key can be reported more than once)."""
    out: dict[tuple, list[str]] = {}
    for rel, sites in tree.get("per_file", {}).items():
        for s in sites:
            out.setdefault((s["rule"], rel, s["class"], s["function"], tuple(s["lines"])), []).append(s["status"])
    return {k: sorted(v) for k, v in out.items()}


def compare(result: dict, baseline: dict) -> dict:
    """Per tree and rule: sites gained / lost vs ``baseline`` (as multisets: a site reported twice
    counts twice), and sites present in both whose statuses changed."""
    out = {}
    for name, tree in result["trees"].items():
        base = baseline.get("trees", {}).get(name)
        if "skipped" in tree or base is None or "skipped" in base:
            out[name] = {"skipped": tree.get("skipped") or (base or {}).get("skipped") or "not in the baseline"}
            continue
        now, before = _sites(tree), _sites(base)
        rules = sorted({k[0] for k in now} | {k[0] for k in before})
        per_rule = {}
        for rule in rules:
            keys = sorted((k for k in now.keys() | before.keys() if k[0] == rule), key=_order)
            gained, lost, changed = [], [], []
            for k in keys:
                n_now, n_before = len(now.get(k, [])), len(before.get(k, []))
                if n_now > n_before:
                    gained += [_site_json(k, now[k][-1])] * (n_now - n_before)
                if n_before > n_now:
                    lost += [_site_json(k, before[k][-1])] * (n_before - n_now)
                if n_now and n_before and now[k] != before[k]:
                    changed.append({**_site_json(k, "/".join(now[k])), "was": "/".join(before[k])})
            per_rule[rule] = {
                "baseline": sum(len(v) for k, v in before.items() if k[0] == rule),
                "now": sum(len(v) for k, v in now.items() if k[0] == rule),
                "gained": gained,
                "lost": lost,
                "status_changed": changed,
            }
        errors_now = sorted(e["file"] for e in tree.get("errors", []))
        errors_before = sorted(e["file"] for e in base.get("errors", []))
        out[name] = {"rules": per_rule,
                     "errors": {"baseline": errors_before, "now": errors_now}}
    return out


def _order(key: tuple) -> tuple:
    """Sort key for site keys (the class is None for module-level functions)."""
    rule, rel, cls, function, lines = key
    return (rule, rel, cls or "", function or "", lines)


def _site_json(key: tuple, status: str) -> dict:
    rule, rel, cls, function, lines = key
    return {"rule": rule, "file": rel, "class": cls, "function": function, "lines": list(lines), "status": status}


# ---------------------------------------------------------------- output


def format_summary(result: dict) -> str:
    lines = [f"adopter: {result['analyzer']['adopter']} (commit {result['analyzer']['git_commit']}, "
             f"analyzer files modified: {result['analyzer']['analyzer_tree_modified']})"]
    for name, tree in result["trees"].items():
        if "skipped" in tree:
            lines.append(f"{name}: skipped ({tree['skipped']})")
            continue
        lines.append(f"{name} {tree.get('version')}: {tree['files']} files, {tree['matches']} matches in "
                     f"{tree['files_with_matches']} files, {len(tree['errors'])} scan errors, {tree['seconds']} s")
        for rule, statuses in tree["per_rule"].items():
            detail = ", ".join(f"{s} {n}" for s, n in statuses.items())
            lines.append(f"  {rule:<20}{sum(statuses.values()):>6}   ({detail})")
        for e in tree["errors"][:10]:
            lines.append(f"  scan error {e['file']}: {e['message'][:150]}")
    return "\n".join(lines)


def format_comparison(comp: dict, baseline_path: str, limit: int = 25) -> str:
    lines = [f"vs baseline {baseline_path}:"]
    for name, per_rule in comp.items():
        if "skipped" in per_rule:
            lines.append(f"{name}: not compared ({per_rule['skipped']})")
            continue
        errors = per_rule["errors"]
        per_rule = per_rule["rules"]
        lines.append(f"{name}: scan errors {len(errors['baseline'])} -> {len(errors['now'])}")
        lines.append(f"  {'rule':<20}{'baseline':>9}{'now':>6}{'gained':>8}{'lost':>6}{'status changed':>16}")
        for rule, c in per_rule.items():
            lines.append(f"  {rule:<20}{c['baseline']:>9}{c['now']:>6}{len(c['gained']):>8}{len(c['lost']):>6}"
                         f"{len(c['status_changed']):>16}")
        for rule, c in per_rule.items():
            for kind in ("gained", "lost", "status_changed"):
                for s in c[kind][:limit]:
                    was = f" (was {s['was']})" if "was" in s else ""
                    lines.append(f"    {kind:<8} {rule} {s['file']}:{s['lines'][0] if s['lines'] else '?'} "
                                 f"[{s['class']}.{s['function']}] lines {s['lines']} {s['status']}{was}")
                if len(c[kind]) > limit:
                    lines.append(f"    ... {len(c[kind]) - limit} more {kind} (see the results file)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file (JSON)")
    ap.add_argument("--compare", metavar="BASELINE.json", help="a saved run to report gained/lost sites against")
    ap.add_argument("--trees", default=",".join(TREES), help="comma-separated subset of " + ",".join(TREES))
    ap.add_argument("--jobs", "-j", type=int, default=0, help="scan_paths jobs (default 0: one per CPU)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="wheel download/unpack folder (default %(default)s)")
    args = ap.parse_args(argv)
    names = [t for t in args.trees.split(",") if t]
    unknown = set(names) - set(TREES)
    if unknown:
        ap.error(f"unknown tree(s): {', '.join(sorted(unknown))}")
    result = {
        "what": "adopter.core.scan.scan_paths, all built-in rules, static (nothing imported)",
        "analyzer": analyzer_info(),
        "trees": {name: scan_tree(name, args.jobs, args.cache) for name in names},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(format_summary(result))
    if args.compare:
        baseline = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        result["comparison"] = {"baseline": str(args.compare), "baseline_analyzer": baseline.get("analyzer"),
                                "trees": compare(result, baseline)}
        print(format_comparison(result["comparison"]["trees"], args.compare))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
