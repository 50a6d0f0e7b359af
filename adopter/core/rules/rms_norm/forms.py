"""Recognizing the RMSNorm forms: the symbolic value a forward returns (:class:`Sym` terms, see
:mod:`adopter.core.rules.rms_norm.forward`) classified as one of the forms the kernel computes
(``(weight, eps, keywords)``), or refused with what differs (:class:`_Variant`), or no RMSNorm at
all (:class:`_NotRMS`)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

from adopter.core.symbolic import Sym

CODE = "norm-variant"
RMS_KERNEL = "rms_norm"
L2_KERNEL = "scaled_l2_norm"  # x-transformers' F.normalize(x, dim=-1) * scale * gamma


class _NotRMS(Exception):
    """Not an RMSNorm at all (plain precondition failure: no match)."""


class _Variant(Exception):
    """An RMSNorm-like form the kernel does not compute: refused with ``code``."""

    def __init__(self, reason: str, code: str = CODE):
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Form:
    """A recognized RMSNorm forward: what the rewrite passes."""

    input: str  # the forward's tensor parameter
    weight: str  # ``self.<attr>``
    eps: str  # source text of eps
    keywords: tuple[tuple[str, str], ...] = ()  # the form (RMSNormForm fields that differ)
    inlined: tuple[str, ...] = ()  # same-class helpers the forward calls
    kernel: str = RMS_KERNEL  # or L2_KERNEL: then ``factors`` (and ``weight``, ``eps`` unused)
    factors: tuple[str, ...] = ()  # source text of what the L2 norm is multiplied by, in order

    def arguments(self) -> list[str]:
        """The kernel call's arguments: ``rms_norm(x, weight, eps, **form)`` or
        ``scaled_l2_norm(x, *factors, **form)``."""
        keywords = [f"{k}={v}" for k, v in self.keywords]
        if self.kernel == L2_KERNEL:
            return [self.input, *self.factors, *keywords]
        return [self.input, self.weight, self.eps, *keywords]


INPUT = Sym("input")


def _op(sym: Sym, name: str) -> bool:
    return sym.kind == "op" and sym.value == name


def _operands(sym: Sym, name: str) -> list[tuple[Sym, Sym]]:
    """Both orders of a commutative binary op's operands."""
    if not _op(sym, name) or len(sym.args) != 2:
        return []
    a, b = sym.args
    return [(a, b), (b, a)] if name in ("*", "+") else [(a, b)]


def _is_cast(sym: Sym, dtype: Sym | str) -> Sym | None:
    """The value ``sym`` casts to ``dtype`` (a dtype name or a ``dtype_of`` symbol), or None."""
    if not _op(sym, "cast"):
        return None
    target = sym.args[1]
    if isinstance(dtype, str):
        return sym.args[0] if target.kind == "dtype" and target.value == dtype else None
    return sym.args[0] if target == dtype else None


def _fp32_input(sym: Sym) -> bool:
    return _is_cast(sym, "float32") == INPUT


def _squared(sym: Sym) -> Sym | None:
    """``b`` of ``b.pow(2)``, ``b ** 2``, ``b.square()``, ``b * b``."""
    if (_op(sym, "pow") or _op(sym, "**")) and len(sym.args) == 2 and sym.args[1].kind == "const" \
            and sym.args[1].value == 2:
        return sym.args[0]
    if _op(sym, "square") and len(sym.args) == 1:
        return sym.args[0]
    if _op(sym, "*") and len(sym.args) == 2 and sym.args[0] == sym.args[1]:
        return sym.args[0]
    return None


def _mean_of_squares(sym: Sym) -> tuple[Sym, tuple[tuple[str, str], ...]]:
    """``(b, keywords)`` of ``mean(b ** 2, dim, keepdim=True)``; raises when it is not a norm's
    mean. ``dim`` is ``-1``, or a ``self.<attr>`` the rewrite passes on (``dim=self.dim``: litgpt's
    norm reads it from an attribute, which the kernel checks is the last dimension at run time)."""
    if not _op(sym, "mean"):
        raise _NotRMS("no mean of squares")
    base = _squared(sym.args[0]) if sym.args else None
    if base is None:
        raise _NotRMS("the mean is not of squares")
    if _op(base, "-"):
        raise _NotRMS("the squares are of a centered value (a LayerNorm)")
    dim = sym.kwarg("dim", 1) or sym.kwarg("axis")
    keepdim = sym.kwarg("keepdim", 2)
    keywords: tuple[tuple[str, str], ...] = ()
    if dim is not None and dim.kind == "attr":
        keywords = (("dim", f"self.{dim.value}"),)
    elif dim is None or dim.kind != "const" or dim.value != -1:
        shown = "no dim" if dim is None else f"dim={ast.unparse(dim.node) if dim.node is not None else dim.value}"
        raise _Variant(f"the mean of squares is over {shown}, not provably the last dimension", "dim-not-last")
    if keepdim is None or keepdim.kind != "const" or keepdim.value is not True:
        raise _Variant("the mean of squares does not keep its dimension")
    return base, keywords


