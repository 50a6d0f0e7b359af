"""Peer-suite benchmark (issue 21): a rewritten library must pass *its own* test suite.

    python3 benchmarks/bench_peer_suites.py [--lib timm|transformers|all] [--subset ci|full]
                                            [--out benchmarks/results] [--findings FILE.md]
                                            [--reuse-pristine]

For each library: two copies of the installed package, one pristine, one rewritten by
``adopter rewrite --write`` (static, no model import), each run through the same selection of the
library's tests; per test outcome pristine vs rewritten, counts per group (torchscript, fx,
forward, backward, intermediates, features, pruning, generation, export, other), the tests
newly failing (passed pristine, failed rewritten, grouped by cause with their error heads) and
newly passing. Writes ``<out>/peer_<lib>.json`` (``peer_<lib>_ci.json`` for ``--subset ci``) and
prints a short table; ``--findings`` also writes the newly failing tests as Markdown.

Everything lives under ``benchmarks/.cache/peer/`` (ignored by git): the sdists, one throwaway
virtual environment per library, the copies and the raw per-test records
(``<lib>/<side>/outcomes.jsonl``).

timm (1.0.31, pinned): ``venv-timm``, created with ``--system-site-packages`` so it shares the system
torch 2.13.0 (CPU) and the editable adopter the rewritten code imports; timm, torchvision and
pytest-timeout are installed into it with ``--no-deps`` (``timm``'s ``torch`` requirement would
otherwise pull a CUDA torch). Its tests come from the sdist (``pip download --no-binary :all:``).
Workaround, in that environment only: the torchvision wheels served here are CUDA builds whose C
operators cannot load beside CPU torch 2.13.0, and ``import torchvision`` then fails in
``torchvision/_meta_registrations.py`` (``operator torchvision::nms does not exist``). A
``.pth`` file in the venv's site-packages runs ``_peer_torchvision_shim``, which puts an empty
module in ``sys.modules['torchvision._meta_registrations']`` before anything imports torchvision:
only the fake-tensor kernels of torchvision's own C ops (nms, roi_align, ...) are lost, which no
timm model calls; ``torchvision.ops.misc``, ``transforms`` and ``models.feature_extraction`` (the
FX feature extractor timm's FX tests use) are pure Python and work. torchvision 0.28.0 is the
release made for torch 2.13 (``Requires-Dist: torch==2.13.0``).

transformers (the installed version, recorded in the results; its sdist of the same version):
the sdist ships ``tests/test_modeling_common.py`` (``ModelTesterMixin``),
``test_configuration_common.py``, ``test_pipeline_mixin.py`` and others, but neither ``tests/models/*`` nor the modules ``test_modeling_common`` imports from
``tests/generation/test_utils.py``, ``tests/exporters/test_export.py`` and
``tests/utils/test_configuration_utils.py``. ``benchmarks/peer/transformers_tests/`` has our
own: model testers for bert, llama, gpt2, t5 (and its encoder), vit in the style of transformers'
``tests/models/<m>/test_modeling_<m>.py``, and small stand-ins for the three missing modules
(``GenerationTesterMixin`` and ``ExportTesterMixin`` with our own generation and
``torch.export`` tests; see their docstrings). Runs in ``venv-transformers``
(``--system-site-packages``, plus ``parameterized``), with a copy of the transformers package first
on ``PYTHONPATH``; the rewritten copy has ``adopter rewrite --write`` over ``models/bert``,
``models/llama``, ``models/gpt2``, ``models/t5``, ``models/vit``. Not used: ``PipelineTesterMixin``
(its tests load tiny checkpoints from the Hub). A ``tests/models/conftest.py`` of ours seeds
transformers' input generator and torch before every test, so both runs see the same inputs and
weights.

The rewritten copy runs first (its failures are logged as they come), then the pristine one;
``--reuse-pristine`` takes the pristine outcomes from an earlier run when the selected tests, the
package, the test files and the plugin are byte-identical (a pristine run never calls adopter).
The rewritten run also records ``adopter.kernels.kernel_calls()`` (which path each kernel took:
fused or the guard's fallback), so a suite that never reached a fused path shows.

Timings on the shared 2-core machine, a side (rewritten, pristine; plus ~30 s of copying, rewriting
and collecting): timm ``full`` (428 tests) ~4 min idle, 22-38 min under a load of ~5 from other
users; timm ``ci`` (32) ~20 s idle, 1-1.5 min loaded; transformers ``full`` (958) ~3-8 min idle,
~15 min loaded; transformers ``ci`` (74) ~35 s idle, 1-3 min loaded.

Both runs check where the package was imported from (``benchmarks/peer/conftest_plugin.py``,
copied as the runs' ``conftest.py``): a run importing the package from anywhere but its copy
stops. ``HF_HUB_OFFLINE=1``: nothing is downloaded from the Hub.

Exit status: 0 no newly failing test; 1 some newly failing test; 2 the benchmark itself failed
(collection error, crash; the traceback is printed); 3 the environment could not be set up (no
registry, no sdist): nothing compared. With ``--lib all`` the highest applies.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from peer import outcomes as oc  # noqa: E402
from peer import timm_selection  # noqa: E402

CACHE = BENCH / ".cache" / "peer"
PLUGIN = BENCH / "peer" / "conftest_plugin.py"
TRANSFORMERS_TESTS = BENCH / "peer" / "transformers_tests"

TORCH_VERSION = "2.13.0"
TIMM_VERSION = "1.0.31"
TORCHVISION_VERSION = "0.28.0"  # the release for torch 2.13 (Requires-Dist: torch==2.13.0)
TIMM_REWRITE = ("timm/models", "timm/layers")
TRANSFORMERS_MODELS = ("bert", "llama", "gpt2", "t5", "vit")
SUBSETS = ("ci", "full")

TIMM_SHIM_MODULE = '''"""peer-suite shim (benchmarks/bench_peer_suites.py), this throwaway environment only: torchvision's
C operators (a CUDA build) cannot load beside CPU torch, and torchvision/_meta_registrations.py then
fails at import (operator torchvision::nms does not exist). An empty module in its place: only the
fake-tensor kernels of torchvision's own C ops are lost."""
import sys
import types

