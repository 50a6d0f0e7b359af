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
from dataclasses import dataclass

from adopter.rewrite import cst

__all__ = ["PartialTree", "SplicedText", "segment_starts"]


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


def _segment_end(lines: list[str], starts: list[int], index: int) -> int:
    """First line after segment ``index``."""
    return starts[index + 1] if index + 1 < len(starts) else len(lines) + 1


def _segment_text(lines: list[str], starts: list[int], index: int) -> str:
    return "".join(lines[starts[index] - 1:_segment_end(lines, starts, index) - 1])


@dataclass(frozen=True)
class SplicedText:
    """The whole file after the edits, and what changed in it."""

    text: str
    # (first line in ``text``, new text) of every segment that changed: each is a sequence of
    # whole top-level statements, so it compiles on its own.
    changed_segments: list[tuple[int, str]]


@dataclass
class PartialTree:
    """The fissix tree of some segments of ``text``, with the original file's line numbers."""

    text: str  # the whole original text (``\\n`` newlines)
    lines: list[str]  # its lines, ends kept, split at ``\\n`` only (as fissix and ast count them)
    starts: list[int]  # first line of every segment
    parsed: list[int]  # indices into ``starts`` of the segments in ``root``, ascending
    root: cst.Node
    first_children: list  # per parsed segment but the first: its first top-level node

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

    @classmethod
    def _build(cls, text: str, lines: list[str], starts: list[int], parsed: list[int]) -> PartialTree:
        pieces, reduced_starts = [], []
        reduced_line = 1
        for index in parsed:
            reduced_starts.append(reduced_line)
            pieces.append(_segment_text(lines, starts, index))
            reduced_line += _segment_end(lines, starts, index) - starts[index]
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
        first_children = []
        for index in parsed[1:]:
            first = by_start.get(starts[index])
            if first is None:
                raise cst.ParseFailure(f"fissix tree has no statement at line {starts[index]}")
            first_children.append(first)
        return cls(text, lines, starts, parsed, root, first_children)

    def spliced(self) -> SplicedText:
        """The whole file: edited segments from the tree, the others as they were.
        Raises :class:`cst.ParseFailure` when an edit moved a segment's first statement (the
        cut points are then unknown)."""
        if len(self.parsed) == len(self.starts):
            text = cst.unparse(self.root, self.text)
            return SplicedText(text, [(1, text)] if text != self.text else [])
        children = self.root.children
        texts = [str(c) for c in children]
        offsets = [0]
        for t in texts:
            offsets.append(offsets[-1] + len(t))
        positions = {id(c): i for i, c in enumerate(children)}
        boundaries = [0]
        for first in self.first_children:
            index = positions.get(id(first))
            if index is None:
                raise cst.ParseFailure("an edit replaced a top-level statement")
            boundaries.append(offsets[index] + len(first.prefix))
        if boundaries != sorted(boundaries):
            raise cst.ParseFailure("an edit reordered top-level statements")
        edited = "".join(texts)
        boundaries.append(len(edited))
        edited_segments = {index: edited[boundaries[k]:boundaries[k + 1]] for k, index in enumerate(self.parsed)}
        out_parts: list[str] = []
        changed: list[tuple[int, str]] = []
        line = 1
        for index in range(len(self.starts)):
            part = _segment_text(self.lines, self.starts, index)
            if index in edited_segments and edited_segments[index] != part:
                part = edited_segments[index]
                changed.append((line, part))
            out_parts.append(part)
            line += part.count("\n")
        text = "".join(out_parts)
        # fissix needs a final newline: cst.parse added one that the original did not have
        if not self.text.endswith("\n") and text.endswith("\n"):
            text = text[:-1]
        return SplicedText(text, changed)