def _eps_text(sym: Sym) -> str:
    """``self.<attr>`` or the number as the source writes it (``1e-6``)."""
    if sym.kind == "attr":
        return f"self.{sym.value}"
    if sym.kind == "const":
        return sym.text or repr(sym.value)
    raise _Variant(f"eps {sym.value if sym.kind == 'unknown' else sym.kind} is not an attribute or a number")


@dataclass(frozen=True)
class _Norm:
    """``factor * rsqrt(mean(base ** 2) + eps)``: ``upcast`` when ``base`` is the float32 input
    (False: the input itself, normalized in its own dtype); ``keywords``: ``dim=self.<attr>``."""

    factor: Sym
    eps: str
    upcast: bool
    keywords: tuple[tuple[str, str], ...] = ()


def _normalized(sym: Sym) -> _Norm:
    """The norm ``sym`` is (``a * rsqrt(mean(f ** 2, -1, keepdim=True) + eps)`` with ``f`` the
    float32 input or the input); raises for what is no such product (refusing the look-alikes)."""
    for a, r in _operands(sym, "*"):
        if _op(r, "rsqrt") and len(r.args) == 1:
            for var, eps in _operands(r.args[0], "+"):
                if _op(var, "mean"):
                    base, keywords = _mean_of_squares(var)
                    upcast = _check_base(base, a)
                    return _Norm(a, _eps_text(eps), upcast, keywords)
            if _op(r.args[0], "mean"):
                _mean_of_squares(r.args[0])
                raise _Variant("no eps inside the square root")
    if _op(sym, "/") and len(sym.args) == 2:
        a, d = sym.args
        if _op(d, "sqrt"):
            for var, _ in _operands(d.args[0], "+"):
                if _op(var, "mean"):
                    _mean_of_squares(var)
                    raise _Variant("divides by sqrt(mean + eps) where the kernel multiplies by rsqrt (other rounding)")
        for s, _ in _operands(d, "+"):
            if _op(s, "sqrt") and s.args and _op(s.args[0], "mean"):
                _mean_of_squares(s.args[0])
                raise _Variant("eps is added outside the square root: x / (sqrt(mean(x**2)) + eps)")
    raise _NotRMS("no x * rsqrt(mean(x**2) + eps)")


def _check_base(base: Sym, factor: Sym) -> bool:
    """The squares are of the float32 input and the factor is the float32 or the plain input
    (True), or both are the input itself: no upcast (False)."""
    if base == INPUT:
        if factor != INPUT:
            raise _Variant("the value normalized is not the input the variance is computed from")
        return False
    if not _fp32_input(base):
        raise _Variant("the squared value is not the forward's input (cast to float32 or not)")
    if factor != base and factor != INPUT:
        raise _Variant("the value normalized is not the input the variance is computed from")
    return True


