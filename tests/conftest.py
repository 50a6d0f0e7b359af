"""Fixtures shared by several test modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

OPTIMIZE_FIXTURES = Path(__file__).parent / "fixtures" / "optimize"


@pytest.fixture()
def toy(monkeypatch):
    """``toy_pkg.model`` from ``tests/fixtures/optimize``, imported fresh for each test."""
    monkeypatch.syspath_prepend(str(OPTIMIZE_FIXTURES))
    for name in [n for n in sys.modules if n == "toy_pkg" or n.startswith("toy_pkg.")]:
        monkeypatch.delitem(sys.modules, name)
    import toy_pkg.model

    return toy_pkg.model
