"""Pattern matching (paper §3.4): rule patterns against extracted model structures.

For every entry function and every one of its control-flow paths, the forward
source pattern of each rule variant is matched as a *sub-sequence*: pattern nodes
must match path nodes in order, other path nodes may sit between them. Abstract
variables (``$x``) are bound consistently across the pattern — a variable binds to
a concrete :class:`Var` (name *and* SSA version) or to a :class:`Const` (its text) —
so only data-connected nodes match. Then the init pattern is matched, in any order,
against the ``__init__`` bindings of the class (and of its bases in the same file),
sharing the bindings made by the forward pattern (``@$drop`` links the called module
to its ``self.dropout = nn.Dropout(...)``). Finally the rule's preconditions run;
each returns a reason string when the match must be dropped — or a :class:`Refusal` (a
precision class, :data:`PRECISION_CODES`) when the pattern fits but the kernel is not provably
applicable: the match is then reported ``refused`` with that code, and a precondition may
instead mark it ``conditional`` (it holds only under a configuration a trace settles). The
classes every rule shares (``torchscript``, ``branch-straddle``, a matched module whose type
depends on the configuration) are checked by :mod:`adopter.core.match.precision`.

Node matching details (all documented because rules depend on them):

* Layer types: the pattern type is ``a|b|...``; the concrete FQN must equal one of them.
* Arguments: for layer types with a known signature (:data:`SIGNATURES`: constructor
  signatures for ``torch.nn`` classes, applied to calls that are not made through a
  module, i.e. constructions in ``__init__`` and function calls) positional and
  keyword arguments are normalized to parameter names on both sides, so
  ``nn.Dropout(0.1)`` and ``nn.Dropout(p=0.1)`` are the same. A positional pattern
  argument is required; a keyword pattern argument that the concrete call does not
  pass is simply left unbound (the default applies). Extra concrete arguments are ignored.
* Tensor ops: same operator and arity; ``+`` and ``*`` are commutative (both argument
  orders are tried).
* Variables in patterns that are not abstract (``self.training``) match a concrete
  variable of that name (any version) or a constant with that text; constants match
  constants with the same value (``'gelu'`` == ``"gelu"``).
* ``self.<attr>`` variables compare by name only (attributes carry no SSA version).
* Same-file subclasses (rules with ``match_subclasses``): a layer type defined in the scanned
  file as a subclass of a ``torch.nn`` layer that defines no method but ``__init__`` (forward
  inherited) matches a pattern naming the parent (:func:`layer_subclass_aliases`); the
  arguments of its construction are not matched (its constructor has its own signature).
* Rule hooks over the scanned file: ``Rule.layer_aliases`` names more same-file layer classes
  that match as a torch layer (a GeLU rule: modules whose forward is a GeLU), and
  ``Rule.inlined_functions`` same-file functions whose inlined body the rule sees as one call
  (:func:`fold_inlined_calls`: ESM's ``gelu(x)`` as ``torch.nn.functional.gelu``).

Results are de-duplicated with :meth:`Match.key` after re-homing: a match whose nodes all
lie in one function other than the entry (a helper inlined into several ``forward``s,
e.g. ``eager_attention_forward``) is reported once, under that function. When the same
statements match on several paths and preconditions add different nodes on each (attention
projections: GPT-2's ``self.q_attn`` on the cross-attention path, ``self.c_attn`` on the
self-attention one), the variant reported is the best by :func:`variant_rank`: the one that
runs in every configuration of the class and without optional inputs.

Modules:

    core           values, bindings, node matching, sub-sequence search over one path
    init_match     the init pattern against a class's ``__init__`` bindings
    context        ``MatchContext`` (what preconditions see) and data-flow helpers
    local_layers   same-file layer subclasses and folded same-file helper functions
    post           path-variant choice, re-homing, cross-path veto, overlaps
    precision      precision classes shared by every rule (refused / conditional matches)
    driver         ``match_structures``: every rule on every path of one file
    source         one function's ``ast`` without parsing the whole file
    source_uses    source-level reads: escaping intermediates, ``self.<attr>`` per class
"""

from __future__ import annotations

from adopter.core.match.context import (
    PRECISION_CODES,
    MatchContext,
    NotACandidate,
    Refusal,
    RuleLike,
    reads,
    uses_outside,
)
from adopter.core.match.core import SIGNATURES, match_node, match_pattern, same_value
from adopter.core.match.driver import match_structures
from adopter.core.match.init_match import class_init_bindings, match_init
from adopter.core.match.local_layers import fold_inlined_calls, layer_subclass_aliases, local_type_names
from adopter.core.match.post import optional_inputs, optional_module_attrs, variant_rank

__all__ = [
    "PRECISION_CODES",
    "SIGNATURES",
    "MatchContext",
    "NotACandidate",
    "Refusal",
    "RuleLike",
    "class_init_bindings",
    "fold_inlined_calls",
    "layer_subclass_aliases",
    "local_type_names",
    "match_init",
    "match_node",
    "match_pattern",
    "match_structures",
    "optional_inputs",
    "optional_module_attrs",
    "reads",
    "same_value",
    "uses_outside",
    "variant_rank",
]
