"""Conv_BatchNorm and Linear_BatchNorm codemods (paper Fig. 5).

    __init__:  self.conv = nn.Conv2d(A...); self.bn = nn.BatchNorm2d(C, eps=E)
           =>  self.conv = FusedConv2dBatchNorm2d(A..., bn_eps=E, bn_name="bn")
    forward:   h = self.conv(h); h = self.bn(h)   =>   h = self.conv(h)

The convolution's attribute is reused and ``bn_name`` tells the kernel's state-dict
hooks where the batch-norm keys live, so checkpoints load both ways. When the batch
norm is conditional (DPT: built and applied under ``if self.use_batch_norm:``) the
construction goes under that same condition and the forward call is hoisted (Fig. 4);
with the attribute reused both branches end up identical and collapse back.
"""

from __future__ import annotations

import ast
import copy
import operator

from adopter.core.codemod.base import (
    ChainPlan,
    Codemod,
    arg_text,
    attr_used_elsewhere,
    forward_condition_chain,
    init_statement,
    match_function,
    matched_exprs,
    place_construction,
    pos,
)
from adopter.core.codemod.context import (
    FileContext,
    Skip,
    call_arguments,
    has_call,
    is_self_attr,
    simple_assign_target,
)
from adopter.core.codemod.edits import Edit, InitEdit
from adopter.core.dsl import Layer
from adopter.core.structures import Match

BN_SIG = ("num_features", "eps", "momentum", "affine", "track_running_stats", "device", "dtype")
CONV_SIG = (
    "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
    "padding_mode", "device", "dtype",
)
LINEAR_SIG = ("in_features", "out_features", "bias", "device", "dtype")


class _LayerBatchNorm(Codemod):
    kernel = ""
    first_suffix = ""  # "Conv2d" / "Linear"
    bn_suffix = ""
    first_sig: tuple[str, ...] = ()

    def first_args(self, ctx: FileContext, call: ast.Call) -> tuple[list[str], list[tuple[str, str]]]:
        raise NotImplementedError

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        # The first pattern node: its type may be a same-file subclass (``modeling_x.DepthwiseConv``).
        first = next((e for (n, e), mn in zip(exprs, match.nodes) if isinstance(n, Layer)
                      and (n.type.endswith(self.first_suffix) or mn.pattern_index == 0)), None)
        norm = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith(self.bn_suffix)), None)
        if not isinstance(first, ast.Call) or not isinstance(norm, ast.Call):
            raise Skip(f"match does not have a {self.first_suffix} call and a {self.bn_suffix} call")
        first_attr, bn_attr = is_self_attr(first.func), is_self_attr(norm.func)
        if not first_attr or not bn_attr:
            raise Skip("both layers must be modules called as self.<name>(x)")
        if len(first.args) != 1 or first.keywords or len(norm.args) != 1 or norm.keywords:
            raise Skip("both calls must take exactly one tensor")
        cls = match.class_name
        if cls is None:
            raise Skip(f"{self.rule} needs the class that owns the layers")
        for attr, call in ((first_attr, first), (bn_attr, norm)):
            use = attr_used_elsewhere(ctx, cls, attr, [call])
            if use:
                raise Skip(f"self.{attr} is also used at line {use[0]} ({use[2]})")
        first_stmt, first_call, _ = init_statement(ctx, match, first_attr)
        bn_stmt, bn_call, _ = init_statement(ctx, match, bn_attr)
        positional, keywords = self.first_args(ctx, first_call)
        bn_args = call_arguments(bn_call, BN_SIG)
        for name in ("device", "dtype"):
            if name in bn_args:
                raise Skip(f"{self.bn_suffix} passes {name}=, which the fused kernel does not take")
        for name in ("eps", "momentum", "affine", "track_running_stats"):
            if name in bn_args:
                keywords.append((f"bn_{name}", arg_text(ctx, bn_args[name])))
        keywords.append(("bn_name", f'"{bn_attr}"'))
        parts = positional + [f"{k}={v}" for k, v in keywords]
        construct = f"self.{first_attr} = {self.kernel}({', '.join(parts)})"
        reads = set()
        for node in ast.walk(first_call):
            if isinstance(node, ast.Name):
                reads.add(node.id)
        for node in bn_args.values():
            reads |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        target, init_chain = place_construction(ctx, first_stmt, [bn_stmt], reads)
        fwd_chain = forward_condition_chain(ctx, first, norm)
        if init_chain != fwd_chain:
            raise Skip(
                f"self.{bn_attr} is built under {init_chain or 'no condition'} but applied under "
                f"{fwd_chain or 'no condition'}"
            )
        deletes = [s for s in (first_stmt, bn_stmt) if s is not target]
        if init_chain:
            # The plain layer stays for the branch without batch norm; the fused module
            # replaces it (same attribute) when the condition holds.
            deletes = []
        plan = ChainPlan(ctx, fn, [first, norm])
        plan.anchor_text = f"self.{first_attr}({arg_text(ctx, first.args[0])})"
        plan.moved = [(first.args[0], first)]
        forward = plan.build()
        init = InitEdit(replace=pos(ctx, target), construct=construct, delete=tuple(pos(ctx, s) for s in deletes))
        return Edit(rule=self.rule, forward=forward, init=(init,), imports=(self.kernel,))


