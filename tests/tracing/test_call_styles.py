"""Ways model code runs that the trace and the names must still see (issue 35): a submodule's
``forward`` called without ``__call__`` (``self.ffn.forward(x)``, ``FeedForward.forward(self.ffn,
x)``, ``super().forward(x)``), a function nested in ``forward``, a loss stored on ``self``, a kernel
module called through ``nn.Module.__call__``, example inputs the caller gave.

Fixtures: tests/fixtures/tracing/call_styles/ (the real scanner reads them, each capture method
traces them). Statuses and codes are asserted, not reasons, except where the words are the fix."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STYLES = os.path.join(HERE, "fixtures", "tracing", "call_styles")
sys.path.insert(0, STYLES)

import direct_forward
import softmax_module
import stem_closure
import stored_loss
from adopter.tracing import TracingError, build_model, capture_model, confirm_matches, map_nodes

METHODS = ("symbolic_trace", "export")


def scan(name: str):
    from adopter.core.scan import scan_paths

    return scan_paths([os.path.join(STYLES, name)]).matches


def confirmed(model, inputs, matches, method):
    capture = capture_model(model, inputs, methods=(method,))
    return confirm_matches(model, inputs, matches, capture=capture)


@pytest.mark.parametrize("method", METHODS)
def test_a_submodule_forward_called_directly_is_confirmed(method):
    static = scan("direct_forward.py")
    assert [(m.rule, m.class_name, m.status) for m in static] == [("gated_MLP", "FeedForward", "static")]
    model = direct_forward.Transformer().eval()
    out = confirmed(model, {"tokens": torch.randint(0, 32, (2, 5))}, static, method)
    assert [(m.rule, m.status, m.trace_code) for m in out] == [("gated_MLP", "confirmed", "")]
    # every feed-forward of both blocks ran it: .forward, the class function, super().forward
    assert "runs in 6 instances" in out[0].reason


@pytest.mark.parametrize("method", METHODS)
def test_nodes_of_a_forward_run_without_call_belong_to_its_module(method):
    model = direct_forward.Transformer(n_layers=1).eval()
    capture = capture_model(model, {"tokens": torch.randint(0, 32, (2, 5))}, methods=(method,))
    silu = [s for s in map_nodes(capture.graph_module) if s.op_name == "silu"]
    assert [s.module_path for s in silu] == ["layers.0.feed_forward", "layers.0.extra", "layers.0.halved"]
    assert all(s.class_name == "FeedForward" and s.function == "FeedForward.forward" for s in silu)
    assert silu[2].module_class.endswith("direct_forward.HalvedFeedForward")
    # a leaf of the symbolic trace stays the innermost entry, its owner above it
    w1 = next(s for s in map_nodes(capture.graph_module) if s.op_name == "linear" and s.line == silu[0].line)
    assert [p for p, _ in w1.module_stack][-2:] == ["layers.0.feed_forward", "layers.0.feed_forward.w1"]


def test_a_function_nested_in_forward_is_named_in_its_class_and_not_refused():
    static = scan("stem_closure.py")
    stem = [m for m in static if m.class_name == "ModifiedResNet"]
    assert {(m.rule, m.function, m.status, m.code) for m in stem} == {
        ("Conv_BatchNorm", "forward.stem", "static", "")}
    assert len(stem) == 3
    model = stem_closure.ModifiedResNet().eval()
    for method in METHODS:
        out = confirmed(model, {"x": torch.randn(2, 3, 16, 16)}, static, method)
        # the static pass and the trace agree: every site confirmed, none only seen at run time
        assert [(m.status, m.trace_code) for m in out] == [("confirmed", "")] * len(static), method


def test_the_lm_head_loss_stored_on_self_is_confirmed_in_the_words_of_its_loss():
    static = scan("stored_loss.py")
    assert [(m.rule, m.status) for m in static] == [("linear_cross_entropy", "static")]
    model = stored_loss.Transformer().eval()
    tokens = torch.randint(0, 48, (2, 5))
    out = confirm_matches(model, {"tokens": tokens, "targets": tokens}, static)
    assert [(m.status, m.trace_code) for m in out] == [("confirmed", "")]
    assert "F.cross_entropy" in out[0].reason and "ForCausalLMLoss" not in out[0].reason


def test_kernel_calls_through_module_call_are_counted_at_the_users_line():
    from adopter.kernels import Softmax, count_kernel_calls

    model = softmax_module.Attention()
    model.softmax = Softmax(dim=-1)  # what the softmax rule's rewrite builds there
    with count_kernel_calls() as counted:
        model(torch.randn(2, 4, 16))
    assert [(c.kernel, os.path.basename(c.file), c.function) for c in counted.calls] == [
        ("softmax", "softmax_module.py", "Attention.forward")]
    assert counted.at(softmax_module.__file__, "Attention.forward")


def test_kernel_calls_from_a_nested_function_are_named_as_the_analysis_names_them():
    from adopter.kernels import count_kernel_calls, softmax

    class Net(nn.Module):
        def forward(self, x):
            def stem(x):
                return softmax(x, -1)

            return stem(x)

    with count_kernel_calls() as counted:
        Net()(torch.randn(2, 3))
    assert [c.function.rsplit(".", 2)[-2:] for c in counted.calls] == [["forward", "stem"]]
    assert "<locals>" not in counted.calls[0].function


class _Square(nn.Module):
    def forward(self, x):
        return (x @ torch.ones(4, 4)).sum(-1)


def test_a_forward_failing_on_given_inputs_says_they_were_given():
    with pytest.raises(TracingError) as given:
        build_model(_Square, device="cpu", example_inputs={"x": torch.randn(2, 3)})
    assert "example inputs given (x[2, 3])" in str(given.value) and "generated" not in str(given.value)
    assert "\n" not in str(given.value)


def test_a_constructor_failing_on_a_dict_points_to_a_config_object():
    class Configured(nn.Module):
        def __init__(self, params):
            super().__init__()
            self.dense = nn.Linear(params.dim, params.dim)

    with pytest.raises(TracingError) as failed:
        build_model(Configured, device="cpu", init_kwargs={"params": {"dim": 4}})
    from adopter.tracing.models import DICT_GIVEN_HINT

    assert str(failed.value).endswith(f"params was given as a dict {DICT_GIVEN_HINT}")
