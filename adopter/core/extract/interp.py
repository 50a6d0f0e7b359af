"""The forward interpreter: one instance per file, :meth:`_Interp.entry` per entry function.

Its methods live in mixins by concern; they share the interpreter state set up here:

* per file: ``fc`` (:class:`_File`), ``defs`` (nested ``def`` id -> (FunctionDef,
  qualified name)), ``synthetic`` (calls built for ``apply_chunking_to_forward``, the generator a
  ``map`` call is read as);
* per entry: ``cls``/``owner`` (class of the inlined method / whose ``super()`` is
  meant), SSA bookkeeping ``vers``/``vcount``/``tmps``/``ntmp``/``sources``/``nodes_made``, inlining
  context ``ctx``/``inlined_at``/``qual``/``stack``/``ret_dest``/``memo``, ``spans``,
  ``stmt`` (statement being run), and the limits' ``steps``/``no_fork``/``capped``.
"""

from __future__ import annotations

import ast

from adopter.core.dsl import Var
from adopter.core.extract.calls import _Calls
from adopter.core.extract.expressions import _Expressions
from adopter.core.extract.paths import _Paths
from adopter.core.extract.ssa import _Ssa
from adopter.core.extract.symbols import _ClassCtx, _File, _span
from adopter.core.extract.values import _SELF, _V, DEAD, _annotation_is_tensor, _St
from adopter.core.structures import FunctionStructures


class _Interp(_Paths, _Ssa, _Expressions, _Calls):
    def __init__(self, fc: _File):
        self.fc = fc
        self.defs: dict[int, tuple[ast.FunctionDef, str]] = {}
        self.synthetic: dict[int, ast.AST] = {}
        # per file, by ast node id: ``self.fc.fqn`` of a called dotted name, ``extraneous(call)``
        self.fq_cache: dict[int, str | None] = {}
        self.extraneous_cache: dict[int, bool] = {}

    # -- entry
    def entry(
        self, cls: _ClassCtx | None, fdef: ast.FunctionDef, qual: str, owner: _ClassCtx | None = None
    ) -> FunctionStructures:
        """The paths of ``fdef`` run on an instance of ``cls``; ``owner``: the class defining it
        when ``cls`` inherits it (whose bases ``super()`` in it means)."""
        self.cls = cls
        self.owner = owner or cls
        self.vers: dict = {}
        self.vcount: dict[str, int] = {}
        self.tmps: dict = {}
        self.ntmp = 0
        self.ctx: tuple = ()
        self.inlined_at: tuple[int, ...] = ()
        self.qual = qual
        self.stack = [id(fdef)]
        self.ret_dest = None
        self.sources: dict = {}
        self.memo: dict = {}
        self.spans: dict = {}
        self.nodes_made: dict = {}
        self.stmt = fdef
        self.capped = False
        self.steps = 0
        self.no_fork = False
        env = {}
        params = list(fdef.args.posonlyargs) + list(fdef.args.args)
        if cls is not None and params:
            env[params[0].arg] = _SELF
            params = params[1:]
        for p in params + list(fdef.args.kwonlyargs):
            env[p.arg] = _V(var=Var(p.arg), tensor=_annotation_is_tensor(p.annotation))
        for p in (fdef.args.vararg, fdef.args.kwarg):
            if p is not None:
                env[p.arg] = _V(text=p.arg)
        states = self.block(fdef.body, [_St(None, env)])
        heads = [s.nodes for s in states if s.flow != DEAD]
        paths = self._paths(heads)
        span = _span(fdef, qual, fdef)
        return FunctionStructures(
            class_name=cls.name if cls is not None else None,
            function=fdef.name,
            paths=paths,
            span=span,
            capped=self.capped,
            sources=self.sources,
        )
