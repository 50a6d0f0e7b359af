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


@pytest.fixture(autouse=True)
def _kernels_fused_where_the_backend_policy_says_original(request, monkeypatch):
    """Tests check the fused kernels' math and paths on CPU: the measured backend policy
    (``adopter.kernels.policy.BACKEND_POLICY``, which sends e.g. the rotary kernel to the original
    ops on CPU) is lifted, as ``QKV_FUSE_ON_CPU`` is switched on where QKV's math is tested. Tests
    marked ``shipped_policy`` see the policy as shipped (subprocesses always do)."""
    if request.node.get_closest_marker("shipped_policy"):
        yield
        return
    from adopter.kernels import policy

    monkeypatch.setattr(policy, "BACKEND_POLICY", {})
    yield
