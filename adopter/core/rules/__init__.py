"""Rule registry: one module per rule, each exposing ``RULE`` (a :class:`Rule`).

A rule is its DSL text (one or more ``rule NAME`` blocks with the same name, the
*variants*, see :mod:`adopter.core.dsl_text`), the kernel it targets, preconditions
(functions ``MatchContext -> str | None`` returning a reason when violated) and a
doc paragraph that says exactly what counts as a match.

    all_rules()            every built-in rule, in Table 1 order
    get_rules(names)       built-in rules by name (unknown name: UnknownRuleError)
    load_rules_file(path)  user rules from a DSL file (``adopter scan --rules-file``)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from adopter.core.dsl import Layer, RuleText
from adopter.core.dsl_text import DSLSyntaxError, parse_rules

__all__ = ["RULE_MODULES", "Rule", "UnknownRuleError", "all_rules", "get_rules", "load_rules_file", "rule_names"]

# name -> module under adopter.core.rules (Table 1 order)
RULE_MODULES: dict[str, str] = {
    "BertSelfAttention": "bert_self_attention",
    "T5Attention": "t5_attention",
    "GPT2Attention": "gpt2_attention",
    "softmax": "softmax",
    "Dropout_LayerNorm": "dropout_layernorm",
    "biased_GeLU": "biased_gelu",
    "Conv_BatchNorm": "conv_batchnorm",
    "Linear_BatchNorm": "linear_batchnorm",
    "fused_QKV": "fused_qkv",
}


class UnknownRuleError(ValueError):
    pass


@dataclass(frozen=True)
class Rule:
    """A transformation rule: DSL variants + kernel + preconditions + documentation."""

    name: str
    kernel: str
    doc: str
    dsl: str
    preconditions: tuple[Callable, ...] = ()
    # "lines": one match per distinct set of statements; "class": at most one per class
    # function (a whole attention computation reached through several paths).
    dedup: str = "lines"
    # Report a match whose nodes all lie in an inlined helper under that helper (once for
    # all callers). Off for rules whose match is about the calling class (attention).
    rehome: bool = True
    # A precondition violated on one path through the matched statements vetoes the
    # match on every path (the fused code would run on all of them).
    veto_across_paths: bool = True
    # A layer class defined in the scanned file that derives from a ``torch.nn`` layer named in
    # the patterns and defines no method but ``__init__`` (so its forward is the parent's) is
    # matched as that parent (EfficientNet's ``EfficientNetDepthwiseConv2d(nn.Conv2d)``).
    # Its constructor arguments are not matched: its own signature differs from the parent's.
    match_subclasses: bool = False
    # ``(structures, source) -> {layer type: torch layer type}``: layer classes defined in the
    # scanned file that the rule treats as the named torch layer (biased_GeLU: same-file modules
    # whose forward is a GeLU of their input, e.g. BLOOM's ``BloomGelu``). Their call arguments
    # are matched as the torch layer's.
    layer_aliases: Callable | None = field(default=None, compare=False)
    # ``(structures, source) -> {function name: layer type}``: module-level functions of the
    # scanned file whose inlined body the rule sees as one call of that layer type (biased_GeLU:
    # ESM's ``def gelu(x)`` written-out erf GeLU -> ``torch.nn.functional.gelu``).
    inlined_functions: Callable | None = field(default=None, compare=False)
    variants: tuple[RuleText, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if not self.variants:
            variants = tuple(parse_rules(self.dsl, source_name=f"<rule {self.name}>"))
            if not variants:
                raise ValueError(f"rule {self.name}: DSL text holds no rule block")
            for v in variants:
                if v.name != self.name:
                    raise ValueError(f"rule {self.name}: DSL block named {v.name!r}")
            object.__setattr__(self, "variants", variants)

    @property
    def summary(self) -> str:
        """First sentence of the doc."""
        text = " ".join(self.doc.split())
        end = text.find(". ")
        return text if end < 0 else text[: end + 1]


_CACHE: dict[str, Rule] = {}


def _load(name: str) -> Rule:
    if name not in _CACHE:
        module = importlib.import_module(f"adopter.core.rules.{RULE_MODULES[name]}")
        _CACHE[name] = module.RULE
    return _CACHE[name]


def rule_names() -> list[str]:
    return list(RULE_MODULES)


def all_rules() -> list[Rule]:
    return [_load(n) for n in RULE_MODULES]


def get_rules(names: Iterable[str]) -> list[Rule]:
    """Built-in rules by name, in the order given; duplicates removed."""
    out: list[Rule] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name not in RULE_MODULES:
            raise UnknownRuleError(f"unknown rule {name!r}; known rules: {', '.join(RULE_MODULES)}")
        rule = _load(name)
        if rule not in out:
            out.append(rule)
    return out


def _kernel_of(variant: RuleText) -> str:
    for node in variant.forward.target.nodes:
        if isinstance(node, Layer):
            return node.type
    return ""


def load_rules_file(path: str | Path) -> list[Rule]:
    """User rules from a DSL file; blocks with the same name become variants of one rule.

    Raises ``OSError`` when unreadable and :class:`DSLSyntaxError` (with file:line:col)
    when malformed. User rules have no preconditions beyond the patterns themselves.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    variants = parse_rules(text, source_name=str(path))
    if not variants:
        raise DSLSyntaxError("no 'rule NAME' block in file", 1, 1, str(path))
    grouped: dict[str, list[RuleText]] = {}
    for v in variants:
        grouped.setdefault(v.name, []).append(v)
    rules = []
    for name, vs in grouped.items():
        rules.append(
            Rule(
                name=name,
                kernel=_kernel_of(vs[0]),
                doc=f"User rule from {path.name}.",
                dsl="",
                variants=tuple(vs),
            )
        )
    return rules
