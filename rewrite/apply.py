"""Transformation half: perform :class:`~adopter.core.codemod.edits.Edit` plans on a fissix tree.

Statements are found by where they start in the original text; synthesized nodes carry
line 0 so they are never mistaken for original code, and hoisted copies other than the
one that receives the kernel call are cleared the same way.
"""

from __future__ import annotations

import ast
import sys

from adopter.rewrite import cst
from fissix.pgen2 import token
from fissix.pygram import python_symbols as syms

from adopter.core.codemod.context import Skip
from adopter.core.codemod.edits import Edit, Extent, Pos

KERNELS_MODULE = "adopter.kernels"


# ---------------------------------------------------------------- lookup


def _leaves_at(root, line: int, col: int):
    """Leaves of ``root`` starting at ``(line, col)``, in tree order (``root.leaves()``
    without its nested generators: this runs over whole files for every lookup)."""
    leaf_type = cst.Leaf
    stack = [root]
    pop, extend = stack.pop, stack.extend
    while stack:
        node = pop()
        if isinstance(node, leaf_type):
            if node.lineno == line and node.column == col:
                yield node
        else:
            extend(reversed(node.children))


def find_statement(root, at: Pos):
    line, col = at
    for leaf in _leaves_at(root, line, col):
        if leaf.type not in (token.INDENT, token.DEDENT):
            stmt = cst.enclosing_statement_or_none(leaf)
            # The innermost statement starting at this leaf.
            node = leaf
            found = None
            while node is not None:
                if cst.is_statement(node) and cst.first_leaf(node) is leaf:
                    found = node
                    break
                node = node.parent
            if found is not None:
                return found
            if stmt is not None:
                return stmt
    raise Skip(f"statement at line {line} not found in the tree")


def replace_expression(stmts, extent: Extent, text: str) -> None:
    """Replace the expression at ``extent`` with ``text``. fissix has no node for the head
    of a trailer chain (``self.query(x)`` in ``self.query(x).view(...)``); then the
    leading children of the ``power`` node are swapped for the new expression."""
    new = parse_expression(text)
    for stmt in stmts:
        node = _node_at(stmt, extent)
        if node is not None:
            new.prefix = node.prefix
            node.replace(new)
            return
        head = _power_head(stmt, extent)
        if head is not None:
            power, count = head
            if new.type not in (token.NAME, syms.atom, syms.power):
                new = parse_expression(f"({text})")
            new.prefix = power.children[0].prefix
            for child in power.children[:count]:
                child.remove()
            if new.type == syms.power:
                for offset, child in enumerate(list(new.children)):
                    child.remove()
                    power.insert_child(offset, child)
            else:
                power.insert_child(0, new)
            return
    raise Skip(f"expression at {extent[0]}:{extent[1]} not found")


def _power_head(scope, extent: Extent):
    line, col, end_line, end_col = extent
    for node in _all_nodes(scope):
        if node.type != syms.power or not node.children:
            continue
        first = cst.first_leaf(node)
        if (first.lineno, first.column) != (line, col):
            continue
        for count in range(1, len(node.children)):
            if cst.end_position(node.children[count - 1]) == (end_line, end_col):
                return node, count
    return None


def _node_at(scope, extent: Extent):
    line, col, end_line, end_col = extent
    start = None
    for leaf in scope.leaves():
        if leaf.lineno == line and leaf.column == col:
            start = leaf
            break
    if start is None:
        return None
    node, candidate = start, None
    while node is not None and cst.first_leaf(node) is start:
        if cst.end_position(node) == (end_line, end_col):
            candidate = node
        node = node.parent
        if node is scope.parent:
            break
    return candidate


def parse_expression(text: str):
    tree = cst.parse(text + "\n")
    stmt = tree.children[0]
    expr = stmt.children[0]
    expr.remove()
    for leaf in expr.leaves():
        leaf.lineno = 0
    return expr


# ---------------------------------------------------------------- hoisting (paper Fig. 4)


def _ancestor_in(node, block):
    """The statement of ``block`` that contains ``node`` (or None)."""
    current = node
    while current is not None and current.parent is not block:
        current = current.parent
    return current


def _branch_suites(if_node):
    return [c for c in if_node.children if c.type == syms.suite]


