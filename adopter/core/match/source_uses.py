"""Source-level check that a matched intermediate value is read nowhere else.

Extraction only records DL nodes, so a value that escapes through a plain statement —
``residual = hidden_states`` later added back, ``return out, dropped``, ``outputs +=
(attn,)`` — is invisible in the path. This re-reads the function's source (``ast``,
never executed) and looks for loads of the variable's name after its defining
statement and before the name is assigned again, outside the matched statements.
"""

from __future__ import annotations

import ast
from functools import lru_cache

from adopter.core.dsl import Node, Var
from adopter.core.match.source import function_ast, parse_file
from adopter.core.syntax import per_file, walk

# Reading only metadata is harmless: the fused kernel's input and output share it.
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"}
_META_METHODS = {"size", "dim", "ndimension", "numel", "nelement"}


def _metadata_only(parent: ast.AST | None, grandparent: ast.AST | None) -> bool:
    if isinstance(parent, ast.Attribute):
        if parent.attr in _META_ATTRS:
            return True
        if parent.attr in _META_METHODS and isinstance(grandparent, ast.Call) and grandparent.func is parent:
            return True
    return False


@per_file
@lru_cache(maxsize=512)
def _name_index(source: str, qualname: str, hint_line: int) -> dict[str, tuple[list[tuple[int, int]], list[int]]] | None:
    """name -> (data loads (line, col), store lines) in one function, computed once."""
    fn = function_ast(source, qualname, hint_line)
    if fn is None:
        return None
    parents: dict[int, ast.AST] = {}
    for node in walk(fn):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    index: dict[str, tuple[list[tuple[int, int]], list[int]]] = {}
    for node in walk(fn):
        if isinstance(node, ast.Name):
            loads, stores = index.setdefault(node.id, ([], []))
            if isinstance(node.ctx, ast.Load):
                parent = parents.get(id(node))
                if _metadata_only(parent, parents.get(id(parent)) if parent is not None else None):
                    continue
                loads.append((node.lineno, node.col_offset))
            else:
                stores.append(node.lineno)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            index.setdefault(node.target.id, ([], []))[0].append((node.lineno, node.col_offset))
    return index


def escaping_read(source: str | None, producer: Node, value: Var, matched: list[Node]) -> int | None:
    """Line of a read of ``value`` outside the matched statements, or None.

    ``producer`` is the matched node defining ``value``. Temporaries introduced by
    extraction (``tmp_<n>``) have no name in the source and never escape this way.
    """
    if source is None or not isinstance(value, Var) or value.name.startswith("tmp_") or "." in value.name:
        return None
    span = producer.span
    if span is None or not span.function:
        return None
    index = _name_index(source, span.function, span.line)
    if index is None:
        return None
    def_end = span.stmt_end_line or span.end_line
    matched_ranges = [
        (n.span.stmt_line or n.span.line, n.span.stmt_end_line or n.span.end_line)
        for n in matched
        if n.span is not None and n.span.function == span.function
    ]
    loads, stores = index.get(value.name, ([], []))
    later_stores = sorted(line for line in stores if line > def_end)
    horizon = later_stores[0] if later_stores else 10**9
    for line, _col in sorted(loads):
        if line <= def_end or line > horizon:
            continue
        if any(lo <= line <= hi for lo, hi in matched_ranges):
            continue
        return line
    return None


# ---------------------------------------------------------------- attribute reads per class


@per_file
@lru_cache(maxsize=8)
def class_attribute_reads(source: str) -> dict[str, tuple[tuple[str, ...], dict[str, dict[str, tuple[tuple[int, int], ...]]]]]:
    """class name -> (in-file base names, method name -> attribute -> (line, col) of every
    ``self.<attribute>`` in that method), for every module-level class, ``__init__`` left out.

    From the ``ast`` (comments and strings do not count, unlike ``ClassInfo.attr_uses``);
    stores count as well as loads (a method rebinding the attribute also depends on it).
    """
    tree = parse_file(source)
    if tree is None:
        return {}
    out: dict = {}
    for cls in _module_level_classes(tree.body):
        bases = tuple(
            b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases
        )
        methods: dict[str, dict[str, tuple[tuple[int, int], ...]]] = {}
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__":
                continue
            params = fn.args.posonlyargs + fn.args.args
            self_name = params[0].arg if params else "self"
            reads: dict[str, list[tuple[int, int]]] = {}
            for node in walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == self_name:
                    reads.setdefault(node.attr, []).append((node.lineno, node.col_offset))
            methods[fn.name] = {k: tuple(v) for k, v in reads.items()}
        if cls.name in out:
            # defined twice (``if is_x_available(): class A ... else: class A ...``): either may run
            old_bases, old_methods = out[cls.name]
            for m, reads in old_methods.items():
                merged = dict(methods.get(m, {}))
                for k, v in reads.items():
                    merged[k] = tuple(sorted(set(merged.get(k, ())) | set(v)))
                methods[m] = merged
            bases = tuple(dict.fromkeys(old_bases + bases))
        out[cls.name] = (bases, methods)
    return out


def _module_level_classes(body: list[ast.stmt]):
    """Classes defined at module level, also inside ``if``/``try``/``with`` blocks."""
    for stmt in body:
        if isinstance(stmt, ast.ClassDef):
            yield stmt
        elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level_classes(getattr(stmt, block, []) or [])
            for handler in getattr(stmt, "handlers", []) or []:
                yield from _module_level_classes(handler.body)


def attribute_uses_in_class_family(source: str | None, class_name: str, attr: str) -> list[tuple[int, int, str]] | None:
    """Every ``self.<attr>`` outside ``__init__`` that can run on an instance of ``class_name`` or
    of a subclass defined in the same file: (line, col, ``Class.method``). Methods of in-file
    base classes count unless ``class_name`` (or a nearer base) overrides them; methods of
    in-file subclasses all count (they inherit the same ``__init__`` binding). None when the
    source cannot be parsed."""
    if source is None:
        return None
    found = _attribute_uses_in_class_family(source, class_name, attr)
    return None if found is None else list(found)


@per_file
@lru_cache(maxsize=256)
def _attribute_uses_in_class_family(source: str, class_name: str, attr: str) -> tuple[tuple[int, int, str], ...] | None:
    classes = class_attribute_reads(source)
    if class_name not in classes:
        return None
    found: list[tuple[int, int, str]] = []
    # the class and its in-file ancestors, nearest first (method resolution)
    defined: set[str] = set()
    todo, seen = [class_name], set()
    while todo:
        name = todo.pop(0)
        if name in seen or name not in classes:
            continue
        seen.add(name)
        bases, methods = classes[name]
        for method, reads in methods.items():
            if method in defined:
                continue
            defined.add(method)
            found.extend((line, col, f"{name}.{method}") for line, col in reads.get(attr, ()))
        todo.extend(bases)
    # in-file descendants
    family = {class_name}
    changed = True
    while changed:
        changed = False
        for name, (bases, _methods) in classes.items():
            if name not in family and any(b in family for b in bases):
                family.add(name)
                changed = True
    for name in family - {class_name}:
        for method, reads in classes[name][1].items():
            found.extend((line, col, f"{name}.{method}") for line, col in reads.get(attr, ()))
    return tuple(sorted(set(found)))
