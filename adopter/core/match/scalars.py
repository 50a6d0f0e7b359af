"""Which ``self.<attr>`` values are Python numbers, read from the class's ``__init__`` (never run):
``self.scale = dim ** -0.5``, ``self.scale = 1 / math.sqrt(head_dim)``. Shape and rank reasoning
needs it: ``t * self.scale`` has the rank of ``t`` when ``self.scale`` is a number, while a tensor
operand may broadcast to a higher rank. Anything not settled by the source is not a number."""

from __future__ import annotations

import ast

from adopter.core.match.context import MatchContext
from adopter.core.match.source import parse_file, same_file_lineage
from adopter.core.syntax import dotted_name, walk

# ``math`` functions that convert their arguments with ``__float__`` and return a Python float
# (``math.floor``/``ceil``/``trunc``/``prod`` hand back what the argument's own method returns)
_MATH_FLOATS = frozenset({"sqrt", "log", "log2", "log10", "log1p", "exp", "pow", "fabs", "cos", "sin", "tan"})
_NUMBER_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
# torch factories whose positional arguments, when there are several, are each one int size; and
# the ``torch.nn`` layers whose two leading arguments are int widths (not ``LayerNorm``: its
# ``normalized_shape`` may be a sequence; not ``Dropout``: a probability)
_SIZE_FACTORIES = frozenset({"torch.randn", "torch.rand", "torch.zeros", "torch.ones", "torch.empty"})
_WIDTH_LAYERS = frozenset({
    "Linear", "Embedding", "EmbeddingBag", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm", "MultiheadAttention", "LSTM",
    "GRU", "RNN",
})
_SIZE_KEYWORDS = frozenset({
    "in_features", "out_features", "num_embeddings", "embedding_dim", "in_channels", "out_channels",
    "embed_dim", "num_features", "num_channels", "num_groups", "hidden_size", "input_size",
})
_MAX_DEPTH = 6


def self_attr_is_number(ctx: MatchContext, text: str) -> bool:
    """``text`` (an expression kept verbatim, ``self.scale``) is a ``self`` attribute the class
    sets once, in ``__init__``'s body (not under a branch or loop), to a Python number: numeric
    literals, arithmetic on numbers, ``float()``/``int()``, ``math.sqrt``-like calls, other such
    attributes and ``__init__`` locals, and constructor parameters the ``__init__`` passes as a
    layer width or a tensor size (an int by torch's signatures). No other store of the attribute
    anywhere in the file (a subclass, another method)."""
    if ctx.cls is None or ctx.source is None or not text.startswith("self."):
        return False
    key = ("self-number", ctx.cls.name, text)
    cache = ctx.file_cache
    if key not in cache:
        cache[key] = _number_attr(ctx, text[len("self."):], 0)
    return cache[key]


def _number_attr(ctx: MatchContext, attr: str, depth: int) -> bool:
    if not attr.isidentifier() or depth > _MAX_DEPTH:
        return False
    tree = parse_file(ctx.source)
    if tree is None:
        return False
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ctx.cls.name]
    if len(classes) != 1:
        return False
    lineage = same_file_lineage(tree, classes[0])
    # where a store could reach this class's instances: its lineage, its subclasses in the file,
    # and code outside any class (``model.scale = ...``); other classes' ``self.scale`` do not
    reach = [n for n in tree.body if not isinstance(n, ast.ClassDef)] + [
        c for c in tree.body if isinstance(c, ast.ClassDef)
        and (c in lineage or any(b is classes[0] for b in same_file_lineage(tree, c)))]
    nodes = [n for part in reach for n in walk(part)]
    stores = [n for n in nodes if isinstance(n, ast.Attribute) and n.attr == attr and not isinstance(n.ctx, ast.Load)]
    if len(stores) != 1 or any(isinstance(n, ast.Call) and dotted_name(n.func) == "setattr" for n in nodes):
        return False
    for cls in lineage:
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is None:
            continue
        for st in init.body:  # the top level of the body: the store runs on every construction
            if (isinstance(st, ast.Assign) and len(st.targets) == 1 and st.targets[0] is stores[0]
                    and isinstance(stores[0].value, ast.Name) and stores[0].value.id == "self"):
                return _number(ctx, init, st.value, depth)