class ConvBatchNorm(_LayerBatchNorm):
    rule = "Conv_BatchNorm"
    kernel = "FusedConv2dBatchNorm2d"
    first_suffix = "Conv2d"
    bn_suffix = "BatchNorm2d"

    def first_args(self, ctx, call):
        subclass = _same_file_class(ctx, call.func)
        if subclass is not None:
            return conv2d_subclass_args(ctx, call, subclass)
        args = call_arguments(call, CONV_SIG)
        for name in ("device", "dtype"):
            if name in args:
                raise Skip(f"Conv2d passes {name}=, which the fused kernel does not take")
        # Positional arguments stay positional, keywords stay keywords: Conv2d's signature.
        positional = [arg_text(ctx, a) for a in call.args]
        keywords = [(kw.arg, arg_text(ctx, kw.value)) for kw in call.keywords]
        return positional, keywords


# ---------------------------------------------------------------- nn.Conv2d subclasses of the file
#
# The matcher treats a same-file ``class X(nn.Conv2d)`` that defines nothing but ``__init__`` as a
# Conv2d (EfficientNet's ``EfficientNetDepthwiseConv2d``). The fused module must be built from the
# Conv2d arguments that constructor ends up passing, not from its own arguments:
#
#     class EfficientNetDepthwiseConv2d(nn.Conv2d):
#         def __init__(self, in_channels, depth_multiplier=1, kernel_size=3, stride=1, padding=0,
#                      dilation=1, bias=True, padding_mode="zeros"):
#             out_channels = in_channels * depth_multiplier
#             super().__init__(in_channels=in_channels, out_channels=out_channels, ...,
#                              groups=in_channels, ...)
#
#     self.depthwise_conv = EfficientNetDepthwiseConv2d(in_dim, kernel_size=k, stride=s, padding=p, bias=False)
#  => self.depthwise_conv = FusedConv2dBatchNorm2d(in_channels=in_dim, out_channels=in_dim,
#         kernel_size=k, stride=s, padding=p, dilation=1, groups=in_dim, bias=False, padding_mode="zeros", ...)
#
# The call's arguments are bound to the subclass's parameters (literal defaults fill the rest),
# local assignments are substituted, and the ``super().__init__`` arguments are rewritten in
# terms of the call site's expressions. Anything else — other statements or methods, ``*args``,
# non-literal defaults, reads of anything but parameters and locals, a call-site expression with
# a call in it used twice — skips the match with a reason.

_CONV2D_BASES = {"nn.Conv2d", "torch.nn.Conv2d"}
# Pure expressions a constructor may compute its Conv2d arguments with.
_PURE = (ast.Name, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.IfExp, ast.Compare, ast.BoolOp,
         ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.expr_context)


def _same_file_class(ctx: FileContext, func: ast.expr) -> ast.ClassDef | None:
    """The module-level class of this file that ``func`` (a plain name) constructs."""
    if not isinstance(func, ast.Name):
        return None
    for stmt in ctx.tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == func.id:
            return stmt
    return None


def _conv2d_base(ctx: FileContext, cls: ast.ClassDef) -> bool:
    if len(cls.bases) != 1 or cls.keywords:
        return False
    base = ast.unparse(cls.bases[0])
    if base in _CONV2D_BASES:
        return True
    if base == "Conv2d":  # from torch.nn import Conv2d
        return any(
            isinstance(s, ast.ImportFrom) and s.module == "torch.nn" and any(a.name == "Conv2d" and a.asname is None
                                                                          for a in s.names)
            for s in ctx.tree.body
        )
    return False


