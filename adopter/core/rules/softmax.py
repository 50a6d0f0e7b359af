"""softmax: drop-in replacement of torch softmax calls by the triton kernel ``adopter.kernels.softmax``."""

from __future__ import annotations

from adopter.core.rules import Rule

DSL = """
rule softmax
forward:
    torch.nn.functional.softmax|torch.softmax|torch.Tensor.softmax|torch.special.softmax($x) -> $y
    => adopter.kernels.softmax($x) -> $y

rule softmax
init:
    torch.nn.Softmax() -> $m
    => adopter.kernels.Softmax() -> $m
forward:
    torch.nn.Softmax@$m($x) -> $y
    => adopter.kernels.Softmax@$m($x) -> $y

# nn.Softmax(dim=-1)(x): the module is constructed and called in one expression
rule softmax
forward:
    torch.nn.Softmax() -> $m
    => adopter.kernels.Softmax() -> $m
"""

DOC = """\
Replaces softmax with the triton softmax kernel (same signature: ``input, dim, dtype``).
A match is every call of ``torch.nn.functional.softmax`` (however imported: ``F.softmax``,
``nn.functional.softmax``), ``torch.softmax``, ``torch.special.softmax``, the tensor method
``x.softmax(...)``, a ``torch.nn.Softmax`` module bound in ``__init__`` and called in
``forward``, or one constructed and called inline (``nn.Softmax(dim=-1)(x)``); one match per
call site. Not a match: ``log_softmax``, ``gumbel_softmax``,
sparse/masked softmax variants, user functions named ``softmax``, and calls in code that
extraction does not reach (nested lambdas)."""

RULE = Rule(name="softmax", kernel="adopter.kernels.softmax", doc=DOC, dsl=DSL)
