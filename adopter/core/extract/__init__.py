"""Model-structure extraction from source with the stdlib ``ast`` (paper §3.2).

``extract_source(text, filename) -> FileStructures`` never imports or executes the
scanned code. For every class it records the ``__init__`` layer bindings (following
``self._init_x(...)`` helpers; ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict``
contents as ``container`` bindings ``self.layers[*]``, ``self.seq[0]``; ``ACT2FN[...]``
/ ``get_activation(...)`` resolved through :data:`adopter.core.extract.tables.ACTIVATIONS`).
For every entry function (each class's ``forward`` and each module-level function) it
enumerates the control-flow paths, inlining ``self.<method>(...)``, ``super().<m>(...)``
and calls of module-level/nested functions of the same file (also through local
aliases such as ``attention_interface``), and writes each path as a sequence of DSL
nodes (:mod:`adopter.core.dsl`) in SSA form.

How paths are enumerated (an abstract interpretation over *states*):

* A state is (node list, environment). Statements run on every live state; ``if``,
  loops, ``try`` and conditional expressions run each branch on a copy.
* At the join, states that added no DL node in any branch are merged back into one:
  variables that differ get a fresh SSA version (a "phi", recorded in
  ``FunctionStructures.sources``), so a branch with no DL node never forks paths.
  States whose *aliases* differ (``attention_interface`` bound to
  ``eager_attention_forward`` in one branch and to ``ALL_ATTENTION_FUNCTIONS[...]`` in
  the other) stay apart, because the callee decides which nodes follow.
* An ``if`` on a condition already decided on the path (same text, same SSA versions of
  the names it reads) takes the same branch again; ``if x is None`` on a parameter that
  holds a literal (an inlined function's default) is decided statically.
* Loops run their body once (paper: each loop is expanded once); loops that do not
  iterate over a module container also keep the zero-trip path.
* ``raise`` kills a path; ``return`` ends it. A path that is a prefix of another
  (an early return before any further DL node) is dropped from the entry's result.
* At most :data:`MAX_PATHS` paths per entry, and after :data:`MAX_STEPS` statement
  executions branches stop forking (``FunctionStructures.capped`` says when either cut
  paths off); inlining stops at :data:`MAX_INLINE_DEPTH` and on recursion. An inlined
  callee runs once per distinct (call site, arguments) and its nodes are replayed on
  every path that reaches the call.

SSA: every assignment gets a version keyed by its statement and inlining context,
so the same statement has the same version on every path; temporaries for nested
calls are ``tmp_<n>``. Parameters and never-assigned names are version 0. A node
returned by an inlined callee writes straight into the caller's assignment target
(``q = self._split_heads(x)``: the callee's ``permute`` outputs ``q#1``).

Node kinds: module calls ``Layer(type, module=Var("self.x"))`` (type from the
``__init__`` binding; one path variant per type when conditional bindings differ);
functions ``Layer("torch.nn.functional.softmax")``; tensor methods
``Layer("torch.Tensor.view", args=(self_tensor, ...))``; operators ``TensorOp``.
Calls that are no DL computation (builtins, shape queries, tensor factories, logging,
``print``, ``warnings``, transformers utilities) produce no node; unresolvable calls of
``self.<attr>`` in a module produce a barrier ``Layer(UNKNOWN_TYPE)``.

Modules of this package (each imports only the stdlib, :mod:`adopter.core.dsl`,
:mod:`adopter.core.dsl_text`, :mod:`adopter.core.structures`, :mod:`adopter.core.source_file`,
:mod:`adopter.core.syntax`, :mod:`adopter.core.symbolic` (dotted names) and its siblings):

* :mod:`~adopter.core.extract.driver` — ``extract_source`` / ``extract_file``: runs the
  steps below over one file and builds the :class:`FileStructures`; ``torch_base_of``.
* :mod:`~adopter.core.extract.symbols` — symbol tables of one file: imports and aliases,
  module-level functions and dicts, the class table (MRO in the file, methods, bindings).
* :mod:`~adopter.core.extract.init_bindings` — ``__init__`` extraction (``InitBinding``),
  assembled from :mod:`~adopter.core.extract.init_values` (what an expression may hold:
  layer constructions, class references, factories followed) and
  :mod:`~adopter.core.extract.init_containers` (lists and Sequentials being built, the
  children of container bindings).
* :mod:`~adopter.core.extract.values` — abstract values and states, extraction limits.
* :mod:`~adopter.core.extract.interp` — the forward interpreter, assembled from
  :mod:`~adopter.core.extract.paths` (statements, control-flow paths),
  :mod:`~adopter.core.extract.ssa` (SSA versions, assignment, branch merge),
  :mod:`~adopter.core.extract.expressions` (expressions to values and nodes) and
  :mod:`~adopter.core.extract.calls` (call resolution and inlining).
* :mod:`~adopter.core.extract.printer` — ``format_structure`` (debugging aid).
* :mod:`~adopter.core.extract.tables` — static tables (tensor methods, activations, ...).
"""

from __future__ import annotations

from adopter.core.extract.driver import extract_file, extract_source, torch_base_of
from adopter.core.extract.printer import format_structure
from adopter.core.extract.values import ATTENTION_TABLE_TYPE, MAX_INLINE_DEPTH, MAX_PATHS, UNKNOWN_TYPE

__all__ = [
    "extract_source",
    "extract_file",
    "format_structure",
    "torch_base_of",
    "MAX_PATHS",
    "MAX_INLINE_DEPTH",
    "UNKNOWN_TYPE",
    "ATTENTION_TABLE_TYPE",
]
