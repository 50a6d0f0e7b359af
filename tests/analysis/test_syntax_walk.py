"""adopter.core.syntax.walk: ast.walk's nodes in ast.walk's order, computed once per node."""
from __future__ import annotations

import ast
from pathlib import Path

from adopter.core.syntax import walk

CORPUS = Path(__file__).parents[1] / "corpus"


def test_walk_is_ast_walk_in_its_order_for_trees_and_subtrees():
    files = sorted(CORPUS.rglob("*.py"))[:40]
    assert files
    for path in files:
        tree = ast.parse(path.read_text())
        assert list(walk(tree)) == list(ast.walk(tree)), path
        for node in list(ast.walk(tree))[::97]:
            assert list(walk(node)) == list(ast.walk(node)), (path, node)


def test_walk_is_kept_per_node_and_not_shared_between_equal_trees():
    a, b = ast.parse("x = f(y)"), ast.parse("x = f(y)")
    assert walk(a) is walk(a)
    assert walk(a) is not walk(b) and all(n in walk(b) for n in ast.walk(b))
    assert isinstance(walk(a), tuple)  # (callers cannot change what the next caller reads)
