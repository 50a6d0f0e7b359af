"""Copied as ``conftest.py`` into the root of each peer-suite run (``benchmarks/bench_peer_suites.py``).

Two jobs, both read from environment variables the script sets:

* ``PEER_PACKAGE`` / ``PEER_EXPECT_ROOT``: the package under test (``timm``, ``transformers``) must be
  imported from the copy under ``PEER_EXPECT_ROOT`` (pristine or rewritten), never from the
  virtual environment or the system; the session stops at once otherwise. The origin, the versions
  and how many of the package's modules import ``adopter.kernels`` go to ``PEER_IMPORT_CHECK`` (JSON).
* ``PEER_KERNEL_CALLS``: at the end, how many calls of each ``adopter.kernels`` entry point took
  which path (``adopter.kernels.kernel_calls()``: fused backend or ``original``, the guard's
  fallback), summed over the session; written only when the code under test imported the kernels.
* ``PEER_OUTCOMES``: one JSON line per test phase report (node id, phase, outcome, error head and
  the innermost frame), appended and flushed as the run goes, so a crash keeps what ran before it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

_PACKAGE = os.environ.get("PEER_PACKAGE", "")
_ROOT = os.environ.get("PEER_EXPECT_ROOT", "")
_OUT = os.environ.get("PEER_OUTCOMES", "")
_CHECK = os.environ.get("PEER_IMPORT_CHECK", "")
_CALLS = os.environ.get("PEER_KERNEL_CALLS", "")


def _import_check() -> dict:
    module = importlib.import_module(_PACKAGE)
    origin = Path(module.__file__).resolve().parent
    import torch

    import adopter

    uses_kernels = sorted(
        str(p.relative_to(origin)) for p in origin.rglob("*.py") if "adopter.kernels" in p.read_text(errors="replace")
    )
    return {
        "package": _PACKAGE,
        "origin": str(origin),
        "version": getattr(module, "__version__", None),
        "expected_root": _ROOT,
        "from_expected_root": str(origin).startswith(str(Path(_ROOT).resolve())),
        "adopter": str(Path(adopter.__file__).resolve().parent),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "files_importing_adopter_kernels": len(uses_kernels),
        "files_importing_adopter_kernels_sample": uses_kernels[:10],
    }


_STATE: dict = {}


def pytest_configure(config):
    if not _PACKAGE:
        return
    check = _import_check()
    _STATE["check"] = check
    if _CHECK:
        Path(_CHECK).write_text(json.dumps(check, indent=1))
    if not check["from_expected_root"]:
        raise pytest.UsageError(f"peer suite: {_PACKAGE} imported from {check['origin']}, not from {_ROOT}")


def pytest_report_header(config):
    check = _STATE.get("check")
    if check:
        return (f"peer-suite: {check['package']} {check['version']} from {check['origin']} "
                f"({check['files_importing_adopter_kernels']} files import adopter.kernels); "
                f"adopter from {check['adopter']}; torch {check['torch']}")
    return None


def _error_head(report) -> tuple[str, str]:
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        where = f"{crash.path}:{crash.lineno}"
        return crash.message[:1500], where
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, lineno, reason)
        return str(longrepr[2])[:1500], f"{longrepr[0]}:{longrepr[1]}"
    text = str(longrepr or "").strip()
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if not lines and text:
        lines = text.splitlines()[-1:]
    return "\n".join(lines[:8])[:1500], ""


def pytest_runtest_logreport(report):
    if not _OUT:
        return
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "duration": round(report.duration, 3)}
    if hasattr(report, "wasxfail"):
        record["xfail"] = True
    if report.outcome != "passed":
        record["message"], record["where"] = _error_head(report)
    with open(_OUT, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def pytest_sessionfinish(session, exitstatus):
    if not _CALLS or "adopter.kernels" not in sys.modules:
        return
    try:
        from adopter.kernels import kernel_calls

        calls = kernel_calls()
    except Exception as exc:  # the telemetry API is not this plugin's to pin
        Path(_CALLS).write_text(json.dumps({"error": repr(exc)}))
        return
    by_path: dict = {}
    reasons: dict = {}
    for call in calls:
        key = f"{call.kernel} {call.backend}"
        by_path[key] = by_path.get(key, 0) + call.count
        if call.reason:
            rkey = f"{call.kernel}: {call.reason}"
            reasons[rkey] = reasons.get(rkey, 0) + call.count
    Path(_CALLS).write_text(json.dumps({"calls_by_kernel_and_backend": dict(sorted(by_path.items())),
                                        "fallback_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))},
                                       indent=1))
