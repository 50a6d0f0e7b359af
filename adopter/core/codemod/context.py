"""Analysis half of the codemods: read-only questions about the original source,
answered with stdlib ``ast`` (whose positions are exactly the ``Span`` contract).

Codemods turn a :class:`~adopter.core.structures.Match` into an :class:`~adopter.core.codemod.edits.Edit`
using only this module; :mod:`adopter.rewrite.apply` then performs the edit on the fissix tree.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from adopter.core.dsl import Span
from adopter.core.source_file import source_lines
from adopter.core.syntax import walk


def _split_lines_no_ff(text: str) -> list[str]:
    """Lines with their ends, split at \\r\\n, \\r and \\n only (what ast.get_source_segment uses)."""
    return re.split(r"(?<=\r\n)|(?<=\r)(?!\n)|(?<=\n)", text)


class Skip(Exception):
    """A match that cannot be rewritten safely; the message is the reason shown to the user."""


def _walk_no_nested_scopes(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that does not descend into nested functions, lambdas or classes."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            stack.append(child)


@dataclass
class FunctionInfo:
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    class_node: ast.ClassDef | None


@dataclass
class FileContext:
    """The original source, parsed once with ``ast``, plus position indexes."""

    text: str
    filename: str = "<string>"
    tree: ast.Module = field(init=False)
    lines: list[str] = field(init=False)

    def __post_init__(self):
        from adopter.core.extract.driver import parsed_tree

        # The scan that produced the matches parsed this very text: its tree is shared
        # (neither side changes it).
        shared = parsed_tree(self.text)
        self.tree = shared if shared is not None else ast.parse(self.text, filename=self.filename)
        self.lines = source_lines(self.text, keepends=True)  # split where ast counts lines
        # One walk builds every index (ast.walk per index was a tenth of rewrite time).
        parents: dict[ast.AST, ast.AST] = {}
        by_pos: dict[tuple[int, int, int, int], list[ast.AST]] = {}
        classes: dict[str, ast.ClassDef] = {}
        names: set[str] = set()
        AST, Name, ClassDef, arg, alias = ast.AST, ast.Name, ast.ClassDef, ast.arg, ast.alias
        definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ClassDef)
        queue = [self.tree]
        for node in queue:  # breadth first, as ast.walk
            if isinstance(node, Name):
                names.add(node.id)
            elif isinstance(node, definitions):
                names.add(node.name)
                if isinstance(node, ClassDef):
                    classes[node.name] = node  # the last definition wins, as in the module
            elif isinstance(node, alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, arg):
                names.add(node.arg)
            end_line = getattr(node, "end_lineno", None)
            if end_line is not None:
                key = (node.lineno, node.col_offset, end_line, node.end_col_offset)
                found = by_pos.get(key)
                if found is None:
                    by_pos[key] = [node]
                else:
                    found.append(node)
            for field_name in node._fields:
                value = getattr(node, field_name, None)
                if isinstance(value, AST):
                    parents[value] = node
                    queue.append(value)
                elif isinstance(value, list):
                    for item in value:
                        if isinstance(item, AST):
                            parents[item] = node
                            queue.append(item)
        self._parents = parents
        self._by_pos = by_pos
        self._classes = classes
        self._names = frozenset(names)

    # ---------------------------------------------------------------- positions

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self._parents.get(node)

    def expr_at(self, span: Span) -> ast.expr:
        """The expression exactly at ``span`` (outermost when several share it)."""
        found = self._by_pos.get((span.line, span.col, span.end_line, span.end_col))
        exprs = [n for n in found or () if isinstance(n, ast.expr)]
        if not exprs:
            raise Skip(f"no expression at {span.line}:{span.col} (source changed since scanning?)")
        return exprs[0]

    def augassign_at(self, span: Span) -> ast.AugAssign | None:
        """The in-place statement exactly at ``span`` (``x += y``: extraction gives its
        operation the statement's span), or None."""
        found = self._by_pos.get((span.line, span.col, span.end_line, span.end_col))
        return next((n for n in found or () if isinstance(n, ast.AugAssign)), None)

    def segment(self, node: ast.AST) -> str:
        """``ast.get_source_segment(self.text, node)``, without re-splitting the file per call
        (codemods ask for many segments of one file)."""
        end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
        if end_line is None or end_col is None:
            raise Skip(f"cannot read the source of the expression at line {getattr(node, 'lineno', '?')}")
        lines = self._segment_lines
        first, last = node.lineno - 1, end_line - 1
        if first == last:
            return lines[first][node.col_offset:end_col].decode()
        head = lines[first][node.col_offset:].decode()
        tail = lines[last][:end_col].decode()
        return head + "".join(line.decode() for line in lines[first + 1:last]) + tail

    @cached_property
    def _segment_lines(self) -> list[bytes]:
        # the same line split as ast.get_source_segment (no split at form feeds), UTF-8 encoded
        # because ast columns are byte offsets
        return [line.encode() for line in _split_lines_no_ff(self.text)]

    def char_col(self, line: int, byte_col: int) -> int:
        """ast columns are UTF-8 byte offsets; fissix counts characters."""
        raw = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(raw.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))

    def char_span(self, node: ast.AST) -> tuple[int, int, int, int]:
        return (
            node.lineno,
            self.char_col(node.lineno, node.col_offset),
            node.end_lineno,
            self.char_col(node.end_lineno, node.end_col_offset),
        )

    # ---------------------------------------------------------------- scopes

    @cached_property
    def functions(self) -> dict[str, FunctionInfo]:
        out: dict[str, FunctionInfo] = {}

        def visit(body, prefix: str, cls: ast.ClassDef | None):
            for stmt in body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}{stmt.name}"
                    out.setdefault(qual, FunctionInfo(qual, stmt, cls))
                elif isinstance(stmt, ast.ClassDef):
                    visit(stmt.body, f"{prefix}{stmt.name}.", stmt)
                elif isinstance(stmt, (ast.If, ast.Try)):
                    # Definitions under `if TYPE_CHECKING`/try at module level still count.
                    for part in (getattr(stmt, "body", []), getattr(stmt, "orelse", [])):
                        visit(part, prefix, cls)

        visit(self.tree.body, "", None)
        return out

    @property
    def classes(self) -> dict[str, ast.ClassDef]:
        return self._classes

    def function(self, qualname: str) -> FunctionInfo:
        info = self.functions.get(qualname)
        if info is None:
            raise Skip(f"function {qualname} not found")
        return info

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | None:
        current = self.parent(node)
        while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
            current = self.parent(current)
        return current

    def enclosing_class_name(self, node: ast.AST) -> str | None:
        current = self.parent(node)
        while current is not None and not isinstance(current, ast.ClassDef):
            current = self.parent(current)
        return current.name if current is not None else None

    def statement_of(self, node: ast.AST) -> ast.stmt:
        current = node
        while current is not None and not isinstance(current, ast.stmt):
            current = self.parent(current)
        if current is None:
            raise Skip(f"expression at line {node.lineno} is not inside a statement")
        return current

    def block_of(self, stmt: ast.stmt) -> tuple[ast.AST, str, list[ast.stmt]]:
        """(owner node, field name, the statement list holding ``stmt``)."""
        owner = self.parent(stmt)
        for name in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(owner, name, None)
            if isinstance(block, list) and stmt in block:
                return owner, name, block
        raise Skip(f"statement at line {stmt.lineno} is not in a block")

    def enclosing_ifs(self, stmt: ast.stmt, stop: ast.AST) -> list[tuple[str, str]]:
        """``[(test source, 'body'|'orelse'), ...]`` of the ``if`` statements between
        ``stop`` (exclusive) and ``stmt``, outermost first. Other compound statements
        (loops, with, try) raise :class:`Skip`."""
        chain: list[tuple[str, str]] = []
        current: ast.AST = stmt
        while True:
            owner, name, _ = self.block_of(current)
            if owner is stop:
                break
            if not isinstance(owner, ast.If):
                raise Skip(f"line {stmt.lineno} is inside a {type(owner).__name__.lower()} statement")
            chain.append((self.segment(owner.test), name))
            current = owner
        return list(reversed(chain))

    # ---------------------------------------------------------------- names

    def class_attr_uses(self, class_name: str, attr: str) -> list[tuple[int, int, str]]:
        """Every read of ``self.<attr>`` in the class outside ``__init__``:
        ``(line, col, function name)``; also ``getattr(self, "attr")``."""
        cls = self.classes.get(class_name)
        if cls is None:
            return []
        uses = []
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in walk(fn):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == attr
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and isinstance(node.ctx, ast.Load)
                ):
                    if fn.name == "__init__":
                        uses.append((node.lineno, node.col_offset, "__init__"))
                    else:
                        uses.append((node.lineno, node.col_offset, fn.name))
                elif (
                    isinstance(node, ast.Constant)
                    and node.value == attr
                    and isinstance(self.parent(node), ast.Call)
                ):
                    uses.append((node.lineno, node.col_offset, fn.name))
        return uses

    def subclasses(self, class_name: str) -> list[str]:
        """Classes in this file deriving (transitively) from ``class_name``."""
        out: list[str] = []
        frontier = [class_name]
        while frontier:
            base = frontier.pop()
            for cls in self.classes.values():
                names = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases}
                if base in names and cls.name not in out and cls.name != class_name:
                    out.append(cls.name)
                    frontier.append(cls.name)
        return out

    def method_in_class_family(self, class_name: str, name: str) -> tuple[str, ast.FunctionDef] | None:
        """``(owner, def)`` of method ``name`` on ``class_name`` or its nearest same-file base."""
        todo, seen = [class_name], set()
        while todo:
            cls = self.classes.get(todo.pop(0))
            if cls is None or cls.name in seen:
                continue
            seen.add(cls.name)
            for stmt in cls.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return cls.name, stmt  # type: ignore[return-value]
            todo.extend(b.id for b in cls.bases if isinstance(b, ast.Name))
        return None

    def defined_here(self, name: str) -> bool:
        """``name`` is a class or function defined at module level of this file."""
        return any(isinstance(s, (ast.ClassDef, ast.FunctionDef)) and s.name == name for s in self.tree.body)

    def same_file_callable(self, class_name: str | None, call: ast.Call) -> str | None:
        """The name of a same-file class or function ``call`` runs, if it is one: ``gelu(x)`` with
        a module-level ``def gelu``, or ``self.act(x)`` with ``self.act = MyAct()`` in the class.
        The kernels recognize torch and transformers activations at run time, so a site whose
        activation is the file's own would always fall back."""
        func = call.func
        if isinstance(func, ast.Name):
            return func.id if self.defined_here(func.id) else None
        attr = is_self_attr(func)
        if attr is None or class_name is None:
            return None
        for stmt in self.class_attr_stores(class_name, attr):
            value = getattr(stmt, "value", None)
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and self.defined_here(value.func.id):
                return value.func.id
        return None

    def class_attr_stores(self, class_name: str, attr: str) -> list[ast.stmt]:
        cls = self.classes.get(class_name)
        out = []
        for node in walk(cls) if cls is not None else ():
            if isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    out.append(self.statement_of(node))
        return out

    def names_in_function(self, fn: ast.AST) -> set[str]:
        names = set()
        for node in walk(fn):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
        return names

    def kernel_imports(self) -> dict[str, str]:
        """Names already imported from ``adopter.kernels`` at module level: name -> local name."""
        out = {}
        for stmt in self.tree.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "adopter.kernels" and stmt.level == 0:
                for alias in stmt.names:
                    out[alias.name] = alias.asname or alias.name
        return out

    def module_names(self) -> set[str]:
        """Every name bound or read anywhere in the module (to avoid import collisions)."""
        return set(self._names)