_m = types.ModuleType("torchvision._meta_registrations")
_m.__doc__ = __doc__
sys.modules.setdefault("torchvision._meta_registrations", _m)
'''

PYTEST_INI = """[pytest]
# written by benchmarks/bench_peer_suites.py: the rootdir of one peer-suite run (keeps the
# adopter repository's own pytest configuration out)
addopts = -p no:cacheprovider -p no:randomly
markers =
{markers}
"""
TIMM_MARKERS = ("base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features", "fxforward",
                "fxbackward")
TRANSFORMERS_MARKERS = ("slow", "flash_attn_test", "flash_attn_3_test", "is_pipeline_test", "is_staging_test",
                        "generate", "torch_compile_test", "torch_export_test", "training_ci", "is_training_test",
                        "accelerate_tests", "agent_tests", "bitsandbytes", "deepspeed", "not_device_test")


class SetupUnavailable(RuntimeError):
    """The environment (virtual environment, packages, sdist) could not be set up: no registry."""


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, check: bool = True,
         what: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SetupUnavailable(f"{what or cmd[:4]} failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout)[-1500:]}")
    return proc


# --------------------------------------------------------------------------------------------
# environment


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, packages: list[str]) -> Path:
    """A ``--system-site-packages`` virtual environment at ``venv`` (created once) sharing the
    system torch and the editable adopter, with ``packages`` (``name==version``) installed into it
    ``--no-deps`` when missing. Raises ``SetupUnavailable`` when pip cannot get them."""
    python = venv_python(venv)
    if not python.exists():
        log(f"creating {venv.relative_to(ROOT)}")
        _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], what="python -m venv")
        if sys.prefix != sys.base_prefix:
            # run from a virtual environment: --system-site-packages reaches the base interpreter's
            # packages, not this environment's torch and adopter; a .pth file adds them after its own
            # (through site.addsitedir, so their own .pth files, the editable adopter's, are read too)
            import site
            purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                what="venv site-packages").stdout.strip())
            (purelib / "_adopter_parent_env.pth").write_text(
                "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    probe = ("import importlib.metadata as m, json, sys\n"
             "def v(n):\n"
             "    try: return m.version(n)\n"
             "    except m.PackageNotFoundError: return None\n"
             "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    names = [p.split("==")[0] for p in packages] + ["torch", "adopter"]
    have = json.loads(_run([str(python), "-c", probe, *names], what="venv probe").stdout)
    if not (have.get("torch") or "").startswith(TORCH_VERSION):
        raise SetupUnavailable(f"{venv}: torch {have.get('torch')} is not the system torch {TORCH_VERSION}")
    if not have.get("adopter"):
        raise SetupUnavailable(f"{venv}: adopter is not importable (pip install -e . first)")
    missing = [p for p in packages if "==" in p and have.get(p.split("==")[0]) != p.split("==")[1]]
    missing += [p for p in packages if "==" not in p and not have.get(p)]
    if missing:
        log(f"pip install --no-deps {' '.join(missing)} into {venv.name}")
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", *missing], what="pip install")
    return python


def install_torchvision_shim(python: Path) -> None:
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "_peer_torchvision_shim.py").write_text(TIMM_SHIM_MODULE)
    (site / "_peer_torchvision_shim.pth").write_text("import _peer_torchvision_shim\n")
    proc = _run([str(python), "-c", "import torchvision, torchvision.ops.misc, "
                 "torchvision.models.feature_extraction; print(torchvision.__version__)"], check=False)
    if proc.returncode != 0:
        raise SetupUnavailable(f"torchvision still fails to import with the shim: {proc.stderr[-800:]}")


def sdist(name: str, version: str) -> Path:
    """The unpacked sdist of ``name==version`` under ``CACHE/dl`` (downloaded once)."""
    dl = CACHE / "dl"
    unpacked = dl / f"{name}-{version}"
    if unpacked.is_dir():
        return unpacked
    dl.mkdir(parents=True, exist_ok=True)
    log(f"pip download --no-deps --no-binary :all: {name}=={version}")
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(dl),
          f"{name}=={version}"], what="pip download")
    archives = sorted(dl.glob(f"{name}-{version}.tar.gz"))
    if not archives:
        raise SetupUnavailable(f"no sdist {name}-{version}.tar.gz in {dl}")
    import tarfile

    with tarfile.open(archives[0]) as tar:
        tar.extractall(dl, filter="data")
    return unpacked


def package_dir(python: Path, package: str) -> Path:
    code = f"import importlib.util; print(importlib.util.find_spec({package!r}).submodule_search_locations[0])"
    return Path(_run([str(python), "-c", code], what=f"locate {package}").stdout.strip())


def adopter_state() -> dict:
    def git(*args):
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "adopter", "kernels", "rewrite", "tracing")
    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted_files": [ln[3:] for ln in (dirty or "").splitlines()]}


# --------------------------------------------------------------------------------------------
# copies, rewrite, runs


def make_copy(package: Path, tests: Path, dest: Path, markers: tuple[str, ...], extra_tests: Path | None = None) -> Path:
    """``dest`` = a fresh copy of the installed ``package`` + the suite's ``tests/`` + a
    ``pytest.ini`` (so the rootdir is ``dest``: rootdir-relative imports of ``tests/`` find this
    copy first) + the peer plugin as ``conftest.py``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(package, dest / package.name, ignore=ignore, symlinks=True)
    shutil.copytree(tests, dest / "tests", ignore=ignore)
    if extra_tests is not None:
        shutil.copytree(extra_tests, dest / "tests", ignore=ignore, dirs_exist_ok=True)
    (dest / "pytest.ini").write_text(PYTEST_INI.format(markers="\n".join(f"    {m}" for m in markers)))
    shutil.copy(PLUGIN, dest / "conftest.py")
    return dest


def rewrite(copy_root: Path, paths: list[str]) -> dict:
    """``adopter rewrite --write --format json -j1`` over ``paths`` (relative to ``copy_root``):
    the summary and, per changed file, the applied rules."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "adopter", "rewrite", "--write", "--format", "json", "--jobs", "1",
                           *paths], cwd=copy_root, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1, 2) or not proc.stdout.strip():
        raise RuntimeError(f"adopter rewrite crashed ({proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    files = []
    for f in report["files"]:
        if f.get("applied") or f.get("status") not in ("unchanged",):
            rules: dict[str, int] = {}
            for a in f.get("applied", []):
                rules[a["rule"]] = rules.get(a["rule"], 0) + 1
            files.append({"file": f["file"], "status": f["status"], "applied": rules,
                          "skipped_matches": len(f.get("skipped", []))})
    by_rule: dict[str, int] = {}
    for f in files:
        for rule, n in f["applied"].items():
            by_rule[rule] = by_rule.get(rule, 0) + n
    return {"paths": list(paths), "exit_status": proc.returncode, "wall_s": round(wall, 1),
            "summary": report.get("summary", {}), "applied_by_rule": dict(sorted(by_rule.items())),
            "files": files, "stderr_tail": proc.stderr[-1000:]}


def collect(python: Path, root: Path, env: dict, paths: list[str]) -> list[str]:
    proc = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q", *paths], cwd=root, env=env,
                          capture_output=True, text=True)
    ids = [ln.strip() for ln in proc.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if not ids:
        raise RuntimeError(f"collection in {root} found nothing ({proc.returncode}): {proc.stdout[-2000:]}"
                           f"{proc.stderr[-1000:]}")
    return ids


def run_env(root: Path, package: str, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME"):
        env.pop(var, None)
    env.update({
        "PYTHONPATH": str(root),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PEER_PACKAGE": package,
        "PEER_EXPECT_ROOT": str(root),
        "PEER_OUTCOMES": str(root / "outcomes.jsonl"),
        "PEER_IMPORT_CHECK": str(root / "import_check.json"),
        "PEER_KERNEL_CALLS": str(root / "kernel_calls.json"),
    })
    env.update(extra or {})
    return env


def run_side(python: Path, root: Path, env: dict, nodeids: list[str], label: str,
             timeout_s: float | None = None) -> dict:
    """pytest over ``nodeids`` in ``root`` (one process, no parallelism); the per-test outcomes
    come from the plugin's JSON lines, so a crash or a time-out keeps what ran."""
    out = root / "outcomes.jsonl"
    for stale in (out, root / "kernel_calls.json", root / "import_check.json"):
        stale.unlink(missing_ok=True)
    args_file = root / "selected_tests.txt"
    args_file.write_text("\n".join(nodeids) + "\n")
    cmd = [str(python), "-m", "pytest", "-q", "-rfE", "--tb=short", f"@{args_file}"]
    log(f"{label}: pytest over {len(nodeids)} tests in {root.relative_to(ROOT)}")
    start = time.perf_counter()
    log_path = root / "pytest.log"
    rc: int | str
    with open(log_path, "w") as fh:
        fh.write(" ".join(cmd) + "\n\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        seen: set[str] = set()
        while True:
            try:
                rc = proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                if timeout_s is not None and time.perf_counter() - start > timeout_s:
                    proc.kill()
                    proc.wait()
                    rc = "timeout"
                    break
            seen = _report_progress(out, seen, len(nodeids), label)
        _report_progress(out, seen, len(nodeids), label)
    stdout = log_path.read_text()
    wall = time.perf_counter() - start
    results = oc.read_outcomes(out)
    check_path = root / "import_check.json"
    check = json.loads(check_path.read_text()) if check_path.exists() else None
    calls_path = root / "kernel_calls.json"
    calls = json.loads(calls_path.read_text()) if calls_path.exists() else None
    summary = [ln for ln in stdout.strip().splitlines() if ln.strip()][-1:]
    log(f"{label}: {summary[0] if summary else rc} ({wall:.0f} s)")
    if not results and rc not in (0, 1):
        raise RuntimeError(f"{label}: pytest ran nothing ({rc}): {stdout[-3000:]}")
    return {"outcomes": results, "wall_s": round(wall, 1), "exit_status": rc, "import_check": check,
            "kernel_calls": calls, "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "pytest_summary": summary[0] if summary else "", "log": str((root / "pytest.log").relative_to(ROOT))}


def _report_progress(path: Path, seen: set[str], total: int, label: str) -> set[str]:
    """Log each failing test as soon as the plugin records it, and a count every 50 tests."""
    results = oc.read_outcomes(path)
    for nodeid, rec in results.items():
        if nodeid in seen:
            continue
        if rec["outcome"] in ("failed", "error"):
            head = (rec.get("message") or "").strip().splitlines()[:1]
            log(f"{label}: {rec['outcome'].upper()} {nodeid}: {head[0][:200] if head else ''}")
            seen.add(nodeid)
    done = len(results)
    bucket = f"#{done // 50}"
    if done >= 50 and bucket not in seen:
        seen.add(bucket)
        log(f"{label}: {done}/{total} tests done")
    return seen


def _pristine_key(selected: list[str], package: Path, tests: Path, extra_tests: Path | None) -> str:
    digest = hashlib.sha256(json.dumps(selected).encode())
    for root in (package, tests, extra_tests, PLUGIN):
        if root is None:
            continue
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
        for f in files:
            digest.update(str(f.relative_to(root.parent)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def compare_sides(lib: str, subset: str, pristine: dict, rewritten: dict, extra: dict) -> dict:
    comparison = oc.compare(pristine["outcomes"], rewritten["outcomes"])
    return {
        "benchmark": "peer_suites",
        "library": lib,
        "subset": subset,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "runs": {side: {k: v for k, v in run.items() if k != "outcomes"}
                 for side, run in (("pristine", pristine), ("rewritten", rewritten))},
        **comparison,
    }


def prepare_and_run(lib: str, subset: str, python: Path, package: Path, tests: Path, markers: tuple[str, ...],
                    rewrite_paths: list[str], select, env_extra: dict, reuse_pristine: bool,
                    extra_tests: Path | None = None, collect_paths: list[str] | None = None) -> tuple[dict, dict, dict,
                                                                                                    list[str]]:
    base = CACHE / lib
    base.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f"{lib}.lock", "w") as lock:
        # one run per library at a time: the copies and records under CACHE/<lib> are shared
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_and_run_locked(lib, subset, python, package, tests, markers, rewrite_paths, select, env_extra,
                                       reuse_pristine, extra_tests, collect_paths, base)


def _prepare_and_run_locked(lib, subset, python, package, tests, markers, rewrite_paths, select, env_extra,
                            reuse_pristine, extra_tests, collect_paths, base):
    pristine_root = make_copy(package, tests, base / "pristine", markers, extra_tests)
    rewritten_root = make_copy(package, tests, base / "rewritten", markers, extra_tests)
    log(f"{lib}: adopter rewrite --write {' '.join(rewrite_paths)}")
    rw = rewrite(rewritten_root, rewrite_paths)
    log(f"{lib}: rewrite summary {rw['summary']} in {rw['wall_s']} s")
    env_p = run_env(pristine_root, package.name, env_extra)
    env_r = run_env(rewritten_root, package.name, env_extra)
    collected = collect(python, pristine_root, env_p, collect_paths or ["tests"])
    selected = select(collected)
    if not selected:
        raise RuntimeError(f"{lib}: the {subset} selection matched none of {len(collected)} collected tests")
    # what a pristine run depends on: the tests selected, the package copy, the tests and the plugin
    # (not adopter: the pristine copy never calls it)
    key = _pristine_key(selected, package, tests, extra_tests)
    # the rewritten copy first: its failures are the news, logged as they come
    rewritten = run_side(python, rewritten_root, env_r, selected, f"{lib} rewritten")
    if rewritten["import_check"] and rewritten["import_check"]["files_importing_adopter_kernels"] == 0:
        raise RuntimeError(f"{lib}: the rewritten copy imports no adopter.kernels: the rewrite did not apply")
    cache = base / "pristine_cache" / f"{key[:24]}.json"
    pristine = json.loads(cache.read_text()) if reuse_pristine and cache.exists() else None
    if pristine is None:
        pristine = run_side(python, pristine_root, env_p, selected, f"{lib} pristine")
        cache.parent.mkdir(exist_ok=True)
        cache.write_text(json.dumps(pristine))
        pristine["cache"] = str(cache.relative_to(ROOT))
    else:
        pristine["reused"] = True
        pristine["cache"] = str(cache.relative_to(ROOT))
        log(f"{lib} pristine: reused the run finished {pristine.get('finished')} ({len(pristine['outcomes'])} tests)")
    return pristine, rewritten, rw, selected


# --------------------------------------------------------------------------------------------
# libraries


def bench_timm(subset: str, reuse_pristine: bool) -> dict:
    python = ensure_venv(CACHE / "venv-timm", [f"timm=={TIMM_VERSION}", f"torchvision=={TORCHVISION_VERSION}",
                                               "pytest-timeout"])
    install_torchvision_shim(python)
    tests = sdist("timm", TIMM_VERSION) / "tests"
    package = package_dir(python, "timm")
    pristine, rewritten, rw, selected = prepare_and_run(
        "timm", subset, python, package, tests, TIMM_MARKERS, list(TIMM_REWRITE),
        lambda ids: timm_selection.select(ids, subset),
        # timm's per-test limits (120-360 s) are for CI runners; a loaded 2-core machine needs more
        {"TIMEOUT": "600"}, reuse_pristine,
        collect_paths=["tests/test_models.py", "tests/test_prune.py"])
    return compare_sides("timm", subset, pristine, rewritten, {
        "versions": _versions(python, ["timm", "torch", "torchvision"]),
        "adopter": adopter_state(),
        "environment": {
            "venv": str((CACHE / "venv-timm").relative_to(ROOT)),
            "tests_from": f"timm-{TIMM_VERSION} sdist (pip download --no-binary :all:)",
            "workarounds": ["torchvision==0.28.0 (CUDA wheel; its C ops cannot load beside CPU torch): "
                            "torchvision._meta_registrations replaced by an empty module through a .pth "
                            "file in the venv (fake-tensor kernels of torchvision's own ops only)",
                            "TIMEOUT=600 (timm's per-test time limits)", "HF_HUB_OFFLINE=1"],
        },
        "selection": {"subset": subset, "count": len(selected), "doc": timm_selection.__doc__.strip(),
                      "node_ids": selected},
        "rewrite": rw,
    })


def bench_transformers(subset: str, reuse_pristine: bool) -> dict:
    from importlib.metadata import version

    tf_version = version("transformers")
    python = ensure_venv(CACHE / "venv-transformers", ["parameterized"])
    tests = sdist("transformers", tf_version) / "tests"
    package = package_dir(python, "transformers")
    sys.path.insert(0, str(TRANSFORMERS_TESTS))
    from peer.transformers_tests import selection as tf_selection

    pristine, rewritten, rw, selected = prepare_and_run(
        "transformers", subset, python, package, tests, TRANSFORMERS_MARKERS,
        [f"transformers/models/{m}" for m in TRANSFORMERS_MODELS],
        lambda ids: tf_selection.select(ids, subset), {}, reuse_pristine,
        extra_tests=TRANSFORMERS_TESTS / "tests", collect_paths=["tests/models"])
    return compare_sides("transformers", subset, pristine, rewritten, {
        "versions": _versions(python, ["transformers", "torch"]),
        "adopter": adopter_state(),
        "environment": {
            "venv": str((CACHE / "venv-transformers").relative_to(ROOT)),
            "tests_from": f"transformers-{tf_version} sdist (common mixins) + benchmarks/peer/transformers_tests "
                          "(model testers, stand-ins for the mixin modules the sdist lacks)",
            "workarounds": ["HF_HUB_OFFLINE=1", "tests/generation/test_utils.py, tests/exporters/test_export.py, "
                            "tests/utils/test_configuration_utils.py are not in the sdist: our stand-ins"],
        },
        "selection": {"subset": subset, "count": len(selected), "doc": tf_selection.__doc__.strip(),
                      "node_ids": selected},
        "rewrite": rw,
    })


def _versions(python: Path, names: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys, platform\n"
            "print(json.dumps({**{n: m.version(n) for n in sys.argv[1:]}, 'python': platform.python_version()}))")
    return json.loads(_run([str(python), "-c", code, *names]).stdout)


LIBS = {"timm": bench_timm, "transformers": bench_transformers}


def result_path(out: Path, lib: str, subset: str) -> Path:
    return out / (f"peer_{lib}.json" if subset == "full" else f"peer_{lib}_{subset}.json")


def recompare(path: Path, lib: str) -> dict | None:
    """``path``'s result with its comparison redone from the records of the run that wrote it (the
    copies' ``outcomes.jsonl``; a reused pristine run's from its cache entry)."""
    if not path.exists():
        log(f"{lib}: no {path} to recompare")
        return None
    result = json.loads(path.read_text())
    base = CACHE / lib
    selected = set(result["selection"]["node_ids"])
    sides = {}
    for side in ("pristine", "rewritten"):
        records = oc.read_outcomes(base / side / "outcomes.jsonl")
        cache = result["runs"]["pristine"].get("cache")
        if side == "pristine" and result["runs"]["pristine"].get("reused") and cache and (ROOT / cache).exists():
            records = json.loads((ROOT / cache).read_text())["outcomes"]
        reported = {t for t, e in result.get("tests", {}).items() if e.get(side) not in (None, "missing")}
        if not records or set(records) != reported or not set(records) <= selected:
            log(f"{lib}: the records under {base / side} are not those of {path.name} (another run since?)")
            return None
        sides[side] = records
    result.update(oc.compare(sides["pristine"], sides["rewritten"]))
    result["recompared"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return result


def _report(result: dict, lib: str, args, path: Path, sections: list[str]) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(oc.table(result, f"\n{lib} {result['versions'].get(lib)} ({args.subset}, {result.get('wall_s', 0):.0f} s): "
                           f"pristine vs rewritten"))
    for f in result["newly_failing"]:
        head = f["message"].strip().splitlines()[0][:160] if f["message"].strip() else ""
        print(f"  NEWLY FAILING {f['test']} [{f['cause']}] {head}")
    for f in result["newly_passing"]:
        print(f"  newly passing {f['test']}")
    for f in result.get("slowdowns", [])[:10]:
        print(f"  far slower rewritten: {f['test']} {f['pristine_s']:.1f} s -> {f['rewritten_s']:.1f} s")
    log(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    sections.append(oc.findings_markdown(result, f"{lib} {result['versions'].get(lib)} ({args.subset}): "
                                                 f"{len(result['newly_failing'])} newly failing"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", choices=[*LIBS, "all"], default="all")
    parser.add_argument("--subset", choices=SUBSETS, default="ci")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--findings", type=Path, help="also write the newly failing tests, by cause, as Markdown")
    parser.add_argument("--recompare", action="store_true",
                        help="run nothing: redo the comparison of the existing <out>/peer_<lib>*.json from the per-test "
                             "records left under benchmarks/.cache/peer/<lib>/ by its run (e.g. after a change to "
                             "the grouping or the causes)")
    parser.add_argument("--reuse-pristine", action="store_true",
                        help="reuse the last pristine run when the selected tests, the package, the test files and "
                             "the plugin are unchanged (a pristine run never calls adopter)")
    args = parser.parse_args(argv)
    libs = list(LIBS) if args.lib == "all" else [args.lib]
    args.out.mkdir(parents=True, exist_ok=True)
    status, sections = 0, []
    for lib in libs:
        start = time.perf_counter()
        if args.recompare:
            result = recompare(result_path(args.out, lib, args.subset), lib)
            if result is None:
                status = max(status, 2)
                continue
            _report(result, lib, args, result_path(args.out, lib, args.subset), sections)
            if result["newly_failing"] and status == 0:
                status = 1
            continue
        try:
            result = LIBS[lib](args.subset, args.reuse_pristine)
        except SetupUnavailable as exc:
            log(f"{lib}: environment not available: {exc}")
            status = max(status, 3)
            continue
        except Exception:  # the benchmark itself broke (collection error, crash): nothing compared
            import traceback

            traceback.print_exc()
            log(f"{lib}: the peer suite could not run (above); nothing compared")
            status = max(status, 2)
            continue
        result["wall_s"] = round(time.perf_counter() - start, 1)
        _report(result, lib, args, result_path(args.out, lib, args.subset), sections)
        if result["newly_failing"] and status == 0:
            status = 1
    if args.findings and sections:
        args.findings.write_text("# Peer suites: newly failing tests\n\n" + "\n".join(sections))
    return status


if __name__ == "__main__":
    sys.exit(main())