def _test_names(if_node) -> set[str]:
    names = set()
    children = if_node.children
    for i, child in enumerate(children):
        if isinstance(child, cst.Leaf) and child.value in ("if", "elif"):
            test = children[i + 1]
            for leaf in test.leaves():
                if leaf.type == token.NAME:
                    names.add(leaf.value)
            if any(n.type == syms.trailer and n.children[0].value == "(" for n in _all_nodes(test)):
                raise Skip("the branch condition calls a function; statements cannot move past it")
    return names


def _all_nodes(node):
    yield node
    for child in getattr(node, "children", ()):
        yield from _all_nodes(child)


def _stored_names(stmt) -> set[str]:
    names = set()
    for node in _all_nodes(stmt):
        if node.type == syms.expr_stmt and len(node.children) >= 3:
            for target in node.children[:-2:2]:
                for leaf in target.leaves():
                    if leaf.type == token.NAME:
                        names.add(leaf.value)
    return names


def _ensure_else(if_node) -> None:
    if any(isinstance(c, cst.Leaf) and c.value == "else" for c in if_node.children):
        return
    if_indent = cst.indent_of(if_node)
    body = _branch_suites(if_node)[0]
    body_indent = next(c.value for c in body.children if c.type == token.INDENT)
    delta = body_indent[len(if_indent):] if body_indent.startswith(if_indent) else "    "
    snippet = cst.parse_statements(f"if _:\n{delta}pass\nelse:\n{delta}pass\n", if_indent)[0]
    else_leaf, colon, suite = snippet.children[-3:]
    for part in (else_leaf, colon, suite):
        part.remove()
    last_suite = _branch_suites(if_node)[-1]
    old_dedent = cst._last_dedent(last_suite)
    new_dedent = cst._last_dedent(suite)
    if old_dedent is not None and new_dedent is not None:
        new_dedent.prefix = old_dedent.prefix
        old_dedent.prefix = ""
    else_leaf.prefix = if_indent
    if_node.append_child(else_leaf)
    if_node.append_child(colon)
    if_node.append_child(suite)


def _clone_into(stmts, suite, where: str, block_indent: str) -> list:
    branch_indent = next((c.value for c in suite.children if c.type == token.INDENT), block_indent)
    copies = [cst.clone_statement(s, block_indent, branch_indent) for s in stmts]
    if where == "start":
        cst.insert_statements(suite, 0, copies, branch_indent)
    else:
        cst.insert_statements(suite, len(cst.statements_in(suite)), copies, branch_indent)
    # A suite that held only `pass` (our fresh else) loses it.
    for s in cst.statements_in(suite):
        if cst.code(s).strip() == "pass" and all(leaf.lineno == 0 for leaf in s.leaves()):
            cst.remove_statement(s)
    return copies


def _forget_positions(node) -> None:
    for leaf in node.leaves():
        leaf.lineno = 0


def _check_movable(stmts) -> None:
    for stmt in stmts:
        if stmt.type != syms.simple_stmt:
            raise Skip("hoisting would copy a compound statement")
        if cst.has_multiline_string(stmt):
            raise Skip("hoisting would re-indent a multi-line string")


def _copy_into_branches(if_node, moving: list, where: str, matched_suite, stmts: list) -> list:
    """Move ``moving`` to the ``where`` ("start"/"end") of every branch of ``if_node`` (adding
    an ``else`` if needed). The copy in ``matched_suite`` — the branch the match runs through —
    takes the place of the originals in ``stmts``; the other copies lose their positions so
    later edits never target them. Returns the updated ``stmts``."""
    block_indent = cst.indent_of(moving[0])
    _ensure_else(if_node)
    tracked = None
    for suite in _branch_suites(if_node):
        copies = _clone_into(moving, suite, where, block_indent)
        if suite is matched_suite:
            tracked = copies
        else:
            for c in copies:
                _forget_positions(c)
    for s in moving:
        cst.remove_statement(s)
    index = {id(m): k for k, m in enumerate(moving)}
    return [tracked[index[id(s)]] if id(s) in index else s for s in stmts]


