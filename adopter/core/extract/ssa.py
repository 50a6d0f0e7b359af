"""SSA state of the forward interpreter: versions and temporaries, spans, assignment
binding, and the merge of states at a join (phi versions recorded as sources)."""

from __future__ import annotations

import ast

from adopter.core.dsl import Arg, Span, TensorOp, Var
from adopter.core.extract.expressions import _OPS
from adopter.core.extract.symbols import _span
from adopter.core.extract.values import _SELF, _V, DEAD, RET, _St


class _Ssa:
    """SSA state and branch merge of :class:`adopter.core.extract.interp._Interp`."""

    # -- versions and temporaries
    def new_var(self, name: str, site) -> Var:
        key = (name, id(site), self.ctx)
        v = self.vers.get(key)
        if v is None:
            n = self.vcount.get(name, 0) + 1
            self.vcount[name] = n
            v = self.vers[key] = Var(name, n)
        return v

    def made(self, node):
        """The node of this entry equal to ``node`` (``node`` itself the first time): a statement
        run again on each state a branch forked makes equal nodes, and one object for them lets
        matching share its work between the paths (by identity)."""
        return self.nodes_made.setdefault(node, node)

    def tmp(self, site, extra=0) -> Var:
        key = (id(site), extra, self.ctx)
        v = self.tmps.get(key)
        if v is None:
            self.ntmp += 1
            v = self.tmps[key] = Var(f"tmp_{self.ntmp}")
        return v

    def span(self, node) -> Span:
        # the same expression in the same inlining context always has the same span
        key = (id(node), self.ctx)
        sp = self.spans.get(key)
        if sp is None:
            sp = self.spans[key] = _span(node, self.qual, self.stmt, self.inlined_at)
        return sp

    # -- join
    def merge(self, states: list[_St], site) -> list[_St]:
        states = [s for s in states if s.flow != DEAD]
        if len(states) <= 1:
            return states
        coarse: dict = {}
        for s in states:
            coarse.setdefault((id(s.nodes), s.flow), []).append(s)
        if len(coarse) == len(states):
            return states
        out = []
        for g0 in coarse.values():
            if len(g0) == 1:
                out.append(g0[0])
                continue
            first = g0[0]
            fenv = first.env
            keys = set(fenv)
            for s in g0:
                if s.env is not fenv:
                    keys.update(s.env)
            diff = []
            alias_keys = []
            if len(g0) == 2:  # the usual join of two branches, without per-key lists
                oenv = g0[1].env
                for k in keys:
                    v0 = fenv.get(k)
                    v1 = oenv.get(k)
                    if v0 is v1:
                        continue
                    diff.append(k)
                    if (v0 is not None and v0.alias is not None) or (v1 is not None and v1.alias is not None):
                        alias_keys.append(k)
            else:
                envs = [s.env for s in g0]
                for k in keys:
                    v0 = fenv.get(k)
                    vals = [e.get(k) for e in envs]
                    if all(v is v0 for v in vals):
                        continue
                    diff.append(k)
                    if any(v is not None and v.alias is not None for v in vals):
                        alias_keys.append(k)
            ret_alias = first.flow == RET and any(s.ret is not None and s.ret.alias is not None for s in g0)
            if alias_keys or ret_alias:
                # states whose callables differ stay apart: they lead to different nodes
                sub: dict = {}
                for s in g0:
                    sig = tuple(None if s.env.get(k) is None else s.env[k].alias for k in alias_keys)
                    if ret_alias:
                        sig += (None if s.ret is None else s.ret.alias,)
                    sub.setdefault(sig, []).append(s)
                groups = list(sub.values())
            else:
                groups = [g0]
            for g in groups:
                out.append(g[0] if len(g) == 1 else self.join(g, diff, site))
        return out

    def join(self, g: list[_St], diff: list[str], site) -> _St:
        first = g[0]
        env = dict(first.env)
        for k in diff:
            vals = [s.env.get(k) for s in g]
            v0 = vals[0]
            if all(v is v0 for v in vals):
                continue
            if v0 is not None and v0.alias is not None:
                continue  # the same callable on every state (grouped by it)
            if k[0] == "?":  # a branch decision that differs: unknown after the join
                env.pop(k, None)
                continue
            phi = self.new_var(k, site)
            env[k] = _V(var=phi, tensor=any(v is None or v.tensor for v in vals))
            self.add_sources(phi, vals)
        ret = first.ret
        if first.flow == RET and any(s.ret is not ret for s in g) and (ret is None or ret.alias is None):
            phi = self.tmp(site, "ret")
            ret = _V(var=phi, tensor=any(s.ret is None or s.ret.tensor for s in g))
            self.add_sources(phi, [s.ret for s in g])
        return _St(first.nodes, env, first.flow, ret)

    def add_sources(self, var: Var, vals) -> None:
        srcs = []
        for v in vals:
            if v is not None and v.var is not None and v.var != var and v.var not in srcs:
                srcs.append(v.var)
        if srcs:
            old = self.sources.get(var)
            if old:
                srcs = list(old) + [x for x in srcs if x not in old]
            self.sources[var] = tuple(srcs)

    # -- assignment
    def assign(self, s, st: _St) -> list[_St]:
        targets = s.targets if type(s) is ast.Assign else [s.target]
        dest = None
        if len(targets) == 1:
            tg = targets[0]
            if type(tg) is ast.Name:
                dest = self.new_var(tg.id, s)
            elif type(tg) is ast.Attribute and type(tg.value) is ast.Name and st.env.get(tg.value.id) is _SELF:
                dest = self.new_var(f"self.{tg.attr}", s)
        out = []
        evaluated = None
        if len(targets) == 1 and type(targets[0]) in (ast.Tuple, ast.List) \
                and not any(type(x) is ast.Starred for x in targets[0].elts):
            evaluated = self.unpacked_elements(s.value, len(targets[0].elts), st)
        for st2, v in evaluated if evaluated is not None else self.ev(s.value, st, dest):
            for tg in targets:
                self.bind(tg, v, st2, s, dest)
            out.append(st2)
        return out

    def bind(self, tg, v: _V, st: _St, site, dest: Var | None) -> None:
        t = type(tg)
        if t is ast.Name:
            if v.alias is not None:
                st.env[tg.id] = v
            else:
                var = dest if dest is not None else self.new_var(tg.id, site)
                if v.var is not None and v.var != var:
                    self.add_sources(var, (v,))
                st.env[tg.id] = _V(var=var, tensor=v.tensor, elts=v.elts)
        elif t is ast.Tuple or t is ast.List:
            elts = tg.elts
            if v.elts is not None and len(v.elts) == len(elts) and not any(type(e) is ast.Starred for e in elts):
                for e, ev in zip(elts, v.elts):
                    self.bind(e, ev, st, site, None)
            else:
                item = _V(tensor=v.tensor or v.var is not None, text="item")
                for e in elts:
                    self.bind(e.value if type(e) is ast.Starred else e, item, st, site, None)
        elif t is ast.Attribute:
            if type(tg.value) is ast.Name and st.env.get(tg.value.id) is _SELF:
                key = f"self.{tg.attr}"
                if v.alias is not None:
                    st.env[key] = v
                else:
                    var = dest if dest is not None else self.new_var(key, site)
                    st.env[key] = _V(var=var, tensor=v.tensor)
        elif t is ast.Subscript:
            base = tg.value
            if type(base) is ast.Name and base.id in st.env:
                old = st.env[base.id]
                if old.alias is None:
                    st.env[base.id] = _V(var=self.new_var(base.id, tg), tensor=old.tensor)
        elif t is ast.Starred:
            self.bind(tg.value, v, st, site, dest)

    def augassign(self, s: ast.AugAssign, st: _St) -> list[_St]:
        tg = s.target
        if type(tg) is ast.Name:
            old = st.env.get(tg.id) or self.name(tg.id, st)
            key = tg.id
        elif type(tg) is ast.Attribute and type(tg.value) is ast.Name and st.env.get(tg.value.id) is _SELF:
            key = f"self.{tg.attr}"
            old = self.self_attr(tg.attr, st, tg)
        else:
            return [x for x, _ in self.ev(s.value, st)]
        out = []
        for st2, rv in self.ev(s.value, st):
            var = self.new_var(key, s)
            op = _OPS.get(type(s.op))
            if op is not None and (old.tensor or rv.tensor):
                node = self.made(TensorOp(op, (Arg(old.value()), Arg(rv.value())), var, self.span(s)))
                st2.nodes = (node, st2.nodes)
            st2.env[key] = _V(var=var, tensor=old.tensor or rv.tensor)
            out.append(st2)
        return out

