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


@pytest.fixture(scope="session", autouse=True)
def _kernels_fused_where_the_backend_policy_says_original():
    """Tests check the fused kernels' math and paths on CPU: the measured backend policy
    (``adopter.kernels.policy.BACKEND_POLICY``, which sends e.g. the rotary kernel to the original
    ops on CPU) is lifted for the session — before module-scoped fixtures optimize anything — as
    ``QKV_FUSE_ON_CPU`` is switched on where QKV's math is tested. Tests marked ``shipped_policy``
    see the policy as shipped (subprocesses always do). The calibrated cost model
    (``adopter.kernels.cost``, which sends small calls to the original ops where the fused path
    does not pay) is switched off alike."""
    from adopter.kernels import cost, policy

    _SHIPPED_POLICY.update(policy.BACKEND_POLICY)
    policy.BACKEND_POLICY.clear()
    cost.ENABLED = False
    yield
    policy.BACKEND_POLICY.update(_SHIPPED_POLICY)
    cost.ENABLED = True


_SHIPPED_POLICY: dict = {}


@pytest.fixture(autouse=True)
def _shipped_policy_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("shipped_policy"):
        from adopter.kernels import cost, policy

        monkeypatch.setattr(policy, "BACKEND_POLICY", dict(_SHIPPED_POLICY))
        monkeypatch.setattr(cost, "ENABLED", True)
    yield