def _scale(sym: Sym, before_cast: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(weight attribute, form keywords)`` of a scale: ``self.w``, ``self.w.float()``,
    ``offset + ...`` (Gemma, litgpt), ``(offset + self.w).float()`` (only before the cast back)."""
    if sym.kind == "attr":
        return sym.value, ()
    inner = _is_cast(sym, "float32")
    if inner is not None and inner.kind == "attr":
        return inner.value, (("weight_fp32", "True"),)
    for c, rest in _operands(sym, "+"):
        if c.kind == "const":
            weight, keywords = _scale(rest, before_cast)
            if keywords not in ((), (("weight_fp32", "True"),)):
                break
            return weight, (("offset", repr(float(c.value))),) + keywords
    if inner is not None and before_cast:
        # (1.0 + self.weight).float() * n: the sum rounds in the weight's dtype; the product with
        # the float32 n promotes it exactly as the cast does
        for c, rest in _operands(inner, "+"):
            if c.kind == "const" and rest.kind == "attr":
                return rest.value, (("offset", repr(float(c.value))),)
    if _op(sym, "-") and any(a.kind == "attr" for a in sym.args):
        raise _Variant("the scale subtracts from the weight")
    raise _Variant(f"the scale {_shown(sym)} is not a weight attribute (optionally float32, plus a constant)")


def _shown(sym: Sym) -> str:
    if sym == INPUT:
        return "its input unchanged"
    return ast.unparse(sym.node) if sym.node is not None else sym.kind


_NO_UPCAST = (("upcast", "False"),)

# each keyword's value when the rewrite leaves it out (the kernel's defaults)
_DEFAULTS = {"offset": "0.0", "weight_before_cast": "False", "weight_fp32": "False",
             "cast_to_half_weight": "False", "upcast": "True", "dim": "-1"}


def classify(result: Sym) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """``(weight, eps, keywords)`` of a recognized RMSNorm value; raises :class:`_Variant` or
    :class:`_NotRMS`."""
    flags = _branch_flags(result)
    if flags:
        return _classify_branches(result, flags)
    # the ``+ self.bias`` of a bias-carrying norm, reported as such
    for a, b in _operands(result, "+"):
        if b.kind == "attr" and _contains_plain_norm(a):
            raise _Variant(f"adds self.{b.value} to the scaled norm (a bias the kernel does not add)")
    # Llama: scale * n.to(input_dtype) (Meta-llama/torchtitan: self._norm(x.float()).type_as(x) * w)
    for s, cast in _operands(result, "*"):
        inner = _is_cast(cast, Sym("dtype_of", args=(INPUT,)))
        if inner is not None and _contains_norm(inner):
            norm = _normalized(inner)
            if norm.factor == INPUT and norm.upcast:
                raise _Variant("scales x * rstd cast back, with x not the float32 copy")
            weight, keywords = _scale(s, before_cast=False)
            return weight, norm.eps, keywords + _upcast(norm) + norm.keywords
    # OLMo-2, Gemma, Helium: (scale * n).to(input_dtype)
    inner = _is_cast(result, Sym("dtype_of", args=(INPUT,)))
    if inner is not None:
        if _is_normalized(inner):
            raise _Variant("no weight (an unweighted RMSNorm)")
        for s, n in _operands(inner, "*"):
            if _contains_norm(n) and not _contains_norm(s):
                norm = _normalized(n)
                if norm.factor == INPUT and norm.upcast:
                    raise _Variant("x * rstd with x not the float32 copy, cast back")
                weight, keywords = _scale(s, before_cast=True)
                return weight, norm.eps, keywords + (("weight_before_cast", "True"),) + _upcast(norm) + norm.keywords
    # T5LayerNorm: self.w * (h.to(self.w.dtype) if self.w.dtype is half else h), h = x * rstd
    for w, sel in _operands(result, "*"):
        if w.kind == "attr" and sel.kind == "select":
            test, then, other = sel.args
            if test.args[0] == w and then is not None and _is_cast(then, Sym("dtype_of", args=(w,))) == other:
                norm = _normalized(other)
                if norm.factor != INPUT or not norm.upcast:
                    raise _Variant("T5's form, normalizing the float32 copy instead of the input, or without "
                                   "the float32 variance")
                return w.value, norm.eps, (("cast_to_half_weight", "True"),) + norm.keywords
    # no upcast, no cast: scale * (x * rsqrt(mean(x ** 2) + eps)), all in the input's dtype
    for s, n in _operands(result, "*"):
        if _contains_norm(n) and not _contains_norm(s) and _is_normalized(n):
            norm = _normalized(n)
            if norm.upcast:
                raise _Variant("scales the float32 norm and never casts back to the input dtype")
            weight, keywords = _scale(s, before_cast=False)
            return weight, norm.eps, keywords + _NO_UPCAST + norm.keywords
    if _is_normalized(result):
        raise _Variant("no weight and no cast back (an unweighted RMSNorm)")
    helper = _opaque(result)
    if helper is not None:
        raise _Variant(f"calls self.{helper}, whose body is not a sequence of assignments and a return "
                       "(branches): the form cannot be read")
    if _contains_plain_norm(result):
        raise _Variant(f"the forward returns {_shown(result)}, which computes more than the RMSNorm of its input")
    if _scaled_l2_normalize(result):
        raise _Variant("F.normalize(x, dim=-1) scaled, but not as F.normalize(x[.float()]) * f1 * f2 ... "
                       "[.type_as(x)] (a cast between the products, a factor that is not an attribute or a "
                       "number): the scaled L2 norm kernel casts once, last, and reads its factors from the module")
    raise _NotRMS("the forward does not return an RMSNorm of its input")


def _scaled_l2_normalize(sym: Sym) -> bool:
    """``F.normalize(x, dim=-1)`` of the forward's input (or a cast of it), times factors that are
    attributes or constants (``* self.scale * self.gamma``, a cast back): an L2-normalization the
    source scales to an RMSNorm."""
    if _op(sym, "*") and len(sym.args) == 2:
        a, b = sym.args
        return (_scaled_l2_normalize(a) and _factor(b)) or (_scaled_l2_normalize(b) and _factor(a))
    inner = _is_cast(sym, Sym("dtype_of", args=(INPUT,)))
    if inner is not None:
        return _scaled_l2_normalize(inner)
    if not _op(sym, "normalize") or not sym.args:
        return False
    x = sym.args[0]
    if x != INPUT and not (_op(x, "cast") and x.args[0] == INPUT):
        return False
    dims = [v for k, v in sym.kw if k == "dim"] + list(sym.args[2:3])
    others = {k for k, _ in sym.kw} - {"dim", "eps"}
    return len(dims) == 1 and dims[0].kind == "const" and dims[0].value == -1 and not others and len(sym.args) <= 3 \
        and (len(sym.args) < 2 or sym.args[1].kind == "const" and sym.args[1].value == 2)


_FACTOR_OPS = ("*", "+", "-", "/")


def _factor_text(sym: Sym) -> str | None:
    """Source text of a factor the normalized value is multiplied by: ``self.<attr>``, a number,
    a float32 cast of one, or arithmetic of them (``(self.gamma + 1)``); None for anything else (a
    local value, the input). Built from the symbolic value, never from the source's own text, which
    may name locals the rewrite deletes; read at every call, as the source reads it."""
    if sym.kind == "attr":
        return f"self.{sym.value}"
    if sym.kind == "const" and not isinstance(sym.value, bool):
        return sym.text or repr(sym.value)
    inner = _is_cast(sym, "float32")
    if inner is not None:
        text = _factor_text(inner)
        return None if text is None else f"{text}.float()"
    if sym.kind == "op" and sym.value in _FACTOR_OPS and len(sym.args) == 2 and not sym.kw:
        left, right = (_factor_text(a) for a in sym.args)
        return None if left is None or right is None else f"({left} {sym.value} {right})"
    return None


def scaled_l2_norm_form(result: Sym) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None:
    """``(factors, keywords)`` of ``F.normalize(x[.float()], dim=-1[, eps=e]) * f1 * f2 ...``
    [``.type_as(x)``] (x-transformers' RMSNorm, either operand order of each product: each is
    exact, the grouping is what rounds), the factors in the order the source applies them; None
    for anything else (a ``p`` other than 2, a ``dim`` not -1, a cast between the products: the
    refusal of :func:`_scaled_l2_normalize`)."""
    keywords: list[tuple[str, str]] = []
    inner = _is_cast(result, Sym("dtype_of", args=(INPUT,)))
    if inner is not None:
        result = inner
        keywords.append(("cast_back", "True"))
    factors: list[str] = []
    while _op(result, "*") and len(result.args) == 2:
        a, b = result.args
        if _has_normalize(a) and not _has_normalize(b):
            text, result = _factor_text(b), a
        elif _has_normalize(b) and not _has_normalize(a):
            text, result = _factor_text(a), b
        else:
            return None
        if text is None:
            return None
        factors.insert(0, text)
    if not _op(result, "normalize") or not result.args or len(result.args) > 4:
        return None
    args = dict(zip(("input", "p", "dim", "eps"), result.args))
    for k, v in result.kw:
        if k in args or k not in ("p", "dim", "eps"):
            return None
        args[k] = v
    x, p, dim = args["input"], args.get("p"), args.get("dim")
    if p is not None and not (p.kind == "const" and p.value == 2 and not isinstance(p.value, bool)):
        return None
    if dim is None or dim.kind != "const" or dim.value != -1:
        return None  # (F.normalize's default dim is 1)
    if _is_cast(x, "float32") == INPUT:
        keywords.insert(0, ("upcast", "True"))
    elif x != INPUT:
        return None
    if "eps" in args:
        try:
            keywords.insert(0, ("eps", _eps_text(args["eps"])))
        except _Variant:
            return None
    return tuple(factors), tuple(keywords)


def _has_normalize(sym: Sym) -> bool:
    return isinstance(sym, Sym) and (_op(sym, "normalize") or any(_has_normalize(a) for a in sym.args))


def _factor(sym: Sym) -> bool:
    """A scale of a normalization: ``self.<attr>``, a constant, or a product/cast of them."""
    if sym.kind in ("attr", "const"):
        return True
    if _op(sym, "cast"):
        return _factor(sym.args[0])
    return _op(sym, "*") and all(_factor(a) for a in sym.args)


def _upcast(norm: _Norm) -> tuple[tuple[str, str], ...]:
    return () if norm.upcast else _NO_UPCAST


def _branch_flags(sym: Sym | None) -> set[str]:
    """The attributes the ``branch`` values inside ``sym`` test."""
    if not isinstance(sym, Sym):
        return set()
    found = {sym.value} if sym.kind == "branch" else set()
    for a in list(sym.args) + [v for _, v in sym.kw]:
        found |= _branch_flags(a)
    return found


def _resolve(sym: Sym | None, attr: str, value: bool) -> Sym | None:
    """``sym`` with every branch on ``self.<attr>`` replaced by its side for ``value``."""
    if not isinstance(sym, Sym):
        return sym
    if sym.kind == "branch" and sym.value == attr:
        return _resolve(sym.args[0] if value else sym.args[1], attr, value)
    if not sym.args and not sym.kw:
        return sym
    return replace(sym, args=tuple(_resolve(a, attr, value) for a in sym.args),
                   kw=tuple((k, _resolve(v, attr, value)) for k, v in sym.kw))


def _classify_branches(result: Sym, flags: set[str]) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """litgpt's ``if self.add_unit_offset: return n * (1 + self.weight)`` / ``return n * self.weight``
    (or ``weight = (1 + self.weight) if self.add_unit_offset else self.weight``): each side a form
    over the same weight and eps; a keyword whose value differs becomes a conditional expression on
    the attribute (``offset=1.0 if self.add_unit_offset else 0.0``), read at run time as the
    source's ``if`` reads it."""
    if len(flags) > 1:
        raise _Variant(f"the forward branches on {', '.join(f'self.{f}' for f in sorted(flags))}: one flag at most")
    (attr,) = flags
    sides = []
    for value in (True, False):
        side = _resolve(result, attr, value)
        try:
            sides.append(classify(side))
        except _NotRMS:
            raise _Variant(f"with self.{attr} {value} the forward returns {_shown(side)}, "
                           "not an RMSNorm of its input") from None
    (w1, e1, k1), (w2, e2, k2) = sides
    if (w1, e1) != (w2, e2):
        raise _Variant(f"the sides of `self.{attr}` scale by different weights or use different eps")
    when_true, when_false = dict(k1), dict(k2)
    keywords = []
    for key in [k for k in _DEFAULTS if k in when_true or k in when_false]:
        a, b = when_true.get(key, _DEFAULTS[key]), when_false.get(key, _DEFAULTS[key])
        if key == "cast_to_half_weight" and a != b:
            raise _Variant(f"one side of `self.{attr}` is T5's form, the other not")
        keywords.append((key, a if a == b else f"{a} if self.{attr} else {b}"))
    return w1, e1, tuple(keywords)


def _is_normalized(sym: Sym) -> bool:
    """``sym`` is ``a * rsqrt(mean(f ** 2) + eps)`` (a look-alike raises its refusal)."""
    try:
        _normalized(sym)
    except _NotRMS:
        return False
    return True


def _opaque(sym: Sym | None) -> str | None:
    if not isinstance(sym, Sym):
        return None
    if sym.kind == "opaque":
        return str(sym.value)
    return next((h for h in map(_opaque, sym.args) if h is not None), None)


def _contains_norm(sym: Sym | None) -> bool:
    if sym is None or not isinstance(sym, Sym):
        return False
    if _op(sym, "rsqrt") or _op(sym, "sqrt"):
        return True
    return any(_contains_norm(a) for a in sym.args)


def _contains_plain_norm(sym: Sym) -> bool:
    """``sym`` holds an RMSNorm's ``a * rsqrt(...)``; raises a look-alike's refusal (``_Variant``)
    met on the way. False for centered (LayerNorm) normalizations only."""
    if not _contains_norm(sym) or not isinstance(sym, Sym):
        return False
    return _is_normalized(sym) or any(_contains_plain_norm(a) for a in sym.args if isinstance(a, Sym))
