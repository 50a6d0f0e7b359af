"""Expression evaluation: ast expressions to abstract values (:class:`_V`), adding
``TensorOp`` nodes for operators on tensors. Every evaluator returns
``[(state, value)]`` (several when a conditional expression forks the state)."""

from __future__ import annotations

import ast

from adopter.core.dsl import Arg, TensorOp, Var
from adopter.core.extract import tables as T
from adopter.core.extract.symbols import _activation_type, _dotted
from adopter.core.extract.values import _SELF, _V, ATTENTION_TABLE_TYPE, _St, _unparse

_OPS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.LShift: "<<", ast.RShift: ">>",
}
_UNARY = {ast.USub: "-", ast.Invert: "~", ast.UAdd: "+"}
_TENSOR_HOLDERS = ("torch.nn.Parameter", "torch.nn.Buffer", "torch.nn.parameter.Parameter")
_SIMPLE = (ast.Name, ast.Constant, ast.Attribute)
# the binding type of ``self.x = partial(...)`` (what it binds is the class's ``partials``)
_PARTIAL = "functools.partial"
# Names one comprehension or ``map`` may be unpacked into and still run once per element
_MAX_UNPACKED = 8


class _Expressions:
    """Expression evaluation of :class:`adopter.core.extract.interp._Interp`."""

    # -- expressions: every evaluator returns [(state, value)], usually one
    def ev(self, e, st: _St, dest: Var | None = None) -> list:
        t = type(e)
        if t is ast.Name:
            return [(st, self.name(e.id, st))]
        if t is ast.Constant:
            return [(st, _V(expr=e))]
        if t is ast.Call:
            return self.call(e, st, dest)
        if t is ast.Attribute:
            return self.attribute(e, st)
        if t is ast.BinOp:
            return self.binop(e, st, dest)
        if t is ast.Subscript:
            return self.subscript(e, st)
        if t is ast.UnaryOp:
            op = _UNARY.get(type(e.op))
            out = []
            for st2, v in self.ev(e.operand, st):
                if op is not None and v.tensor:
                    var = dest or self.tmp(e)
                    st2.nodes = (self.made(TensorOp(op, (Arg(v.value()),), var, self.span(e))), st2.nodes)
                    out.append((st2, _V(var=var, tensor=True)))
                else:
                    out.append((st2, _V(expr=e)))
            return out
        if t is ast.Tuple or t is ast.List:
            res = [(st, [])]
            for el in e.elts:
                if type(el) is ast.Starred:
                    res = [(s2, acc + [_V(expr=el, tensor=True)]) for s2, acc in res]
                    continue
                nres = []
                for s2, acc in res:
                    for s3, v in self.ev(el, s2):
                        nres.append((s3, acc + [v]))
                res = nres
            # a tuple/list display is never itself a tensor (its elements may be)
            return [(s2, _V(elts=acc)) for s2, acc in res]
        if t is ast.IfExp:
            return self.ifexp(e, st, dest)
        if t is ast.Await:
            return self.ev(e.value, st, dest)
        if t is ast.NamedExpr:
            out = []
            for st2, v in self.ev(e.value, st):
                self.bind(e.target, v, st2, e, None)
                out.append((st2, v))
            return out
        if t is ast.Starred:
            return [(st, _V(expr=e, tensor=True))]
        if t is ast.Compare or t is ast.BoolOp:
            return [(st, _V(expr=e, tensor=False))]
        if t is ast.ListComp or t is ast.GeneratorExp or t is ast.SetComp:
            return self.comprehension(e, st)
        return [(st, _V(expr=e))]

    def comprehension(self, e, st: _St) -> list:
        """``[layer(h) for layer in self.layers]``: the element expression once, like a loop body."""
        if len(e.generators) != 1 or e.generators[0].is_async:
            return [(st, _V(expr=e))]
        gen = e.generators[0]
        names = [n.id for n in ast.walk(gen.target) if type(n) is ast.Name]
        saved = {n: st.env.get(n) for n in names}
        self.bind(gen.target, self.element(gen.iter, st), st, e, None)
        out = []
        for st2, _v in self.ev(e.elt, st):
            for n, old in saved.items():  # comprehension variables do not leak
                if old is None:
                    st2.env.pop(n, None)
                else:
                    st2.env[n] = old
            out.append((st2, _V(expr=e)))
        return out

    def unpacked_elements(self, e, count: int, st: _St) -> list | None:
        """``q, k, v = (rearrange(t, ...) for t in (q, k, v))``, ``[t.transpose(1, 2) for t in (q, k,
        v)]``, ``map(lambda t: ..., qkv)``: unpacking into ``count`` names takes exactly ``count``
        elements (Python raises otherwise), so the element expression runs once per element with the
        loop variable bound to that element: the i-th entry of a literal tuple/list of ``count``
        entries (or of a value holding ``count`` elements), else one element of the iterable as a
        plain ``for`` sees it (``t`` of ``qkv.chunk(3)``: a tensor, which one unknown, as when
        ``qkv`` itself is unpacked). Each run has its own context, so its nodes write their own
        temporaries. ``[(state, value with count elements)]``; None when ``e`` is none of these forms."""
        t = type(e)
        if t is ast.Call:
            f = e.func
            if type(f) is ast.Name and f.id in ("tuple", "list") and len(e.args) == 1 and not e.keywords \
                    and self.builtin(f.id, st):
                return self.unpacked_elements(e.args[0], count, st)
            e = self.map_as_generator(e, st)
            if e is None:
                return None
        elif t is not ast.GeneratorExp and t is not ast.ListComp:
            return None
        if len(e.generators) != 1 or not 1 <= count <= _MAX_UNPACKED:
            return None
        gen = e.generators[0]
        if gen.is_async or gen.ifs or type(gen.target) is not ast.Name:
            return None
        it = gen.iter
        if type(it) is ast.Tuple or type(it) is ast.List:
            if len(it.elts) != count or any(type(x) is ast.Starred for x in it.elts):
                return None
        if type(it) is ast.Name or type(it) is ast.Attribute:
            v = self.name(it.id, st) if type(it) is ast.Name else self.attribute(it, st)[0][1]
            if v.elts is not None and len(v.elts) != count:
                return None  # a display of another length (changed since?): which element is which is unknown
            per_state = [(st, v.elts if v.elts is not None else [self.element(it, st)] * count)]
        else:
            per_state = []
            for st2, v in self.ev(it, st):
                if v.elts is not None:
                    # another length: the iterable's nodes are on the state already, its elements unknown
                    per_state.append((st2, v.elts if len(v.elts) == count else None))
                elif v.var is not None or v.tensor:  # a tensor's chunks / rows: a tensor, which one unknown
                    per_state.append((st2, [_V(text="item", tensor=True)] * count))
                else:
                    per_state.append((st2, [self.element(it, st2)] * count))
        name = gen.target.id
        outer = self.ctx
        out = []
        for st0, items in per_state:
            if items is None:
                out.append((st0, _V(expr=e)))
                continue
            saved = st0.env.get(name)
            res = [(st0, [])]
            for i, item in enumerate(items):
                self.ctx = outer + ((id(e), i),)
                nres = []
                try:
                    for s, acc in res:
                        s.env[name] = item
                        for s2, v in self.ev(e.elt, s):
                            nres.append((s2, acc + [v]))
                finally:
                    self.ctx = outer
                res = nres
            for s, acc in res:  # the comprehension's variable does not leak
                if saved is None:
                    s.env.pop(name, None)
                else:
                    s.env[name] = saved
                out.append((s, _V(elts=acc)))
        return out

    def builtin(self, ident: str, st: _St) -> bool:
        """``ident`` names the Python builtin here (no local, import, function or class shadows it)."""
        v = self.name(ident, st)
        return v.alias is None and v.var is None and v.text == ident and ident not in st.env

    def map_as_generator(self, e: ast.Call, st: _St):
        """``map(fn, xs)`` as ``(fn(x) for x in xs)`` (``map(lambda t: body, xs)`` as ``(body for t in
        xs)``), positions those of the source; None when ``e`` is no such ``map`` call."""
        f = e.func
        if not (type(f) is ast.Name and f.id == "map" and len(e.args) == 2 and not e.keywords
                and not any(type(a) is ast.Starred for a in e.args) and self.builtin("map", st)):
            return None
        g = self.synthetic.get(id(e))
        if g is None:
            fn = e.args[0]
            if type(fn) is ast.Lambda:
                a = fn.args
                if len(a.args) != 1 or a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults:
                    return None
                elt, target = fn.body, a.args[0].arg
            else:
                target = "\0map item"  # no Python name: cannot meet a name of the code
                elt = ast.Call(func=fn, args=[ast.Name(id=target, ctx=ast.Load())], keywords=[])
                ast.copy_location(elt, e)
                elt.end_lineno, elt.end_col_offset = e.end_lineno, e.end_col_offset
                ast.copy_location(elt.args[0], e.args[1])
            gen = ast.comprehension(target=ast.Name(id=target, ctx=ast.Store()), iter=e.args[1], ifs=[], is_async=0)
            g = ast.GeneratorExp(elt=elt, generators=[gen])
            ast.copy_location(g, e)
            self.synthetic[id(e)] = g
        return g

    def name(self, ident: str, st: _St) -> _V:
        v = st.env.get(ident)
        if v is not None:
            return v
        cache = self.fc._name_cache
        v = cache.get(ident)
        if v is None:
            fc = self.fc
            if ident in fc.functions:
                v = _V(alias=("local", ident), text=ident)
            elif ident in fc.classes:
                v = _V(alias=("class", ident), text=ident)
            elif ident in fc.local_class_alias:
                v = _V(alias=("class", fc.local_class_alias[ident]), text=ident)
            elif ident in fc.imports:
                v = _V(alias=("fn", fc.imports[ident]), text=ident)
            elif ident in fc.partials and (bound := fc.bound_partial(ident)) is not None:
                v = _V(alias=("partial", bound), text=ident)  # module-level ``attend = partial(...)``
            else:
                v = _V(text=ident)
            cache[ident] = v
        return v

    def self_attr(self, attr: str, st: _St, e) -> _V:
        key = "self." + attr
        v = st.env.get(key)
        if v is not None:
            return v
        cls = self.cls
        if cls is not None:
            types = cls.types_of(key)
            if not types or types == [_PARTIAL]:
                bound = cls.find_partial(attr)
                if bound is not None:  # ``self.attn_fn = partial(F.softmax, dim=-1)``
                    return _V(alias=("partial", bound), expr=e)
            if types:
                if all(ty in _TENSOR_HOLDERS for ty in types):
                    return _V(var=Var(key), tensor=True)
                return _V(alias=("mod", key), expr=e)
            if cls.find_method(attr)[0] is not None:
                return _V(alias=("method", attr), expr=e)
            if cls.find_lambda(attr) is not None:
                return _V(alias=("lambda", attr), expr=e)
        return _V(expr=e, tensor=False)

    def attribute(self, e: ast.Attribute, st: _St) -> list:
        base = e.value
        if type(base) is ast.Name:
            bv = self.name(base.id, st)
            a = bv.alias
            if a is not None:
                if a[0] == "self":
                    return [(st, self.self_attr(e.attr, st, e))]
                if a[0] == "fn":
                    return [(st, _V(alias=("fn", f"{a[1]}.{e.attr}"), expr=e))]
                if a[0] == "mod":
                    return [(st, self.module_attr(a[1], e))]
                return [(st, _V(expr=e))]
            return [(st, _V(expr=e, tensor=self.attr_tensor(bv, e.attr)))]
        out = []
        for st2, bv in self.ev(base, st):
            a = bv.alias
            if a is not None:
                if a[0] == "fn":
                    out.append((st2, _V(alias=("fn", f"{a[1]}.{e.attr}"), expr=e)))
                elif a[0] == "mod":
                    out.append((st2, self.module_attr(a[1], e)))
                else:
                    out.append((st2, _V(expr=e)))
            else:
                out.append((st2, _V(expr=e, tensor=self.attr_tensor(bv, e.attr))))
        return out

    def module_attr(self, name: str, e: ast.Attribute) -> _V:
        """``<module>.<attr>``: a named child of a ModuleDict / OrderedDict Sequential bound in
        ``__init__`` (``self.mlp.c_fc``), a parameter (``weight``/``bias``), or another value."""
        if self.cls is not None and not e.attr.startswith("_"):
            child = f"{name}[{e.attr}]"
            if self.cls.types_of(child):
                return _V(alias=("mod", child), expr=e)
        return _V(expr=e, tensor=e.attr in ("weight", "bias"))

    @staticmethod
    def attr_tensor(bv: _V, attr: str) -> bool:
        if attr in T.META_ATTRS:
            return False
        if attr in T.TENSOR_ATTRS:
            return True
        return bv.tensor and bv.var is not None

    def subscript(self, e: ast.Subscript, st: _St) -> list:
        out = []
        for st2, bv in self.ev(e.value, st):
            a = bv.alias
            if a is None:
                if bv.elts is not None and type(e.slice) is ast.Constant and isinstance(e.slice.value, int):
                    i = e.slice.value
                    if -len(bv.elts) <= i < len(bv.elts):
                        out.append((st2, bv.elts[i]))
                        continue
                out.append((st2, _V(expr=e, tensor=bv.tensor)))
                continue
            kind = a[0]
            if kind == "mod":
                name = a[1]
                sl = e.slice
                if type(sl) is ast.Constant and isinstance(sl.value, (int, str)) and self.cls is not None \
                        and not isinstance(sl.value, bool):
                    # ``self.seq[0]``, ``self.layers["fc"]`` (a ModuleDict's or named Sequential's child)
                    cand = f"{name}[{sl.value}]"
                    if self.cls.types_of(cand):
                        out.append((st2, _V(alias=("mod", cand), expr=e)))
                        continue
                if type(sl) is ast.Slice:
                    out.append((st2, bv))
                else:
                    out.append((st2, _V(alias=("mod", name + "[*]"), expr=e)))
            elif kind == "fn":
                last = a[1].rsplit(".", 1)[-1]
                if last == "ACT2FN":
                    ty, _args, key = _activation_type(e.slice)
                    out.append((st2, _V(alias=("act", ty, key), expr=e)))
                elif "ALL_ATTENTION_FUNCTIONS" in a[1]:
                    out.append((st2, _V(alias=("table", ATTENTION_TABLE_TYPE), expr=e)))
                else:
                    out.append((st2, _V(expr=e, tensor=True)))
            else:
                out.append((st2, _V(expr=e)))
        return out

    def binop(self, e: ast.BinOp, st: _St, dest) -> list:
        out = []
        for st1, lv in self.ev(e.left, st):
            for st2, rv in self.ev(e.right, st1):
                if lv.tensor or rv.tensor:
                    var = dest or self.tmp(e)
                    node = self.made(TensorOp(_OPS[type(e.op)], (Arg(lv.value()), Arg(rv.value())), var, self.span(e)))
                    st2.nodes = (node, st2.nodes)
                    out.append((st2, _V(var=var, tensor=True)))
                else:
                    out.append((st2, _V(expr=e)))
        return out

    def ifexp(self, e: ast.IfExp, st: _St, dest) -> list:
        if type(e.body) in _SIMPLE and type(e.orelse) in _SIMPLE:
            # plain values: no node can come out, no state to fork
            both = self.ev(e.body, st) + self.ev(e.orelse, st)
            if all(v.alias is None for _, v in both):
                return [(st, _V(expr=e, tensor=any(v.tensor for _, v in both)))]
        a = self.ev(e.body, st.fork(), dest)
        b = self.ev(e.orelse, st.fork(), dest)
        both = a + b
        if all(s.nodes is st.nodes and v.alias is None for s, v in both):
            return [(st, _V(expr=e, tensor=any(v.tensor for _, v in both)))]
        if self.no_fork:
            return a[:1]
        if all(s.nodes is st.nodes for s, _ in both) and len({v.alias for _, v in both}) == 1:
            return [(st, both[0][1])]
        return both

    def element(self, it, st: _St) -> _V:
        """Abstract value of one element of iterable ``it`` (``enumerate``/``zip`` give tuples)."""
        t = type(it)
        if t is ast.Call:
            fname = _dotted(it.func)
            if fname == "range":
                return _V(text="i")
            if fname in ("enumerate", "zip") and it.args and not any(type(a) is ast.Starred for a in it.args):
                elts = [self.element(a, st) for a in it.args]
                if fname == "enumerate":
                    elts = [_V(text="i"), elts[0]]
                return _V(elts=elts)
            if fname in ("reversed", "list", "tuple", "iter") and len(it.args) == 1:
                return self.element(it.args[0], st)
            if type(it.func) is ast.Attribute and it.func.attr in ("values", "children"):
                return self.element(it.func.value, st)
            return _V(text="item", tensor=True)
        if t is ast.Subscript and type(it.slice) is ast.Slice:  # self.layers[:n]
            it = it.value
        base = None
        if type(it) is ast.Attribute and type(it.value) is ast.Name:
            bv = st.env.get(it.value.id)
            if bv is _SELF:
                base = self.self_attr(it.attr, st, it)
        elif type(it) is ast.Name:
            base = st.env.get(it.id)
        if base is not None and base.alias is not None and base.alias[0] == "mod":
            return _V(alias=("mod", base.alias[1] + "[*]"), text=_unparse(it) + "[i]")
        if base is not None and base.elts:
            return base.elts[0]
        return _V(text="item", tensor=True)