def hoist(stmts: list) -> tuple[list, list]:
    """Bring ``stmts`` (execution order) into one block by copying the statements
    before a branch into every branch (or those after a branch to the end of every
    branch). Returns (statements now sharing a block, the ``if`` nodes touched)."""
    stmts = list(stmts)
    touched = []
    for _ in range(16):
        blocks = [s.parent for s in stmts]
        if all(b is blocks[0] for b in blocks):
            return stmts, touched
        i = next(j for j in range(1, len(stmts)) if blocks[j] is not blocks[j - 1])
        prev_block = blocks[i - 1]
        anc = _ancestor_in(stmts[i], prev_block)
        if anc is not None:
            # Case (b) of Fig. 4: earlier statements go to the start of every branch.
            if anc.type != syms.if_stmt:
                raise Skip("matched statements are split by a loop/with/try, not an if")
            block_stmts = cst.statements_in(prev_block)
            start = block_stmts.index(stmts[0])
            end = block_stmts.index(anc)
            moving = block_stmts[start:end]
            _check_movable(moving)
            stored = set()
            for s in moving:
                stored |= _stored_names(s)
            if _test_names(anc) & stored:
                raise Skip("the branch condition reads a value the moved statements assign")
            stmts = _copy_into_branches(anc, moving, "start", _ancestor_in(stmts[i], anc), stmts)
            touched.append(anc)
            continue
        owner_if = prev_block.parent
        if owner_if is not None and owner_if.type == syms.if_stmt and stmts[i].parent is owner_if.parent:
            # Following statements go to the end of every branch.
            outer = cst.statements_in(owner_if.parent)
            start = outer.index(owner_if) + 1
            end = outer.index(stmts[i]) + 1
            moving = outer[start:end]
            _check_movable(moving)
            stmts = _copy_into_branches(owner_if, moving, "end", prev_block, stmts)
            touched.append(owner_if)
            continue
        raise Skip("matched statements lie in different branches")
    raise Skip("hoisting did not converge")


def collapse_identical_branches(if_node) -> None:
    """``if c: S else: S`` (after the kernel replaced one copy) becomes ``S`` when ``c``
    has no calls: the branches now do the same thing."""
    if if_node.parent is None:
        return
    suites = _branch_suites(if_node)
    if len(suites) < 2 or not any(isinstance(c, cst.Leaf) and c.value == "else" for c in if_node.children):
        return
    try:
        _test_names(if_node)
    except Skip:
        return
    bodies = [[cst.code(s) for s in cst.statements_in(suite)] for suite in suites]
    if any(b != bodies[0] for b in bodies[1:]):
        return
    keep = cst.statements_in(suites[0])
    # Prefer the copy that kept original positions (it may be looked up again).
    for suite in suites:
        if any(leaf.lineno for s in cst.statements_in(suite) for leaf in s.leaves()):
            keep = cst.statements_in(suite)
            break
    if any(s.type != syms.simple_stmt or cst.has_multiline_string(s) for s in keep):
        return
    branch_indent = cst.indent_of(keep[0])
    if_indent = cst.indent_of(if_node)
    moved = []
    for s in keep:
        s.remove()
        s.prefix = ""
        cst.reindent(s, branch_indent, if_indent)
        moved.append(s)
    cst.replace_statement(if_node, moved)


# ---------------------------------------------------------------- formatting

LINE_LIMIT = 110


def wrap_statement(text: str, indent: str, limit: int = LINE_LIMIT) -> str:
    """Black-style wrapping of a synthesized ``target = callee(args)`` that is too long:
    arguments on one indented line, or one per line when that is still too long."""
    import ast as _ast

    if "\n" in text or len(indent) + len(text) <= limit:
        return text
    try:
        tree = _ast.parse(text)
    except SyntaxError:
        return text
    stmt = tree.body[0] if len(tree.body) == 1 else None
    call = getattr(stmt, "value", None)
    if not isinstance(stmt, _ast.Assign) or not isinstance(call, _ast.Call):
        return text
    head = text[: call.func.end_col_offset] + "("
    args = [_ast.get_source_segment(text, a) for a in call.args]
    args += [_ast.get_source_segment(text, k) for k in call.keywords]
    if any(a is None for a in args) or text[call.end_col_offset:].strip():
        return text
    one_line = ", ".join(args)
    if len(indent) + 4 + len(one_line) <= limit:
        return f"{head}\n    {one_line}\n)"
    return head + "\n" + "".join(f"    {a},\n" for a in args) + ")"


