"""The per-call cost model (adopter.kernels.cost): a calibration decides, from the size of a call,
its grad mode and the thread count, whether a kernel's fused path runs; `adopter calibrate` writes
one; verify acts on the ablation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from adopter.kernels import cost
from adopter.kernels.cost import Point, estimate, monotone, parse, verdict
from torch import nn


def _calibration(points: dict, threads=(1,), device="cpu") -> dict:
    return {"format": cost.FORMAT, "device": device,
            "threads": {str(n): points for n in threads}}


def _pt(size, ratio, low, high):
    return {"size": size, "ratio": ratio, "low": low, "high": high}


@pytest.fixture()
def calibrated(tmp_path, monkeypatch):
    """Write a calibration, point ADOPTER_CALIBRATION at it, switch the cost model on."""
    def use(data: dict):
        path = tmp_path / "cal.json"
        path.write_text(json.dumps(data))
        monkeypatch.setenv(cost.ENV, str(path))
        monkeypatch.setattr(cost, "ENABLED", True)
        cost.reload()
        return path
    yield use
    cost.reload()


def test_a_point_does_not_pay_where_the_fused_path_was_measured_slower():
    assert Point(10, 1.05, 1.0, 1.1).pays
    assert Point(10, 0.995, 0.97, 1.02).pays  # (no measurable difference)
    assert not Point(10, 0.98, 0.95, 1.02).pays  # (median more than 1% below)
    assert not Point(10, 1.2, 1.1, 1.3, fitted=0.95).pays  # (the fit decides)


def test_one_noisy_point_does_not_switch_off_the_sizes_around_it():
    """Medians 0.46, 1.01, 0.97, 1.03, 1.05 (conv_bn on a busy machine): the fit pools the dip."""
    curve = monotone([Point(4096, 0.46, 0.45, 0.47), Point(200_704, 1.012, 0.98, 1.03),
                      Point(401_408, 0.972, 0.94, 1.02), Point(802_816, 1.029, 0.99, 1.09),
                      Point(1_605_632, 1.051, 1.04, 1.07)])
    assert [p.fitted for p in curve] == [0.46, 0.992, 0.992, 1.029, 1.051]
    assert [p.pays for p in curve] == [False, True, True, True, True]
    assert [p.fitted for p in monotone([Point(2, 2.0, 1, 3), Point(1, 1.0, 1, 1)])] == [1.0, 2.0]  # (sorted)


def test_between_measured_sizes_the_fitted_ratio_is_interpolated_on_log_size():
    curve = parse(_calibration({"k": {"train": [_pt(100, 0.8, 0.78, 0.82), _pt(10_000, 1.2, 1.1, 1.3),
                                                 _pt(1_000_000, 1.3, 1.2, 1.4)]}}), "t").curve("k", "train", 1)
    assert estimate(curve, 10) == pytest.approx(0.8)  # below the range: the smallest point
    assert estimate(curve, 1_000) == pytest.approx(1.0)  # halfway on log scale
    assert estimate(curve, 10**9) == pytest.approx(1.3)  # beyond: the largest point
    assert verdict(curve, 10) is curve[0]
    assert verdict(curve, 500) is curve[0]  # (0.94 estimated: the nearest measured point says why)
    assert verdict(curve, 1_000) is None
    assert verdict(curve, 50_000) is None
    assert verdict((), 5) is None  # nothing measured: no objection


def test_the_nearest_thread_count_is_read():
    data = {"format": cost.FORMAT, "device": "cpu", "threads": {
        "1": {"k": {"infer": [_pt(10, 0.5, 0.4, 0.6)]}}, "8": {"k": {"infer": [_pt(10, 2.0, 1.9, 2.1)]}}}}
    cal = parse(data, "t")
    assert cal.curve("k", "infer", 1)[0].ratio == 0.5
    assert cal.curve("k", "infer", 2)[0].ratio == 0.5
    assert cal.curve("k", "infer", 6)[0].ratio == 2.0
    assert cal.curve("other", "infer", 1) == ()


def test_a_thread_count_that_did_not_measure_a_kernel_leaves_it_to_the_nearest_that_did():
    # the shipped CPU calibration's 2-thread section holds only the kernels calibrated there; the
    # others (RMSNorm...) read their 1-thread curves at 2 threads, not "nothing known, fused"
    data = {"format": cost.FORMAT, "device": "cpu", "threads": {
        "1": {"k": {"infer": [_pt(10, 0.5, 0.4, 0.6)], "train": [_pt(10, 0.7, 0.6, 0.8)]}},
        "2": {"new": {"infer": [_pt(10, 3.0, 2.9, 3.1)]}, "k": {"train": [_pt(10, 1.5, 1.4, 1.6)]}}}}
    cal = parse(data, "t")
    assert cal.curve("k", "infer", 2)[0].ratio == 0.5
    assert cal.curve("k", "train", 2)[0].ratio == 1.5
    assert cal.curve("new", "infer", 1)[0].ratio == 3.0
    assert cal.curve("new", "train", 2) == ()


def test_every_kernel_of_the_shipped_cpu_calibration_has_a_curve_at_every_thread_count():
    with open(os.path.join(os.path.dirname(cost.__file__), "calibration", "cpu.json")) as f:
        cal = parse(json.load(f), "shipped")
    kernels = {(k, m) for per in cal.points.values() for k, modes in per.items() for m in modes}
    for threads in (1, 2, 4, 16):
        assert all(cal.curve(k, m, threads) for k, m in kernels), threads


def test_a_malformed_calibration_is_refused():
    with pytest.raises(ValueError, match="not an adopter-calibration"):
        parse({"format": "something else"}, "x.json")


def test_rms_norm_takes_the_original_path_where_the_calibration_says_it_does_not_pay(calibrated):
    from adopter.kernels import count_kernel_calls, rms_norm

    calibrated(_calibration({"rms_norm": {"train": [_pt(1024, 0.7, 0.6, 0.8), _pt(1 << 20, 1.5, 1.4, 1.6)],
                                          "infer": [_pt(1024, 0.6, 0.5, 0.7)]}}, threads=(torch.get_num_threads(),)))
    weight = torch.ones(64, requires_grad=True)
    small, large = torch.randn(16, 64, requires_grad=True), torch.randn(1 << 14, 64, requires_grad=True)
    with count_kernel_calls() as counted:
        out_small = rms_norm(small, weight, 1e-6)
        rms_norm(large, weight, 1e-6)
        with torch.no_grad():
            rms_norm(large, weight, 1e-6)  # (inference: only a losing point measured)
    by_rows = [(c.backend, c.reason) for c in counted.calls]
    assert ("torch", "") in by_rows
    original = [reason for backend, reason in by_rows if backend == "original"]
    assert len(original) == 2 and all("does not pay at this size" in r for r in original)
    assert "train" in original[0] + original[1] and "infer" in original[0] + original[1]
    reference = small * torch.rsqrt(small.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(out_small, reference)


def test_switched_off_the_cost_model_has_no_say(calibrated, monkeypatch):
    from adopter.kernels import count_kernel_calls, rms_norm

    calibrated(_calibration({"rms_norm": {"infer": [_pt(1024, 0.5, 0.4, 0.6)]}}, threads=(torch.get_num_threads(),)))
    monkeypatch.setattr(cost, "ENABLED", False)
    with count_kernel_calls() as counted, torch.no_grad():
        rms_norm(torch.randn(4, 64), torch.ones(64), 1e-6)
    assert [c.backend for c in counted.calls] == ["torch"]


def test_a_calibration_for_another_device_is_not_read(calibrated):
    calibrated(_calibration({"rms_norm": {"infer": [_pt(1024, 0.5, 0.4, 0.6)]}}, device="cuda"))
    assert cost.calibration("cpu") is None
    with torch.no_grad():
        assert cost.cost_reason("rms_norm", torch.randn(4, 4)) == ""


def test_the_lm_head_loss_is_sized_by_its_logits(calibrated):
    """A vocabulary of 65 loses, of 8,192 pays, at the same hidden states: the size is tokens x vocab."""
    from adopter.kernels import count_kernel_calls, lm_head_cross_entropy

    calibrated(_calibration({"linear_cross_entropy": {"train": [_pt(64 * 65, 0.6, 0.5, 0.7),
                                                                _pt(64 * 8192, 1.2, 1.1, 1.3)]}},
                            threads=(torch.get_num_threads(),)))
    h = torch.randn(64, 32, requires_grad=True)
    backends = []
    for vocab in (65, 8192):
        head = nn.Linear(32, vocab, bias=False)
        target = torch.randint(0, vocab, (64,))
        with count_kernel_calls() as counted, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the fused loss says once that the logits are not kept)
            logits, loss = lm_head_cross_entropy(head, h, nn.functional.cross_entropy, target)
        torch.testing.assert_close(loss, nn.functional.cross_entropy(head(h), target))
        backends.append(counted.calls[0].backend)
    assert backends == ["original", "torch"]


def test_decisions_are_cached_per_power_of_two_bucket(calibrated):
    calibrated(_calibration({"k": {"infer": [_pt(1000, 0.5, 0.4, 0.6), _pt(4000, 1.5, 1.4, 1.6)]}},
                            threads=(torch.get_num_threads(),)))
    with torch.no_grad():
        small = cost.cost_reason("k", torch.empty(0), size=700)
        assert "does not pay" in small
        assert cost.cost_reason("k", torch.empty(0), size=1000) == small  # (same bucket: 512..1023)
        assert cost.cost_reason("k", torch.empty(0), size=5000) == ""


def test_the_shipped_cpu_calibration_parses_and_covers_the_policy_kernels():
    shipped = cost.SHIPPED / "cpu.json"
    data = json.loads(shipped.read_text())
    cal = parse(data, str(shipped))
    assert cal.device == "cpu" and 1 in cal.points
    for kernel in ("rms_norm", "linear_gelu", "dropout_add_layer_norm", "linear_cross_entropy", "conv_bn"):
        assert kernel in cal.points[1], kernel


def _adopter(*args, env=None):
    return subprocess.run([sys.executable, "-m", "adopter", *args], capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.mark.parametrize("args, message", [
    (["--kernels", "nope"], "unknown kernel(s) nope"),
    (["--threads", "0"], "thread counts must be at least 1"),
    (["--threads", "x"], "not a list of integers"),
    (["--rounds", "1"], "at least 3 rounds"),
])
def test_calibrate_refuses_bad_arguments_in_one_line(args, message):
    done = _adopter("calibrate", *args)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_calibrate_writes_a_calibration_the_kernels_read(tmp_path):
    out = tmp_path / "mine.json"
    done = _adopter("calibrate", "--kernels", "add_relu", "--threads", "1", "--rounds", "3", "-q", "-o", str(out))
    assert done.returncode == 0, done.stderr
    cal = parse(json.loads(out.read_text()), str(out))
    points = cal.curve("add_relu", "infer", 1)
    assert len(points) >= 3 and all(p.low <= p.ratio <= p.high for p in points)
    assert "add_relu" in done.stdout and str(out) in done.stdout


def test_verify_drops_rules_whose_kernel_costs_or_never_ran_fused():
    from adopter.verification.run import _not_applied

    result = {"ablation": {"kernels": [
        {"kernel": "rms_norm", "pays": False, "why": "makes the step 4.0% slower and saves no memory"},
        {"kernel": "gated_mlp", "pays": True, "why": "saves 8% of peak memory", "effect": "pays its way"},
        {"kernel": "softmax", "pays": True, "why": "no measurable speed change", "effect": "no measurable effect"}]},
        "rules_applied": [
            {"rule": "RMSNorm", "kernel_calls": {"kernels": ["rms_norm"], "backends": {"torch": 4}}},
            {"rule": "gated_MLP", "kernel_calls": {"kernels": ["gated_mlp"], "backends": {"torch": 2}}},
            {"rule": "Conv_BatchNorm", "kernel_calls": {"kernels": ["conv_bn"], "backends": {"original": 3},
                                                        "fallbacks": {"too small": 3}}},
            {"rule": "Conv_BatchNorm", "kernel_calls": {"kernels": [], "backends": {}}},  # (no call seen)
            {"rule": "Add_ReLU", "kernel_calls": {"kernels": ["add_relu"], "backends": {"original": 1, "torch": 1}}},
            {"rule": "Add_ReLU", "kernel_calls": {"kernels": ["add_relu"], "backends": {"original": 2}}},
            {"rule": "Softmax", "kernel_calls": {"kernels": [], "backends": {}}},
            {"rule": "softmax", "kernel_calls": {"kernels": ["softmax"], "backends": {"torch": 4}}},
        ]}
    # (Add_ReLU pays at one of its sites; softmax's kernel makes no measurable difference)
    assert _not_applied(result) == ["Conv_BatchNorm", "RMSNorm", "softmax"]
    entries = result["rules_applied"]
    assert "4.0% slower" in entries[0]["not_applied"]
    assert entries[2]["not_applied"] == "its kernel took the original path at every call here (e.g. too small)"
    assert entries[3]["not_applied"] == entries[2]["not_applied"]
    assert not any("not_applied" in entries[i] for i in (1, 4, 5, 6))
    assert entries[7]["not_applied"].startswith("no measurable gain here")


def test_the_gate_counts_a_rule_verify_did_not_apply_as_not_applied():
    from adopter.verification.gate import _backend_checks, _location_checks

    def entry(rule, backends, not_applied=None):
        e = {"rule": rule, "file": "m.py", "path": "m.py", "class": "Block", "function": "forward", "lines": [3],
             "kernel_calls": {"kernels": ["k"], "backends": backends}}
        return {**e, "not_applied": not_applied} if not_applied else e

    baseline = {"rules_applied": [entry("A", {"torch": 2}), entry("B", {"original": 2}, "never fused")]}
    same = {"rules_applied": [entry("A", {"torch": 2}), entry("B", {}, "never fused")]}
    assert all(c.ok for c in _location_checks(same, baseline) + _backend_checks(same, baseline))
    lost = {"rules_applied": [entry("A", {}, "costs"), entry("B", {}, "never fused")]}
    failed = [c for c in _location_checks(lost, baseline) if not c.ok]
    assert len(failed) == 1 and "A no longer applied" in failed[0].detail


@pytest.mark.slow
def test_verify_runs_at_the_thread_count_it_is_told_else_the_one_training_would_use(tmp_path):
    # issue 33: told nothing, verify keeps torch's own count in the process (OMP_NUM_THREADS here),
    # the count the user's training runs at; --threads N sets it
    for flags, omp, expected in (((), "2", 2), (("--threads", "1"), "2", 1), ((), "1", 1)):
        out = tmp_path / f"v{len(flags)}{omp}.json"
        done = _adopter("verify", "--model", "tiny-bert", "--no-benchmark", "--quiet", "--json", str(out), *flags,
                        env={**os.environ, "OMP_NUM_THREADS": omp})
        assert done.returncode == 0, done.stderr[-500:]
        assert json.loads(out.read_text())["environment"]["torch_threads"] == expected, (flags, omp)