def stores(node: ast.AST) -> set[str]:
    """Local names a statement (re)binds."""
    out = set()
    for sub in _walk_no_nested_scopes(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            out.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not node:
            out.add(sub.name)
        elif isinstance(sub, ast.alias):
            out.add((sub.asname or sub.name).split(".")[0])
    return out


def loads(node: ast.AST) -> set[str]:
    return {
        sub.id for sub in walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
    }


def has_call(node: ast.AST) -> bool:
    return any(isinstance(sub, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)) for sub in walk(node))


def is_self_attr(node: ast.AST) -> str | None:
    """``self.x`` -> ``"x"``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def simple_assign_target(stmt: ast.stmt) -> str | None:
    """``name = ...`` / ``name: T = ...`` -> name."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
        return stmt.target.id
    return None


def call_arguments(call: ast.Call, signature: Iterable[str]) -> dict[str, ast.expr]:
    """Arguments of a call by parameter name (positional mapped through ``signature``)."""
    names = list(signature)
    out: dict[str, ast.expr] = {}
    for index, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            raise Skip("call uses *args")
        if index >= len(names):
            raise Skip("call has more positional arguments than expected")
        out[names[index]] = arg
    for kw in call.keywords:
        if kw.arg is None:
            raise Skip("call uses **kwargs")
        out[kw.arg] = kw.value
    return out


def literal(node: ast.expr | None):
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except Exception:
        return _NOT_LITERAL


_NOT_LITERAL = object()


def is_literal(value) -> bool:
    return value is not _NOT_LITERAL
