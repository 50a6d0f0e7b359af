"""``__init__`` extraction: the ``self.<attr> = <layer>(...)`` bindings of a class
(:class:`InitBinding`), following ``self._init_x(...)`` helpers and the contents of
``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``."""

from __future__ import annotations

import ast

from adopter.core.dsl import Arg, Const, Layer, Var
from adopter.core.extract.symbols import _activation_instance, _activation_type, _ClassCtx, _dotted, _File, _span
from adopter.core.extract.values import _unparse
from adopter.core.structures import InitBinding

_CONTAINERS = ("torch.nn.ModuleList", "torch.nn.Sequential", "torch.nn.ModuleDict")


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


class _InitExtractor:
    """Collects ``self.<attr> = <layer>(...)`` bindings of one ``__init__``."""

    def __init__(self, fc: _File, cls: _ClassCtx, fn: ast.FunctionDef):
        self.fc = fc
        self.cls = cls
        self.fn = fn
        self.qual = f"{cls.name}.{fn.name}"
        self.out: list[InitBinding] = []
        # local name -> list of (type, args, activation, site expr) it may hold
        self.local: dict[str, list[tuple]] = {}
        # local list name -> element values
        self.lists: dict[str, list[tuple]] = {}
        self.self_name = fn.args.args[0].arg if fn.args.args else "self"
        self.stmt = None

    def run(self) -> list[InitBinding]:
        self.visiting = {self.fn.name}
        self.block(self.fn.body, False)
        return self.out

    def helper(self, fn: ast.FunctionDef, conditional: bool):
        """``self._init_weights_of_x(config)`` called from ``__init__``: its bindings count too."""
        saved = (self.qual, self.local, self.lists, self.self_name, self.stmt)
        self.visiting.add(fn.name)
        self.qual = f"{self.cls.name}.{fn.name}"
        self.local, self.lists = {}, {}
        self.self_name = fn.args.args[0].arg if fn.args.args else "self"
        try:
            self.block(fn.body, conditional)
        finally:
            self.visiting.discard(fn.name)
            self.qual, self.local, self.lists, self.self_name, self.stmt = saved

    # -- resolution
    def callee_types(self, f) -> list[str]:
        t = type(f)
        if t is ast.Name:
            if f.id in self.local:
                return [v[0] for v in self.local[f.id] if v[3] is None]
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
            return []
        if t is ast.IfExp:
            return self.callee_types(f.body) + self.callee_types(f.orelse)
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
            return [(ty, _const_args(v), None, v) for ty in self.callee_types(f)]
        if t is ast.Subscript and self.is_act2fn(v.value):
            ty, args, key = _activation_type(v.slice)
            return [(ty, args, key, v)]
        if t is ast.IfExp:
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
            return []
        return []

    def class_refs(self, v) -> list[tuple]:
        """A local bound to a class/function (``attention_class = A if c else B``)."""
        return [(ty, None, None, None) for ty in self.callee_types(v)]

    # -- recording
    def record(self, attr: str, vals: list[tuple], conditional: bool, container_of: str | None = None):
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

    def contents(self, attr: str, prefix: str, ty: str, call: ast.Call, conditional: bool):
        """Bindings for the layers inside ``nn.ModuleList/Sequential/ModuleDict(...)``."""
        items: list[tuple[str, ast.AST]] = []  # (container name, element expr)
        lists: list[tuple[str, list]] = []
        args = call.args
        if ty == "torch.nn.Sequential" and args and all(type(a) is not ast.Starred for a in args):
            if len(args) == 1 and type(args[0]) is ast.Call and (_dotted(args[0].func) or "").endswith("OrderedDict"):
                pass
            else:
                items = [(f"{prefix}[{i}]", a) for i, a in enumerate(args)]
                # the element types of this Sequential, in order: ``self.seq(x)`` in forward
                # is expanded into one node per element (one variant per Sequential when a
                # container holds several differently built ones)
                variant = []
                for name, a in items:
                    vals = [v for v in self.values(a) if v[3] is not None]
                    if len(vals) != 1:
                        variant = None
                        break
                    variant.append((name, vals[0][0]))
                if variant:
                    self.cls.seq_variants.setdefault(prefix, []).append(tuple(variant))
        else:
            for a in args:
                a = a.value if type(a) is ast.Starred else a
                ta = type(a)
                if ta in (ast.List, ast.Tuple):
                    items += [(f"{prefix}[*]", e) for e in a.elts]
                elif ta in (ast.ListComp, ast.GeneratorExp):
                    items.append((f"{prefix}[*]", a.elt))
                elif ta is ast.Dict:
                    items += [(f"{prefix}[*]", e) for e in a.values]
                elif ta is ast.Name and a.id in self.lists:
                    lists.append((f"{prefix}[*]", self.lists[a.id]))
        for name, e in items:
            self.record(attr, self.values(e), conditional, container_of=name)
        for name, vals in lists:
            self.record(attr, vals, conditional, container_of=name)

    # -- statements
    def block(self, body, conditional: bool):
        for st in body:
            self.stmt = st
            self.statement(st, conditional)

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
                for e in st.value.elts:
                    self.lists[st.target.id].extend(self.values(e))
        elif t is ast.Expr and type(st.value) is ast.Call:
            self.call_stmt(st.value, conditional)
        elif t is ast.If:
            self.block(st.body, True)
            self.block(st.orelse, True)
        elif t in (ast.For, ast.AsyncFor):
            self.block(st.body, conditional)
            self.block(st.orelse, True)
        elif t is ast.While:
            self.block(st.body, True)
            self.block(st.orelse, True)
        elif t in (ast.With, ast.AsyncWith):
            self.block(st.body, conditional)
        elif t is ast.Try or t.__name__ == "TryStar":
            self.block(st.body, conditional)
            for h in st.handlers:
                self.block(h.body, True)
            self.block(st.orelse, True)
            self.block(st.finalbody, conditional)

    def assign(self, tg, value, conditional: bool):
        tt = type(tg)
        if tt is ast.Attribute and type(tg.value) is ast.Name and tg.value.id == self.self_name:
            attr = f"self.{tg.attr}"
            vals = self.values(value)
            if type(value) is ast.Name and value.id in self.lists:
                # ``self.layers = layers`` for a plain list: no module container
                return
            # ``nn.Dropout(p) if p > 0 else None``: bound on one branch only
            self.record(attr, vals, conditional or type(value) in (ast.IfExp, ast.BoolOp))
        elif tt is ast.Name:
            name = tg.id
            vt = type(value)
            if vt in (ast.List, ast.Tuple):
                self.lists[name] = [v for e in value.elts for v in self.values(e)]
                self.local.pop(name, None)
            elif vt in (ast.ListComp, ast.GeneratorExp):
                self.lists[name] = self.values(value.elt)
                self.local.pop(name, None)
            else:
                vals = self.values(value)
                refs = self.class_refs(value) if vt in (ast.Name, ast.Attribute, ast.IfExp, ast.Subscript) else []
                # a reference to a class/function also counts: ``norm = nn.LayerNorm``
                self.local[name] = [v for v in vals if v[3] is not None] + refs
                self.lists.pop(name, None)

    def call_stmt(self, call: ast.Call, conditional: bool):
        f = call.func
        if (
            type(f) is ast.Attribute and type(f.value) is ast.Name and f.value.id == self.self_name
            and f.attr in self.cls.methods and f.attr not in self.visiting
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
        if type(recv) is ast.Name and recv.id in self.lists:
            for e in elems:
                self.lists[recv.id].extend(self.values(e))
        elif type(recv) is ast.Attribute and type(recv.value) is ast.Name and recv.value.id == self.self_name:
            attr = f"self.{recv.attr}"
            for e in elems:
                self.record(attr, self.values(e), conditional, container_of=f"{attr}[*]")

