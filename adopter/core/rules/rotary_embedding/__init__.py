"""rotary_embedding: rotary position embeddings (RoPE) in every way models write them, each computed
by one kernel without the rotation's temporaries (the negated half, the concatenation or stack,
every product and the sum; complex tensors).

Forms (each one a DSL variant, in :mod:`.variants`), rewritten one expression at a time, nothing
else changes but statements only the rotation used:

* the sum with a rotation function, half-split (HF Llama) or interleaved (GPT-J's
  ``rotate_every_two``, GLM, Cohere), the function module-level, a ``@staticmethod`` or a method
  of the class (``self.rotate_half(x)``, ``Cls.rotate_half(x)``)::

      q_embed = (q * cos) + (rotate_half(q) * sin)
   => q_embed = rotary(q, cos, sin, rotate_half)
      return (tensor * cos) + (rotate_every_two(tensor) * sin)
   => return rotary_interleaved(tensor, cos, sin, rotate_every_two)

* the half rotation written inline (litgpt's ``apply_rope``): its statements go when only the sum
  reads them and they come right before it, else the rotated tensor is handed over::

      x1 = x[..., : head_size // 2]; x2 = x[..., head_size // 2 :]
      rotated = torch.cat((-x2, x1), dim=-1)
      roped = (x * cos) + (rotated * sin)
   => roped = rotary(x, cos, sin)            (or rotary(x, cos, sin, rotated))

* the complex rotation (Meta-llama, torchtitan, mistral-inference)::

      xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
   => xq_out = rotary_complex(xq_, freqs_cis).flatten(3)

* the pairs rotated in real numbers and stacked (llama2.c) or concatenated::

      xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin; xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
      xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
   => xq_out = rotary_pairs(xq_r, xq_i, freqs_cos, freqs_sin).flatten(3)

``adopter.kernels.rotary*`` run the fused kernel when their preconditions hold at run time (dtypes,
shapes, no gradient wanted for cos/sin/freqs_cis, a rotation function still the rotation read here)
and the original expression otherwise. Each form is recognised by what it computes, read from the
source: which elements pair up (halves or even/odd positions), the signs, the order of the parts; a
look-alike that computes something else (a flipped sign, swapped halves, a third of the dimension,
another tensor rotated than the one multiplied by cos) is not a match, whatever it is named.

The package, one module per part (each imports only those listed before it):

    literals       constants and call arguments as the forms read them
    scope          what the file binds: torch's names, module-level functions, classes, methods
    site           the site read: a function's name facts, the statement, what may be deleted
    values         the symbolic evaluation a rotation is read with (rotary's own)
    rotation       whether a function's source is the half-split or the interleaved rotation
    sum_form       ``x * cos + rotate_half(x) * sin`` (function, method, inline)
    pairs_form     the parts rotated in real numbers, stacked or concatenated
    complex_form   ``view_as_real(view_as_complex(...) * freqs_cis)``
    variants       the DSL, one variant per form, and which one a match is
    preconditions  the site computes a rotary embedding (else not a match, with why)
    codemod        the kernel call written in place of the expression
    rule           the documentation, the run-time check, ``RULE``
"""

from __future__ import annotations

from adopter.core.rules.rotary_embedding.complex_form import ComplexParts, complex_parts
from adopter.core.rules.rotary_embedding.pairs_form import PairParts, pair_parts
from adopter.core.rules.rotary_embedding.rotation import (
    HALF_SPLIT,
    INTERLEAVED,
    OTHER_ROTATION,
    ROTATE_EVERY_TWO,
    ROTATE_HALF,
    half_split_rotation,
    interleaved_rotation,
    rotation_functions,
    rotation_layout,
)
from adopter.core.rules.rotary_embedding.rule import DOC, RULE
from adopter.core.rules.rotary_embedding.site import Site
from adopter.core.rules.rotary_embedding.sum_form import RotaryParts, rotary_parts
from adopter.core.rules.rotary_embedding.variants import DSL

_Site = Site  # the name tests/rules/test_rotary_forms.py reads it by (the module's before the split)

__all__ = [
    "DOC", "DSL", "HALF_SPLIT", "INTERLEAVED", "OTHER_ROTATION", "ROTATE_EVERY_TWO", "ROTATE_HALF", "RULE",
    "ComplexParts", "PairParts", "RotaryParts", "Site", "complex_parts", "half_split_rotation",
    "interleaved_rotation", "pair_parts", "rotary_parts", "rotation_functions", "rotation_layout",
]  # fmt: skip
