"""Generic codemod (paper §3.5, synthesis-based transformation) for rules without a
hand-written codemod, typically user rules from ``--rules-file``.

The edit is synthesized from the rule's DSL *target* patterns and the match's bindings:

    init:     torch.nn.Linear($in, $out, bias=$b) -> $lin
           => mykernels.LinearReLU($in, $out, bias=$b) -> $lin
    forward:  torch.nn.Linear@$lin($x) -> $h; torch.nn.functional.relu($h) -> $y
           => mykernels.LinearReLU@$lin($x) -> $y

__init__: the matched layer constructions go away (those still used elsewhere stay) and
``self.<attr> = Kernel(args)`` takes the place of the last one, so a conditional
construction stays conditional. ``<attr>`` is the attribute bound to the target's output
variable (``$lin`` above: ``self.proj``, state-dict keys unchanged) or, when the target
output is a variable the source pattern does not bind, a fresh ``self.<snake_case kernel>``.
forward: the matched statements collapse into ``<out> = <callee>(args)`` at the last matched
call (the ``ChainPlan`` checks of the built-in codemods: intermediates not read elsewhere,
moved arguments unchanged in between; statements split by an ``if`` are hoisted by
``apply``). Arguments come from the bindings, taken from the matched source expressions.

The kernel class is imported from its module: through the engine's kernel import when it
lives in ``adopter.kernels``, reusing a module-level import the file already has, else with
a local ``from <module> import <Name>`` in front of the synthesized statement (the engine
only writes module-level imports for ``adopter.kernels``).

Which variant of the rule matched: ``Match.variant`` when the matcher records it, else the
variants of the match's rule are re-matched against the matched nodes and the one that reproduces ``Match.bindings`` is used.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace

from adopter.core.codemod.base import (
    ChainPlan,
    Codemod,
    attr_used_elsewhere,
    fresh_attr,
    init_statement,
    kernel_name,
    match_function,
    matched_exprs,
    pos,
)
from adopter.core.codemod.context import FileContext, Skip, stores
from adopter.core.codemod.edits import Edit, InitEdit
from adopter.core.dsl import Const, Layer, RuleText, TensorOp, Value, Var, Wildcard
from adopter.core.match import match_node, same_value
from adopter.core.structures import Match
from adopter.core.syntax import walk

__all__ = ["GenericCodemod", "generic_codemod"]

KERNELS_MODULE = "adopter.kernels"


def generic_codemod(match: Match, rule=None) -> GenericCodemod | None:
    """The generic codemod when the DSL of this match's rule (``rule``: an object with
    ``name`` and ``variants``) is known, else None."""
    if getattr(match, "variant", None) is not None or (rule is not None and getattr(rule, "variants", ())):
        return GenericCodemod(rule)
    return None


# ---------------------------------------------------------------- helpers


def snake_case(name: str) -> str:
    """``LinearReLU`` -> ``linear_relu``, ``FusedQKV`` -> ``fused_qkv``."""
    # A short capitalized word absorbs a trailing run of capitals that no lowercase letter
    # follows (``ReLU``, ``GeLU``, ``SiLU``); otherwise such a run is a word (``QKV``).
    words = re.findall(r"[A-Z][a-z0-9]{0,2}[A-Z]+(?![a-z0-9])|[A-Z]+(?![a-z])|[A-Z][a-z0-9]*|[a-z0-9]+", name)
    out = "_".join(w.lower() for w in words)
    return out if out.isidentifier() else "kernel"


def _same(a: Value, b: Value) -> bool:
    return same_value(a, b)


def find_variant(match: Match, rule=None) -> RuleText:
    """The rule variant that produced ``match`` (see the module docstring)."""
    variant = getattr(match, "variant", None)
    if variant is not None:
        return variant
    if rule is None:
        raise Skip(f"no codemod for rule {match.rule}")
    for candidate in rule.variants:
        pattern = candidate.forward.source.nodes
        if len(pattern) != len(match.nodes):
            continue
        b: dict | None = {}
        for mn in match.nodes:
            if not 0 <= mn.pattern_index < len(pattern):
                b = None
                break
            b = match_node(pattern[mn.pattern_index], mn.node, b)
            if b is None:
                break
        if b is None or set(b) != set(match.bindings):
            continue
        if all(_same(b[k], match.bindings[k]) for k in b) and (candidate.init is None) == (not match.init_nodes):
            return candidate
    raise Skip(f"rule {match.rule}: no variant of its DSL reproduces this match")


def _direct_operands(expr: ast.expr) -> list[ast.expr]:
    """Argument expressions of a matched call / operator, where its DSL args come from."""
    if isinstance(expr, ast.Call):
        out = list(expr.args) + [k.value for k in expr.keywords]
        if isinstance(expr.func, ast.Attribute):
            out.append(expr.func.value)  # x.method(...): the tensor is an argument
        return out
    if isinstance(expr, ast.BinOp):
        return [expr.left, expr.right]
    if isinstance(expr, ast.UnaryOp):
        return [expr.operand]
    return []


def _fqn_parts(fqn: str) -> tuple[str, str]:
    if "|" in fqn:
        raise Skip(f"target type {fqn!r} lists alternatives; the kernel to call is ambiguous")
    module, _, name = fqn.rpartition(".")
    if not module or not name.isidentifier():
        raise Skip(f"target type {fqn!r} is not a fully qualified name (module.Name)")
    if module == "torch.Tensor":
        raise Skip(f"target {fqn} is a tensor method; only module and function targets are synthesized")
    return module, name


# ---------------------------------------------------------------- codemod


class GenericCodemod(Codemod):
    """Synthesizes the edit from the matched variant's target patterns."""

    rule = ""

    def __init__(self, rule_object=None):
        self.rule_object = rule_object  # the Rule whose variants may have produced the match

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        variant = find_variant(match, self.rule_object)
        if variant.forward.target is None:
            raise Skip(f"rule {match.rule} has neither a codemod nor a DSL target")
        target = variant.forward.target.nodes
        if len(target) != 1 or not isinstance(target[0], Layer):
            kinds = ", ".join(type(n).__name__ for n in target)
            raise Skip(f"forward target is {len(target)} node(s) ({kinds}); only a single kernel call is synthesized")
        kernel = target[0]
        module, kname = _fqn_parts(kernel.type)
        source = variant.forward.source.nodes
        if any(isinstance(n, Wildcard) for n in source):
            raise Skip("source pattern has a wildcard: what the kernel replaces there is unknown")
        if len(match.nodes) != len(source):
            raise Skip("match holds nodes the pattern does not name")
        bindings: dict[str, Value] = dict(match.bindings)
        init_only = dict(match.init_bindings)

        exprs = matched_exprs(match, ctx)
        for node, expr in exprs:
            if not isinstance(expr, (ast.Call, ast.BinOp, ast.UnaryOp)):
                raise Skip(f"line {expr.lineno}: matched node is not a call or an operator expression")
        fn = match_function(match, ctx, exprs)
        self._check_one_block(ctx, exprs)

        # The synthesized call takes the place of the last matched node: its output must be
        # what the target produces.
        last = source[-1]
        last_out = getattr(last, "output", None)
        if kernel.output is not None and (last_out is None or kernel.output.name != last_out.name):
            raise Skip(
                f"target output {kernel.output} is not the output of the last matched node"
                f" ({last_out if last_out is not None else 'none'})"
            )
        produced = [n.node.output for n in match.nodes if isinstance(n.node, (Layer, TensorOp)) and n.node.output]

        # ---- init part
        init_edit = None
        init_attr = None  # attribute the init target constructs
        imports: list[str] = []
        local_imports: list[str] = []
        if variant.init is not None:
            init_edit, init_attr = self._init(match, ctx, variant, bindings, init_only, exprs, imports, local_imports)

        # ---- forward callee
        if kernel.module is not None:
            callee_attr = self._module_attr(kernel.module, bindings, init_attr, variant)
            callee = f"self.{callee_attr}"
            if init_attr is None:
                # No init target: the existing module is called with other arguments; it must be
                # exactly the matched one.
                called = {str(n.node.module) for n in match.nodes if isinstance(n.node, Layer) and n.node.module}
                if f"self.{callee_attr}" not in called:
                    raise Skip(f"forward target calls self.{callee_attr}, which no init target constructs")
        else:
            callee, local = self._function_name(ctx, module, kname, imports)
            if local:
                local_imports.append(local)

        # ---- forward arguments
        positional: list[str] = []
        keywords: list[tuple[str, str]] = []
        moved: list[tuple[ast.expr, ast.expr]] = []
        for arg in kernel.args:
            text = self._forward_arg(arg.value, bindings, init_only, produced, exprs, moved, arg.keyword is not None)
            if text is None:
                continue  # keyword whose variable the match left unbound: default applies
            if arg.keyword:
                keywords.append((arg.keyword, text))
            else:
                positional.append(text)
        anchor_text = ", ".join(positional + [f"{k}={v}" for k, v in keywords])
        plan = ChainPlan(ctx, fn, [e for _, e in exprs])
        plan.anchor_text = f"{callee}({anchor_text})"
        plan.moved = moved
        forward = plan.build()
        if local_imports and kernel.module is None:
            forward = replace(forward, insert_before=tuple(local_imports))
        return Edit(
            rule=match.rule,
            forward=forward,
            init=(init_edit,) if init_edit is not None else (),
            imports=tuple(imports),
        )

    def _check_one_block(self, ctx: FileContext, exprs) -> None:
        """Matched statements split by an ``if`` would be hoisted (paper Fig. 4): copies of
        the earlier statements stay on the other branch and keep calling modules this
        rewrite replaces or deletes. The built-in conv+batch-norm codemod proves that safe
        for its kernel (construction under the same condition); nothing generic does."""
        first = ctx.statement_of(exprs[0][1])
        block = ctx.block_of(first)[2]
        for _, expr in exprs[1:]:
            stmt = ctx.statement_of(expr)
            if ctx.block_of(stmt)[2] is not block:
                owner = ctx.block_of(stmt)[0]
                what = f"if {ctx.segment(owner.test)}" if isinstance(owner, ast.If) else type(owner).__name__.lower()
                raise Skip(
                    f"line {stmt.lineno}: matched statements are split by a branch ({what}); the generic"
                    " codemod rewrites only statements of one block"
                )

    # ---------------------------------------------------------------- init

    def _init(self, match, ctx, variant, bindings, init_only, exprs, imports, local_imports):
        targets = variant.init.target.nodes
        if len(targets) != 1 or not isinstance(targets[0], Layer) or targets[0].module is not None:
            raise Skip(f"init target is {len(targets)} node(s); only one kernel construction is synthesized")
        construct_node = targets[0]
        if construct_node.output is None:
            raise Skip("init target has no output attribute (-> $var)")
        module, kname = _fqn_parts(construct_node.type)
        cls = match.class_name
        if cls is None:
            raise Skip("the matched layers are not owned by a class")
        if not match.init_nodes:
            raise Skip("no __init__ construction matched")

        # Attribute of the constructed kernel: reuse the one bound to the target output, or a fresh one.
        out_var = construct_node.output
        bound = bindings.get(out_var.name, init_only.get(out_var.name)) if out_var.is_abstract else out_var
        if bound is not None:
            if not (isinstance(bound, Var) and bound.name.startswith("self.") and bound.name.count(".") == 1):
                raise Skip(f"init target output {out_var} is bound to {bound}, not a self.<attr>")
            attr = bound.name[len("self."):]
            fresh = False
        else:
            attr = fresh_attr(ctx, cls, snake_case(kname))
            fresh = True

        # Constructor arguments from the bindings (init and forward).
        everything = {**bindings, **init_only}
        positional, keywords = [], []
        for arg in construct_node.args:
            value = arg.value
            if isinstance(value, Var) and value.is_abstract:
                concrete = everything.get(value.name)
                if concrete is None:
                    if arg.keyword:
                        continue
                    raise Skip(f"init target argument {value.name} is not bound by the match")
                if isinstance(concrete, Var) and not concrete.name.startswith("self."):
                    # a forward local: it does not exist in __init__
                    raise Skip(f"init target argument {value.name} is the forward value {concrete.name}")
                text = concrete.text if isinstance(concrete, Const) else concrete.name
            else:
                text = value.text if isinstance(value, Const) else value.name
            (keywords.append((arg.keyword, text)) if arg.keyword else positional.append(text))

        # Which matched constructions go away.
        allowed = [e for _, e in exprs]
        statements = []
        deleted = []
        for ib in match.init_nodes:
            name = ib.attr.removeprefix("self.")
            stmt, _call, _ = init_statement(ctx, match, name)
            statements.append((name, stmt))
            use = attr_used_elsewhere(ctx, cls, name, allowed)
            if use is None:
                deleted.append(stmt)
            elif name == attr:
                raise Skip(f"self.{attr} is also used at line {use[0]} ({use[2]}); it would become the kernel")
        if not fresh and attr not in [n for n, _ in statements]:
            raise Skip(f"self.{attr} is not one of the matched __init__ constructions")
        if not deleted:
            raise Skip("every matched __init__ layer is still used elsewhere; nothing to replace")
        deleted.sort(key=lambda s: (s.lineno, s.col_offset))
        last = deleted[-1]
        init_fn = ctx.enclosing_function(last)
        chains = {tuple(ctx.enclosing_ifs(s, init_fn)) for s in deleted}
        if len(chains) > 1:
            raise Skip("the matched __init__ layers are constructed under different conditions")

        # Arguments read at the last construction must mean what they meant where they were read.
        reads = set()
        for text in positional + [v for _, v in keywords]:
            try:
                reads |= {n.id for n in walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
            except SyntaxError:
                raise Skip(f"cannot parse bound argument {text!r}") from None
        first = min((s for _, s in statements), key=lambda s: (s.lineno, s.col_offset))
        rebound = set()
        for node in walk(init_fn):
            if (
                isinstance(node, ast.stmt)
                and not isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try))
                and first.lineno <= node.lineno
                and node.end_lineno < last.lineno
                and node not in deleted
            ):
                rebound |= stores(node)
        clash = reads & rebound
        if clash:
            raise Skip(f"{', '.join(sorted(clash))} changes between the matched __init__ constructions")

        local_name, local_import = self._class_name(ctx, module, kname, imports)
        construct = f"self.{attr} = {local_name}({', '.join(positional + [f'{k}={v}' for k, v in keywords])})"
        if local_import:
            construct = local_import + "\n" + construct
        edit = InitEdit(
            replace=pos(ctx, last),
            construct=construct,
            delete=tuple(pos(ctx, s) for s in deleted[:-1]),
        )
        return edit, attr

    # ---------------------------------------------------------------- names

    def _module_attr(self, module_var: Var, bindings, init_attr, variant) -> str:
        if module_var.is_abstract:
            bound = bindings.get(module_var.name)
            init_out = variant.init.target.nodes[0].output if variant.init is not None else None
            if bound is None:
                if init_out is not None and init_out.name == module_var.name and init_attr:
                    return init_attr
                raise Skip(f"forward target module {module_var.name} is bound neither by the match nor by the init target")
            if not (isinstance(bound, Var) and bound.name.startswith("self.") and bound.name.count(".") == 1):
                raise Skip(f"forward target module {module_var.name} is bound to {bound}, not a self.<attr>")
            attr = bound.name[len("self."):]
        else:
            if not (module_var.name.startswith("self.") and module_var.name.count(".") == 1):
                raise Skip(f"forward target module {module_var} is not a self.<attr>")
            attr = module_var.name[len("self."):]
        if init_attr is not None and attr != init_attr:
            raise Skip(f"forward target calls self.{attr} but the init target constructs self.{init_attr}")
        return attr

    def _existing_import(self, ctx: FileContext, module: str, name: str) -> str | None:
        """Local name under which the module already imports ``module.name`` at top level."""
        for stmt in ctx.tree.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module == module:
                for alias in stmt.names:
                    if alias.name == name:
                        return alias.asname or alias.name
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.name == module:
                        return f"{alias.asname}.{name}" if alias.asname else f"{module}.{name}"
        return None

    def _class_name(self, ctx: FileContext, module: str, name: str, imports: list[str]) -> tuple[str, str]:
        """(local name to call, local import statement or "")."""
        if module == KERNELS_MODULE:
            spec, local = kernel_name(ctx, name)
            imports.append(spec)
            return local, ""
        existing = self._existing_import(ctx, module, name)
        if existing is not None:
            return existing, ""
        local = name if name not in ctx.module_names() else f"adopter_{name}"
        spec = name if local == name else f"{name} as {local}"
        return local, f"from {module} import {spec}"

    def _function_name(self, ctx: FileContext, module: str, name: str, imports: list[str]) -> tuple[str, str]:
        return self._class_name(ctx, module, name, imports)

    # ---------------------------------------------------------------- forward arguments

    def _forward_arg(self, value: Value, bindings, init_only, produced, exprs, moved, is_keyword: bool) -> str | None:
        if isinstance(value, Const):
            return value.text
        if not value.is_abstract:
            return value.name
        concrete = bindings.get(value.name)
        if concrete is None and value.name in init_only:
            init_value = init_only[value.name]
            try:
                ast.literal_eval(getattr(init_value, "text", ""))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise Skip(
                    f"forward target argument {value.name} is bound in __init__ ({init_value}), which forward cannot read"
                ) from None
            return init_value.text  # a literal means the same anywhere
        if concrete is None:
            if is_keyword:
                return None
            raise Skip(f"forward target argument {value.name} is not bound by the match")
        if isinstance(concrete, Const):
            return concrete.text
        if concrete.name.startswith("self.") and concrete.name.count(".") == 1:
            return concrete.name  # a module attribute: same object wherever it is read
        if any(_same(concrete, p) for p in produced):
            raise Skip(f"forward target argument {value.name} is computed by the matched code it replaces")
        # The source expression that held this value: moved to the synthesized call.
        for node, expr in exprs:
            if not any(isinstance(a.value, Var) and _same(a.value, concrete) for a in node.args) and not (
                isinstance(node, Layer) and node.module is not None and _same(node.module, concrete)
            ):
                continue
            for operand in _direct_operands(expr):
                if ast.unparse(operand) == concrete.name:
                    moved.append((operand, expr))
                    return concrete.name
        raise Skip(f"cannot find the source expression of argument {value.name} ({concrete})")
