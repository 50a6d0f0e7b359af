"""Call resolution and inlining: a call becomes a ``Layer`` node (module, function,
tensor method), an alias value (a module built in forward, an activation), nothing
(no DL computation), or the inlined body of a method/function of the same file."""

from __future__ import annotations

import ast
import builtins

from adopter.core.dsl import Arg, Const, Layer, Span, Var
from adopter.core.extract import partials
from adopter.core.extract import tables as T
from adopter.core.extract.symbols import _OPAQUE_CLASS_SUFFIXES, _activation_instance, _activation_type, _dotted
from adopter.core.extract.values import (
    _NONE,
    _SELF,
    _V,
    ATTENTION_TABLE_TYPE,
    DEAD,
    MAX_INLINE_DEPTH,
    MAX_PATHS,
    RET,
    UNKNOWN_TYPE,
    _annotation_is_tensor,
    _cons_to_tuple,
    _push_all,
    _sig,
    _St,
    _unparse,
)

_BUILTINS = frozenset(dir(builtins))
# ``self.<name>(...)`` with no binding and no method in the file: inherited utilities
# (PreTrainedModel) rather than layers, so no barrier node.
_NOT_LAYER_METHODS = (
    "get_", "set_", "warn", "post_init", "loss_function", "size", "__init__", "register_", "invert_attention_mask",
    "_prepare_4d", "_update_causal_mask", "_update_full_mask", "_update_cross_attn_mask", "num_parameters",
)


