"""``__init__`` extraction: the ``self.<attr> = <layer>(...)`` bindings of a class
(:class:`InitBinding`), following ``self._init_x(...)`` helpers and the contents of
``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.dsl import Arg, Const, Layer, Var
from adopter.core.extract.symbols import _activation_instance, _activation_type, _ClassCtx, _dotted, _File, _span
from adopter.core.extract.values import UNKNOWN_TYPE, _unparse
from adopter.core.structures import InitBinding
from adopter.core.syntax import walk

_CONTAINERS = ("torch.nn.ModuleList", "torch.nn.Sequential", "torch.nn.ModuleDict")
_SEQUENTIAL = "torch.nn.Sequential"
_MODULE_DICT = "torch.nn.ModuleDict"
# Nesting of factory functions followed from ``__init__`` (``conv_bn`` -> ``conv3x3`` -> ...).
_MAX_FACTORY_DEPTH = 6


@dataclass
class _Entry:
    """One element of a list being built (``layers.append(norm_layer(c))``) or of a Sequential:
    its candidate values, the expression that builds it, and whether it stands for any number
    of elements (a comprehension, ``*unknown``), after which positions are unknown."""

    values: list
    expr: ast.AST | None
    many: bool = False
    # the child's name: an ``("fc", nn.Linear(...))`` pair of a list that makes an OrderedDict,
    # a key of an OrderedDict filled item by item (``layers["fc"] = nn.Linear(...)``)
    name: str | None = None

    def copy(self) -> "_Entry":
        return _Entry(list(self.values), self.expr, self.many, self.name)


class _ListVar(list):
    """A local list (or ``OrderedDict``) of layers being built, entry by entry (:class:`_Entry`).

    When an ``if`` the source does not decide grows it differently on its branches, ``ways``
    holds what it is on each: ``[(condition, entries)]`` (the list itself keeps every entry of
    every branch, in order, for the bindings of the layers it holds). Entries added afterwards
    go to every way."""

    def __init__(self, entries=(), keyed: bool = False):
        super().__init__(entries)
        self.keyed = keyed  # an OrderedDict: entries carry their names
        self.ways: list[tuple[str, list]] | None = None

    def extend(self, items) -> None:
        items = list(items)
        super().extend(items)
        for _cond, entries in self.ways or ():
            entries.extend(items)

    def append(self, item) -> None:
        self.extend([item])

    def set_item(self, name: str, entry: _Entry) -> None:
        """``od[name] = value``: a new key goes last, an existing one keeps its place."""
        for entries in [self] + [e for _c, e in self.ways or ()]:
            at = next((i for i, e in enumerate(entries) if e.name == name), None)
            if at is None:
                list.append(entries, entry)
            else:
                entries[at] = entry

    def snapshot(self) -> "_ListVar":
        out = _ListVar(self, self.keyed)
        if self.ways is not None:
            out.ways = [(c, list(e)) for c, e in self.ways]
        return out

    def same_as(self, other: "_ListVar") -> bool:
        return self.ways is None and other.ways is None and len(self) == len(other) and all(
            a is b for a, b in zip(self, other))

    def by_way(self, condition: str) -> list[tuple[str, list]]:
        if self.ways is None:
            return [(condition, list(self))]
        return [(f"{condition} and {c}", list(e)) for c, e in self.ways]


# Ways a list may be built (if/else branches) followed before its contents are merged into one.
_MAX_WAYS = 4


@dataclass
class SeqBuildRecord:
    """An ``nn.Sequential(...)`` construction seen while resolving values (see
    :class:`~adopter.core.structures.SequentialBuild`): its entries as resolved where it is built."""

    class_name: str | None
    function: str
    call: ast.Call
    stmt: ast.AST | None
    alternatives: list  # [[(child name or None, _Entry)], ...]: one per distinct way it was built
    # per alternative: the branch conditions it is built under ("" for every way through)
    conditions: list = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.conditions is None:
            self.conditions = [""] * len(self.alternatives)


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


def _calls_super_forward(fn: ast.FunctionDef) -> bool:
    """``forward`` runs the Sequential's own (``super().forward(x)``), adding around it."""
    for node in walk(fn):
        if (
            type(node) is ast.Call and type(node.func) is ast.Attribute and node.func.attr == "forward"
            and type(node.func.value) is ast.Call and _dotted(node.func.value.func) == "super"
        ):
            return True
    return False


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


