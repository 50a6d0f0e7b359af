"""What the kernels accept, as data, and the one reader of a norm+act module's ``forward``: read by
the rules (static analysis, which never imports torch) and by the kernels (their run-time checks),
so the two cannot drift apart.

Before this module four GeLU tables had (``kernels/guarded.py``, ``rules/biased_gelu.py``,
``rules/_activation_keys.py``, ``rules/gated_mlp.py``), and one named a class transformers never had.
"""
from __future__ import annotations

# transformers.activations classes computing the GeLU the kernels implement -> its approximation
# (the tanh-formula classes compute F.gelu(approximate="tanh"), up to rounding). PytorchGELUTanh is
# transformers 4.x's name of 5.x's GELUTanh.
TRANSFORMERS_GELUS: dict[str, str] = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}

# transformers.activations classes named like a GeLU that compute another function -> why not
NOT_KERNEL_GELUS: dict[str, str] = {
    "QuickGELUActivation": "QuickGELU (x*sigmoid(1.702x)) is not the GeLU the kernel implements",
    "ClippedGELUActivation": "clipped GeLU is not the GeLU the kernel implements",
}

# ACT2FN keys (config.hidden_act) that give one of TRANSFORMERS_GELUS or torch's GELU
GELU_CONFIG_KEYS = frozenset(
    {"gelu", "gelu_new", "gelu_fast", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate"}
)


# ---------------------------------------------------------------- norm + activation modules

# The BatchNorm class a norm+act module extends and the functional it may write out
BATCH_NORM_2D = "torch.nn.BatchNorm2d"
_BATCH_NORM_FUNCTION = "torch.nn.functional.batch_norm"
_BATCH_NORM_PARAMS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
# what each argument of the written-out batch norm must be in eval mode (momentum: unused there)
_EVAL_ARGUMENTS = {
    "input": ("input",),
    "running_mean": ("self", "running_mean"),
    "running_var": ("self", "running_var"),
    "weight": ("self", "weight"),
    "bias": ("self", "bias"),
    "training": False,
    "eps": ("self", "eps"),
}
_UNKNOWN = object()


def norm_act_form(forward, fqn) -> tuple[str, ...] | None:
    """The submodules a BatchNorm2d subclass's ``forward`` applies, in order, to the batch norm of
    its input, when that is all it computes in eval mode with running statistics (timm's
    ``BatchNormAct2d``: ``x = super().forward(x); x = self.drop(x); x = self.act(x)``): e.g.
    ``("drop", "act")``; None for anything else.

    ``forward``: its ``ast.FunctionDef``; ``fqn(dotted) -> str | None``: what a dotted name of its
    module is (``F.batch_norm`` -> ``torch.nn.functional.batch_norm``). The batch norm is
    ``super().forward(x)`` (or ``nn.BatchNorm2d.forward(self, x)``) or a
    written-out ``F.batch_norm`` whose arguments are, with ``self.training`` False and running
    statistics present, the module's own statistics, affine parameters and ``eps`` with
    ``training=False``; ``if`` tests are decided under the same assumptions (an undecided one, or
    any other statement, and it is not one). Read by the static analysis (a layer built by a factory
    of another file) and by the kernel at run time (``kernels/guarded.py``: the class the module
    has then), so the two recognise the same forms."""
    import ast

    a = forward.args
    params = a.posonlyargs + a.args
    if len(params) != 2 or a.vararg or a.kwarg or a.kwonlyargs or a.defaults or forward.decorator_list:
        return None
    self_name, x = params[0].arg, params[1].arg
    env: dict[str, object] = {x: ("input",)}

    def truth(v):
        return v if isinstance(v, bool) else _UNKNOWN

    def self_attr(e) -> str | None:
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == self_name:
            return e.attr
        return None

    def value(e):  # noqa: C901 - one case per expression kind
        if isinstance(e, ast.Constant):
            return e.value if e.value is None or isinstance(e.value, bool) else _UNKNOWN
        if isinstance(e, ast.Name):
            return env.get(e.id, _UNKNOWN)
        attr = self_attr(e)
        if attr is not None:
            return False if attr == "training" else ("self", attr)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = truth(value(e.operand))
            return _UNKNOWN if v is _UNKNOWN else not v
        if isinstance(e, ast.BoolOp):
            vals = [truth(value(v)) for v in e.values]
            decisive = isinstance(e.op, ast.Or)  # True decides an ``or``, False an ``and``
            if decisive in vals:
                return decisive
            return _UNKNOWN if _UNKNOWN in vals else not decisive
        if isinstance(e, ast.Compare) and len(e.ops) == 1 and isinstance(e.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(e.comparators[0], ast.Constant) and e.comparators[0].value is None:
            attr = self_attr(e.left)
            if attr in ("running_mean", "running_var", "weight", "bias"):
                # statistics present (what the fold needs, checked on the module); affine unknown
                is_none = False if attr.startswith("running_") else _UNKNOWN
            else:
                left = value(e.left)
                is_none = _UNKNOWN if left is _UNKNOWN or (isinstance(left, tuple) and left[0] == "self") \
                    else left is None
            if is_none is _UNKNOWN:
                return _UNKNOWN
            return is_none if isinstance(e.ops[0], ast.Is) else not is_none
        if isinstance(e, ast.IfExp):
            t = truth(value(e.test))
            if t is _UNKNOWN:
                body, orelse = value(e.body), value(e.orelse)
                return body if body is not _UNKNOWN and body == orelse else _UNKNOWN
            return value(e.body if t else e.orelse)
        if isinstance(e, ast.Call):
            return call(e)
        return _UNKNOWN

    def call(e):
        f = e.func
        if any(isinstance(v, ast.Starred) for v in e.args) or any(k.arg is None for k in e.keywords):
            return _UNKNOWN
        if isinstance(f, ast.Attribute) and f.attr == "forward":
            recv = f.value
            args = list(e.args)
            # (``super()`` alone: ``super(Cls, self)`` may name a class above the batch norm's)
            is_super = isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super" \
                and not recv.args and not recv.keywords
            if not is_super and fqn_of(recv) == BATCH_NORM_2D and args and isinstance(args[0], ast.Name) \
                    and args[0].id == self_name:
                is_super, args = True, args[1:]
            if is_super and len(args) == 1 and not e.keywords and value(args[0]) == ("input",):
                return ("post",)
            return _UNKNOWN
        attr = self_attr(f)
        if attr is not None:
            if len(e.args) == 1 and not e.keywords:
                v = value(e.args[0])
                if isinstance(v, tuple) and v[0] == "post":
                    return (*v, attr)
            return _UNKNOWN
        if fqn_of(f) != _BATCH_NORM_FUNCTION or len(e.args) > len(_BATCH_NORM_PARAMS):
            return _UNKNOWN
        given = dict(zip(_BATCH_NORM_PARAMS, e.args))
        for k in e.keywords:
            if k.arg not in _BATCH_NORM_PARAMS or k.arg in given:
                return _UNKNOWN
            given[k.arg] = k.value
        for name, wanted in _EVAL_ARGUMENTS.items():
            if name not in given or value(given[name]) != wanted or (wanted is False and value(given[name]) is not False):
                return _UNKNOWN
        return ("post",)

    def fqn_of(e) -> str | None:
        parts = []
        while isinstance(e, ast.Attribute):
            parts.append(e.attr)
            e = e.value
        if not isinstance(e, ast.Name) or e.id in env or e.id == self_name:
            return None
        return fqn(".".join([e.id, *reversed(parts)]))

    def run(body) -> object:
        for st in body:
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                continue  # docstring
            if isinstance(st, ast.If):
                t = truth(value(st.test))
                if t is _UNKNOWN:
                    return _UNKNOWN
                out = run(st.body if t else st.orelse)
                if out is not None:
                    return out
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                env[st.targets[0].id] = value(st.value)
                continue
            if isinstance(st, ast.Return) and st.value is not None:
                return value(st.value)
            return _UNKNOWN
        return None  # (fell through: the caller goes on)

    out = run(forward.body)
    if isinstance(out, tuple) and out[:1] == ("post",):
        return tuple(out[1:])
    return None
