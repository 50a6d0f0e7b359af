"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
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


# ---------------------------------------------------------------- one rule's story: -m rule_<Rule>
# `make test-rule RULE=RMSNorm` runs the tests marked rule_RMSNorm: the rule's snapshot cases
# (tests/rules, marked by folder) and every test whose path or name says the rule or its kernel.
RULE_KEYWORDS = {
    "Add_ReLU": ("add_relu",),
    "Conv_BatchNorm": ("conv_bn", "conv_batchnorm", "batch_norm_fold", "conv_prepacked"),
    "Dropout_LayerNorm": ("dropout_layernorm", "dropout_add_layer_norm", "layer_norm"),
    "Linear_BatchNorm": ("linear_bn", "linear_batchnorm"),
    "RMSNorm": ("rms_norm", "rmsnorm", "l2_norm"),
    "attention": ("attention",),
    "biased_GeLU": ("biased_gelu", "bias_gelu", "linear_gelu"),
    "fused_QKV": ("qkv",),
    "gated_MLP": ("gated_mlp", "gated_act"),
    "linear_cross_entropy": ("linear_cross_entropy", "lce", "lm_head"),
    "rotary_embedding": ("rotary",),
    "softmax": ("softmax",),
    "sdpa_attention": ("sdpa",),
}


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        # one pytest-xdist worker per core (make test-fast): torch's own default of one thread
        # per core in every worker would oversubscribe the cores the workers already share
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    config.addinivalue_line("markers", "rule(name): a snapshot case of a rule's fixture folder (tests/rules)")
    for rule in RULE_KEYWORDS:
        config.addinivalue_line("markers", f"rule_{rule}: the tests of rule {rule} (make test-rule RULE={rule})")


def pytest_collection_modifyitems(config, items):
    for item in items:
        own = item.get_closest_marker("rule")
        text = item.nodeid.lower()
        for rule, keywords in RULE_KEYWORDS.items():
            if (own is not None and own.args and own.args[0] == rule) or any(k in text for k in keywords):
                item.add_marker(getattr(pytest.mark, f"rule_{rule}"))
