"""What names mean in a function or a file, for the written-out form: imports, dotted names through
them, the names a function binds, the one assignment of a name, a module-level function, int
literals. Questions of a tree the analysis never changes; the bindings of a scope are collected once
per scope (:func:`binding_index`).
"""

from __future__ import annotations

import ast

from adopter.core.syntax import dotted_name, mentioned_names, per_node, statements, walk


def import_map(tree: ast.Module, fn: ast.AST | None = None) -> dict[str, str]:
    """Local name -> fully qualified name of the imports at module level (under ``if``/``try`` too)
    and inside ``fn``."""
    out: dict[str, str] = {}
    scopes: list[ast.AST] = [tree] + ([fn] if fn is not None else [])
    for scope in scopes:
        stack = list(scope.body)
        while stack:
            node = stack.pop(0)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        out[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.If, ast.Try)):
                stack += list(node.body) + list(getattr(node, "orelse", [])) + list(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    stack += handler.body
    return out


def qualified(node: ast.AST, imports: dict[str, str], local: set[str]) -> str | None:
    """``F.cross_entropy`` -> ``torch.nn.functional.cross_entropy`` through the imports; None when
    the first name is bound in the function (``local``) or not a dotted name."""
    name = dotted_name(node)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    if head in local:
        return None
    full = imports.get(head, head)
    return f"{full}.{rest}" if rest else full


def stored_names(fn: ast.AST) -> set[str]:
    """Every name ``fn`` binds: its parameters, assignments, deletions, definitions, imports."""
    out = {a.arg for a in walk(fn.args) if isinstance(a, ast.arg)} if hasattr(fn, "args") else set()
    for node in walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
    return out


def int_literal(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return -node.operand.value
    return None


def names_in(node: ast.AST, names: set[str]) -> list[ast.Name]:
    return [n for n in walk(node) if isinstance(n, ast.Name) and n.id in names]


def names_read(node: ast.AST) -> set[str]:
    """Every name and attribute name ``node`` mentions."""
    return mentioned_names(node)


def callee_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def argument(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    """The argument of ``call`` passed as ``keyword`` or at position ``index``."""
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if len(call.args) > index and not isinstance(call.args[index], ast.Starred) else None


def class_of(tree: ast.Module, fn: ast.AST) -> ast.ClassDef | None:
    """The class of ``tree`` whose body defines ``fn``."""
    for node in statements(tree):
        if isinstance(node, ast.ClassDef) and fn in node.body:
            return node
    return None


@per_node(256)  # (the checks ask about many names of the same function or file)
def binding_index(scope: ast.AST) -> tuple[dict[str, list], dict[int, ast.Assign]]:
    """(name -> the nodes binding it in ``scope``, id(target) -> its one-target ``Assign``): one
    walk per scope."""
    binds: dict[str, list] = {}
    assigns: dict[int, ast.Assign] = {}
    # (exact types: a parsed tree holds no subclasses of its node classes, and this loop sees
    # every node of a module)
    name, store, definitions, alias, assign = ast.Name, (ast.Store, ast.Del), _DEFINITIONS, ast.alias, ast.Assign
    for sub in walk(scope):
        kind = type(sub)
        if kind is name:
            if type(sub.ctx) in store:
                binds.setdefault(sub.id, []).append(sub)
        elif kind in definitions:
            if sub is not scope:
                binds.setdefault(sub.name, []).append(sub)
        elif kind is alias:
            binds.setdefault((sub.asname or sub.name).split(".")[0], []).append(sub)
        elif kind is assign and len(sub.targets) == 1:
            assigns[id(sub.targets[0])] = sub
    return binds, assigns


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def single_assign(scope: ast.AST, name: str) -> ast.Assign | None:
    """The one ``name = ...`` of ``scope`` (its body for a module) when it binds ``name`` once."""
    binds, assigns = binding_index(scope)
    found = binds.get(name, [])
    if len(found) != 1 or not isinstance(found[0], ast.Name):
        return None
    return assigns.get(id(found[0]))


def module_function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    """The module-level ``def name`` when nothing else at module level binds ``name``."""
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(defs) != 1:
        return None
    for node in tree.body:
        if node is defs[0]:
            continue
        for sub in walk(node):
            if isinstance(sub, ast.Name) and sub.id == name and isinstance(sub.ctx, ast.Store):
                return None
            if isinstance(sub, ast.alias) and (sub.asname or sub.name).split(".")[0] == name:
                return None
    return defs[0]
