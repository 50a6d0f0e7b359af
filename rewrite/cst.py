"""fissix tree helpers: parsing, locating statements by position, and statement edits
that keep indentation, comments and blank lines intact.

fissix keeps all whitespace in leaf prefixes. Inside a block (``suite``) the first
statement's indentation lives in the ``INDENT`` leaf and its prefix is empty; every
later statement carries ``<comment/blank lines><indentation>`` as prefix; text before
the next dedented statement sits in the ``DEDENT`` leaf's prefix. The helpers here
keep that invariant so ``str(tree)`` always round-trips to valid source.
"""

from __future__ import annotations

from collections.abc import Iterator

from fissix import pygram, pytree
from fissix.pgen2 import driver as pgen_driver
from fissix.pgen2 import token
from fissix.pygram import python_symbols as syms

from adopter.core.source_file import source_lines

Node = pytree.Node
Leaf = pytree.Leaf
LN = pytree.Base

_DRIVER = pgen_driver.Driver(pygram.python_grammar_no_print_and_exec_statement, convert=pytree.convert)

STMT_TYPES = {
    syms.simple_stmt,
    syms.if_stmt,
    syms.while_stmt,
    syms.for_stmt,
    syms.try_stmt,
    syms.with_stmt,
    syms.funcdef,
    syms.classdef,
    syms.decorated,
    syms.async_stmt,
    syms.async_funcdef,
}


class ParseFailure(Exception):
    """fissix cannot parse the text (newer syntax it does not know, or a syntax error)."""


def parse(text: str) -> Node:
    """Parse ``\\n``-newline text. A missing final newline is tolerated (fissix needs one:
    we add it here and :func:`unparse` removes it again)."""
    if text and not text.endswith("\n"):
        text += "\n"
    try:
        return _DRIVER.parse_string(text)
    except Exception as exc:  # fissix raises ParseError, TokenError, IndentationError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ParseFailure(f"fissix cannot parse this file ({type(exc).__name__}: {detail})") from None


def unparse(tree: Node, original: str) -> str:
    text = str(tree)
    if not original.endswith("\n") and text.endswith("\n"):
        text = text[:-1]
    return text


# ------------------------------------------------------------------ navigation


def first_leaf(node: LN) -> Leaf:
    while isinstance(node, Node):
        node = node.children[0]
    return node


def is_statement(node: LN) -> bool:
    return node.type in STMT_TYPES and node.parent is not None and node.parent.type in (
        syms.suite,
        syms.file_input,
    )


def statements_in(block: Node) -> list[LN]:
    return [c for c in block.children if c.type in STMT_TYPES]


def enclosing_statement(node: LN) -> LN:
    """The statement (direct child of a block) that contains ``node``."""
    while node is not None and not is_statement(node):
        node = node.parent
    if node is None:
        raise LookupError("node is not inside a statement")
    return node


def block_of(stmt: LN) -> Node:
    return stmt.parent


def enclosing_statement_or_none(node: LN) -> LN | None:
    try:
        return enclosing_statement(node)
    except LookupError:
        return None


def end_position(node: LN) -> tuple[int, int]:
    last = node
    while isinstance(last, Node):
        last = last.children[-1] if last.children else last
        if isinstance(last, Node) and not last.children:
            break
    # Skip trailing NEWLINE/DEDENT tokens: they are not part of an expression's text.
    if isinstance(last, Leaf):
        text = last.value
        lines = text.split("\n")
        if len(lines) == 1:
            return last.lineno, last.column + len(text)
        return last.lineno + len(lines) - 1, len(lines[-1])
    return (0, 0)


# ------------------------------------------------------------------ indentation


def indent_of(stmt: LN) -> str:
    """Indentation string of the line where ``stmt`` starts: every statement of a block
    shares the indentation held by the block's ``INDENT`` leaf (module level: none)."""
    block = stmt.parent
    if block is None or block.type == syms.file_input:
        return ""
    for child in block.children:
        if child.type == token.INDENT:
            return child.value
    prefix = stmt.prefix
    return prefix.rsplit("\n", 1)[-1] if prefix.strip() == "" or "\n" in prefix else ""


def has_multiline_string(node: LN) -> bool:
    return any(leaf.type == token.STRING and "\n" in leaf.value for leaf in node.leaves())


