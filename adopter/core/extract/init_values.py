"""What an expression in ``__init__`` may hold: candidate ``(type, args, activation key, site)``
values of a layer construction, a class reference (``norm_layer = nn.LayerNorm``), an
``ACT2FN[...]``/``get_activation(...)`` lookup, a ``functools.partial`` of a class; factory
functions and methods of the file (or of a module of its package) followed into their bodies,
their parameters bound as the call binds them and ``if`` tests on constant parameters decided
(:func:`_fold`). A mixin of :class:`adopter.core.extract.init_bindings._InitExtractor`, whose state
it reads."""

from __future__ import annotations

import ast

from adopter.core.dsl import Arg, Const
from adopter.core.extract.init_containers import _SEQUENTIAL
from adopter.core.extract.symbols import _activation_instance, _activation_type, _dotted, _File, next_base
from adopter.core.extract.values import _unparse
from adopter.core.syntax import walk


class _NotNone:
    """A factory parameter the call binds to a class (its default, or a class it passes): no
    constant, but not None either — ``if norm_layer is not None:`` is decided with it."""

    def __repr__(self) -> str:
        return "<a class>"

    def __bool__(self) -> bool:
        return True


NOT_NONE = _NotNone()


class _Unknown:
    """An element of a :class:`KnownList` whose value the call does not write as a constant."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN_ELEMENT = _Unknown()


class KnownList:
    """A factory parameter the call binds to a list or tuple it writes out (``MLP(d, [4 * d, d])``):
    how many elements it has, each a constant or :data:`UNKNOWN_ELEMENT`. Bound only when the
    factory never changes it (:func:`_only_read`), so a ``for`` over it can be unrolled
    (``_InitExtractor.unrolled``); never equal to a constant, true when not empty."""

    def __init__(self, items: tuple):
        self.items = items

    def __repr__(self) -> str:
        return f"<list of {len(self.items)}>"

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)


_SEQUENTIAL_NAMES = (_SEQUENTIAL, "torch.nn.modules.container.Sequential")
# Nesting of factory functions followed from ``__init__`` (``conv_bn`` -> ``conv3x3`` -> ...).
_MAX_FACTORY_DEPTH = 6
# Classes between an nn.Sequential subclass of another file and nn.Sequential, each passing its
# arguments on with ``super().__init__(...)`` (torchvision: Conv2dNormActivation -> ConvNormActivation)
_MAX_SEQUENTIAL_CHAIN = 4


def _only_read(fn: ast.FunctionDef, name: str) -> bool:
    """``name`` is only read in ``fn``: iterated, indexed or sliced, measured with ``len`` — never
    rebound, changed (``append``, ``x[0] = ...``, ``del``) or handed to a call that might change it."""
    allowed = set()
    for n in walk(fn):
        t = type(n)
        if t is ast.Subscript and type(n.ctx) is ast.Load and type(n.value) is ast.Name:
            allowed.add(id(n.value))
        elif t in (ast.For, ast.comprehension) and type(n.iter) is ast.Name:
            allowed.add(id(n.iter))
        elif t is ast.Call and type(n.func) is ast.Name and n.func.id == "len" and len(n.args) == 1 \
                and type(n.args[0]) is ast.Name:
            allowed.add(id(n.args[0]))
    return all(id(n) in allowed for n in walk(fn) if type(n) is ast.Name and n.id == name)


def int_constant(e: ast.AST, consts: dict[str, object]) -> int | None:
    """An ``int`` the expression is for certain: a literal (``-1`` too), a parameter holding one,
    ``len`` of a :class:`KnownList`; None otherwise."""
    t = type(e)
    if t is ast.Constant:
        v = e.value
    elif t is ast.UnaryOp and type(e.op) is ast.USub and type(e.operand) is ast.Constant:
        v = e.operand.value
        v = -v if type(v) is int else None
    elif t is ast.Name:
        v = consts.get(e.id)
    elif t is ast.Call and type(e.func) is ast.Name and e.func.id == "len" and len(e.args) == 1 \
            and not e.keywords and type(e.args[0]) is ast.Name and isinstance(consts.get(e.args[0].id), KnownList):
        v = len(consts[e.args[0].id])
    else:
        v = None
    return v if type(v) is int else None


def _const_args(call: ast.Call) -> tuple[Arg, ...]:
    out = []
    for a in call.args:
        if type(a) is ast.Starred:
            out.append(Arg(Const("*" + _unparse(a.value))))
        else:
            out.append(Arg(Const(_unparse(a))))
    for k in call.keywords:
        if k.arg is None:
            out.append(Arg(Const("**" + _unparse(k.value))))
        else:
            out.append(Arg(Const(_unparse(k.value)), k.arg))
    return tuple(out)


def _positional_params(fn: ast.FunctionDef, skip_self: bool) -> list[ast.arg]:
    a = fn.args
    params = list(a.posonlyargs) + list(a.args)
    return params[1:] if skip_self and params else params


def _defaults(fn: ast.FunctionDef) -> list[tuple[ast.arg, ast.expr]]:
    """(parameter, default expression) of every parameter of ``fn`` that has a default."""
    a = fn.args
    params = _positional_params(fn, skip_self=False)
    pairs = list(zip(params[len(params) - len(a.defaults):], a.defaults)) if a.defaults else []
    return pairs + [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]


def _constant_defaults(fn: ast.FunctionDef) -> dict[str, object]:
    """Parameters of ``fn`` whose default is a constant (``activation: str = "gelu"``)."""
    return {p.arg: d.value for p, d in _defaults(fn) if type(d) is ast.Constant}


def _fold(test: ast.AST, consts: dict[str, object]) -> bool | None:
    """The value of an ``if`` test over constant parameters (``activation == "gelu"``,
    ``name in ("relu", "gelu")``, ``not flag``), or None when it depends on anything else."""
    t = type(test)
    if t is ast.Name:
        return bool(consts[test.id]) if test.id in consts else None
    if t is ast.UnaryOp and type(test.op) is ast.Not:
        inner = _fold(test.operand, consts)
        return None if inner is None else not inner
    if t is ast.Compare and len(test.ops) == 1 and type(test.left) is ast.Name and test.left.id in consts:
        left, op, right = consts[test.left.id], type(test.ops[0]), test.comparators[0]
        if type(right) is ast.Constant:
            if op in (ast.Eq, ast.Is):
                return left == right.value
            if op in (ast.NotEq, ast.IsNot):
                return left != right.value
        if type(right) in (ast.Tuple, ast.List, ast.Set) and all(type(e) is ast.Constant for e in right.elts):
            values = [e.value for e in right.elts]
            if op is ast.In:
                return left in values
            if op is ast.NotIn:
                return left not in values
    return None


class _InitValues:
    """Value resolution and factories of :class:`~adopter.core.extract.init_bindings._InitExtractor`."""

    def parameter_defaults(self, fn: ast.FunctionDef) -> dict[str, list[tuple]]:
        """Parameters whose default is a class (``norm_layer: Type = nn.BatchNorm2d``,
        ``act_layer=partial(nn.GELU, approximate="tanh")``): the class unless a caller passes
        another (what a caller in another file passes is unknown here; the trace says)."""
        out = {}
        for p, d in _defaults(fn):
            refs = self.class_refs(d) if type(d) in (ast.Name, ast.Attribute, ast.Call, ast.IfExp) else []
            if refs:
                out[p.arg] = refs
        return out

    def bound_parameters(self, fn: ast.FunctionDef, call: ast.Call, skip_self: bool,
                         home: _File | None = None) -> tuple[dict, dict]:
        """Parameters of a factory ``fn`` (defined in ``home``, else this file) as ``call``
        (evaluated in the current scope) binds them: ``(layers, constants)`` — class references and
        constructed layers passed in, else the defaults (read with the names of ``fn``'s module);
        constants the call writes, else the factory's constant defaults."""
        home = home or self.fc
        out = self.in_module_scope(home, lambda: self.parameter_defaults(fn))
        a = fn.args
        names = [p.arg for p in _positional_params(fn, skip_self)]
        passed: list[tuple[str, ast.AST]] = []
        for i, arg in enumerate(call.args):
            if type(arg) is ast.Starred:
                break
            if i < len(names):
                passed.append((names[i], arg))
        known = set(names) | {p.arg for p in a.kwonlyargs}
        passed += [(k.arg, k.value) for k in call.keywords if k.arg in known]
        consts = _constant_defaults(fn)
        for name, arg in passed:
            if type(arg) is ast.Constant:
                consts[name] = arg.value
            elif type(arg) is ast.Name and arg.id in self.consts:
                consts[name] = self.consts[arg.id]
            elif type(arg) in (ast.List, ast.Tuple) and not any(type(e) is ast.Starred for e in arg.elts) \
                    and _only_read(fn, name):
                consts[name] = KnownList(tuple(self.element_value(e) for e in arg.elts))
            else:
                consts.pop(name, None)
        for name, arg in passed:
            vals = [v for v in self.values(arg) if v[3] is not None]
            refs = self.class_refs(arg) if type(arg) in (ast.Name, ast.Attribute, ast.Call, ast.IfExp) else []
            if vals or refs:
                out[name] = vals + refs
                if refs and self.names_a_class(arg):
                    consts[name] = NOT_NONE  # ``norm_layer=nn.BatchNorm2d``, ``partial(...)``
            else:
                out.pop(name, None)  # a value we cannot resolve: unknown, not the default
        given = {name for name, _arg in passed}
        class_defaults = self.in_module_scope(home, lambda: [p.arg for p, d in _defaults(fn) if self.names_a_class(d)])
        for name in class_defaults:
            if name in out and name not in given:
                # the class default the call leaves in place: ``if norm_layer is not None:`` holds
                consts.setdefault(name, NOT_NONE)
        return out, consts

    def in_module_scope(self, home: _File, evaluate):
        """``evaluate()`` with the names of ``home``'s module alone (a function's defaults)."""
        saved = (self.fc, self.cls, self.local, self.consts, self.lists)
        self.fc, self.cls, self.local, self.consts, self.lists = home, None, {}, {}, {}
        try:
            return evaluate()
        finally:
            self.fc, self.cls, self.local, self.consts, self.lists = saved

    def call_args(self, call: ast.Call) -> tuple[Arg, ...]:
        """The arguments of a layer construction as written, a parameter of the factory being
        evaluated that its call binds to a bool, None or number written as that constant
        (``nn.Linear(d, h, bias=bias)`` of ``MLP(..., bias=False)``: ``bias=False``)."""
        args = _const_args(call)
        if not self.consts:
            return args
        out = []
        for arg, node in zip(args, [*call.args, *(k.value for k in call.keywords)]):
            if type(node) is ast.Name and node.id in self.consts:
                value = self.consts[node.id]
                if value is None or type(value) in (bool, int, float):
                    arg = Arg(Const(repr(value)), arg.keyword)
            out.append(arg)
        return tuple(out)

    def element_value(self, e: ast.AST) -> object:
        """An element of a list a call writes out: its constant, else :data:`UNKNOWN_ELEMENT`."""
        if type(e) is ast.Constant:
            return e.value
        if type(e) is ast.Name and e.id in self.consts and not isinstance(self.consts[e.id], KnownList):
            return self.consts[e.id]
        return UNKNOWN_ELEMENT

    def iteration_values(self, it: ast.AST, limit: int) -> list | None:
        """The values a ``for`` over ``it`` takes, when a call settles how many (a :class:`KnownList`
        parameter, a constant slice of one, ``range`` of ints the call passes), at most ``limit``;
        None otherwise (the loop stands for any number of iterations)."""
        t = type(it)
        if t is ast.Name and isinstance(self.consts.get(it.id), KnownList):
            out = list(self.consts[it.id].items)
        elif t is ast.Subscript and type(it.slice) is ast.Slice and type(it.value) is ast.Name \
                and isinstance(self.consts.get(it.value.id), KnownList):
            bounds = []
            for b in (it.slice.lower, it.slice.upper, it.slice.step):
                v = None if b is None else int_constant(b, self.consts)
                if b is not None and v is None:
                    return None
                bounds.append(v)
            if bounds[2] == 0:
                return None
            out = list(self.consts[it.value.id].items[slice(*bounds)])
        elif t is ast.Call and type(it.func) is ast.Name and it.func.id == "range" and 1 <= len(it.args) <= 3 \
                and not it.keywords and not self.shadowed("range"):
            bounds = [int_constant(a, self.consts) for a in it.args]
            if None in bounds or (len(bounds) == 3 and bounds[2] == 0):
                return None
            r = range(*bounds)
            if len(r) > limit:
                return None  # (before a list of it is made)
            out = list(r)
        else:
            return None
        return out if len(out) <= limit else None

    def shadowed(self, builtin: str) -> bool:
        """A builtin's name is bound to something else in the scope being evaluated."""
        fc = self.fc
        return builtin in self.local or builtin in self.lists or builtin in fc.imports or builtin in fc.functions \
            or builtin in fc.classes

    def names_a_class(self, e: ast.AST) -> bool:
        """``e`` is a class reference, never None: a dotted name of a class (not a local, which a
        branch may have left None) or ``partial(Class, ...)``."""
        if type(e) is ast.Call:
            return bool(e.args) and self.is_partial(e.func) and self.names_a_class(e.args[0])
        if type(e) is ast.Name:
            return e.id not in self.local and e.id not in self.consts and bool(self.callee_types(e))
        return type(e) is ast.Attribute and bool(self.callee_types(e))

    def factory_values(self, fn: ast.FunctionDef, call: ast.Call, owner: str | None, home: _File | None = None) -> list[tuple]:
        """What a factory function/method defined in this file (or, ``home``, another module of
        its package) returns when ``call`` calls it (``conv3x3(inplanes, planes)`` ->
        ``nn.Conv2d(...)`` built in its body). The sites are the constructions inside the
        factory; [] when nothing resolves."""
        if fn.name in self.visiting or len(self.visiting) > _MAX_FACTORY_DEPTH:
            return []
        params, consts = self.bound_parameters(fn, call, skip_self=owner is not None, home=home)
        if home is not None:
            # the body is evaluated with its own module's names; what it builds is noted there
            saved_fc, saved_cls = self.fc, self.cls
            self.fc, self.cls = home, None
            try:
                return self.factory_values_in_scope(fn, params, consts, owner)
            finally:
                self.fc, self.cls = saved_fc, saved_cls
        return self.factory_values_in_scope(fn, params, consts, owner)

    def factory_values_in_scope(self, fn: ast.FunctionDef, params: dict, consts: dict, owner: str | None) -> list[tuple]:
        saved = (self.qual, self.local, self.lists, self.self_name, self.stmt, self.returns, self.consts)
        saved_alias, self.attr_alias = self.attr_alias, {}
        self.consts = consts
        self.visiting.add(fn.name)
        self.qual = f"{owner}.{fn.name}" if owner else fn.name
        self.local, self.lists, self.returns = params, {}, []
        if owner is None:
            self.self_name = "self"
        try:
            self.block(fn.body, True)
            return self.returns
        finally:
            self.visiting.discard(fn.name)
            self.qual, self.local, self.lists, self.self_name, self.stmt, self.returns, self.consts = saved
            self.attr_alias = saved_alias

    def callee_types(self, f) -> list[str]:
        t = type(f)
        if t is ast.Name:
            if f.id in self.local:
                return [v[0] for v in self.local[f.id] if v[3] is None]
            if f.id in self.fc.partials:
                return self.callee_types(self.fc.partials[f.id])
            if f.id in self.fc.classes:
                return [self.fc.class_type(f.id)]
            if f.id in self.fc.local_class_alias:
                return [self.fc.class_type(self.fc.local_class_alias[f.id])]
            if f.id in self.fc.functions:
                return [f"{self.fc.module}.{f.id}"]
            fq = self.fc.imports.get(f.id) or self.fc.star_name(f.id)
            return [self.fc.layer_type(fq)] if fq else []
        if t is ast.Attribute:
            d = _dotted(f)
            if d is not None and not d.startswith(self.self_name + "."):
                fq = self.fc.fqn(d)
                return [self.fc.layer_type(fq)] if fq else []
            if self.cls is not None and d is not None and d.count(".") == 1:
                # ``self._norm_layer`` holding a class ``__init__`` stored before
                return [ty for ty, _a, _k, site in self.cls.class_attrs.get(d.split(".")[1], ()) if site is None]
            return []
        if t is ast.IfExp:
            taken = _fold(f.test, self.consts) if self.consts else None
            if taken is not None:  # ``LoRALinear if lora else nn.Linear`` with ``lora`` a constant
                return self.callee_types(f.body if taken else f.orelse)
            return self.callee_types(f.body) + self.callee_types(f.orelse)
        if t is ast.Call and f.args and self.is_partial(f.func):
            # ``partial(nn.BatchNorm2d, eps=1e-3)``: a class with some arguments bound
            return self.callee_types(f.args[0])
        if t is ast.Call:
            # ``get_norm_act_layer("batchnorm")``: a factory (of this file or another module) that
            # returns classes
            return list(dict.fromkeys(ty for ty, _a, _k, site in self.factory_call(f) if site is None))
        if t is ast.Subscript and type(f.value) is ast.Name and f.value.id in self.fc.dicts:
            d = self.fc.dicts[f.value.id]
            key = f.slice
            vals = d.values
            if type(key) is ast.Constant:
                vals = [v for k, v in zip(d.keys, d.values) if type(k) is ast.Constant and k.value == key.value]
            out = []
            for v in vals:
                for ty in self.callee_types(v):
                    if ty not in out:
                        out.append(ty)
            return out
        return []

    def is_partial(self, expr) -> bool:
        d = _dotted(expr)
        return d is not None and (self.fc.fqn(d) or d) == "functools.partial"

    def is_act2fn(self, expr) -> bool:
        d = _dotted(expr)
        if d is None:
            return False
        fq = self.fc.fqn(d) or d
        return fq.rsplit(".", 1)[-1] == "ACT2FN"

    def values(self, v) -> list[tuple]:
        """Candidate (type, args, activation, layer-holder-call) for an assigned value."""
        t = type(v)
        if t is ast.Call:
            f = v.func
            if type(f) is ast.Subscript and self.is_act2fn(f.value):
                ty, args, key = _activation_type(f.slice)
                return [(ty, args, key, v)]
            fd = _dotted(f)
            fq = (self.fc.fqn(fd) if fd else None) or fd or ""
            if fq.rsplit(".", 1)[-1] == "get_activation" and v.args:
                ty, args, key = _activation_type(v.args[0])
                return [(ty, args, key, v)]
            if type(f) is ast.Name and f.id in self.local:
                # calling a local that holds a class (``attention_class(config)``)
                return [(ty, self.call_args(v), None, v) for ty, a, k, site in self.local[f.id] if site is None]
            if type(f) is ast.Name and f.id in self.fc.functions and f.id not in self.fc.classes:
                made = self.built(self.factory_values(self.fc.functions[f.id], v, None))
                if made:
                    return made
            method = self.own_method(f)
            if method is not None:
                made = self.built(self.factory_values(method, v, self.cls.name))
                if made:
                    return made
            out = [(ty, self.call_args(v), None, v) for ty in self.callee_types(f)]
            if len(out) == 1 and not out[0][0].startswith("torch."):
                found = self.fc.package_definition(out[0][0])
                if found is not None and not isinstance(found[1], ast.ClassDef):
                    made = self.built(self.factory_values(found[1], v, None, found[0]))
                    if made:
                        return [self.called_here(m, v) for m in made]
                elif found is not None and found[0] is not self.fc:
                    made = self.foreign_sequential(found[0], found[1], v)
                    if made:
                        return made
            if any(ty == _SEQUENTIAL for ty, _a, _k, _s in out):
                self.note_sequential(v)
            return out
        if t is ast.Subscript and self.is_act2fn(v.value):
            ty, args, key = _activation_type(v.slice)
            return [(ty, args, key, v)]
        if t is ast.IfExp:
            taken = _fold(v.test, self.consts) if self.consts else None
            if taken is not None:  # a factory's ``A(i, o) if flag else B(i, o)`` with a constant flag
                return self.values(v.body if taken else v.orelse)
            return self.values(v.body) + self.values(v.orelse)
        if t is ast.BoolOp:
            return [x for operand in v.values for x in self.values(operand)]
        if t is ast.Name:
            if v.id in self.local:
                return [x for x in self.local[v.id] if x[3] is not None]
            fq = self.fc.imports.get(v.id)
            if fq and v.id not in self.fc.classes:
                return [(_activation_instance(fq) or fq, (), None, v)]
            if v.id in self.fc.functions:
                return [(f"{self.fc.module}.{v.id}", (), None, v)]
            return []
        if t is ast.Attribute:
            d = _dotted(v)
            if d is not None and not d.startswith(self.self_name + "."):
                fq = self.fc.fqn(d)
                if fq and (fq.startswith("torch.") or fq.startswith("transformers.activations")):
                    return [(fq, (), None, v)]
            elif d is not None and d.count(".") == 1:
                # ``nn.Sequential(self.conv1, self.bn1)``: a layer this __init__ bound before
                attr = "self." + d.split(".")[1]
                return [(b.layer.type, b.layer.args, b.activation, v)
                        for b in self.out if b.attr == attr and b.container is None]
            return []
        return []

    def foreign_sequential(self, home: _File, node: ast.ClassDef, call: ast.Call) -> list[tuple]:
        """``call`` builds an ``nn.Sequential`` subclass of another file that defines only
        ``__init__`` and fills itself with ``super().__init__(...)`` (torchvision's
        ``Conv2dNormActivation`` style), maybe through classes between it and nn.Sequential that do
        the same (``Conv2dNormActivation`` -> ``ConvNormActivation``): its ``__init__`` evaluated
        there with ``call``'s arguments, each ``super().__init__(...)`` running its base's with the
        arguments it passes, the children the last one passes found again under ``call``; [] for
        anything else."""
        if self.loop_depth > 8:
            return []
        chain = self.sequential_chain(home, node)
        if chain is None:
            return []
        contexts = [where.classes.get(n.name) for where, n, _init, _super in chain]
        if any(c is None for c in contexts):
            return []
        contexts[-1].bases = (_SEQUENTIAL,)
        first_home, _node, init, _super = chain[0]
        params, consts = self.bound_parameters(init, call, skip_self=True, home=first_home)
        saved = (self.fc, self.cls, set(self.visiting), self.foreign_init, dict(self.foreign_chain))
        self.fc, self.cls, self.foreign_init = first_home, contexts[0], True
        for (_h, _n, _i, super_call), (base_home, _b, base_init, _s), base_cls in zip(chain, chain[1:], contexts[1:]):
            self.foreign_chain[id(super_call)] = (base_home, base_cls, base_init)
        builds = self.fc.read_seq_builds
        try:
            self.factory_values_in_scope(init, params, consts, contexts[0].name)
        finally:
            self.fc, self.cls, self.visiting, self.foreign_init, self.foreign_chain = saved
        # taken away: another call of the class builds its own children, never merged into these
        built = builds.pop(id(chain[-1][3]), None)
        if built is None:
            return []
        builds[id(call)] = built
        return [(_SEQUENTIAL, _const_args(call), None, call)]

    def sequential_chain(self, home: _File, node: ast.ClassDef) -> list[tuple] | None:
        """``[(file, class, its __init__, its super().__init__ call)]`` from ``node`` down to the
        class deriving from ``nn.Sequential``, when each defines nothing but an ``__init__`` calling
        ``super().__init__`` once and derives from the next alone; None otherwise."""
        chain: list[tuple] = []
        for _ in range(_MAX_SEQUENTIAL_CHAIN):
            if len(node.bases) != 1 or node.keywords:
                return None
            methods = {st.name: st for st in node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))}
            init = methods.get("__init__")
            if init is None or set(methods) != {"__init__"}:
                return None
            supers = [n for n in walk(init) if type(n) is ast.Call and type(n.func) is ast.Attribute
                      and n.func.attr == "__init__" and type(n.func.value) is ast.Call
                      and _dotted(n.func.value.func) == "super" and not n.func.value.args]
            if len(supers) != 1:
                return None
            chain.append((home, node, init, supers[0]))
            base = next_base(home, node, _SEQUENTIAL_NAMES.__contains__)
            if base is None:
                return None
            if type(base) is not tuple:
                return chain  # (nn.Sequential reached)
            home, node = base
        return None

    def foreign_base_init(self, call: ast.Call) -> bool:
        """``super().__init__(...)`` of a class between another file's nn.Sequential subclass and
        nn.Sequential (:meth:`foreign_sequential`): its base's ``__init__`` evaluated with the
        arguments it passes (in the base's module); False for any other call."""
        target = self.foreign_chain.get(id(call))
        if target is None:
            return False
        home, cls, init = target
        params, consts = self.bound_parameters(init, call, skip_self=True, home=home)
        saved = (self.fc, self.cls, set(self.visiting))
        self.fc, self.cls = home, cls
        try:
            self.factory_values_in_scope(init, params, consts, cls.name)
        finally:
            self.fc, self.cls, self.visiting = saved
        return True

    def called_here(self, made: tuple, call: ast.Call) -> tuple:
        """A layer another file's factory builds, placed at ``call`` (its call in this file); an
        ``nn.Sequential`` built there is found again under ``call`` (its entries as resolved there)."""
        ty, args, key, site = made
        builds = self.fc.read_seq_builds
        if id(site) in builds:
            builds[id(call)] = builds[id(site)]
        return (ty, args, key, call)

    @staticmethod
    def built(made: list[tuple]) -> list[tuple]:
        """The constructions among a factory's returns (not the classes it returns)."""
        return [v for v in made if v[3] is not None]

    def factory_call(self, call: ast.Call) -> list[tuple]:
        """What the factory ``call`` calls returns (constructions and classes), when it is a
        function of this file, a method of the class or a function of another module; []
        otherwise."""
        f = call.func
        if type(f) is ast.Name and f.id in self.fc.functions and f.id not in self.fc.classes:
            return self.factory_values(self.fc.functions[f.id], call, None)
        method = self.own_method(f)
        if method is not None:
            return self.factory_values(method, call, self.cls.name)
        if type(f) is ast.Name and (f.id in self.local or f.id in self.fc.classes):
            return []
        d = _dotted(f)
        if d is None or d.startswith(self.self_name + "."):
            return []
        fq = self.fc.fqn(d)
        if fq is None or fq.startswith("torch.") or not fq.rsplit(".", 1)[-1][:1].islower():
            return []
        found = self.fc.package_function(fq)
        return self.factory_values(found[1], call, None, found[0]) if found is not None else []

    def own_method(self, f) -> ast.FunctionDef | None:
        """``self.<m>`` of a method defined in this class or a same-file base (``self._make_layer``)."""
        if self.cls is None or type(f) is not ast.Attribute or type(f.value) is not ast.Name:
            return None
        if f.value.id != self.self_name:
            return None
        fdef, _owner = self.cls.find_method(f.attr)
        return fdef

    def class_refs(self, v) -> list[tuple]:
        """A local bound to a class/function (``attention_class = A if c else B``)."""
        return [(ty, None, None, None) for ty in self.callee_types(v)]