def _inherits_everything(cls: ast.ClassDef) -> bool:
    """A class whose body is only a docstring / ``pass``."""
    return not cls.decorator_list and all(
        isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in cls.body
    )


def _super_init_call(stmt: ast.stmt, cls_name: str) -> list | None:
    """Arguments of ``super().__init__(...)``/``nn.Conv2d.__init__(self, ...)``: (args, keywords)."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "__init__"):
        return None
    owner = func.value
    if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
        if owner.args and not (len(owner.args) == 2 and ast.unparse(owner.args[0]) == cls_name
                               and ast.unparse(owner.args[1]) == "self"):
            return None
        return [list(call.args), list(call.keywords)]
    if ast.unparse(owner) in _CONV2D_BASES | {"Conv2d"}:
        if not call.args or not (isinstance(call.args[0], ast.Name) and call.args[0].id == "self"):
            return None
        return [list(call.args[1:]), list(call.keywords)]
    return None


class _Substitute(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.expr]):
        self.env = env

    def visit_Name(self, node: ast.Name):
        return copy.deepcopy(self.env[node.id])


_INT_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _fold(node: ast.expr) -> ast.expr:
    """``x * 1`` -> ``x``; arithmetic on int literals evaluated (``3 // 1`` -> ``3``)."""
    for child_name, child in ast.iter_fields(node):
        if isinstance(child, ast.expr):
            setattr(node, child_name, _fold(child))
    if isinstance(node, ast.BinOp):
        left, right = node.left, node.right
        ints = all(isinstance(x, ast.Constant) and type(x.value) is int for x in (left, right))
        op = _INT_OPS.get(type(node.op))
        if ints and op is not None and not (isinstance(node.op, ast.FloorDiv) and right.value == 0):
            return ast.Constant(op(left.value, right.value))
        if isinstance(node.op, ast.Mult):
            if isinstance(right, ast.Constant) and type(right.value) is int and right.value == 1:
                return left
            if isinstance(left, ast.Constant) and type(left.value) is int and left.value == 1:
                return right
    return node


def _check_pure(node: ast.expr, known: set[str], what: str) -> None:
    for sub in ast.walk(node):
        if not isinstance(sub, _PURE):
            raise Skip(f"{what} is computed with {type(sub).__name__} ({ast.unparse(node)}): not a plain expression")
        if isinstance(sub, ast.Name) and sub.id not in known:
            raise Skip(f"{what} reads {sub.id!r}, which is not a constructor argument")


def conv2d_subclass_args(ctx: FileContext, call: ast.Call, cls: ast.ClassDef) -> tuple[list[str], list[tuple[str, str]]]:
    """Conv2d keyword arguments equivalent to ``cls(<call's arguments>)``, or :class:`Skip`."""
    name = cls.name
    seen = {name}
    while not _conv2d_base(ctx, cls) and _inherits_everything(cls):
        # ``class Deeper(Depthwise): pass`` constructs exactly as its same-file base
        base = _same_file_class(ctx, cls.bases[0]) if len(cls.bases) == 1 and not cls.keywords else None
        if base is None or base.name in seen:
            break
        seen.add(base.name)
        cls = base
    if not _conv2d_base(ctx, cls) or cls.decorator_list:
        raise Skip(f"{name} is not a direct, undecorated subclass of nn.Conv2d")
    body = [s for s in cls.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    inits = [s for s in body if isinstance(s, ast.FunctionDef) and s.name == "__init__"]
    if len(body) != 1 or len(inits) != 1:
        raise Skip(f"{name} defines more than __init__: it may not compute what nn.Conv2d does")
    init = inits[0]
    a = init.args
    if a.vararg or a.kwarg or init.decorator_list:
        raise Skip(f"{name}.__init__ takes *args/**kwargs or is decorated")
    params = [p.arg for p in a.posonlyargs + a.args]
    if not params or params[0] != "self":
        raise Skip(f"{name}.__init__ has no self parameter")
    params = params[1:]
    defaults: dict[str, ast.expr] = dict(zip(params[len(params) - len(a.defaults):], a.defaults))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        if d is not None:
            defaults[p.arg] = d
    for p, d in defaults.items():
        try:
            ast.literal_eval(d)
        except ValueError:
            raise Skip(f"{name}.__init__: the default of {p} is not a literal") from None
    # Bind the call's arguments to the constructor's parameters.
    posonly = {p.arg for p in a.posonlyargs}
    env: dict[str, ast.expr] = {}
    if len(call.args) > len(params):
        raise Skip(f"{name}(...) passes more positional arguments than {name}.__init__ takes")
    for param, arg in zip(params, call.args):
        if isinstance(arg, ast.Starred):
            raise Skip(f"{name}(...) is called with *args")
        env[param] = arg
    keyword_names = set(params) - posonly | {p.arg for p in a.kwonlyargs}
    for arg in list(call.args) + [kw.value for kw in call.keywords]:
        # Its expression is copied wherever the constructor uses the parameter (maybe several
        # times, maybe never): only call-free expressions can be copied or dropped safely.
        if has_call(arg):
            raise Skip(f"{name}(...) argument {ast.unparse(arg)} contains a call")
    for kw in call.keywords:
        if kw.arg is None:
            raise Skip(f"{name}(...) is called with **kwargs")
        if kw.arg not in keyword_names or kw.arg in env:
            raise Skip(f"{name}(...) passes {kw.arg}= that {name}.__init__ does not take once")
        env[kw.arg] = kw.value
    for param in params + [p.arg for p in a.kwonlyargs]:
        if param not in env:
            if param not in defaults:
                raise Skip(f"{name}(...) does not pass the required {param}")
            env[param] = defaults[param]
    # Walk the body: docstring, plain local assignments, then the super().__init__ call last.
    statements = [s for s in init.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not statements:
        raise Skip(f"{name}.__init__ does not call nn.Conv2d.__init__")
    *locals_, last = statements
    super_args = _super_init_call(last, name)
    if super_args is None:
        raise Skip(f"{name}.__init__ does not end with super().__init__(...)")
    for stmt in locals_:
        target = simple_assign_target(stmt)
        if target is None or not isinstance(stmt, ast.Assign) or target == "self":
            raise Skip(f"{name}.__init__ line {stmt.lineno} is not a plain local assignment")
        _check_pure(stmt.value, set(env), f"{name}.__init__ local {target}")
        env[target] = _fold(_Substitute(env).visit(copy.deepcopy(stmt.value)))
    positional, keywords = super_args
    conv_args: dict[str, ast.expr] = {}
    if len(positional) > len(CONV_SIG) or any(isinstance(x, ast.Starred) for x in positional):
        raise Skip(f"{name}.__init__ passes *args to nn.Conv2d")
    for param, value in zip(CONV_SIG, positional):
        conv_args[param] = value
    for kw in keywords:
        if kw.arg is None or kw.arg not in CONV_SIG or kw.arg in conv_args:
            raise Skip(f"{name}.__init__ passes {kw.arg or '**kwargs'} to nn.Conv2d")
        conv_args[kw.arg] = kw.value
    for required in ("in_channels", "out_channels", "kernel_size"):
        if required not in conv_args:
            raise Skip(f"{name}.__init__ does not pass {required} to nn.Conv2d")
    for extra in ("device", "dtype"):
        if extra in conv_args:
            raise Skip(f"{name}.__init__ passes {extra}=, which the fused kernel does not take")
    out: list[tuple[str, str]] = []
    # expressions written in the file (call-site arguments, literal defaults) keep their text
    written = {id(x) for x in list(call.args) + [kw.value for kw in call.keywords] + list(defaults.values())}
    for param in CONV_SIG:
        if param not in conv_args:
            continue
        value = conv_args[param]
        _check_pure(value, set(env), f"the {param} {name} passes to nn.Conv2d")
        if isinstance(value, ast.Name) and id(env[value.id]) in written:
            text = arg_text(ctx, env[value.id])
        else:
            text = ast.unparse(_fold(_Substitute(env).visit(copy.deepcopy(value))))
        out.append((param, text))
    return [], out


class LinearBatchNorm(_LayerBatchNorm):
    rule = "Linear_BatchNorm"
    kernel = "FusedLinearBatchNorm1d"
    first_suffix = "Linear"
    bn_suffix = "BatchNorm1d"

    def first_args(self, ctx, call):
        args = call_arguments(call, LINEAR_SIG)
        for name in ("device", "dtype"):
            if name in args:
                raise Skip(f"Linear passes {name}=, which the fused kernel does not take")
        if "in_features" not in args or "out_features" not in args:
            raise Skip("Linear without in/out features")
        positional = [arg_text(ctx, args["in_features"]), arg_text(ctx, args["out_features"])]
        keywords = [("bias", arg_text(ctx, args["bias"]))] if "bias" in args else []
        return positional, keywords
