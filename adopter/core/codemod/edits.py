"""The edit plan: what a codemod's analysis decided, as plain data.

Positions are ``(line, column)`` in *characters* of the original text (fissix
convention); statements are named by where they start. The transformation
(:mod:`adopter.rewrite.apply`) needs nothing but these objects and the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

Pos = tuple[int, int]  # (line, char column) where a statement starts
Extent = tuple[int, int, int, int]  # (line, col, end_line, end_col) of an expression


@dataclass(frozen=True)
class ExprEdit:
    """Replace the expression at ``extent`` (inside one of the forward statements) by ``text``."""

    extent: Extent
    text: str


@dataclass(frozen=True)
class StatementEdit:
    """Replace the whole statement starting at ``at`` by ``text`` (one or more statements)."""

    at: Pos
    text: str


@dataclass(frozen=True)
class InitEdit:
    """``__init__`` side: the statement at ``replace`` becomes ``construct``; ``delete``
    statements go away (layers the kernel absorbs and nothing else uses)."""

    replace: Pos
    construct: str
    delete: tuple[Pos, ...] = ()


@dataclass(frozen=True)
class ForwardEdit:
    """Composition-function side.

    ``statements`` are the matched statements in execution order; when they are not in
    one block they are first brought together by hoisting (paper Fig. 4). Then
    ``expr_edits``/``statement_edits`` apply, ``insert_before`` statements go before the
    statement at ``anchor``, and ``delete`` statements are removed.
    """

    statements: tuple[Pos, ...]
    anchor: Pos
    expr_edits: tuple[ExprEdit, ...] = ()
    statement_edits: tuple[StatementEdit, ...] = ()
    insert_before: tuple[str, ...] = ()
    delete: tuple[Pos, ...] = ()


@dataclass(frozen=True)
class MethodEdit:
    """Class side: the method definition ``text`` (written at column 0) goes into the class
    right below the method whose ``def`` starts at ``after``, which stays as it is (a helper
    split for a kernel: its other callers and overrides keep the original)."""

    after: Pos
    text: str


@dataclass(frozen=True)
class Edit:
    """Everything one match changes."""

    rule: str
    forward: ForwardEdit | None
    init: tuple[InitEdit, ...] = ()
    imports: tuple[str, ...] = ()  # names imported from adopter.kernels (``name`` or ``name as alias``)
    methods: tuple[MethodEdit, ...] = ()