def reindent(node: LN, old: str, new: str) -> None:
    """Shift the continuation lines inside ``node`` from indentation ``old`` to ``new``
    (the first line's indentation is the caller's business: it lives in the prefix)."""
    if old == new:
        return
    first = first_leaf(node)
    for leaf in node.leaves():
        if leaf is first or "\n" not in leaf.prefix:
            continue
        parts = leaf.prefix.split("\n")
        fixed = [parts[0]]
        for part in parts[1:]:
            fixed.append(new + part[len(old):] if part.startswith(old) else part)
        leaf.prefix = "\n".join(fixed)
    for inner in _nodes(node):
        if inner.type == syms.suite:
            for child in inner.children:
                if child.type == token.INDENT and child.value.startswith(old):
                    child.value = new + child.value[len(old):]
                if child.type == token.DEDENT and child.prefix:
                    parts = child.prefix.split("\n")
                    child.prefix = "\n".join(
                        [parts[0]] + [new + p[len(old):] if p.startswith(old) else p for p in parts[1:]]
                    )


def _nodes(node: LN) -> Iterator[Node]:
    if isinstance(node, Node):
        yield node
        for child in node.children:
            yield from _nodes(child)


# ------------------------------------------------------------------ building nodes


def parse_statements(text: str, indent: str) -> list[LN]:
    """Parse ``text`` (statements written at column 0, ``\\n``-terminated) into statement
    nodes whose continuation lines sit at ``indent``. Their first-line indentation is
    left to the insertion helpers."""
    if not text.endswith("\n"):
        text += "\n"
    if not indent:
        tree = parse(text)
        stmts = statements_in(tree)
    else:
        body = "".join(indent + line if line.strip() else line for line in source_lines(text, keepends=True))
        tree = parse("if 1:\n" + body)
        suite = tree.children[0].children[3]
        stmts = statements_in(suite)
    for stmt in stmts:
        stmt.remove()
        stmt.prefix = ""
        for leaf in stmt.leaves():
            leaf.lineno = 0  # synthesized: never found by position lookups
    return stmts


def _split_prefix(prefix: str) -> tuple[str, str]:
    """``(comment/blank lines, indentation)`` of a statement prefix."""
    if "\n" in prefix:
        head, indentation = prefix.rsplit("\n", 1)
        return head + "\n", indentation
    return "", prefix


def replace_statement(stmt: LN, new_stmts: list[LN]) -> list[LN]:
    """Put ``new_stmts`` where ``stmt`` is; comments above ``stmt`` stay above the first."""
    indentation = indent_of(stmt)
    block = stmt.parent
    index = block.children.index(stmt)
    first_in_block = index > 0 and block.children[index - 1].type == token.INDENT
    _release_dedent(stmt)
    for offset, new in enumerate(new_stmts):
        if offset == 0:
            new.prefix = stmt.prefix if not first_in_block else ""
        else:
            new.prefix = indentation
    stmt.remove()
    for offset, new in enumerate(new_stmts):
        block.insert_child(index + offset, new)
    return new_stmts


def prefix_in_dedent(stmt: LN) -> bool:
    """True when ``stmt`` follows a compound statement in its block: fissix then keeps
    ``stmt``'s comments and indentation in that compound's final ``DEDENT`` prefix."""
    prev = stmt.prev_sibling
    return prev is not None and prev.type in STMT_TYPES and prev.type != syms.simple_stmt and stmt.prefix == ""


class _TrailingDedents:
    """The DEDENT leaves closing a compound statement (one per nested block). They print
    back to back, so the text they hold (the next statement's comments and indentation)
    is their joined prefixes; setting it puts it on the outermost and clears the others."""

    def __init__(self, leaves_: list[Leaf]):
        self.leaves = leaves_

    @property
    def prefix(self) -> str:
        return "".join(leaf.prefix for leaf in self.leaves)

    @prefix.setter
    def prefix(self, value: str) -> None:
        for leaf in self.leaves:
            leaf.prefix = ""
        self.leaves[-1].prefix = value


def _last_dedent(node: LN) -> _TrailingDedents | None:
    trailing: list[Leaf] = []
    for leaf in reversed(list(node.leaves())):
        if leaf.type != token.DEDENT:
            break
        trailing.append(leaf)
    if not trailing:
        return None
    return _TrailingDedents(list(reversed(trailing)))


def _release_dedent(stmt: LN) -> None:
    """Before a compound statement goes away: the text its final DEDENT holds (the next
    statement's comments and indentation) moves back into the next statement's prefix."""
    if stmt.type == syms.simple_stmt:
        return
    nxt = stmt.next_sibling
    dedent = _last_dedent(stmt)
    if dedent is not None and nxt is not None and nxt.type in STMT_TYPES and nxt.prefix == "":
        nxt.prefix = dedent.prefix
        dedent.prefix = ""
    elif dedent is not None and nxt is not None and nxt.type == token.DEDENT:
        nxt.prefix = dedent.prefix + nxt.prefix
        dedent.prefix = ""


