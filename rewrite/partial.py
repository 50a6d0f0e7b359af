"""Parse only the part of a file that edits touch.

fissix's parser is pure Python and was half of ``adopter rewrite``'s time, while the edits
of a file touch a few of its top-level statements. The file is cut into *segments* at the
start of top-level statements (a segment runs up to the next one, so the comments and blank
lines between two statements stay with the one above, as in a whole-file parse); the
header (everything before the first top-level ``def``/``class``, where kernel imports go),
the segments holding edited lines, and those holding a ``from adopter.kernels import`` are
concatenated and parsed as one tree. Leaf line numbers are then shifted back to the
original file's, so edits find their statements by the same positions as in a whole-file
tree, and :meth:`PartialTree.text` splices the edited segments back between the untouched
ones, which are copied verbatim.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from adopter.rewrite import cst

__all__ = ["PartialTree", "segment_starts"]


def segment_starts(module: ast.Module) -> list[int]:
    """First lines (1-based) of the segments of the file ``module`` was parsed from: line 1
    (the header), then every top-level statement from the first ``def``/``class`` on."""
    starts = [1]
    seen_definition = False
    for stmt in module.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            seen_definition = True
        if not seen_definition:
            continue
        decorators = getattr(stmt, "decorator_list", None)
        line = min([stmt.lineno, *(d.lineno for d in decorators or ())])
        if line > starts[-1]:  # two statements on one line are one segment
            starts.append(line)
    return starts


def _kernel_import_lines(module: ast.Module, kernels_module: str) -> list[int]:
    return [
        stmt.lineno
        for stmt in module.body
        if isinstance(stmt, ast.ImportFrom) and stmt.module == kernels_module and stmt.level == 0
    ]


@dataclass
class PartialTree:
    """The fissix tree of some segments of ``text``, with the original file's line numbers."""

    text: str  # the whole original text (``\\n`` newlines)
    lines: list[str]  # its lines, ends kept, split at ``\\n`` only (as fissix and ast count them)
    starts: list[int]  # first line of every segment
    parsed: list[int]  # indices into ``starts`` of the segments in ``root``, ascending
    root: cst.Node
    first_children: list  # per parsed segment but the first: its first top-level node
    # Set by text_after_edits: (first line in the new text, new text) of every segment that
    # changed. Each is a sequence of whole top-level statements: it compiles on its own.
    changed_segments: list = field(default_factory=list)

    @classmethod
    def parse(
        cls, text: str, module: ast.Module, edited_lines: Iterable[int] | None, kernels_module: str
    ) -> PartialTree:
        """The segments of ``text`` (whose ast is ``module``) holding ``edited_lines``, plus
        the header and any kernel import; every segment when ``edited_lines`` is None.
        Raises :class:`cst.ParseFailure`."""
        split = text.split("\n")
        lines = [line + "\n" for line in split[:-1]] + ([split[-1]] if split[-1] else [])
        starts = segment_starts(module)
        if edited_lines is None:
            return cls._build(text, lines, starts, list(range(len(starts))))
        wanted = {0}
        for line in [*edited_lines, *_kernel_import_lines(module, kernels_module)]:
            if line >= 1:
                wanted.add(bisect.bisect_right(starts, line) - 1)
        return cls._build(text, lines, starts, sorted(wanted))

    def reparse(self) -> PartialTree:
        """A fresh tree of the same segments (after a failed edit left this one half done)."""
        return self._build(self.text, self.lines, self.starts, self.parsed)

    def _segment_text(self, index: int) -> str:
        return "".join(self.lines[self.starts[index] - 1:self._segment_end(index) - 1])

    def _segment_end(self, index: int) -> int:
        """First line after segment ``index``."""
        return self.starts[index + 1] if index + 1 < len(self.starts) else len(self.lines) + 1

    @classmethod
    def _build(cls, text: str, lines: list[str], starts: list[int], parsed: list[int]) -> PartialTree:
        tree = cls(text, lines, starts, parsed, None, [])
        pieces, reduced_starts = [], []
        reduced_line = 1
        for index in parsed:
            reduced_starts.append(reduced_line)
            pieces.append(tree._segment_text(index))
            reduced_line += tree._segment_end(index) - starts[index]
        reduced = "".join(pieces)
        root = cst.parse(reduced)
        if str(root) != (reduced if reduced.endswith("\n") or not reduced else reduced + "\n"):
            raise cst.ParseFailure("fissix does not round-trip this file exactly")
        # Back to the original numbering: a leaf on reduced line r of parsed segment k sits
        # on line r + (original start - reduced start) of the file.
        shifts = [starts[index] - line for index, line in zip(parsed, reduced_starts)]
        if any(shifts):
            stack = [root]
            while stack:
                node = stack.pop()
                if isinstance(node, cst.Leaf):
                    k = bisect.bisect_right(reduced_starts, node.lineno) - 1
                    if k > 0:
                        node.lineno += shifts[k]
                else:
                    stack.extend(node.children)
        by_start = {}
        for child in root.children:
            leaf = cst.first_leaf(child)
            if leaf.column == 0:
                by_start.setdefault(leaf.lineno, child)
        for index in parsed[1:]:
            first = by_start.get(starts[index])
            if first is None:
                raise cst.ParseFailure(f"fissix tree has no statement at line {starts[index]}")
            tree.first_children.append(first)
        tree.root = root
        return tree

    def text_after_edits(self) -> str:
        """The whole file: edited segments from the tree, the others as they were.
        Raises :class:`cst.ParseFailure` when an edit moved a segment's first statement (the
        cut points are then unknown)."""
        if len(self.parsed) == len(self.starts):
            text = cst.unparse(self.root, self.text)
            self.changed_segments = [(1, text)] if text != self.text else []
            return text
        children = self.root.children
        out_parts: list[str] = []
        boundaries = [0]
        positions = {id(c): i for i, c in enumerate(children)}
        texts = [str(c) for c in children]
        for first in self.first_children:
            index = positions.get(id(first))
            if index is None or first.parent is not self.root:
                raise cst.ParseFailure("an edit replaced a top-level statement")
            boundaries.append(sum(len(t) for t in texts[:index]) + len(first.prefix))
        edited = "".join(texts)
        if boundaries != sorted(boundaries):
            raise cst.ParseFailure("an edit reordered top-level statements")
        boundaries.append(len(edited))
        edited_segments = {
            index: edited[boundaries[k]:boundaries[k + 1]] for k, index in enumerate(self.parsed)
        }
        self.changed_segments = []
        line = 1
        for index in range(len(self.starts)):
            part = self._segment_text(index)
            if index in edited_segments and edited_segments[index] != part:
                part = edited_segments[index]
                self.changed_segments.append((line, part))
            out_parts.append(part)
            line += part.count("\n")
        text = "".join(out_parts)
        # fissix needs a final newline: cst.parse added one that the original did not have
        if not self.text.endswith("\n") and text.endswith("\n"):
            text = text[:-1]
        return text
