"""Abstract values and interpreter states of the forward interpretation, and the extraction limits."""

from __future__ import annotations

import ast

from adopter.core.dsl import Const

MAX_PATHS = 128
MAX_INLINE_DEPTH = 6
# Budget of statement executions per entry; past it, branches no longer fork
# (their nodes are kept on the first branch only) so pathological files stay fast.
MAX_STEPS = 5_000
# Type of a call whose callee cannot be resolved statically (``self.foo(x)`` with no
# binding of ``foo``, calling a parameter).
UNKNOWN_TYPE = "?"
# Calls through transformers' runtime attention dispatch table.
ATTENTION_TABLE_TYPE = "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS"

# ``_St.flow``: running, returned, killed (``raise``), after ``break`` / ``continue``
LIVE, RET, DEAD, BRK, CONT = range(5)


class _V:
    """Abstract value of an expression.

    ``var`` set: a data value (node output, parameter, assigned name). ``alias`` set:
    a callable or module reference (``("mod", "self.LayerNorm")``, ``("fn", fqn)``,
    ``("local", name)``, ``("method", name)``, ``("def", id)``, ``("class", name)``,
    ``("act", type, key)``, ``("table", fqn)``, ``("self",)``). Otherwise a constant /
    other expression kept as text (``expr`` unparsed lazily, or ``text``).
    ``tensor`` says whether the value may be a tensor (decides whether ``a + b`` is a
    TensorOp). ``elts`` holds element values of a tuple/list display.
    """

    __slots__ = ("var", "expr", "text", "tensor", "alias", "elts", "_const")

    def __init__(self, var=None, expr=None, text=None, tensor=False, alias=None, elts=None):
        self.var = var
        self.expr = expr
        self.text = text
        self.tensor = tensor
        self.alias = alias
        self.elts = elts
        self._const = None

    def value(self):
        if self.var is not None:
            return self.var
        c = self._const
        if c is not None:
            return c  # values never change after construction: the same Const every time
        if self.text is None:
            if self.elts is not None:
                inner = ", ".join(str(e.value()) for e in self.elts)
                self.text = f"({inner},)" if len(self.elts) == 1 else f"({inner})"
            elif self.expr is not None:
                self.text = _unparse(self.expr)
            else:
                self.text = "None"
        c = self._const = Const(self.text)
        return c


# id(ast expr) -> ast.unparse(expr) for the tree being extracted (cleared per file):
# the same expression is written into nodes on many paths.
_UNPARSED: dict[int, str] = {}


def _unparse(node) -> str:
    """``ast.unparse(node)``, once per node of the tree being extracted."""
    text = _UNPARSED.get(id(node))
    if text is None:
        text = _UNPARSED[id(node)] = _unparse_by_source(node)
    return text


# The file being extracted, as UTF-8 lines (ast columns are byte offsets), for source
# segments; set and cleared with _UNPARSED.
SOURCE_LINES: list[bytes] = []
# (node type, exact source text) -> ast.unparse of it. An expression's tree is a function of
# its text, so this holds across files: the same conditions and config expressions recur in
# every model file, and ast.unparse (pure Python) was a tenth of a scan.
_UNPARSED_BY_TEXT: dict[tuple[type, str], str] = {}
_UNPARSED_BY_TEXT_LIMIT = 200_000


# Parts of f-strings (their literal pieces, replacement fields and format specs) carry the
# position of the whole f-string in Python < 3.12: their source text says nothing about them.
_POSITION_NOT_OWN = (ast.JoinedStr, ast.FormattedValue, ast.Constant)


def _unparse_by_source(node) -> str:
    # (a node of another module read for its factories: its positions index that module's text,
    # not SOURCE_LINES; sliced from here it cached a wrong text for every later file)
    if isinstance(node, _POSITION_NOT_OWN) or getattr(node, "other_file", False):
        return ast.unparse(node)
    line, end_line = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    lines = SOURCE_LINES
    if line is None or end_line is None or not 0 < line <= end_line <= len(lines):
        return ast.unparse(node)
    col, end_col = node.col_offset, node.end_col_offset
    try:
        if line == end_line:
            source = lines[line - 1][col:end_col].decode()
        else:
            source = (
                lines[line - 1][col:].decode()
                + b"".join(lines[line:end_line - 1]).decode()
                + lines[end_line - 1][:end_col].decode()
            )
    except UnicodeDecodeError:  # positions that do not fall on characters: no shortcut
        return ast.unparse(node)
    key = (type(node), source)
    text = _UNPARSED_BY_TEXT.get(key)
    if text is None:
        if len(_UNPARSED_BY_TEXT) >= _UNPARSED_BY_TEXT_LIMIT:
            _UNPARSED_BY_TEXT.clear()
        text = _UNPARSED_BY_TEXT[key] = ast.unparse(node)
    return text

_NONE = _V(text="None")
_TRUE = _V(text="True")
_FALSE = _V(text="False")
# id(if test) -> names it reads (cleared per file with _UNPARSED)
_TEST_NAMES: dict[int, list[str]] = {}
_SELF = _V(alias=("self",), text="self")


class _St:
    __slots__ = ("nodes", "env", "flow", "ret")

    def __init__(self, nodes, env, flow=LIVE, ret=None):
        self.nodes = nodes  # cons list (see _cons_to_tuple) or None
        self.env = env
        self.flow = flow
        self.ret = ret

    def fork(self) -> "_St":
        return _St(self.nodes, dict(self.env), self.flow, self.ret)


def _cons_to_tuple(cell) -> tuple:
    """The nodes of a cons list, oldest first. A cell is ``(node, previous)`` or, for the
    nodes of an inlined call replayed onto a caller's path, ``(nodes, previous, _CHUNK)``
    with ``nodes`` oldest first (:func:`_push_all`)."""
    out = []
    while cell is not None:
        if len(cell) == 2:
            out.append(cell[0])
        else:
            out.extend(reversed(cell[0]))
        cell = cell[1]
    out.reverse()
    return tuple(out)


_CHUNK = "chunk"


def _push_all(nodes: tuple, cell):
    """``cell`` with ``nodes`` (oldest first) added: one cell for all of them, where adding
    them one by one cost a cell per node on every path an inlined call returned to."""
    if not nodes:
        return cell
    if len(nodes) == 1:
        return (nodes[0], cell)
    return (nodes, cell, _CHUNK)


def _has_module(v: _V) -> bool:
    if v.alias is not None:
        return v.alias[0] == "mod"
    return v.elts is not None and any(_has_module(e) for e in v.elts)


def _sig(v: _V):
    """Hashable identity of an abstract value (equal signatures behave the same)."""
    if v.var is not None:
        return (v.var, v.tensor, None if v.elts is None else tuple(_sig(x) for x in v.elts))
    if v.alias is not None:
        return v.alias
    if v.elts is not None:
        return ("elts",) + tuple(_sig(x) for x in v.elts)
    return (v.text, id(v.expr), v.tensor)


def _annotation_is_tensor(ann) -> bool:
    if ann is None:
        return True
    text = ann if isinstance(ann, str) else _unparse(ann)
    if "Tensor" in text or "tensor" in text:
        return True
    return False

