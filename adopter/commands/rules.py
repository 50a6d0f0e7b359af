"""`adopter rules [NAME]`: list the transformation rules, or show one rule's DSL and doc."""

from __future__ import annotations

import json
import sys
import textwrap

HELP = "list the transformation rules (or print one rule's DSL text and documentation)"


def add_arguments(parser):
    parser.add_argument("name", nargs="?", help="show this rule's DSL text and documentation")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("--rules-file", metavar="FILE", action="append", default=[],
                        help="also list the rules of this DSL file; may repeat")


def _rule_json(rule, full: bool) -> dict:
    from adopter.core.dsl_text import format_rules

    d = {"name": rule.name, "kernel": rule.kernel, "summary": rule.summary}
    if full:
        d["doc"] = " ".join(rule.doc.split())
        d["dsl"] = rule.dsl.strip() or format_rules(list(rule.variants)).strip()
    return d


def run(args) -> int:
    from adopter.commands.scan import select_rules
    from adopter.core.dsl_text import format_rules
    from adopter.core.rules import all_rules
    from adopter.errors import UserError

    rules = all_rules()
    if args.rules_file:
        args.rules = None
        rules = rules + select_rules(args)
    if args.name:
        chosen = [r for r in rules if r.name == args.name]
        if not chosen:
            raise UserError(f"unknown rule {args.name!r}; known rules: {', '.join(r.name for r in rules)}")
        rule = chosen[0]
        if args.format == "json":
            sys.stdout.write(json.dumps(_rule_json(rule, full=True)) + "\n")
            return 0
        print(f"{rule.name}  ->  {rule.kernel}\n")
        print(textwrap.fill(" ".join(rule.doc.split()), width=88))
        print()
        print(rule.dsl.strip() or format_rules(list(rule.variants)).strip())
        return 0
    if args.format == "json":
        sys.stdout.write(json.dumps([_rule_json(r, full=False) for r in rules]) + "\n")
        return 0
    width = max(len(r.name) for r in rules)
    kwidth = max(len(r.kernel) for r in rules)
    for r in rules:
        print(f"{r.name.ljust(width)}  {r.kernel.ljust(kwidth)}  {r.summary}")
    return 0
