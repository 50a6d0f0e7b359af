"""Control-flow path enumeration: statements run on every live state; ``if``, loops and
``try`` fork states (merged back by :mod:`adopter.core.extract.ssa`); the entry's
paths are the node lists of the states left at its end."""

from __future__ import annotations

import ast

from adopter.core.extract import tables as T
from adopter.core.extract.symbols import _dotted
from adopter.core.extract.values import (
    _FALSE,
    _NONE,
    _TEST_NAMES,
    _TRUE,
    _V,
    BRK,
    CONT,
    DEAD,
    LIVE,
    MAX_PATHS,
    MAX_STEPS,
    RET,
    _cons_to_tuple,
    _has_module,
    _St,
    _unparse,
)
from adopter.core.structures import PathStructure


class _Paths:
    """Statements and control flow of :class:`adopter.core.extract.interp._Interp`."""

    @staticmethod
    def _paths(heads) -> tuple[PathStructure, ...]:
        interior: set[int] = set()
        uniq = []
        seen = set()
        for h in heads:
            if h is None or id(h) in seen:
                continue
            seen.add(id(h))
            uniq.append(h)
            cell = h[1]
            while cell is not None and id(cell) not in interior:
                interior.add(id(cell))
                cell = cell[1]
        kept = [h for h in uniq if id(h) not in interior]
        if not kept:
            return (PathStructure(()),)
        return tuple(PathStructure(_cons_to_tuple(h)) for h in kept)

    # -- statements
    def block(self, body, states: list[_St]) -> list[_St]:
        for s in body:
            live = [x for x in states if x.flow == LIVE]
            if not live:
                break
            if len(live) != len(states):
                done = [x for x in states if x.flow != LIVE]
            else:
                done = []
            self.stmt = s
            self.steps += len(live)
            if self.steps > MAX_STEPS:
                if not self.no_fork:
                    self.no_fork = True
                    self.capped = True
                if len(live) > 1:
                    live = live[:1]
            new = self.statement(s, live)
            states = done + new if done else new
            if len(states) > MAX_PATHS:
                states = states[:MAX_PATHS]
                self.capped = True
        return states

    def statement(self, s, live: list[_St]) -> list[_St]:
        t = type(s)
        if t is ast.Assign or t is ast.AnnAssign:
            if s.value is None:
                return live
            out = []
            for st in live:
                out.extend(self.assign(s, st))
            return out
        if t is ast.Expr:
            v = s.value
            tv = type(v)
            if tv is ast.Await:
                v = v.value
                tv = type(v)
            if tv is not ast.Call and tv is not ast.NamedExpr:
                return live
            if tv is ast.Call and self.extraneous(v):
                return live
            out = []
            for st in live:
                out.extend(st2 for st2, _ in self.ev(v, st))
            return out
        if t is ast.Return:
            out = []
            for st in live:
                if s.value is None:
                    st.flow, st.ret = RET, _NONE
                    out.append(st)
                else:
                    # in an inlined callee, the returned node writes straight into the
                    # caller's assignment target (``q = self._split_heads(x)``: permute -> q#1)
                    for st2, v in self.ev(s.value, st, self.ret_dest):
                        st2.flow, st2.ret = RET, v
                        out.append(st2)
            return out
        if t is ast.If:
            return self.if_(s, live)
        if t is ast.For or t is ast.AsyncFor or t is ast.While:
            return self.loop(s, live)
        if t is ast.AugAssign:
            out = []
            for st in live:
                out.extend(self.augassign(s, st))
            return out
        if t is ast.With or t is ast.AsyncWith:
            for st in live:
                for item in s.items:
                    if item.optional_vars is not None:
                        self.bind(item.optional_vars, _V(expr=item.context_expr), st, s, None)
            return self.block(s.body, live)
        if t is ast.Try or t.__name__ == "TryStar":
            return self.try_(s, live)
        if t is ast.Raise:
            for st in live:
                st.flow = DEAD
            return live
        if t is ast.Break or t is ast.Continue:
            for st in live:
                st.flow = BRK if t is ast.Break else CONT
            return live
        if t is ast.FunctionDef or t is ast.AsyncFunctionDef:
            self.defs[id(s)] = (s, f"{self.qual}.{s.name}")
            v = _V(alias=("def", id(s)), text=s.name)
            for st in live:
                st.env[s.name] = v
            return live
        if t is ast.Match:
            out = []
            for st in live:
                res = []
                for case in s.cases:
                    res.extend(self.block(case.body, [st.fork()]))
                res.append(st)
                out.extend(self.merge(res, s))
            return out
        return live  # pass, assert, import, global, delete, ...

    def extraneous(self, call: ast.Call) -> bool:
        r = self.extraneous_cache.get(id(call))
        if r is None:
            r = self.extraneous_cache[id(call)] = self._extraneous(call)
        return r

    def _extraneous(self, call: ast.Call) -> bool:
        d = _dotted(call.func)
        if d is None:
            return False
        head = d.split(".", 1)[0]
        if d == "print" or head in T.LOGGER_NAMES or d.startswith("self.logger"):
            return True
        fq = self.fc.fqn(d) or ""
        return fq in T.EXTRANEOUS_CALLS or fq.startswith(("warnings.", "logging."))

    def if_(self, s: ast.If, live: list[_St]) -> list[_St]:
        test = s.test
        if type(test) is ast.Constant:
            return self.block(s.body if test.value else s.orelse, live)
        scripting = self.scripting_test(test)
        if scripting is not None:
            # Python never runs a ``torch.jit.is_scripting()`` branch (TorchScript's compiler
            # alone does; adopter's own rewrites keep the user's statements there for it)
            return self.block(s.orelse if scripting else s.body, live)
        out = []
        for st in live:
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            # Remember the decision on each branch: a later ``if`` on the same condition
            # (same names, same SSA versions) takes the same branch, so ``if
            # self.use_batch_norm:`` twice in a forward gives 2 paths, not 4.
            dkey = self.decision_key(test, st)
            d = st.env.get(dkey)
            known = (d is _TRUE) if (d is _TRUE or d is _FALSE) else self.truth(test, st)
            if known is not None:
                out.extend(self.block(s.body if known else s.orelse, [st]))
                continue
            taken = st.fork()
            taken.env[dkey] = _TRUE
            body = self.block(s.body, [taken])
            self.stmt = s
            if self.no_fork and any(b.nodes is not st.nodes for b in body if b.flow != DEAD):
                out.extend(body)
                continue
            st.env[dkey] = _FALSE
            orelse = self.block(s.orelse, [st]) if s.orelse else [st]
            self.stmt = s
            out.extend(self.merge(body + orelse, s))
        return out

    def scripting_test(self, test) -> bool | None:
        """True for ``torch.jit.is_scripting()`` (however ``torch`` is imported), False for its
        ``not``; None for any other test."""
        negated = type(test) is ast.UnaryOp and type(test.op) is ast.Not
        call = test.operand if negated else test
        if type(call) is not ast.Call or call.args or call.keywords:
            return None
        d = _dotted(call.func)
        if d is None or (self.fc.fqn(d) or d) not in ("torch.jit.is_scripting", "torch.jit._script.is_scripting"):
            return None
        return not negated

    def decision_key(self, test, st: _St) -> str:
        names = _TEST_NAMES.get(id(test))
        if names is None:
            found = set()
            for n in ast.walk(test):
                tn = type(n)
                if tn is ast.Name:
                    found.add(n.id)
                elif tn is ast.Attribute and type(n.value) is ast.Name:
                    found.add("self." + n.attr)
            names = _TEST_NAMES[id(test)] = sorted(found)
        parts = [_unparse(test)]
        env = st.env
        for n in names:
            v = env.get(n)
            if v is not None:
                if v.var is not None:
                    parts.append(f"{n}={v.var}")
                elif v.alias is not None:
                    parts.append(f"{n}={v.alias}")
                else:
                    parts.append(f"{n}=`{v.value()}`")
        return "?" + "|".join(parts)

    def truth(self, test, st: _St) -> bool | None:
        """Statically known truth of an ``if`` test, or None. Only decides tests on names
        that hold a literal constant on this path (an inlined function's ``None`` default):
        ``if scaling is None``, ``if dropout``, ``not x``, ``and``/``or`` of those."""
        t = type(test)
        if t is ast.Name:
            v = st.env.get(test.id)
            if v is not None and v.var is None and type(v.expr) is ast.Constant:
                return bool(v.expr.value)
            return None
        if t is ast.Compare:
            if len(test.ops) != 1 or type(test.left) is not ast.Name:
                return None
            op = type(test.ops[0])
            right = test.comparators[0]
            if op not in (ast.Is, ast.IsNot) or type(right) is not ast.Constant or right.value is not None:
                return None
            v = st.env.get(test.left.id)
            if v is None:
                return None
            if v is _NONE or (v.var is None and type(v.expr) is ast.Constant and v.expr.value is None):
                is_none = True
            elif v.alias is not None or v.elts is not None or (
                v.var is None and v.expr is not None and type(v.expr) not in (ast.Name, ast.Subscript)
            ):
                # a literal or an expression like ``self.scaling`` passed for the parameter
                is_none = False
            else:
                return None
            return is_none if op is ast.Is else not is_none
        if t is ast.UnaryOp and type(test.op) is ast.Not:
            r = self.truth(test.operand, st)
            return None if r is None else not r
        if t is ast.BoolOp:
            vals = [self.truth(v, st) for v in test.values]
            if type(test.op) is ast.And:
                if any(v is False for v in vals):
                    return False
                return True if all(v is True for v in vals) else None
            if any(v is True for v in vals):
                return True
            return False if all(v is False for v in vals) else None
        return None

    def loop(self, s, live: list[_St]) -> list[_St]:
        out = []
        is_for = type(s) is not ast.While
        for st in live:
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            zero_trip = True
            once = st.fork()
            if is_for:
                zero_trip = not self.bind_loop_target(s, once)
            if self.no_fork:
                zero_trip = False
            res = self.block(s.body, [once])
            self.stmt = s
            exits = [st] if zero_trip else []
            broke = []
            ended = []
            for r in res:
                if r.flow == LIVE or r.flow == CONT:
                    r.flow = LIVE
                    exits.append(r)
                elif r.flow == BRK:
                    r.flow = LIVE
                    broke.append(r)
                else:
                    ended.append(r)
            if s.orelse and exits:
                exits = self.block(s.orelse, exits)
                self.stmt = s
            out.extend(self.merge(exits + broke + ended, s))
        return out

    def bind_loop_target(self, s, st: _St) -> bool:
        """Bind the loop variable(s) for one iteration; True if iterating a module container."""
        elem = self.element(s.iter, st)
        self.bind(s.target, elem, st, s, None)
        return _has_module(elem)

    def try_(self, s, live: list[_St]) -> list[_St]:
        out = []
        for st in live:
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            start = st.fork()
            body = self.block(s.body, [st])
            self.stmt = s
            ok = [b for b in body if b.flow == LIVE]
            rest = [b for b in body if b.flow != LIVE]
            if s.orelse and ok:
                ok = self.block(s.orelse, ok)
            res = ok + rest
            for h in () if self.no_fork else s.handlers:
                hs = start.fork()
                if h.name:
                    hs.env[h.name] = _V(text=h.name)
                res.extend(self.block(h.body, [hs]))
            if s.finalbody:
                fin_live = [r for r in res if r.flow == LIVE]
                res = [r for r in res if r.flow != LIVE] + self.block(s.finalbody, fin_live)
            self.stmt = s
            out.extend(self.merge(res, s))
        return out