def remove_statement(stmt: LN) -> None:
    """Delete ``stmt`` with its own leading comment lines; a block left empty gets ``pass``."""
    block = stmt.parent
    index = block.children.index(stmt)
    prev = block.children[index - 1] if index > 0 else None
    nxt = block.children[index + 1] if index + 1 < len(block.children) else None
    if not (block.type == syms.suite and len(statements_in(block)) == 1):
        _release_dedent(stmt)
    if block.type == syms.suite and len(statements_in(block)) == 1:
        replace_statement(stmt, parse_statements("pass\n", indent_of(stmt)))
        return
    if prefix_in_dedent(stmt) and nxt is not None and nxt.type in STMT_TYPES:
        dedent = _last_dedent(prev)
        if dedent is not None:
            head_d, indentation_d = _split_prefix(dedent.prefix)
            head_n, _ = _split_prefix(nxt.prefix)
            # Lines indented deeper than this block belong to the previous block's body;
            # comment lines at this level described the deleted statement.
            lines = head_d.split("\n")
            kept = [ln for ln in lines if ln.strip() and ln.startswith(indentation_d) and len(ln) - len(ln.lstrip()) > len(indentation_d)]
            blank = "\n" * (len(head_d) - len(head_d.lstrip("\n")))
            dedent.prefix = "".join(k + "\n" for k in kept) + (head_n or blank) + indentation_d
            nxt.prefix = ""
        stmt.remove()
        return
    if prev is not None and prev.type == token.INDENT and nxt is not None and nxt.type in STMT_TYPES:
        # The next statement becomes the block's first: its indentation moves into INDENT.
        head, indentation = _split_prefix(nxt.prefix)
        prev.prefix = prev.prefix + head.lstrip("\n") if prev.prefix else head.lstrip("\n")
        nxt.prefix = ""
    elif nxt is not None and nxt.type in STMT_TYPES:
        # Keep blank lines that separated the previous statement from what follows.
        own_head, _ = _split_prefix(stmt.prefix)
        head, indentation = _split_prefix(nxt.prefix)
        if own_head.strip("\n") == "" and own_head and not head:
            nxt.prefix = own_head + indentation
    elif nxt is not None and nxt.type == token.DEDENT:
        own_head, _ = _split_prefix(stmt.prefix)
        if own_head.strip("\n") == "" and own_head and not nxt.prefix.startswith("\n"):
            nxt.prefix = own_head + nxt.prefix if "\n" in nxt.prefix else nxt.prefix
    stmt.remove()


def insert_statements(
    block: Node, index: int, new_stmts: list[LN], indentation: str, take_leading: bool = True
) -> None:
    """Insert at statement position ``index`` of ``block`` (0 = first statement). With
    ``take_leading`` the new statements go above the comments/blank lines that preceded
    the statement at ``index``; otherwise right below the previous statement."""
    stmts = statements_in(block)
    if index < len(stmts):
        anchor = stmts[index]
        child_index = block.children.index(anchor)
        first_in_block = (
            child_index > 0 and block.children[child_index - 1].type == token.INDENT
        ) or prefix_in_dedent(anchor)
        # The new statements take over the anchor's leading comments/blank lines.
        if first_in_block or not take_leading:
            leading = "" if first_in_block else indentation
            for offset, new in enumerate(new_stmts):
                new.prefix = leading if offset == 0 else indentation
                block.insert_child(child_index + offset, new)
            if first_in_block:
                anchor.prefix = indentation
        else:
            leading = anchor.prefix
            for offset, new in enumerate(new_stmts):
                new.prefix = leading if offset == 0 else indentation
                block.insert_child(child_index + offset, new)
            anchor.prefix = indentation
    else:
        # Append: before the DEDENT of a suite, or at the end of the module.
        child_index = len(block.children)
        while child_index > 0 and block.children[child_index - 1].type in (token.DEDENT, token.ENDMARKER):
            child_index -= 1
        for offset, new in enumerate(new_stmts):
            new.prefix = indentation
            block.insert_child(child_index + offset, new)


def clone_statement(stmt: LN, old_indent: str, new_indent: str) -> LN:
    copy = stmt.clone()
    copy.prefix = ""
    reindent(copy, old_indent, new_indent)
    return copy


def code(node: LN) -> str:
    """Text of a node without its prefix (comments and indentation before it)."""
    prefix = node.prefix
    return str(node)[len(prefix):]
