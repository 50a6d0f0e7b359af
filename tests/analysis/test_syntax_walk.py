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


def test_statements_are_walks_statements_in_its_order():
    from adopter.core.syntax import statements

    source = (
        "import a\n"
        "def f(x):\n"
        "    try:\n        y = 1\n    except E as e:\n        z = 2\n    else:\n        w = 3\n    finally:\n        v = 4\n"
        "    match x:\n        case 1:\n            m = 1\n        case _:\n            pass\n"
        "    return [lambda: q for q in x]\n"
        "class C:\n    def g(self):\n        if x:\n            for i in x:\n                pass\n        else:\n            with c:\n                u = 5\n"
    )
    tree = ast.parse(source)
    for node in [tree, *ast.walk(tree)]:
        want = tuple(n for n in ast.walk(node) if isinstance(n, ast.stmt) and n is not node)
        assert statements(node) == want
    assert statements(tree) is statements(tree)  # computed once