def _number(ctx: MatchContext, init: ast.FunctionDef, e: ast.expr, depth: int) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if isinstance(e, ast.Constant):
        return type(e.value) in (int, float)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
        return _number(ctx, init, e.operand, depth + 1)
    if isinstance(e, ast.BinOp) and isinstance(e.op, _NUMBER_OPS):
        return _number(ctx, init, e.left, depth + 1) and _number(ctx, init, e.right, depth + 1)
    if isinstance(e, ast.Subscript) and _is_shape(e.value) and not isinstance(e.slice, ast.Slice):
        return True  # ``x.shape[-1]``: an int (a slice is a torch.Size)
    if isinstance(e, ast.Call):
        if e.keywords or any(isinstance(a, ast.Starred) for a in e.args):
            return False
        if isinstance(e.func, ast.Attribute) and e.func.attr == "size" and len(e.args) == 1:
            return True  # ``x.size(-1)``: an int
        name = dotted_name(e.func) or ""
        head, _, last = name.rpartition(".")
        imports = ctx.structures.imports
        if name in ("float", "int") and name not in imports and len(e.args) == 1:
            return True  # the builtins return Python numbers or raise
        return bool(head) and imports.get(head) == "math" and last in _MATH_FLOATS \
            and all(_number(ctx, init, a, depth + 1) for a in e.args)
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
        return _number_attr(ctx, e.attr, depth + 1)
    if isinstance(e, ast.Name):
        params = [a.arg for a in init.args.posonlyargs + init.args.args[1:] + init.args.kwonlyargs]
        local_stores = [n for n in walk(init) if isinstance(n, ast.Name) and n.id == e.id
                        and not isinstance(n.ctx, ast.Load)]
        if e.id in params:
            return not local_stores and _size_parameter(ctx, init, e.id)
        if len(local_stores) != 1:
            return False
        st = next((s for s in init.body if isinstance(s, ast.Assign) and s.targets == [local_stores[0]]), None)
        if st is None:
            # ``b, c, h, w = x.shape`` (``x.size()``, ``x.shape[-2:]``): each name an int
            st = next((s for s in init.body if isinstance(s, ast.Assign) and len(s.targets) == 1
                       and isinstance(s.targets[0], (ast.Tuple, ast.List))
                       and any(t is local_stores[0] for t in s.targets[0].elts)), None)
            return st is not None and st.lineno < e.lineno and _shape_value(st.value)
        return st.lineno < e.lineno and _number(ctx, init, st.value, depth + 1)


def _is_shape(e: ast.expr) -> bool:
    return isinstance(e, ast.Attribute) and e.attr == "shape"


def _shape_value(e: ast.expr) -> bool:
    """``x.shape``, ``x.shape[a:b]``, ``x.size()``: a torch.Size, whose elements are ints."""
    if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Slice):
        e = e.value
    return _is_shape(e) or (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "size"
                            and not e.args and not e.keywords)


def local_is_number(ctx: MatchContext, text: str, function: ast.AST | None, line: int) -> bool:
    """``text`` (an operand kept verbatim at ``line`` of ``function``) is a Python number by the
    rules of :func:`self_attr_is_number`, its names read from ``function``'s own top-level
    statements: ``int(c) ** -0.5``, ``1 / math.sqrt(d)``, ``c ** -0.5`` after ``b, c, h, w = q.shape``."""
    if function is None or ctx.source is None:
        return False
    try:
        e = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return False
    ast.increment_lineno(e, line - 1)
    return _number(ctx, function, e, 0)


def _size_parameter(ctx: MatchContext, init: ast.FunctionDef, name: str) -> bool:
    """The parameter ``name`` is handed, as it is, to a ``torch.nn`` layer as a width or to a torch
    factory as one of several sizes: an int by those signatures (what else passes there is a
    one-element integer tensor through ``__index__``, which no model hands a layer as its width)."""
    imports = ctx.structures.imports
    for call in walk(init):
        if not isinstance(call, ast.Call):
            continue
        fn = dotted_name(call.func) or ""
        head, _, rest = fn.partition(".")
        fq = ".".join(filter(None, (imports.get(head), rest))) if imports.get(head) else ""
        layer = fq.startswith("torch.nn.") and fq.rsplit(".", 1)[-1] in _WIDTH_LAYERS
        if (fq in _SIZE_FACTORIES and len(call.args) >= 2) or layer:
            positional = call.args if fq in _SIZE_FACTORIES else call.args[:2]
            if any(isinstance(a, ast.Name) and a.id == name for a in positional):
                return True
            if layer and any(k.arg in _SIZE_KEYWORDS and isinstance(k.value, ast.Name) and k.value.id == name
                             for k in call.keywords):
                return True
