"""The rule: its documentation (what counts as a match), its run-time check, and the :class:`Rule`
tying together the DSL variants, the precondition, the codemod and the rotation functions folded
at extraction."""

from __future__ import annotations

from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.rules.rotary_embedding.codemod import RotaryCodemod
from adopter.core.rules.rotary_embedding.preconditions import is_rotary_embedding
from adopter.core.rules.rotary_embedding.rotation import rotation_functions
from adopter.core.rules.rotary_embedding.variants import DSL, form_of

DOC = """\
Applies a rotary position embedding in one kernel, in each of the ways models write it. (1) The sum
``x * cos + rotate_half(x) * sin`` (``q`` and ``k`` lines of ``apply_rotary_pos_emb``, any operand
order, parentheses or none, inside a larger expression such as ``torch.cat([(q_rot * cos) +
(rotate_half(q_rot) * sin), q_pass], dim=-1)``) becomes ``rotary(x, cos, sin, rotate_half)``, or
``rotary_interleaved(x, cos, sin, rotate_every_two)`` when the rotation pairs even/odd positions
(GPT-J, CodeGen, GLM, Cohere). The same ``x`` must be in both products (a name, attribute or
subscript, optionally cast with ``.float()``/``.to(...)``: it is evaluated once instead of twice).
The rotation is a call of a function of the same file whose *source* is the rotation — a
module-level function (not rebound there, nor a parameter or local of the calling function), a
``@staticmethod`` or a method not reading ``self`` of the calling class or of a class of the file
(``self.rotate_half(x)``, ``Cls.rotate_half(x)``): half-split ``x1 = x[..., : x.shape[-1] // 2]``,
``x2 = x[..., x.shape[-1] // 2 :]`` (``x.size(-1)``, the half in a local, ``x.chunk(2, dim=-1)``, a ``(2, d/2)`` view unbound
``x.reshape(*x.shape[:-1], 2, -1).unbind(-2)`` or indexed ``[..., 0, :]``/``[..., 1, :]``
(x-transformers), ``cat`` imported from torch), ``return torch.cat((-x2, x1), dim=-1)``; interleaved ``x1 = x[...,
::2]``, ``x2 = x[..., 1::2]`` (``x[:, :, :, ::2]``, ``x.reshape(*x.shape[:-1], -1, 2).unbind(-1)``),
``return torch.stack((-x2, x1), dim=-1).flatten(-2)``. Or the half-split rotation written inline in
the function (litgpt): ``rotated = torch.cat((-x2, x1), dim=-1)`` with ``x1``/``x2`` the halves of
``x`` by slicing, or the ``cat`` in the product itself; the rewrite is ``rotary(x, cos, sin)`` and
removes the rotation's statements when only the sum reads them and they come right before it (else
``rotary(x, cos, sin, rotated)``, the rotated tensor handed over). Partial rotary (``q_rot = q[...,
:rotary_dim]``, Phi/GPT-NeoX/StableLM) matches: the kernel rotates whatever it is given. (2) The
complex rotation ``torch.view_as_real(xq_ * freqs_cis)`` (Meta-llama, torchtitan,
mistral-inference) with ``xq_ = torch.view_as_complex(<x>.reshape(..., -1, 2))`` becomes
``rotary_complex(xq_, freqs_cis)`` (the ``.flatten(3)`` and ``.type_as(xq)`` after it stay); not
when the other factor reads a learned parameter of the class (``self.w = nn.Parameter(...)``,
``register_parameter``, through local names: a complex spectral mix, not unit-modulus angles built
from the positions), and a ``freqs_cis`` that is an ``nn.Parameter`` at run time (where the source
did not settle it) runs the original product. (3)
Pairs rotated in real numbers, ``torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)``
(llama2.c; the two parts inline or assigned just before, any order of terms and factors) or
``torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)``, becomes ``rotary_pairs(x1, x2,
cos, sin)`` (``join="cat"``); the parts' statements go, so they must be read by nothing else and
come right before the stack (or among another such rotation's, as q and k). Not a match (computes
something else): a flipped sign (``cat((x2, -x1))``, ``x1 * cos + x2 * sin``), swapped parts, a
third of the dimension, a stack on another dimension, a rotation of another tensor than the one
multiplied by cos, a rotation imported from another file or passed in. At run time the kernels
fall back to the original expression unless the tensors are floating (complex) of one dtype and
device, cos/sin (freqs_cis) broadcast to ``x``'s shape (a single KV head ``k`` of shape ``(b, 1, s,
d)`` is never widened) with the last dimension the layout reads, need no gradient, and a rotation
function passed is (still) the rotation read here, probed at ``x``'s rank."""



def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    """What ran: the shapes of the sum (the kernel needs an even last dimension; an odd one would
    make every call fall back, so the site is not worth rewriting), of the complex product, or of
    the stacked parts."""
    form = form_of(site.nodes)
    if form == "sum":
        shapes = [s for ops in site.ops for op in ops if op.name == "add" for s in op.input_shapes if s]
        if not shapes:
            return None, ""
        last = {tuple(s)[-1] for s in shapes if len(s)}
        if any(d % 2 for d in last):
            return f"the rotated last dimension is odd ({sorted(last)}): the kernel would always fall back", ""
        return None, f"rotary on {' + '.join(str(tuple(s)) for s in shapes)}"
    shapes = [tuple(s) for ops in site.ops for op in ops for s in op.input_shapes if s]
    what = "complex rotary" if form == "complex" else "rotary pairs"
    return None, f"{what} on {' , '.join(map(str, shapes))}" if shapes else ""


RULE = Rule(
    name="rotary_embedding",
    kernel="adopter.kernels.rotary",
    doc=DOC,
    dsl=DSL,
    codemod=RotaryCodemod(),
    runtime=Runtime(check=_runtime_check),
    fixtures="rotary_embedding",
    preconditions=(is_rotary_embedding,),
    inlined_functions=rotation_functions,
)
