"""Rule registry: one module per built-in rule, each exposing ``RULE`` (a :class:`Rule`).

A rule module holds the whole rule (see :mod:`adopter.core.rule`): DSL text (one or more
``rule NAME`` blocks with the same name, the *variants*), static preconditions (functions
``MatchContext -> str | None`` returning a reason when violated), its codemod, its runtime
checks and sequence, the kernel it targets and a doc paragraph that says exactly what
counts as a match. Modules named ``_*.py`` hold helpers shared by several rules.

    all_rules()            every built-in rule (Table 1 order), then registered ones
    get_rules(names)       rules by name (unknown name: UnknownRuleError)
    find_rule(name, rules) a rule by name: from ``rules`` first, else the registry; or None
    register_rule(rule)    add a rule defined elsewhere (a plug-in, a test); by name
    load_rules_file(path)  user rules from a DSL file (``adopter scan --rules-file``)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

from adopter.core.dsl import RuleText
from adopter.core.dsl_text import DSLSyntaxError, parse_rules
from adopter.core.rule import Rule, Runtime, RuntimeSite, RuntimeStep, kernel_of

__all__ = [
    "RULE_MODULES", "Rule", "Runtime", "RuntimeSite", "RuntimeStep", "UnknownRuleError", "all_rules",
    "find_rule", "get_rules", "load_rules_file", "register_rule", "rule_names", "unregister_rule",
]  # fmt: skip

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
    # the LLM rule pack (issue 12)
    "RMSNorm": "rms_norm",
    "gated_MLP": "gated_mlp",
    "rotary_embedding": "rotary_embedding",
    "linear_cross_entropy": "linear_cross_entropy",
    # residual blocks (issue 25)
    "Add_ReLU": "add_relu",
    # written-out attention outside the HF namesake classes (issue 35)
    "sdpa_attention": "sdpa_attention",
}


class UnknownRuleError(ValueError):
    pass


_CACHE: dict[str, Rule] = {}
# Rules defined outside this package (plug-ins, tests), by name.
_REGISTERED: dict[str, Rule] = {}


def _load(name: str) -> Rule:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _CACHE:
        module = importlib.import_module(f"adopter.core.rules.{RULE_MODULES[name]}")
        _CACHE[name] = module.RULE
    return _CACHE[name]


def register_rule(rule: Rule) -> Rule:
    """Make ``rule`` known by name to every layer (scan, trace, rewrite, verify, CLI).
    A registered rule of a built-in's name shadows the built-in until unregistered."""
    if not isinstance(rule, Rule):
        raise TypeError(f"register_rule expects a Rule, got {type(rule).__name__}")
    _REGISTERED[rule.name] = rule
    return rule


def unregister_rule(name: str) -> None:
    _REGISTERED.pop(name, None)


def rule_names() -> list[str]:
    return list(RULE_MODULES) + [n for n in _REGISTERED if n not in RULE_MODULES]


def all_rules() -> list[Rule]:
    return [_load(n) for n in rule_names()]


def find_rule(name: str, rules: Iterable[Rule] = ()) -> Rule | None:
    """The rule called ``name``: from ``rules`` (the ones in use) first, else the registry."""
    for rule in rules:
        if getattr(rule, "name", None) == name:
            return rule
    if name in _REGISTERED or name in RULE_MODULES:
        return _load(name)
    return None


def get_rules(names: Iterable[str]) -> list[Rule]:
    """Rules by name, in the order given; duplicates removed."""
    out: list[Rule] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name not in RULE_MODULES and name not in _REGISTERED:
            raise UnknownRuleError(f"unknown rule {name!r}; known rules: {', '.join(rule_names())}")
        rule = _load(name)
        if rule not in out:
            out.append(rule)
    return out


def load_rules_file(path: str | Path) -> list[Rule]:
    """User rules from a DSL file; blocks with the same name become variants of one rule.

    Raises :class:`adopter.core.source_file.SourceReadError` when unreadable (not a regular file,
    not UTF-8) and :class:`DSLSyntaxError` (with file:line:col)
    when malformed. User rules have no preconditions beyond the patterns themselves.
    """
    from adopter.core.source_file import read_text_file

    path = Path(path)
    text = read_text_file(path, "rules file")  # regular files only, strict UTF-8: SourceReadError
    variants = parse_rules(text, source_name=str(path))
    if not variants:
        raise DSLSyntaxError("no 'rule NAME' block in file", 1, 1, str(path))
    grouped: dict[str, list[RuleText]] = {}
    for v in variants:
        # A rule file has no Python codemod: its DSL targets are what the rewrite synthesizes.
        for part_name, part in (("init", v.init), ("forward", v.forward)):
            if part is not None and part.target is None:
                raise DSLSyntaxError(f"rule {v.name}: the {part_name} section needs '=> TARGET'", 1, 1, str(path))
        grouped.setdefault(v.name, []).append(v)
    rules = []
    for name, vs in grouped.items():
        rules.append(
            Rule(
                name=name,
                kernel=kernel_of(vs[0]),
                doc=f"User rule from {path.name}.",
                dsl="",
                variants=tuple(vs),
            )
        )
    return rules