def _ends_here(st: ast.stmt, consts: dict[str, object]) -> bool:
    """The statement leaves the function on every way through it (in a factory's evaluation)."""
    t = type(st)
    if t in (ast.Return, ast.Raise):
        return True
    if t is ast.If:
        taken = _fold(st.test, consts) if consts else None
        branches = [st.body] if taken is True else [st.orelse] if taken is False else [st.body, st.orelse]
        return all(b and _ends_here(b[-1], consts) for b in branches)
    return False


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


class _InitExtractor:
    """Collects ``self.<attr> = <layer>(...)`` bindings of one ``__init__``."""

    def __init__(self, fc: _File, cls: _ClassCtx | None, fn: ast.FunctionDef, sweep: bool = False):
        self.fc = fc
        self.cls = cls
        self.fn = fn
        self.qual = f"{cls.name}.{fn.name}" if cls is not None else fn.name
        self.out: list[InitBinding] = []
        # local name -> list of (type, args, activation, site expr) it may hold
        self.local: dict[str, list[tuple]] = {}
        # local list name -> its elements in order (:class:`_Entry`)
        self.lists: dict[str, _ListVar] = {}
        is_method = cls is not None and not any(_dotted(d) == "staticmethod" for d in fn.decorator_list)
        self.self_name = fn.args.args[0].arg if fn.args.args and is_method else "self"
        self.stmt = None
        # ``return`` values collected while a factory function is followed (None: not in one)
        self.returns: list | None = None
        # sweep: a function visited only for the Sequentials it builds (nothing is bound on self)
        self.sweep = sweep
        self.visiting: set[str] = set()
        self.loop_depth = 0
        # Sequentials grown with ``add_module``: ``self.features = nn.Sequential()`` then
        # ``self.features.add_module(...)``, or an nn.Sequential subclass's ``super().__init__()``
        # then ``self.add_module(...)``: target text -> id of the call building it
        self.growing: dict[str, int] = {}
        # parameters of a factory holding a constant its caller wrote (``get_act("gelu")``, or
        # the factory's own default when the caller left it out): ``if name == "relu":`` is
        # decided with them. Never ``__init__``'s own defaults: its caller may pass anything.
        self.consts: dict[str, object] = {}
        # (list, its entries on one way): while one way of a branch-grown list is recorded
        self.lists_override: tuple | None = None
        # local name -> the ``self.<attr>`` it was assigned (``m = self.mlp``)
        self.attr_alias: dict[str, str] = {}

    def run(self) -> list[InitBinding]:
        self.visiting = {self.fn.name}
        self.local = self.parameter_defaults(self.fn)
        self.block(self.fn.body, False)
        return self.out

    def is_sequential_subclass(self) -> bool:
        """This class is an ``nn.Sequential`` subclass running its children in order (no
        ``forward`` of its own here or in a same-file base)."""
        if self.cls is None or self.fn.name != "__init__" or self.sweep:
            return False
        for c in self.cls.mro():
            fwd = c.methods.get("forward")
            if fwd is not None and not _calls_super_forward(fwd):
                return False  # its own forward decides what runs
        return any(b == _SEQUENTIAL for c in self.cls.mro() for b in c.bases)

    def own_children(self, call: ast.Call) -> bool:
        """``super().__init__(*layers)`` / ``self.add_module("conv", m)`` of an nn.Sequential
        subclass: its own children, in order (a Sequential built by the class itself)."""
        f = call.func
        if type(f) is not ast.Attribute:
            return False
        if f.attr == "__init__" and type(f.value) is ast.Call and _dotted(f.value.func) == "super":
            if not self.is_sequential_subclass():
                return False
            self.note_sequential(call)
            if not call.args:
                self.growing[self.self_name] = id(call)  # children follow through add_module
            return True
        target = _dotted(f.value)
        if f.attr == "add_module" and target in self.growing and len(call.args) > 1:
            rec = self.fc.seq_builds.get(self.growing[target])
            if rec is not None:
                name = call.args[0].value if type(call.args[0]) is ast.Constant else None
                entry = self.entry(call.args[1])
                known = rec.alternatives[0]
                unknown = name is None or entry.many or any(n is None for n, _e in known)
                known.append((None if unknown else str(name), entry))
        return False  # the binding of the element is recorded as before

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

    def bound_parameters(self, fn: ast.FunctionDef, call: ast.Call, skip_self: bool) -> tuple[dict, dict]:
        """Parameters of a factory ``fn`` as ``call`` (evaluated in the current scope) binds
        them: ``(layers, constants)`` — class references and constructed layers passed in, else
        the defaults; constants the call writes, else the factory's constant defaults."""
        out = self.parameter_defaults(fn)
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
            else:
                consts.pop(name, None)
        for name, arg in passed:
            vals = [v for v in self.values(arg) if v[3] is not None]
            refs = self.class_refs(arg) if type(arg) in (ast.Name, ast.Attribute, ast.Call, ast.IfExp) else []
            if vals or refs:
                out[name] = vals + refs
            else:
                out.pop(name, None)  # a value we cannot resolve: unknown, not the default
        return out, consts

    def factory_values(self, fn: ast.FunctionDef, call: ast.Call, owner: str | None, home: _File | None = None) -> list[tuple]:
        """What a factory function/method defined in this file (or, ``home``, another module of
        its package) returns when ``call`` calls it (``conv3x3(inplanes, planes)`` ->
        ``nn.Conv2d(...)`` built in its body). The sites are the constructions inside the
        factory; [] when nothing resolves."""
        if fn.name in self.visiting or len(self.visiting) > _MAX_FACTORY_DEPTH:
            return []
        params, consts = self.bound_parameters(fn, call, skip_self=owner is not None)
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

    def helper(self, fn: ast.FunctionDef, conditional: bool):
        """``self._init_weights_of_x(config)`` called from ``__init__``: its bindings count too."""
        saved = (self.qual, self.local, self.lists, self.self_name, self.stmt, self.returns, self.consts)
        saved_alias, self.attr_alias = self.attr_alias, {}
        self.consts = {}
        self.visiting.add(fn.name)
        self.qual = f"{self.cls.name}.{fn.name}"
        self.local, self.lists, self.returns = self.parameter_defaults(fn), {}, None
        self.self_name = fn.args.args[0].arg if fn.args.args else "self"
        try:
            self.block(fn.body, conditional)
        finally:
            self.visiting.discard(fn.name)
            self.qual, self.local, self.lists, self.self_name, self.stmt, self.returns, self.consts = saved
            self.attr_alias = saved_alias

    # -- resolution
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
            fq = self.fc.imports.get(f.id)
            return [fq] if fq else []
        if t is ast.Attribute:
            d = _dotted(f)
            if d is not None and not d.startswith(self.self_name + "."):
                fq = self.fc.fqn(d)
                return [fq] if fq else []
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
                return [(ty, _const_args(v), None, v) for ty, a, k, site in self.local[f.id] if site is None]
            if type(f) is ast.Name and f.id in self.fc.functions and f.id not in self.fc.classes:
                made = self.factory_values(self.fc.functions[f.id], v, None)
                if made:
                    return made
            method = self.own_method(f)
            if method is not None:
                made = self.factory_values(method, v, self.cls.name)
                if made:
                    return made
            out = [(ty, _const_args(v), None, v) for ty in self.callee_types(f)]
            if len(out) == 1 and not out[0][0].startswith("torch."):
                found = self.fc.package_function(out[0][0])
                if found is not None:
                    made = self.factory_values(found[1], v, None, found[0])
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

    def own_method(self, f) -> ast.FunctionDef | None:
        """``self.<m>`` of a method defined in this class or a same-file base (``self._make_layer``)."""
        if self.cls is None or type(f) is not ast.Attribute or type(f.value) is not ast.Name:
            return None
        if f.value.id != self.self_name:
            return None
        fdef, _owner = self.cls.find_method(f.attr)
        return fdef

    def note_sequential(self, call: ast.Call) -> None:
        """Record ``nn.Sequential(...)`` built here with its entries resolved in this scope
        (inline, ``*layers`` of a list built before, an ``OrderedDict``)."""
        ways = self.sequential_ways(call)
        if ways is None:
            return
        for condition, entries in ways:
            self.note_way(call, [(n, e.copy()) for n, e in entries], condition)

    def note_way(self, call: ast.Call, entries: list, condition: str) -> None:
        rec = self.fc.seq_builds.get(id(call))
        if rec is None:
            cls_name = self.qual.split(".")[0] if "." in self.qual else None
            self.fc.seq_builds[id(call)] = SeqBuildRecord(cls_name, self.qual, call, self.stmt, [entries], [condition])
            return
        # built again (a factory called from several places, with other arguments): each entry
        # may be any of the values seen; another number of entries is another alternative. The
        # ways of a list grown on the branches of an ``if`` stay apart (each pair of neighbours
        # is one of a way), unless there are too many.
        if condition and len(rec.alternatives) < _MAX_WAYS and condition not in rec.conditions:
            rec.alternatives.append(entries)
            rec.conditions.append(condition)
            return
        for i, known in enumerate(rec.alternatives):
            if len(known) == len(entries) and (rec.conditions[i] == condition or len(rec.alternatives) >= 4):
                for (_n, old), (_m, new) in zip(known, entries):
                    for v in new.values:
                        if all(v[0] != o[0] for o in old.values):
                            old.values.append(v)
                return
        if len(rec.alternatives) < 4:
            rec.alternatives.append(entries)
            rec.conditions.append(condition)

    def sequential_ways(self, call: ast.Call) -> list | None:
        """``[(condition, [(child name or None, _Entry)])]`` of ``nn.Sequential(...)``: one way when
        its entries do not depend on a branch, one per branch way of the list it is built from
        (``*layers``, ``OrderedDict(layers)``) otherwise; None when not a plain construction."""
        grown = self.branch_list(call)
        if grown is None or grown.ways is None:
            entries = self.sequential_entries(call)
            return None if entries is None else [("", entries)]
        out = []
        saved = grown.ways
        try:
            for condition, entries in saved:
                grown.ways = None
                # the list as built on this way (the Sequential reads it, nothing else)
                self.lists_override = (grown, entries)
                made = self.sequential_entries(call)
                if made is None:
                    return None
                out.append((condition, made))
        finally:
            grown.ways = saved
            self.lists_override = None
        return out

    def branch_list(self, call: ast.Call) -> "_ListVar | None":
        """The local list a Sequential is built from (``*layers``, ``OrderedDict(layers)``, an
        ``OrderedDict`` filled item by item), when there is exactly one."""
        names = []
        for a in call.args:
            a = a.value if type(a) is ast.Starred else a
            if type(a) is ast.Call and (_dotted(a.func) or "").endswith("OrderedDict") and a.args:
                a = a.args[0]
            if type(a) is ast.Name and a.id in self.lists:
                names.append(a.id)
        return self.lists[names[0]] if len(names) == 1 else None

    def list_of(self, name: str) -> list:
        """The entries of local list ``name`` (as built on the way being recorded, if any)."""
        override = getattr(self, "lists_override", None)
        lst = self.lists[name]
        if override is not None and override[0] is lst:
            return override[1]
        return lst

    def sequential_entries(self, call: ast.Call) -> list | None:
        """[(child name or None, _Entry)] of ``nn.Sequential(...)``; None when not a plain construction."""
        args = call.args
        if call.keywords:
            return None
        if len(args) == 1 and type(args[0]) is ast.Name and args[0].id in self.lists and self.lists[args[0].id].keyed:
            # ``layers = OrderedDict(); layers["fc"] = nn.Linear(...); nn.Sequential(layers)``
            return self.named_entries(self.list_of(args[0].id))
        if len(args) == 1 and type(args[0]) is ast.Call and (_dotted(args[0].func) or "").endswith("OrderedDict"):
            od = args[0]
            items: list = []
            if len(od.args) == 1 and not od.keywords and type(od.args[0]) is ast.Name and od.args[0].id in self.lists:
                # ``OrderedDict(layers)`` of a list of ``(name, layer)`` pairs built before
                return self.named_entries(self.list_of(od.args[0].id))
            if od.args and type(od.args[0]) in (ast.List, ast.Tuple):
                for el in od.args[0].elts:
                    if type(el) is ast.Tuple and len(el.elts) == 2 and type(el.elts[0]) is ast.Constant:
                        items.append((str(el.elts[0].value), el.elts[1]))
                    else:
                        items.append((None, el))
            elif od.args and type(od.args[0]) is ast.Dict:
                d = od.args[0]
                items = [(str(k.value) if type(k) is ast.Constant else None, v) for k, v in zip(d.keys, d.values)]
            items += [(k.arg, k.value) for k in od.keywords if k.arg is not None]
            return [(name, _Entry(self.values(e), e)) for name, e in items]
        entries: list = []
        unknown_position = False
        for a in args:
            if type(a) is ast.Starred:
                v = a.value
                listed = self.list_entries(v)
                if listed is not None:
                    for el in listed:
                        entries.append((None if unknown_position or el.many else str(len(entries)), el))
                        unknown_position = unknown_position or el.many
                else:
                    entries.append((None, _Entry([], a, many=True)))
                    unknown_position = True
                continue
            entries.append((None if unknown_position else str(len(entries)), _Entry(self.values(a), a)))
        return entries

    @staticmethod
    def named_entries(entries: list) -> list:
        """[(child name or None, _Entry)] of the pairs of an ``OrderedDict``: names known up to the
        first entry that stands for any number of them."""
        out, unknown = [], False
        for e in entries:
            unknown = unknown or e.many or e.name is None
            out.append((None if unknown else e.name, e))
        return out

    def list_entries(self, v: ast.AST) -> list | None:
        """Entries of a list expression: a list built before, ``[a, b]``, ``[a] + layers``."""
        t = type(v)
        if t is ast.Name and v.id in self.lists:
            return self.list_of(v.id)
        if t in (ast.List, ast.Tuple):
            return [self.entry(e) for e in v.elts]
        if t is ast.BinOp and type(v.op) is ast.Add:
            left, right = self.list_entries(v.left), self.list_entries(v.right)
            if left is not None and right is not None:
                return left + right
        if t is ast.IfExp:
            # ``([nn.ReLU()] if relu else [])``: some entries, how many is not known here
            values = [x for branch in (v.body, v.orelse) for e in (self.list_entries(branch) or []) for x in e.values]
            return [_Entry(values, v, many=True)]
        return None

    def entry(self, e: ast.AST) -> _Entry:
        if type(e) is ast.Starred:
            return _Entry([], e, many=True)
        if type(e) is ast.Tuple and len(e.elts) == 2 and type(e.elts[0]) is ast.Constant \
                and isinstance(e.elts[0].value, str):
            # ``("fc", nn.Linear(...))``: a named child of the OrderedDict the list becomes
            return _Entry(self.values(e.elts[1]), e.elts[1], many=self.loop_depth > 0, name=e.elts[0].value)
        return _Entry(self.values(e), e, many=self.loop_depth > 0)

    def class_refs(self, v) -> list[tuple]:
        """A local bound to a class/function (``attention_class = A if c else B``)."""
        return [(ty, None, None, None) for ty in self.callee_types(v)]

    # -- recording
    def record(self, attr: str, vals: list[tuple], conditional: bool, container_of: str | None = None):
        if self.sweep:
            return
        multi = len(vals) > 1
        for ty, args, key, site in vals:
            if site is None:
                continue
            span = _span(site, self.qual, self.stmt)
            out_name = container_of if container_of is not None else attr
            self.out.append(
                InitBinding(
                    attr=attr,
                    layer=Layer(ty, args, Var(out_name), None, span),
                    conditional=conditional or multi,
                    container=container_of,
                    span=span,
                    activation=key,
                )
            )
            if ty in _CONTAINERS and type(site) is ast.Call:
                # contents, also of containers inside containers (a Sequential in a ModuleList)
                self.contents(attr, out_name, ty, site, conditional)

    def dict_items(self, a: ast.AST) -> list[tuple[str | None, list]]:
        """``(key or None, values)`` of the children of the mapping a ModuleDict is built from."""
        ta = type(a)
        if ta is ast.Dict:
            return [(k.value if type(k) is ast.Constant and isinstance(k.value, str) and k.value.isidentifier()
                     else None, self.values(v)) for k, v in zip(a.keys, a.values)]
        if ta is ast.Call and (_dotted(a.func) or "") in ("dict", "OrderedDict", "collections.OrderedDict"):
            out: list = []
            if a.args:
                inner = a.args[0]
                if type(inner) in (ast.List, ast.Tuple):
                    for el in inner.elts:
                        e = self.entry(el)
                        out.append((e.name if e.name and e.name.isidentifier() else None, e.values))
                else:
                    out += self.dict_items(inner)
            out += [(k.arg, self.values(k.value)) for k in a.keywords if k.arg is not None]
            return out
        if ta is ast.Name and a.id in self.lists:
            return [(e.name if e.name and e.name.isidentifier() and not e.many else None, e.values)
                    for e in self.lists[a.id]]
        return []

    def contents(self, attr: str, prefix: str, ty: str, call: ast.Call, conditional: bool):
        """Bindings for the layers inside ``nn.ModuleList/Sequential/ModuleDict(...)``."""
        items: list[tuple[str, list]] = []  # (container name, element values)
        build = self.fc.seq_builds.get(id(call)) if ty == _SEQUENTIAL else None
        if build is not None:
            # the entries as resolved where the Sequential is built (maybe in a factory); each
            # way when a list grown under ``if``/``else`` built it (else the last one seen)
            branched = any(build.conditions)
            seen_names: dict[str, int] = {}
            for alternative in build.alternatives if branched else build.alternatives[-1:]:
                variant: list | None = []
                for name, entry in alternative:
                    vals = [v for v in entry.values if v[3] is not None]
                    container = f"{prefix}[{name}]" if name is not None else f"{prefix}[*]"
                    if container in seen_names and name is not None:
                        known = items[seen_names[container]][1]
                        known += [v for v in vals if all(v[0] != k[0] for k in known)]
                    else:
                        seen_names[container] = len(items)
                        items.append((container, list(vals)))
                    if name is None or not name.isdigit():
                        variant = None
                    elif variant is not None:
                        # ``self.seq(x)`` in forward is expanded into one node per element (one
                        # variant per Sequential when a container holds several differently built
                        # ones); an entry we cannot type stays unknown, the others still count
                        types = {v[0] for v in vals}
                        variant.append((f"{prefix}[{name}]", vals[0][0] if len(types) == 1 else UNKNOWN_TYPE))
                if variant:
                    self.cls.seq_variants.setdefault(prefix, []).append(tuple(variant))
        elif ty == _MODULE_DICT and call.args:
            # ``nn.ModuleDict({"fc": ...})``, ``nn.ModuleDict(dict(fc=...))``, of an OrderedDict
            # filled before: each child under its key (``self.mlp.fc``/``self.mlp["fc"]`` in forward)
            for key, vals in self.dict_items(call.args[0]):
                items.append((f"{prefix}[{key}]" if key is not None else f"{prefix}[*]", vals))
        elif ty != _SEQUENTIAL:
            for a in call.args:
                a = a.value if type(a) is ast.Starred else a
                ta = type(a)
                if ta in (ast.List, ast.Tuple):
                    items += [(f"{prefix}[*]", self.values(e)) for e in a.elts]
                elif ta in (ast.ListComp, ast.GeneratorExp):
                    items.append((f"{prefix}[*]", self.values(a.elt)))
                elif ta is ast.Dict:
                    items += [(f"{prefix}[*]", self.values(e)) for e in a.values]
                elif ta is ast.Name and a.id in self.lists:
                    items += [(f"{prefix}[*]", e.values) for e in self.lists[a.id]]
        for name, vals in items:
            self.record(attr, vals, conditional, container_of=name)

    # -- statements
    def block(self, body, conditional: bool):
        for st in body:
            self.stmt = st
            self.statement(st, conditional)
            if self.returns is not None and _ends_here(st, self.consts):
                break  # what follows a return (or a decided branch that returns) never runs

    def statement(self, st, conditional: bool):
        t = type(st)
        if t in (ast.Assign, ast.AnnAssign):
            value = st.value
            if value is None:
                return
            targets = st.targets if t is ast.Assign else [st.target]
            for tg in targets:
                self.assign(tg, value, conditional)
        elif t is ast.AugAssign:
            if type(st.target) is ast.Name and st.target.id in self.lists and type(st.value) in (ast.List, ast.Tuple):
                self.lists[st.target.id].extend([self.entry(e) for e in st.value.elts])
        elif t is ast.Return:
            if st.value is not None:
                # evaluated also outside factories: a returned ``nn.Sequential(*layers)`` is noted
                made = [v for v in self.values(st.value) if v[3] is not None]
                if self.returns is not None:
                    self.returns.extend(made)
        elif t is ast.Expr and type(st.value) is ast.Call:
            self.call_stmt(st.value, conditional)
        elif t is ast.If:
            taken = _fold(st.test, self.consts) if self.consts else None
            if taken is None and self.lists:
                self.branches(st)
                return
            if taken is not False:
                self.block(st.body, taken is None or conditional)
            if taken is not True:
                self.block(st.orelse, taken is None or conditional)
        elif t in (ast.For, ast.AsyncFor, ast.While):
            # elements appended in a loop stand for any number of elements
            self.loop_depth += 1
            try:
                self.block(st.body, conditional or t is ast.While)
            finally:
                self.loop_depth -= 1
            self.block(st.orelse, True)
        elif t in (ast.With, ast.AsyncWith):
            self.block(st.body, conditional)
        elif t is ast.Try or t.__name__ == "TryStar":
            self.block(st.body, conditional)
            for h in st.handlers:
                self.block(h.body, True)
            self.block(st.orelse, True)
            self.block(st.finalbody, conditional)

    def note_lambda(self, attr: str, lam: ast.Lambda) -> None:
        """``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))`` (minGPT): the class calls it like a
        method; the names it captures that hold ``self`` or one of its modules are kept."""
        if self.cls is None or self.sweep:
            return
        params = {a.arg for a in lam.args.posonlyargs + lam.args.args + lam.args.kwonlyargs}
        captured = {}
        for n in walk(lam.body):
            if type(n) is ast.Name and n.id not in params:
                if n.id == self.self_name:
                    captured[n.id] = "self"
                elif n.id in self.attr_alias:
                    captured[n.id] = self.attr_alias[n.id]
        self.cls.lambdas[attr] = (lam, self.stmt, self.qual, captured)

    def branches(self, st: ast.If) -> None:
        """An ``if`` the source does not decide, with lists being built: each branch grows its own
        copy of them; a list the branches grow differently keeps each way
        (:attr:`_ListVar.ways`), its entries stay those of both branches in order."""
        before = {k: v.snapshot() for k, v in self.lists.items()}
        self.block(st.body, True)
        body = self.lists
        self.lists = {k: v.snapshot() for k, v in before.items()}
        self.block(st.orelse, True)
        orelse = self.lists
        test = _unparse(st.test)
        merged: dict[str, _ListVar] = {}
        for name in list(dict.fromkeys([*body, *orelse])):
            b, e = body.get(name), orelse.get(name)
            if b is None or e is None or name not in before:
                merged[name] = b if e is None else e  # made on one branch: as the branch left it
                continue
            if b.same_as(e):
                merged[name] = b
                continue
            start = len(before[name])
            grown_only = all(x is y for x, y in zip(b, before[name])) and all(x is y for x, y in zip(e, before[name]))
            both = _ListVar(list(b) + list(e)[start:] if grown_only and len(b) >= start and len(e) >= start
                            else list(e), b.keyed and e.keyed)
            ways = b.by_way(test) + e.by_way(f"not ({test})")
            if len(ways) <= _MAX_WAYS:
                both.ways = ways
            merged[name] = both
        self.lists = merged

    def assign(self, tg, value, conditional: bool):
        tt = type(tg)
        target = _dotted(tg)
        if target is not None:
            self.growing.pop(target, None)
            if (
                type(value) is ast.Call and not value.args and not value.keywords
                and self.callee_types(value.func) == [_SEQUENTIAL]
            ):
                self.growing[target] = id(value)
        if tt is ast.Attribute and type(tg.value) is ast.Name and tg.value.id == self.self_name:
            attr = f"self.{tg.attr}"
            if type(value) is ast.Lambda:
                self.note_lambda(tg.attr, value)
                return
            if self.cls is not None and type(value) in (ast.Name, ast.Attribute, ast.Call, ast.IfExp):
                refs = self.class_refs(value)
                if refs:
                    self.cls.class_attrs[tg.attr] = refs
            vals = self.values(value)
            if type(value) is ast.Name and value.id in self.lists:
                # ``self.layers = layers`` for a plain list: no module container
                return
            # ``nn.Dropout(p) if p > 0 else None``: bound on one branch only
            self.record(attr, vals, conditional or type(value) in (ast.IfExp, ast.BoolOp))
        elif tt is ast.Subscript and type(tg.value) is ast.Name and tg.value.id in self.lists \
                and self.lists[tg.value.id].keyed and type(tg.slice) is ast.Constant and isinstance(tg.slice.value, str):
            # ``layers["fc"] = nn.Linear(...)`` of an OrderedDict being filled
            e = self.entry(value)
            e.name = tg.slice.value
            self.lists[tg.value.id].set_item(tg.slice.value, e)
        elif tt is ast.Name:
            name = tg.id
            self.consts.pop(name, None)
            # ``m = self.mlp``: a name a lambda may capture
            if type(value) is ast.Attribute and type(value.value) is ast.Name and value.value.id == self.self_name:
                self.attr_alias[name] = f"self.{value.attr}"
            else:
                self.attr_alias.pop(name, None)
            vt = type(value)
            keyed = self.ordered_dict(value)
            if vt in (ast.List, ast.Tuple):
                self.lists[name] = _ListVar([self.entry(e) for e in value.elts])
                self.local.pop(name, None)
            elif vt in (ast.ListComp, ast.GeneratorExp):
                self.lists[name] = _ListVar([_Entry(self.values(value.elt), value.elt, many=True)])
                self.local.pop(name, None)
            elif keyed is not None:
                self.lists[name] = _ListVar(keyed, keyed=True)
                self.local.pop(name, None)
            else:
                vals = self.values(value)
                refs = (
                    self.class_refs(value) if vt in (ast.Name, ast.Attribute, ast.IfExp, ast.Subscript, ast.Call) else []
                )
                # a reference to a class/function also counts: ``norm = nn.LayerNorm``
                new = [v for v in vals if v[3] is not None] + refs
                if conditional and name in self.local:
                    # ``if use_relu: act_layer = nn.ReLU``: either value from here on
                    new = self.local[name] + [v for v in new if v not in self.local[name]]
                self.local[name] = new
                self.lists.pop(name, None)

    def ordered_dict(self, value) -> list | None:
        """Entries of a new ``OrderedDict()``/``OrderedDict([("fc", layer), ...])``/``dict()``/``{...}``
        assigned to a local (filled item by item afterwards), or None for another value."""
        if type(value) is ast.Dict:
            if not all(type(k) is ast.Constant and isinstance(k.value, str) for k in value.keys):
                return None
            out = []
            for k, v in zip(value.keys, value.values):
                e = self.entry(v)
                e.name = k.value
                out.append(e)
            return out
        if type(value) is not ast.Call or value.keywords:
            return None
        d = _dotted(value.func) or ""
        if not (d.endswith("OrderedDict") or d == "dict"):
            return None
        if not value.args:
            return []
        if len(value.args) == 1 and type(value.args[0]) in (ast.List, ast.Tuple):
            entries = [self.entry(e) for e in value.args[0].elts]
            return entries if all(e.name is not None for e in entries) else None
        return None

    def call_stmt(self, call: ast.Call, conditional: bool):
        f = call.func
        if self.own_children(call):
            return
        if (
            self.cls is not None and type(f) is ast.Attribute and type(f.value) is ast.Name
            and f.value.id == self.self_name and f.attr in self.cls.methods and f.attr not in self.visiting
        ):
            self.helper(self.cls.methods[f.attr], conditional)
            return
        if type(f) is not ast.Attribute or f.attr not in ("append", "extend", "add_module", "insert"):
            return
        recv = f.value
        elems: list = []
        if f.attr == "append" and call.args:
            elems = [call.args[0]]
        elif f.attr == "insert" and len(call.args) > 1:
            elems = [call.args[1]]
        elif f.attr == "extend" and call.args and type(call.args[0]) in (ast.List, ast.Tuple):
            elems = list(call.args[0].elts)
        elif f.attr == "add_module" and len(call.args) > 1 and type(recv) is ast.Name and recv.id == self.self_name:
            if type(call.args[0]) is ast.Constant and isinstance(call.args[0].value, str):
                self.record(f"self.{call.args[0].value}", self.values(call.args[1]), conditional)
            return
        if type(recv) is ast.Name and recv.id in self.lists and not self.lists[recv.id].keyed:
            new = [self.entry(e) for e in elems]
            if f.attr == "insert":
                new = [_Entry(e.values, e.expr, many=True) for e in new]  # position not followed
            self.lists[recv.id].extend(new)
        elif type(recv) is ast.Attribute and type(recv.value) is ast.Name and recv.value.id == self.self_name:
            attr = f"self.{recv.attr}"
            for e in elems:
                self.record(attr, self.values(e), conditional, container_of=f"{attr}[*]")