class _Calls:
    """Call resolution and inlining of :class:`adopter.core.extract.interp._Interp`."""

    # -- calls
    def call(self, e: ast.Call, st: _St, dest) -> list:
        f = e.func
        tf = type(f)
        if tf is ast.Attribute:
            root = f.value
            if type(root) is ast.Call and type(root.func) is ast.Name and root.func.id == "super":
                return self.call_super(f.attr, e, st, dest)
            while type(root) is ast.Attribute:
                root = root.value
            if type(root) is ast.Name and root.id not in st.env:
                fq = self.fq_cache.get(id(f), 0)
                if fq == 0:
                    d = _dotted(f)
                    fq = self.fq_cache[id(f)] = self.fc.fqn(d) if d else None
                if fq is not None:
                    return self.call_fqn(fq, e, st, dest)
                if root.id in T.LOGGER_NAMES:
                    return [(st, _V(expr=e))]
            out = []
            for st1, rv in self.ev(f.value, st):
                out.extend(self.call_method(rv, f.attr, e, st1, dest))
            return out
        if tf is ast.Name:
            v = self.name(f.id, st)
            if v.alias is None and v.var is None:
                return self.call_global(f.id, e, st)
            return self.call_value(v, e, st, dest)
        out = []
        for st1, fv in self.ev(f, st):
            out.extend(self.call_value(fv, e, st1, dest))
        return out

    def call_super(self, attr: str, e: ast.Call, st: _St, dest) -> list:
        """``super().<attr>(...)``: inline the method of a base class in the same file."""
        owner = self.owner
        if owner is not None:
            for base in owner.local_bases:
                fdef, found = base.find_method(attr)
                if fdef is not None:
                    static = any(_dotted(d) == "staticmethod" for d in fdef.decorator_list)
                    return self.inline(fdef, f"{found.name}.{attr}", found, e, st, dest, bound_self=not static)
        return self.opaque(e, st, True)

    def call_global(self, name: str, e: ast.Call, st: _St) -> list:
        if name in _BUILTINS:
            if name in ("tuple", "list") and e.args:
                return self.ev(e.args[0], st)
            return [(st, _V(expr=e, tensor=False))]
        return self.opaque(e, st, tensor=True)

    def opaque(self, e: ast.Call, st: _St, tensor: bool) -> list:
        """A call that is no DL node: its arguments may still hold some."""
        out = []
        for st2, _pos, _kw in self.eval_args(e, st):
            out.append((st2, _V(expr=e, tensor=tensor)))
        return out

    def call_method(self, rv: _V, attr: str, e: ast.Call, st: _St, dest) -> list:
        a = rv.alias
        if a is not None:
            kind = a[0]
            if kind == "self":
                av = self.self_attr(attr, st, e.func)
                if av.alias is not None:
                    if av.alias[0] == "act":  # instance stored on self in forward
                        return self.emit(av.alias[1], e, st, dest, module=Var("self." + attr))
                    return self.call_value(av, e, st, dest)
                if self.cls is not None and self.cls.is_module and not attr.startswith(_NOT_LAYER_METHODS):
                    return self.emit(UNKNOWN_TYPE, e, st, dest, module=Var("self." + attr))
                return self.opaque(e, st, True)
            if kind == "fn":
                return self.call_fqn(f"{a[1]}.{attr}", e, st, dest)
            if kind == "mod" and attr == "forward":
                return self.call_value(rv, e, st, dest)
            if kind == "mod" and self.cls is not None and self.cls.types_of(f"{a[1]}[{attr}]"):
                # ``self.mlp.c_fc(x)``: a named child of a ModuleDict / OrderedDict Sequential
                return self.call_module(f"{a[1]}[{attr}]", e, st, dest)
            return self.opaque(e, st, True)
        if attr in T.SHAPE_METHODS:
            return [(st, _V(expr=e, tensor=False))]
        if attr in T.TENSOR_METHODS and rv.tensor:
            out = self.emit("torch.Tensor." + attr, e, st, dest, recv=rv)
            recv = e.func.value
            if attr[-1] == "_" and type(recv) is ast.Name and rv.var is not None:
                # in-place method (``x.masked_fill_(...)``): later reads of ``x`` see its result
                for st2, v in out:
                    if st2.env.get(recv.id) is rv:
                        st2.env[recv.id] = _V(var=v.var, tensor=True)
            return out
        return self.opaque(e, st, rv.tensor)

    def call_value(self, v: _V, e: ast.Call, st: _St, dest) -> list:
        a = v.alias
        if a is None:
            if v.var is not None:  # calling a data value (a parameter holding a function)
                return self.emit(UNKNOWN_TYPE, e, st, dest)
            return self.opaque(e, st, True)
        kind = a[0]
        if kind == "mod":
            return self.call_module(a[1], e, st, dest)
        if kind == "fn":
            return self.call_fqn(a[1], e, st, dest)
        if kind == "local":
            fdef = self.fc.functions[a[1]]
            return self.inline(fdef, a[1], None, e, st, dest, bound_self=False)
        if kind == "method":
            fdef, owner = self.cls.find_method(a[1])
            static = any(_dotted(d) == "staticmethod" for d in fdef.decorator_list)
            fq = self.forwarding_function(fdef, static, e)
            if fq is not None:
                # ``def gelu(self, x): return F.gelu(x)``: the call site is that function's call
                return self.call_fqn(fq, e, st, dest)
            return self.inline(fdef, f"{owner.name}.{a[1]}", owner, e, st, dest, bound_self=not static)
        if kind == "def":
            fdef, qual = self.defs[a[1]]
            return self.inline(fdef, qual, None, e, st, dest, bound_self=False, closure=True)
        if kind == "lambda":
            return self.call_lambda(a[1], e, st, dest)
        if kind == "class":
            cls = self.fc.classes.get(a[1])
            if cls is not None and cls.is_module:
                # constructing a module in forward: calling the instance is the node
                return [(st, _V(alias=("act", self.fc.class_type(a[1]), ""), expr=e))]
            return self.opaque(e, st, True)
        if kind == "act":
            if a[1] == T.ACT2FN_TYPE and a[2]:
                # ``ACT2FN[config.hidden_act](x)``: the key travels as a keyword argument
                return self.emit(a[1], e, st, dest, extra=(Arg(Const(a[2]), "activation"),))
            if a[1] == "torch.nn.GELU" and a[2] in ("'gelu'", '"gelu"'):
                # ``ACT2FN["gelu"](x)`` called in place: exactly ``nn.functional.gelu(x)``
                return self.emit("torch.nn.functional.gelu", e, st, dest)
            return self.emit(a[1], e, st, dest)
        if kind == "table":
            return self.emit(a[1], e, st, dest)
        if kind == "partial":
            return self.call_partial(a[1], e, st, dest)
        return self.emit(UNKNOWN_TYPE, e, st, dest)

    def call_partial(self, bound: partials.Bound, e: ast.Call, st: _St, dest) -> list:
        """A call of a ``functools.partial``: the call of the function it binds, the bound
        arguments (source text where the partial was made) merged with the call's. A torch or
        einops function is the node (``bound`` on it says where the partial names it); a
        function of this file is inlined; anything else is what a plain call of it gives."""
        func = bound.func
        given = ([_V(expr=x, tensor=False) for x in bound.args], [(k, _V(expr=x, tensor=False)) for k, x in bound.keywords])
        if type(func) is ast.Name and func.id in self.fc.functions and func.id not in self.fc.classes:
            return self.inline(self.fc.functions[func.id], func.id, None, e, st, dest, bound_self=False, bound=given)
        d = _dotted(func)
        fq = self.fc.fqn(d) if d else None
        if fq is None:
            return self.opaque(e, st, True)
        last = fq.rsplit(".", 1)[-1]
        plain = fq.startswith(("torch.", "einops.")) and not last[:1].isupper() and not (
            fq in T.NON_DL_TORCH or fq.startswith(T.NON_DL_TORCH_PREFIXES) or fq.startswith("torch.nn.init."))
        if not plain:
            return self.call_fqn(fq, e, st, dest)
        at = Span(func.lineno, func.col_offset, func.end_lineno, func.end_col_offset)
        return self.emit(fq, e, st, dest, bound=given, bound_at=at)

    def call_fqn(self, fq: str, e: ast.Call, st: _St, dest) -> list:
        last = fq.rsplit(".", 1)[-1]
        if fq == "functools.partial":
            # ``partial(F.softmax, dim=-1)`` made in the body (a lambda's ``partial(...)(t)``)
            bound = partials.unwrap(e, self.fc.fqn, self.fc.partials.get)
            if bound is not None:
                return [(st, _V(alias=("partial", bound), expr=e))]
            return self.opaque(e, st, False)
        if fq.startswith("torch."):
            if fq in T.NON_DL_TORCH or fq.startswith(T.NON_DL_TORCH_PREFIXES) or fq.startswith("torch.nn.init."):
                return [(st, _V(expr=e, tensor=True))]
            if last[:1].isupper() and fq.startswith("torch.nn."):
                # ``nn.Softmax(dim=-1)(x)``, ``loss_fct = CrossEntropyLoss()``: the call of the
                # instance is the node, not its construction
                return [(st, _V(alias=("act", fq, ""), expr=e))]
            return self.emit(fq, e, st, dest)
        if last == "get_activation" and e.args:
            ty, _args, key = _activation_type(e.args[0])
            return [(st, _V(alias=("act", ty, key), expr=e))]
        if last == "get_interface" and "ALL_ATTENTION_FUNCTIONS" in fq:
            default = e.args[1] if len(e.args) > 1 else None
            for k in e.keywords:
                if k.arg in ("default", "default_interface"):
                    default = k.value
            table = _V(alias=("table", ATTENTION_TABLE_TYPE), expr=e)
            if default is None:
                return [(st, table)]
            out = []
            for st2, dv in self.ev(default, st.fork()):
                out.append((st2, dv))
            if self.no_fork:
                return out[:1]
            out.append((st, table))
            return out
        if last == "apply_chunking_to_forward" and len(e.args) >= 4:
            syn = self.synthetic.get(id(e))
            if syn is None:
                syn = ast.Call(func=e.args[0], args=list(e.args[3:]), keywords=[])
                ast.copy_location(syn, e)
                syn.end_lineno, syn.end_col_offset = e.end_lineno, e.end_col_offset
                self.synthetic[id(e)] = syn
            return self.call(syn, st, dest)
        if fq in T.EXTRANEOUS_CALLS or fq.startswith(("warnings.", "logging.", "math.", "numpy.", "typing.")):
            return [(st, _V(expr=e, tensor=False))]
        if fq.startswith(("einops.", "flash_attn", "xformers.", "apex.", "liger_kernel.", "epoi.", "adopter.kernels")):
            return self.emit(fq, e, st, dest)
        act = _activation_instance(fq)
        if act is not None:
            # ``gelu(x)`` with transformers' module-level GELUActivation instance computes
            # exactly ``nn.functional.gelu(x)``: written as that function call
            return self.emit("torch.nn.functional.gelu" if act == "torch.nn.GELU" else act, e, st, dest)
        if fq.startswith("transformers.activations."):
            if last[:1].isupper():
                return [(st, _V(alias=("act", fq, ""), expr=e))]
            return self.emit(fq, e, st, dest)
        if last[:1].isupper() and not last.endswith(_OPAQUE_CLASS_SUFFIXES) and not last.isupper():
            if not fq.startswith("transformers.") or ".modeling_" in fq or fq.endswith("pytorch_utils.Conv1D"):
                return [(st, _V(alias=("act", fq, ""), expr=e))]
        if last == "apply" and fq.rsplit(".", 2)[-2][:1].isupper():  # autograd.Function.apply
            return self.emit(fq, e, st, dest)
        return self.opaque(e, st, True)

    def call_module(self, var: str, e: ast.Call, st: _St, dest) -> list:
        cls = self.cls
        types = cls.types_of(var) if cls is not None else []
        module = Var(var)
        if not types:
            return self.emit(UNKNOWN_TYPE, e, st, dest, module=module)
        if len(types) > 1:
            ck = "@" + var
            chosen = st.env.get(ck)
            if chosen is not None:
                choices = [(st, chosen.alias[1])]
            elif self.no_fork:
                choices = [(st, types[0])]
            else:
                choices = []
                for i, ty in enumerate(types):
                    s2 = st if i == len(types) - 1 else st.fork()
                    s2.env[ck] = _V(alias=("choice", ty), text=ty)
                    choices.append((s2, ty))
        else:
            choices = [(st, types[0])]
        out = []
        mod_prefix = self.fc.module + "."
        for s2, ty in choices:
            if ty.startswith(mod_prefix) and ty[len(mod_prefix):] in self.fc.functions:
                name = ty[len(mod_prefix):]
                out.extend(self.inline(self.fc.functions[name], name, None, e, s2, dest, bound_self=False))
            elif ty == "torch.nn.Sequential" and self.sequential_variants(var):
                out.extend(self.call_sequential(var, e, s2, dest))
            else:
                out.extend(self.emit(ty, e, s2, dest, module=module))
        return out

    def sequential_variants(self, var: str) -> list:
        for c in self.cls.mro():
            if var in c.seq_variants:
                return c.seq_variants[var]
        return []

    def call_sequential(self, var: str, e: ast.Call, st: _St, dest) -> list:
        """``self.seq(x)`` for an ``nn.Sequential`` built in ``__init__``: its elements in order."""
        variants = self.sequential_variants(var)
        if self.no_fork:
            variants = variants[:1]
        out = []
        for st1, pos, _kw in self.eval_args(e, st):
            start = pos[0].value() if pos else Const("None")
            for i, variant in enumerate(variants):
                st2 = st1 if i == len(variants) - 1 else st1.fork()
                flat = self.flatten_sequential(variant, 0)
                cur = start
                for j, (name, ty) in enumerate(flat):
                    var_out = dest if (j == len(flat) - 1 and dest is not None) else self.tmp(e, j)
                    st2.nodes = (self.made(Layer(ty, (Arg(cur),), var_out, Var(name), self.span(e))), st2.nodes)
                    cur = var_out
                out.append((st2, _V(var=cur, tensor=True)))
        return out

    def flatten_sequential(self, variant, depth: int) -> list:
        """Elements of a Sequential, nested Sequentials (first variant) expanded in place."""
        flat = []
        for name, ty in variant:
            inner = self.sequential_variants(name) if ty == "torch.nn.Sequential" and depth < 4 else []
            if inner:
                flat.extend(self.flatten_sequential(inner[0], depth + 1))
            else:
                flat.append((name, ty))
        return flat

    def eval_args(self, e: ast.Call, st: _St, bound=None) -> list:
        """[(state, positional values, [(keyword, value)])] for the call's arguments (with
        ``bound``, a partial's ``(positional, keyword)`` values, merged in as the partial does)."""
        res = [(st, [], [])]
        for a in e.args:
            ta = type(a)
            if ta is ast.Starred:
                v = _V(text="*" + _unparse(a.value), tensor=True)
                for _s, pos, _kw in res:
                    pos.append(v)
                continue
            if ta is ast.Name:
                for s, pos, _kw in res:
                    pos.append(self.name(a.id, s))
                continue
            if ta is ast.Constant:
                for _s, pos, _kw in res:
                    pos.append(_V(expr=a))
                continue
            if len(res) == 1:
                s, pos, kw = res[0]
                r = self.ev(a, s)
                if len(r) == 1:  # no fork: extend the one state's lists in place
                    s2, v = r[0]
                    pos.append(v)
                    if s2 is not s:
                        res[0] = (s2, pos, kw)
                else:
                    res = [(s2, pos + [v], list(kw)) for s2, v in r]
                continue
            nres = []
            for s, pos, kw in res:
                for s2, v in self.ev(a, s):
                    nres.append((s2, pos + [v], list(kw)))
            res = nres
        for k in e.keywords:
            if k.arg is None:
                v = _V(text="**" + _unparse(k.value))
                for _s, _pos, kw in res:
                    kw.append((None, v))
                continue
            if len(res) == 1:
                s, pos, kw = res[0]
                r = self.ev(k.value, s)
                if len(r) == 1:  # no fork: extend the one state's lists in place
                    s2, v = r[0]
                    kw.append((k.arg, v))
                    if s2 is not s:
                        res[0] = (s2, pos, kw)
                else:
                    res = [(s2, list(pos), kw + [(k.arg, v)]) for s2, v in r]
                continue
            nres = []
            for s, pos, kw in res:
                for s2, v in self.ev(k.value, s):
                    nres.append((s2, list(pos), kw + [(k.arg, v)]))
            res = nres
        if bound is not None:
            return [(s, *partials.merge(bound[0], bound[1], pos, kw)) for s, pos, kw in res]
        return res

    def emit(
        self, type_: str, e: ast.Call, st: _St, dest, module: Var | None = None, recv: _V | None = None, extra=(),
        bound=None, bound_at: Span | None = None,
    ) -> list:
        out = []
        for st2, pos, kw in self.eval_args(e, st, bound):
            args = [Arg(v.value()) for v in pos]
            args += [Arg(v.value(), k) for k, v in kw]
            args += extra
            if recv is not None:
                args.insert(0, Arg(recv.value()))
            var = dest or self.tmp(e)
            node = self.made(Layer(type_, tuple(args), var, module, self.span(e), bound_at))
            st2.nodes = (node, st2.nodes)
            out.append((st2, _V(var=var, tensor=True)))
        return out

    def forwarding_function(self, fdef, static: bool, e: ast.Call) -> str | None:
        """The torch function a one-expression method only forwards its arguments to, in order
        (``def gelu(self, x): return F.gelu(x)``) when ``e`` passes them all by position: the
        call of the method is that function's call, at the call site (where a rewrite can
        change it); None for any other method."""
        if fdef.decorator_list and not static:
            return None
        body = [s for s in fdef.body if not (type(s) is ast.Expr and type(s.value) is ast.Constant)]
        if len(body) != 1 or type(body[0]) is not ast.Return or type(body[0].value) is not ast.Call:
            return None
        inner = body[0].value
        a = fdef.args
        params = [p.arg for p in (a.posonlyargs + a.args)[0 if static else 1:]]
        if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or not params or inner.keywords or e.keywords:
            return None
        if len(e.args) != len(params) or any(type(x) is ast.Starred for x in e.args):
            return None
        if [x.id if type(x) is ast.Name else None for x in inner.args] != params:
            return None
        d = _dotted(inner.func)
        fq = self.fc.fqn(d) if d else None
        if fq is None or not fq.startswith("torch.") or fq.rsplit(".", 1)[-1][:1].isupper():
            return None
        if fq in T.NON_DL_TORCH or fq.startswith(T.NON_DL_TORCH_PREFIXES):
            return None
        return fq

    def call_lambda(self, attr: str, e: ast.Call, st: _St, dest) -> list:
        """``self.mlpf(x)`` of ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))`` bound in
        ``__init__``: its body inlined like a method's, the names it captured (``m = self.mlp``)
        holding the modules they alias. Positions are the lambda's, in ``__init__``."""
        lam, stmt, qual, captured = self.cls.find_lambda(attr)
        fdef = self.synthetic.get(id(lam))
        if fdef is None:
            ret = ast.Return(value=lam.body)
            ast.copy_location(ret, stmt if stmt is not None else lam)
            fdef = ast.FunctionDef(name="<lambda>", args=lam.args, body=[ret], decorator_list=[], returns=None,
                                   type_comment=None, type_params=[])
            ast.copy_location(fdef, lam)
            self.synthetic[id(lam)] = fdef
        env = {name: (_SELF if held == "self" else _V(alias=("mod", held), text=name)) for name, held in captured.items()}
        return self.inline(fdef, qual, None, e, st, dest, bound_self=False, captured=env)

    # -- inlining
    def inline(
        self, fdef, qual: str, owner, e: ast.Call, st: _St, dest, bound_self: bool, closure=False, captured=None,
        bound=None,
    ) -> list:
        if fdef is None or id(fdef) in self.stack or len(self.stack) > MAX_INLINE_DEPTH or self.no_fork:
            return self.opaque(e, st, True)
        out = []
        for st1, pos, kw in self.eval_args(e, st, bound):
            caller_env = st1.env
            key = None
            if not closure:
                # Same callee, call site, arguments and ``self.*`` state -> same nodes: the
                # callee runs once per distinct input, its node deltas are replayed per path.
                key = (
                    id(e), self.ctx, id(fdef), dest,
                    tuple(_sig(v) for v in pos),
                    tuple((k, _sig(v)) for k, v in kw),
                    tuple((k, _sig(v)) for k, v in caller_env.items() if k[0] == "@" or k.startswith("self.")),
                )
                results = self.memo.get(key)
            else:
                results = None
            if results is None:
                results = self.run_callee(fdef, qual, owner, e, caller_env, pos, kw, bound_self, closure, dest, captured)
                if key is not None:
                    self.memo[key] = results
            if not results:
                out.append((_St(st1.nodes, caller_env, DEAD), _NONE))
                continue
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            for delta, ret, updates in results:
                nodes = _push_all(delta, st1.nodes)
                if updates:
                    cenv = dict(caller_env)
                    cenv.update(updates)
                else:
                    cenv = caller_env if len(results) == 1 else dict(caller_env)
                out.append((_St(nodes, cenv), ret))
        return out

    def run_callee(self, fdef, qual, owner, e, caller_env, pos, kw, bound_self, closure, dest, captured=None) -> list:
        """Run an inlined body from an empty node list: [(added nodes, return value, self.* updates)]."""
        env = dict(captured) if captured else {}
        if closure:
            env.update(caller_env)
        else:
            for k, v in caller_env.items():
                if k[0] == "@" or k.startswith("self."):
                    env[k] = v
        a = fdef.args
        params = list(a.posonlyargs) + list(a.args)
        if bound_self and params:
            env[params[0].arg] = _SELF
            params = params[1:]
        star = any(v.text is not None and v.text.startswith("*") and v.var is None and v.alias is None for v in pos)
        ndef = len(a.defaults)
        first_default = len(params) - ndef
        kwmap = {k: v for k, v in kw if k is not None}
        for i, p in enumerate(params):
            if i < len(pos) and not (star and pos[i].text is not None and pos[i].text.startswith("*")):
                env[p.arg] = pos[i]
            elif p.arg in kwmap:
                env[p.arg] = kwmap.pop(p.arg)
            elif i >= first_default and not star:
                env[p.arg] = _V(expr=a.defaults[i - first_default], tensor=False)
            else:
                env[p.arg] = _V(var=Var(p.arg), tensor=_annotation_is_tensor(p.annotation))
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            if p.arg in kwmap:
                env[p.arg] = kwmap.pop(p.arg)
            elif d is not None:
                env[p.arg] = _V(expr=d, tensor=False)
            else:
                env[p.arg] = _V(var=Var(p.arg), tensor=True)
        if a.vararg is not None:
            env[a.vararg.arg] = _V(text=a.vararg.arg)
        if a.kwarg is not None:
            env[a.kwarg.arg] = _V(text=a.kwarg.arg)
        saved = (self.qual, self.ctx, self.inlined_at, self.stmt, self.cls, self.ret_dest, self.owner)
        self.ret_dest = dest
        if owner is not None:
            self.owner = owner
        self.qual = qual
        self.ctx = self.ctx + (id(e),)
        self.inlined_at = self.inlined_at + (e.lineno,)
        if owner is not None and self.cls is None:
            self.cls = owner
        self.stack.append(id(fdef))
        try:
            results = self.block(fdef.body, [_St(None, env)])
        finally:
            self.stack.pop()
            self.qual, self.ctx, self.inlined_at, self.stmt, self.cls, self.ret_dest, self.owner = saved
        rets = []
        for r in results:
            if r.flow == DEAD:
                continue
            upd = {k: v for k, v in r.env.items() if (k[0] == "@" or k.startswith("self.")) and caller_env.get(k) is not v}
            rets.append(_St(r.nodes, upd, RET, r.ret if r.flow == RET and r.ret is not None else _NONE))
        out = []
        for r in self.merge(rets, e):
            out.append((_cons_to_tuple(r.nodes), r.ret, r.env))
        return out

