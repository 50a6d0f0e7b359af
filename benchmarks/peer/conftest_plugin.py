"""Copied as ``conftest.py`` into the root of each peer-suite run (``benchmarks/bench_peer_suites.py``).

Two jobs, both read from environment variables the script sets:

* ``PEER_PACKAGE`` / ``PEER_EXPECT_ROOT``: the package under test (``timm``, ``transformers``) must be
  imported from the copy under ``PEER_EXPECT_ROOT`` (pristine or rewritten), never from the
  virtual environment or the system; the session stops at once otherwise. The origin, the versions
  and how many of the package's modules import ``adopter.kernels`` go to ``PEER_IMPORT_CHECK`` (JSON).
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


def _import_check() -> dict:
    module = importlib.import_module(_PACKAGE)
    origin = Path(module.__file__).resolve().parent
    import adopter
    import torch

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
