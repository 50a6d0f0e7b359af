"""Differential fuzzing of every kernel the rewrites emit against the code it replaces (fast tier).

Each case builds the user's modules twice from one seed (one world runs the original code, the
other the kernel), runs the same calls and state changes on both under one execution mode, and
compares everything observable after each call: outputs (values, NaN/inf positions, dtype,
``requires_grad``), gradients of inputs and parameters (first and second order), tangents, the
modules' state (BatchNorm running statistics), in-place writes to the inputs, the next random draw
and hook calls. The tables (kernel rows, modes, state changes) and the comparison live in
``tests/kernels/fuzz_cases.py``; ``benchmarks/fuzz_kernels.py`` runs many more seeds (the long tier).

A case is named ``<row>|<exec>/<grad mode>/<state changes>|s<seed>`` and reproduces from the name::

    python benchmarks/fuzz_kernels.py --cases 'ID'

(which clears ``adopter.kernels.policy.BACKEND_POLICY``, as ``conftest.py`` does for the session).
Cases that fail because of a kernel bug stay in the suite, marked ``xfail(strict=True)`` with the
bug in the reason (:data:`KNOWN_BUGS`): fixing the kernel turns them into an XPASS failure, and the
mark is then removed.
"""
from __future__ import annotations

import gc

import fuzz_cases as fc
import pytest
import torch

# the kernels the issue lists, and the row that exercises each
ISSUE_KERNELS = {
    "conv_bn": "conv_bn", "conv_bn+ReLU": "conv_bn", "linear_bn": "linear_bn",
    "GuardedSequential(Conv2d,BatchNorm2d[,ReLU])": "seq_conv_bn", "GuardedSequential(Linear,BatchNorm1d)": "seq_linear_bn",
    "GuardedSequential(Linear,GELU)": "seq_linear_gelu", "FusedConv2dBatchNorm2d": "fused_conv_bn_module",
    "FusedLinearBatchNorm1d": "fused_linear_bn_module", "qkv": "qkv", "linear_gelu": "linear_gelu",
    "dropout_add_layer_norm": "dropout_add_layer_norm", "softmax": "softmax", "attention": "attention",
    "add_relu": "add_relu", "rms_norm": "rms_norm", "scaled_l2_norm": "scaled_l2_norm", "gated_mlp": "gated_mlp", "gated_mlp_packed": "gated_mlp_packed",
    "linear_cross_entropy": "linear_cross_entropy", "lm_head_cross_entropy": "lm_head_cross_entropy",
    "rotary": "rotary", "rotary_interleaved": "rotary_interleaved", "rotary_pairs": "rotary_pairs",
    "rotary_complex": "rotary_complex",
}

# case id -> the kernel bug it shows (a key of fuzz_cases.BUGS, which says what it is), from running this
# tier (``python benchmarks/fuzz_kernels.py --fast`` prints these entries for the cases that fail)
KNOWN_BUGS: dict[str, str] = {
    "rms_norm|compile_aot_eager/grad/once|s0": "overflow_regime",
}

CASES = fc.fast_cases(seeds_per_mode=3)
_OUTCOMES: dict[str, fc.Outcome] = {}


def _param(row: str, mode: fc.Mode, seed: int):
    cid = fc.case_id(row, mode, seed)
    bug = KNOWN_BUGS.get(cid)
    marks = [pytest.mark.xfail(strict=True, reason=f"{bug}: {fc.BUGS.get(bug, bug)}")] if bug else []
    return pytest.param(row, mode, seed, id=cid, marks=marks)


@pytest.mark.parametrize("row, mode, seed", [_param(*c) for c in CASES])
def test_kernel_computes_what_the_original_computes(row, mode, seed, monkeypatch):
    # QKV's fused path is off on CPU (a measured policy): the qkv row switches it on for the
    # kernel's world (fuzz_cases.qkv_on_cpu); here it stays off for everything else
    monkeypatch.setattr(fc.G, "QKV_FUSE_ON_CPU", False)
    if mode.exec.startswith("compile"):
        # modules frozen by earlier cases and garbage-collected while dynamo builds its guards make
        # that order-dependent (fuzz_cases.BUGS["compile_frozen_guard"], seen by the long tier): not here
        gc.collect()
    outcome = fc.run_case(row, mode, seed)
    _OUTCOMES[outcome.case] = outcome
    if outcome.status == "skip":
        pytest.skip(outcome.problems[0] if outcome.problems else "skipped")
    assert outcome.status in ("match", "documented"), f"[{fc.classify(outcome)}] {outcome.report()}"


def test_known_bugs_name_cases_of_this_tier():
    ids = {fc.case_id(*c) for c in CASES}
    assert set(KNOWN_BUGS) <= ids
    assert set(KNOWN_BUGS.values()) <= set(fc.BUGS)


def test_every_kernel_of_the_issue_has_a_row():
    assert set(ISSUE_KERNELS.values()) <= set(fc.ROWS)
    rows = {row for row, _, _ in CASES}
    assert rows == set(fc.ROWS)


def test_cases_reproduce_from_their_name():
    row, mode, seed = CASES[7]
    cid = fc.case_id(row, mode, seed)
    assert fc.case_from_id(cid) == (row, mode, seed)
    first, again = fc.run_case(row, mode, seed), fc.run_case(*fc.case_from_id(cid))
    assert first.choices == again.choices and first.status == again.status and first.problems == again.problems


def test_a_wrong_kernel_is_caught():
    # the comparison itself: a kernel that is off by one ulp-scale amount, one that drops a hook
    # call and one that draws from the RNG are each reported
    spec = fc.Spec(lambda k: torch.nn.Module(), lambda g: [torch.randn(4, 3, generator=g)],
                   lambda w, x: x.relu(), lambda w, x: x.relu() * (1 + 1e-3), torch.float32)
    a = fc.Result(out=[torch.ones(2)], rng=torch.zeros(1))
    b = fc.Result(out=[torch.ones(2) * 1.001], rng=torch.ones(1), hooks=1)
    problems, _ = fc.compare(spec, fc.Mode(), "no_grad", a, b, "call 0")
    assert any("values differ" in p for p in problems)
    assert any("RNG" in p for p in problems) and any("hooks" in p for p in problems)
    nan = fc.Result(out=[torch.tensor([float("nan"), 0.0])])
    zero = fc.Result(out=[torch.tensor([0.0, 0.0])])
    assert any("NaN positions" in p for p in fc.compare(spec, fc.Mode(), "no_grad", nan, zero, "c")[0])


def test_zz_the_fused_paths_ran():
    """The cases above exercised each kernel's fused path, not only its fallback (checked once the
    whole tier ran in this process)."""
    if len(_OUTCOMES) < len(CASES):
        pytest.skip("only part of the tier ran")
    fused = {}
    for o in _OUTCOMES.values():
        fused[o.row] = fused.get(o.row, 0) + o.fused
    missing = [r for r, row in fc.ROWS.items() if row.kernel and not fused.get(r)]
    assert not missing, f"rows whose fused path never ran: {missing}"
