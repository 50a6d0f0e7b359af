"""``__init__`` extraction: the ``self.<attr> = <layer>(...)`` bindings of a class
(:class:`InitBinding`), following ``self._init_x(...)`` helpers and the contents of
``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``.

:class:`_InitExtractor` runs the statements (this module) and records the bindings; its methods
for what an expression may hold (values, factories) live in
:mod:`~adopter.core.extract.init_values`, those for the lists and Sequentials being built and the
children of containers in :mod:`~adopter.core.extract.init_containers`. They share the state set
up in :meth:`_InitExtractor.__init__`."""

from __future__ import annotations

import ast

from adopter.core.dsl import Layer, Var
from adopter.core.extract import partials
from adopter.core.extract.init_containers import _CONTAINERS, _MAX_WAYS, _SEQUENTIAL, _Entry, _InitContainers, _ListVar
from adopter.core.extract.init_values import UNKNOWN_ELEMENT, _defaults, _fold, _InitValues, _positional_params
from adopter.core.extract.symbols import _ClassCtx, _dotted, _File, _span
from adopter.core.extract.values import UNKNOWN_TYPE, _unparse
from adopter.core.structures import InitBinding
from adopter.core.syntax import walk

# ``for`` loops unrolled (:meth:`_InitExtractor.unroll`): iterations of one, loops nested
_MAX_UNROLLED_ITERATIONS = 8
_MAX_UNROLLED_LOOPS = 2
# what may leave a loop before its last iteration (or leave the function)
_LEAVES_LOOP = (ast.Break, ast.Continue, ast.Return, ast.Yield, ast.YieldFrom)


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


