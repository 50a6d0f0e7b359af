"""Hand-built static matches for the tracing tests: the Match objects the scanner produces for
well-known code, written out so tracing tests do not depend on extraction details."""

from __future__ import annotations

import inspect
import os

from adopter.dsl import Arg, Layer, Span, TensorOp, Var
from adopter.structures import Match, MatchedNode


def line_of(obj, needle: str, occurrence: int = 1) -> int:
    """Absolute line number of the ``occurrence``-th source line of ``obj`` containing ``needle``."""
    lines, start = inspect.getsourcelines(obj)
    seen = 0
    for i, text in enumerate(lines):
        if needle in text:
            seen += 1
            if seen == occurrence:
                return start + i
    raise AssertionError(f"{needle!r} not found in {obj}")


def layer(type_: str, line: int, function: str, *, module: str | None = None, inputs=(), output=None) -> Layer:
    return Layer(
        type_,
        args=tuple(Arg(Var(*v) if isinstance(v, tuple) else Var(v)) for v in inputs),
        output=(Var(*output) if isinstance(output, tuple) else Var(output)) if output else None,
        module=Var(module) if module else None,
        span=Span(line, 0, line, 80, function=function, stmt_line=line, stmt_end_line=line),
    )


def tensor_op(op: str, line: int, function: str, *, inputs=(), output=None) -> TensorOp:
    return TensorOp(
        op,
        args=tuple(Arg(Var(*v) if isinstance(v, tuple) else Var(v)) for v in inputs),
        output=(Var(*output) if isinstance(output, tuple) else Var(output)) if output else None,
        span=Span(line, 0, line, 80, function=function, stmt_line=line, stmt_end_line=line),
    )


def make_match(rule: str, cls_or_fn, nodes, *, class_name: str | None = "__auto__", function="forward") -> Match:
    file = os.path.realpath(inspect.getsourcefile(cls_or_fn))
    if class_name == "__auto__":
        class_name = cls_or_fn.__name__ if inspect.isclass(cls_or_fn) else None
    return Match(
        rule=rule,
        file=file,
        class_name=class_name,
        function=function,
        nodes=tuple(MatchedNode(i, n) for i, n in enumerate(nodes)),
    )


def dropout_layernorm(cls, *, dropout_needle="self.dropout(", ln_needle="LayerNorm(", drop_attr="self.dropout",
                      ln_attr="self.LayerNorm", residual="input_tensor") -> Match:
    fn = f"{cls.__name__}.forward"
    d = line_of(cls.forward, dropout_needle)
    ln = line_of(cls.forward, ln_needle)
    return make_match("Dropout_LayerNorm", cls, [
        layer("torch.nn.Dropout", d, fn, module=drop_attr, inputs=[("hidden_states", 1)], output=("hidden_states", 2)),
        tensor_op("+", ln, fn, inputs=[("hidden_states", 2), residual], output="tmp_1"),
        layer("torch.nn.LayerNorm", ln, fn, module=ln_attr, inputs=["tmp_1"], output=("hidden_states", 3)),
    ])


def biased_gelu(cls, *, linear_needle="self.dense(", act_needle="_act_fn(", linear_attr="self.dense",
                act_attr="self.intermediate_act_fn") -> Match:
    fn = f"{cls.__name__}.forward"
    a = line_of(cls.forward, linear_needle)
    b = line_of(cls.forward, act_needle)
    return make_match("biased_GeLU", cls, [
        layer("torch.nn.Linear", a, fn, module=linear_attr, inputs=["hidden_states"], output=("hidden_states", 1)),
        layer("transformers.activations.ACT2FN", b, fn, module=act_attr, inputs=[("hidden_states", 1)], output=("hidden_states", 2)),
    ])


def fused_qkv(cls, attrs=("self.query", "self.key", "self.value"), x="hidden_states") -> Match:
    fn = f"{cls.__name__}.forward"
    nodes = []
    for attr in attrs:
        line = line_of(cls.forward, attr + "(")
        nodes.append(layer("torch.nn.Linear", line, fn, module=attr, inputs=[x], output=f"tmp_{attr[5:]}"))
    return make_match("fused_QKV", cls, nodes)


def softmax_in_function(fn_obj, needle="softmax(") -> Match:
    line = line_of(fn_obj, needle)
    name = fn_obj.__name__
    return make_match("softmax", fn_obj, [
        layer("torch.nn.functional.softmax", line, name, inputs=["attn_weights"], output=("attn_weights", 2)),
    ], class_name=None, function=name)