# ---------------------------------------------------------------- edits


def apply_edit(root, edit: Edit) -> None:
    """Apply one edit; raises :class:`Skip` (tree possibly half-edited: callers apply
    each edit to a fresh copy first)."""
    if edit.forward is not None:
        fe = edit.forward
        originals = [find_statement(root, p) for p in fe.statements]
        by_pos = dict(zip(fe.statements, originals))
        anchor_original = find_statement(root, fe.anchor)
        hoisted, touched = hoist(originals)
        mapping = {id(o): h for o, h in zip(originals, hoisted)}
        by_pos = {p: mapping.get(id(n), n) for p, n in by_pos.items()}
        anchor = mapping.get(id(anchor_original), anchor_original)
        scope = list(by_pos.values())
        for expr_edit in fe.expr_edits:
            replace_expression(scope, expr_edit.extent, expr_edit.text)
        for stmt_edit in fe.statement_edits:
            old = by_pos.get(stmt_edit.at) or find_statement(root, stmt_edit.at)
            indentation = cst.indent_of(old)
            new_nodes = cst.parse_statements(wrap_statement(stmt_edit.text, indentation), indentation)
            cst.replace_statement(old, new_nodes)
            if old is anchor:
                anchor = new_nodes[0]
            by_pos[stmt_edit.at] = new_nodes[0]
        if fe.insert_before:
            block = anchor.parent
            indentation = cst.indent_of(anchor)
            new_nodes = cst.parse_statements(
                "".join(wrap_statement(t, indentation) + "\n" for t in fe.insert_before), indentation
            )
            cst.insert_statements(block, cst.statements_in(block).index(anchor), new_nodes, indentation)
        for p in fe.delete:
            cst.remove_statement(by_pos[p] if p in by_pos else find_statement(root, p))
        for if_node in reversed(touched):
            collapse_identical_branches(if_node)
    for method in edit.methods:
        # a new method right below an existing one (kept as it is), one blank line between
        helper = find_statement(root, method.after)
        block = helper.parent
        indentation = cst.indent_of(helper)
        new_nodes = cst.parse_statements(method.text, indentation)
        index = cst.statements_in(block).index(helper) + 1
        cst.insert_statements(block, index, new_nodes, indentation, take_leading=False)
        # the blank line between methods: the helper's text ends with it unless it is the last
        if not str(helper).rstrip(" \t").endswith("\n\n"):
            new_nodes[0].prefix = "\n" + new_nodes[0].prefix
        following = cst.statements_in(block)[index + len(new_nodes):]
        if following and not following[0].prefix.startswith("\n"):
            following[0].prefix = "\n" + following[0].prefix
    for init in edit.init:
        old = find_statement(root, init.replace)
        deletions = [find_statement(root, p) for p in init.delete]
        indentation = cst.indent_of(old)
        new_nodes = cst.parse_statements(wrap_statement(init.construct, indentation), indentation)
        cst.replace_statement(old, new_nodes)
        for stmt in deletions:
            cst.remove_statement(stmt)


def _is_import(stmt) -> bool:
    return stmt.type == syms.simple_stmt and stmt.children[0].type in (syms.import_name, syms.import_from)


def _import_from_names(stmt) -> tuple[str, list[str]] | None:
    node = stmt.children[0]
    if node.type != syms.import_from:
        return None
    module = str(node.children[1]).strip()
    names_node = node.children[3] if len(node.children) > 3 else None
    if names_node is None or (isinstance(names_node, cst.Leaf) and names_node.value == "("):
        names_node = node.children[4] if len(node.children) > 4 else None
    if names_node is None:
        return None
    text = str(names_node).strip()
    return module, [part.strip() for part in text.replace("\n", " ").split(",") if part.strip()]


