"""Partial fissix parse (``adopter.rewrite.partial``): only the top-level statements edits
touch are parsed; everything else is copied as it was."""

from __future__ import annotations

import ast

import pytest
from adopter.rewrite import cst
from adopter.rewrite.apply import KERNELS_MODULE, find_statement
from adopter.rewrite.partial import PartialTree, segment_starts

SOURCE = '''"""Module docstring."""
# license header
import torch
from torch import nn

X = 1; Y = 2


# comment above the decorator
@decorator
class A(nn.Module):
    def forward(self, x):
        return x + 1
        # trailing comment inside A


def helper(a, /, b):  # positional-only: fissix cannot parse this line
    return a


class B(nn.Module):
    def forward(self, x):
        y = x * 2
        return y
'''


def _partial(text: str, lines, **kw) -> PartialTree:
    return PartialTree.parse(text, ast.parse(text), lines, KERNELS_MODULE, **kw)


def test_segments_start_at_first_definition_and_each_later_statement():
    starts = segment_starts(ast.parse(SOURCE))
    # header (docstring, imports, X/Y), then @decorator class A, helper, B
    assert starts == [1, 10, 17, 21]


def test_same_line_statements_are_one_segment():
    text = "def f():\n    pass\na = 1; b = 2\n"
    assert segment_starts(ast.parse(text)) == [1, 3]


def test_unedited_parse_gives_back_the_text():
    tree = _partial(SOURCE, [23])
    assert tree.parsed == [0, 3]  # header and class B only: helper (unparsable) is not parsed
    assert tree.spliced().text == SOURCE


def test_positions_are_the_files():
    tree = _partial(SOURCE, [23])
    stmt = find_statement(tree.root, (23, 8))
    assert cst.code(stmt).strip() == "y = x * 2"


def test_edit_in_a_later_segment_is_spliced_back():
    tree = _partial(SOURCE, [23])
    stmt = find_statement(tree.root, (23, 8))
    cst.replace_statement(stmt, cst.parse_statements("y = fused(x)\n", "        "))
    new = tree.spliced().text
    assert new == SOURCE.replace("y = x * 2", "y = fused(x)")


def test_edits_in_two_segments_and_a_header_import():
    tree = _partial(SOURCE, [13, 23])
    ret = find_statement(tree.root, (13, 8))
    cst.replace_statement(ret, cst.parse_statements("return k(x)\n", "        "))
    stmt = find_statement(tree.root, (23, 8))
    cst.replace_statement(stmt, cst.parse_statements("y = fused(x)\n", "        "))
    from adopter.rewrite.apply import add_kernel_imports

    add_kernel_imports(tree.root, ["k"])
    new = tree.spliced().text
    expected = (
        SOURCE.replace("return x + 1", "return k(x)")
        .replace("y = x * 2", "y = fused(x)")
        .replace("from torch import nn\n", "from adopter.kernels import k\nfrom torch import nn\n")  # (isort's place)
    )
    assert new == expected
    compile(new.replace("a, /, b", "a, b"), "m.py", "exec")


def test_no_final_newline_is_kept():
    text = SOURCE.rstrip("\n")
    tree = _partial(text, [23])
    assert tree.spliced().text == text
    stmt = find_statement(tree.root, (24, 8))
    cst.replace_statement(stmt, cst.parse_statements("return y + 0\n", "        "))
    assert tree.spliced().text == text.replace("return y", "return y + 0")


def test_unparsable_code_in_an_edited_segment_fails():
    with pytest.raises(cst.ParseFailure):
        _partial(SOURCE, [18])


def test_replacing_a_top_level_statement_is_detected():
    tree = _partial(SOURCE, [23])
    first = tree.first_children[0]
    cst.replace_statement(first, cst.parse_statements("pass\n", ""))
    with pytest.raises(cst.ParseFailure):
        tree.spliced()


def test_whole_file_parse_and_reparse():
    text = SOURCE.replace("a, /, b", "a, b")
    whole = _partial(text, None)
    assert whole.parsed == list(range(len(whole.starts)))
    assert whole.spliced().text == text
    again = _partial(text, [23]).reparse()
    assert again.spliced().text == text and again.root is not None


def test_engine_redoes_the_edits_on_a_whole_file_tree_when_cut_points_are_lost(monkeypatch):
    from pathlib import Path

    from adopter.rewrite import rewrite_source

    from adopter.core.rules import all_rules
    from adopter.core.scan import scan_source

    fixture = Path(__file__).parents[1] / "fixtures" / "rewrite" / "dropout_layernorm.before.py"
    text = fixture.read_text() + "\n\ndef untouched(x):\n    return x\n"

    rules = list(all_rules())
    expected = rewrite_source(text, scan_source(text, "m.py", rules), filename="m.py", rules=rules)
    assert expected.applied

    original = PartialTree.spliced
    whole_trees, raised = [], []

    def lose_cut_points(self):
        if len(self.parsed) < len(self.starts):
            raised.append(self)
            raise cst.ParseFailure("an edit replaced a top-level statement")
        whole_trees.append(self)
        return original(self)

    monkeypatch.setattr(PartialTree, "spliced", lose_cut_points)
    again = rewrite_source(text, scan_source(text, "m.py", rules), filename="m.py", rules=rules)
    assert raised and whole_trees and again.new_text == expected.new_text
    assert [o.applied for o in again.outcomes] == [o.applied for o in expected.outcomes]


def test_changed_segments_compile_where_they_sit_in_the_new_file():
    from adopter.rewrite.engine import _check_compiles

    text = SOURCE.replace("a, /, b", "a, b")
    tree = _partial(text, [23])
    stmt = find_statement(tree.root, (22, 4))  # B.forward, replaced by a class-level return
    cst.replace_statement(stmt, cst.parse_statements("return 1\n", "    "))
    spliced = tree.spliced()
    new = spliced.text
    [(first_line, segment)] = spliced.changed_segments
    assert new.splitlines()[first_line - 1] == "class B(nn.Module):"
    problem = _check_compiles("\n" * (first_line - 1) + segment, "m.py")
    assert problem == _check_compiles(new, "m.py") == "'return' outside function at line 22"