class _InitExtractor(_InitContainers, _InitValues):
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
        # while the ``__init__`` of an nn.Sequential subclass of another file is evaluated for the
        # children it passes (:meth:`foreign_sequential`): its own ``self.<attr>`` are not ours
        self.foreign_init = False
        # the super().__init__ calls of the classes between such a subclass and nn.Sequential, by
        # id: the base class whose ``__init__`` each one runs (:meth:`foreign_sequential`)
        self.foreign_chain: dict[int, tuple] = {}
        # ``for`` loops being unrolled (:meth:`unroll`)
        self.unrolled = 0
        # local name -> the ``functools.partial(...)`` call it holds (a parameter's default too)
        self.partial_locals: dict[str, ast.Call] = {}

    def run(self) -> list[InitBinding]:
        self.visiting = {self.fn.name}
        self.local = self.parameter_defaults(self.fn)
        if self.local and self.cls is not None and self.fn.name == "__init__":
            self.local = self.as_constructed(self.local)
        self.partial_locals = self.partial_defaults(self.fn)
        self.block(self.fn.body, False)
        return self.out

    def as_constructed(self, defaults: dict[str, list[tuple]], cls_name: str | None = None,
                       fn: ast.FunctionDef | None = None, depth: int = 0) -> dict[str, list[tuple]]:
        """``__init__``'s class-valued parameter defaults (``act: Type[nn.Module] = nn.GELU``) with
        what this file's constructions of the class pass instead (``MLPBlock(d, h, act=nn.ReLU)``):
        the attribute may hold either, so a rule settles it as a condition, never by the default.
        A construction passing its own ``__init__``'s parameter (``Mlp(act_layer=act_layer)``)
        passes that parameter's default and what that class's constructions pass. What cannot be
        read (another function's parameter, ``**kwargs``) is unknown. Constructions in other
        files are not seen (the trace says)."""
        cls_name, fn = cls_name or self.cls.name, fn or self.fn
        names = [p.arg for p in _positional_params(fn, True)]
        known = set(names) | {p.arg for p in fn.args.kwonlyargs}
        out = {name: list(refs) for name, refs in defaults.items()}
        unknown = (UNKNOWN_TYPE, None, None, None)
        for call, where, owner in self.fc.constructions(cls_name):
            passed: dict[str, ast.AST] = {}
            opaque = any(type(a) is ast.Starred for a in call.args) or any(k.arg is None for k in call.keywords)
            for i, arg in enumerate(call.args):
                if type(arg) is ast.Starred:
                    break
                if i < len(names):
                    passed[names[i]] = arg
            passed.update((k.arg, k.value) for k in call.keywords if k.arg in known)
            for name, refs in out.items():
                arg = passed.get(name)
                if arg is None:
                    given = [unknown] if opaque else []
                else:
                    given = self._passed_classes(arg, where, owner, depth)
                for ref in given:
                    if ref not in refs:
                        refs.append(ref)
        return out

    def _passed_classes(self, arg: ast.AST, where: ast.AST | None, owner: str | None, depth: int) -> list[tuple]:
        unknown = [(UNKNOWN_TYPE, None, None, None)]
        if type(arg) is ast.Name and type(where) is ast.FunctionDef and any(
                p.arg == arg.id for p in where.args.posonlyargs + where.args.args + where.args.kwonlyargs):
            # the constructing function's own parameter, never rebound there: its default, and what
            # its class's constructions pass when it is that class's ``__init__``
            if any(type(n) is ast.Name and n.id == arg.id and type(n.ctx) is not ast.Load for n in walk(where)):
                return unknown
            default = next((d for p, d in _defaults(where) if p.arg == arg.id), None)
            if default is None or depth >= 3:
                return unknown
            refs = self.in_module_scope(self.fc, lambda: self.class_refs(default)) \
                if type(default) in (ast.Name, ast.Attribute, ast.Call, ast.IfExp) else []
            if not refs:
                return unknown
            if where.name == "__init__" and owner is not None:
                refs = self.as_constructed({arg.id: refs}, owner, where, depth + 1)[arg.id]
            return refs
        if type(arg) not in (ast.Name, ast.Attribute, ast.Call, ast.IfExp):
            return unknown
        return self.in_module_scope(self.fc, lambda: self.class_refs(arg)) or unknown

    def helper(self, fn: ast.FunctionDef, conditional: bool):
        """``self._init_weights_of_x(config)`` called from ``__init__``: its bindings count too."""
        saved = (self.qual, self.local, self.lists, self.self_name, self.stmt, self.returns, self.consts)
        saved_alias, self.attr_alias = self.attr_alias, {}
        saved_partials, self.partial_locals = self.partial_locals, self.partial_defaults(fn)
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
            self.partial_locals = saved_partials

    def partial_defaults(self, fn: ast.FunctionDef) -> dict[str, ast.Call]:
        """Parameters whose default is a ``functools.partial(...)`` (``fn=partial(F.softmax,
        dim=-1)``): what they hold unless a caller passes another (the trace says)."""
        return {p.arg: d for p, d in _defaults(fn)
                if type(d) is ast.Call and partials.is_partial(d.func, self.fc.fqn)}

    def may_hold_partial(self, value) -> bool:
        """Cheap first look (every ``self.x = ...`` of every ``__init__`` asks): a ``partial(...)``
        call, or a name holding one."""
        t = type(value)
        if t is ast.Name:
            return value.id in self.partial_locals or value.id in self.fc.partials
        return t is ast.Call and partials.is_partial(value.func, self.fc.fqn)

    def bound_of(self, value) -> partials.Bound | None:
        """What ``value`` (a ``partial(...)`` call, or a name holding one) binds, or None."""
        def named(name: str):
            return self.partial_locals.get(name) or self.fc.partials.get(name)
        if type(value) is ast.Name:
            value = named(value.id)
            if value is None:
                return None
        return partials.unwrap(value, self.fc.fqn, named)

    def note_partial(self, attr: str, value) -> None:
        """``self.<attr> = partial(...)`` (or a name holding one): the class calls what it binds;
        an attribute assigned anything else too holds no one partial."""
        if self.cls is None or self.sweep:
            return
        bound = self.bound_of(value)
        if attr in self.cls.partials and (bound is None or self.cls.partials[attr] != bound):
            self.cls.partials[attr] = None
        elif bound is not None:
            self.cls.partials[attr] = bound

    # -- recording
    def record(self, attr: str, vals: list[tuple], conditional: bool, container_of: str | None = None,
               elsewhere: bool = False):
        if self.sweep or self.foreign_init:
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
                    built_elsewhere=elsewhere,
                )
            )
            if ty in _CONTAINERS and type(site) is ast.Call:
                # contents, also of containers inside containers (a Sequential in a ModuleList)
                self.contents(attr, out_name, ty, site, conditional, elsewhere)

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
                    if type(st.value) in (ast.Name, ast.Attribute, ast.IfExp):
                        # a factory returning a class (``return BatchNormAct2d``): its callers call it
                        self.returns.extend(v for v in self.class_refs(st.value) if v not in self.returns)
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
        elif t is ast.For and self.unroll(st, conditional):
            return
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

    def unroll(self, st: ast.For, conditional: bool) -> bool:
        """A ``for`` of a factory (or of another file's ``__init__``) over what its call settles
        (``for d in hidden_channels[:-1]:`` with ``hidden_channels=[4 * dim, dim]`` passed, ``range(n)``
        with ``n`` passed): its body run once per value, the loop variable bound to each (a constant
        or unknown), so what it appends keeps its place. False (nothing run) for any other loop, one
        that may leave early, or more than :data:`_MAX_UNROLLED_ITERATIONS` iterations."""
        if self.returns is None or self.unrolled >= _MAX_UNROLLED_LOOPS or type(st.target) is not ast.Name:
            return False
        values = self.iteration_values(st.iter, _MAX_UNROLLED_ITERATIONS)
        if values is None or any(type(n) in _LEAVES_LOOP for n in walk(st)):
            return False
        name = st.target.id
        self.unrolled += 1
        try:
            for value in values:
                self.local.pop(name, None)
                self.lists.pop(name, None)
                self.attr_alias.pop(name, None)
                if value is UNKNOWN_ELEMENT:
                    self.consts.pop(name, None)
                else:
                    self.consts[name] = value
                self.block(st.body, conditional)
        finally:
            self.unrolled -= 1
        self.block(st.orelse, conditional)  # (no ``break``: the else clause runs)
        return True

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
            if self.cls is not None and (tg.attr in self.cls.partials or self.may_hold_partial(value)):
                self.note_partial(tg.attr, value)
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
            if type(value) is ast.Call and partials.is_partial(value.func, self.fc.fqn):
                self.partial_locals[name] = value
            else:
                self.partial_locals.pop(name, None)
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