def add_kernel_imports(root, specs: list[str]) -> None:
    """``from adopter.kernels import A, B`` once, after the module's imports (merged into
    an existing import from ``adopter.kernels``)."""
    if not specs:
        return
    top = cst.statements_in(root)
    for stmt in top:
        if _is_import(stmt):
            parsed = _import_from_names(stmt)
            if parsed and parsed[0] == KERNELS_MODULE:
                names = sorted(set(parsed[1]) | set(specs), key=_import_sort_key)
                new = cst.parse_statements(f"from {KERNELS_MODULE} import {', '.join(names)}\n", "")
                cst.replace_statement(stmt, new)
                return
    names = sorted(set(specs), key=_import_sort_key)
    new = cst.parse_statements(f"from {KERNELS_MODULE} import {', '.join(names)}\n", "")
    if _insert_where_isort_would(root, top, new):
        return
    last_import = None
    docstring_end = None
    for index, stmt in enumerate(top):
        if stmt.type in (syms.funcdef, syms.classdef, syms.decorated, syms.async_funcdef):
            break
        if _is_import(stmt):
            last_import = index
        elif index == 0 and stmt.type == syms.simple_stmt and stmt.children[0].type == token.STRING:
            docstring_end = index
    if last_import is not None:
        position = last_import + 1
    elif docstring_end is not None:
        position = docstring_end + 1
    else:
        position = 0
    # At the very top the import goes below a license/comment header; elsewhere right
    # after the last import, the following statement keeping its blank lines.
    cst.insert_statements(root, position, new, "", take_leading=position == 0)


# isort's sections, as ruff and isort order them by default
_FUTURE, _STDLIB, _THIRD_PARTY, _LOCAL = 0, 1, 2, 4


def _isort_key(stmt) -> tuple[int, int, str] | None:
    """(section, ``from`` after plain ``import``, module) of an import statement, as isort sorts
    with its defaults (a module it cannot place counts as third-party, as it does without
    configuration); None for a statement that is not one plain import."""
    try:
        tree = ast.parse(str(stmt).strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1:
        return None
    node = tree.body[0]
    if isinstance(node, ast.ImportFrom):
        module, is_from, level = node.module or "", 1, node.level
    elif isinstance(node, ast.Import):
        module, is_from, level = node.names[0].name, 0, 0
    else:
        return None
    top = module.split(".")[0]
    section = (_LOCAL if level else _FUTURE if top == "__future__" else _STDLIB if top in sys.stdlib_module_names
               else _THIRD_PARTY)
    return section, is_from, module.lower() if not level else ""


def _insert_where_isort_would(root, top: list, new: list) -> bool:
    """Put the kernel import where isort would, when the module's leading imports are in isort's
    order (a user running isort or ruff's I rule then finds nothing to change); False otherwise
    (it then goes after the last import)."""
    first = 1 if top and top[0].type == syms.simple_stmt and top[0].children[0].type == token.STRING else 0
    block = []
    for stmt in top[first:]:
        if not _is_import(stmt):
            break
        block.append(stmt)
    keys = [_isort_key(stmt) for stmt in block]
    if not block or any(k is None for k in keys):
        return False
    ordered = [k for k in keys if k[0] != _LOCAL]  # (relative imports: isort orders them by level)
    if ordered != sorted(ordered) or any(a[0] > b[0] for a, b in zip(keys, keys[1:])):
        return False
    ours = (_THIRD_PARTY, 1, KERNELS_MODULE)
    after = next((i for i, k in enumerate(keys) if k > ours), None)
    if after is None:
        return False  # (last of the block: where the kernel import goes anyway)
    anchor = block[after]
    before = keys[after - 1] if after else None
    blank_above = "\n" in anchor.prefix
    if before is not None and before[0] == _THIRD_PARTY:
        # inside the third-party section: right below the import before it
        cst.insert_statements(root, first + after, new, "", take_leading=False)
    else:
        # the section's first import: it takes the blank line above the section
        cst.insert_statements(root, first + after, new, "", take_leading=True)
        if keys[after][0] != _THIRD_PARTY and blank_above:
            anchor.prefix = "\n"  # a section of its own: a blank line before the next one
    return True


def _import_sort_key(spec: str) -> tuple[int, str]:
    # Classes first (capitalized), then functions, like isort's force_sort_within_sections off.
    name = spec.split(" as ")[0]
    return (0 if name[:1].isupper() else 1, name)
