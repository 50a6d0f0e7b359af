"""adopter.core.scan.one_file: the cyclic collector off while one file is analysed, back after;
the file's caches dropped; re-entrant."""

import ast
import gc

from adopter.core.rules import all_rules
from adopter.core.scan import one_file, scan_source
from adopter.core.syntax import walk


def test_the_collector_is_off_inside_and_back_after():
    assert gc.isenabled()
    with one_file():
        assert not gc.isenabled()
        with one_file():
            assert not gc.isenabled()
        assert not gc.isenabled()  # (an inner block leaves it to the outer one)
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with one_file():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_files_trees_are_not_kept_past_it():
    tree = ast.parse("def f(x):\n    return x + 1\n")
    with one_file():
        first = walk(tree)
        assert walk(tree) is first  # kept within the file
    assert walk(tree) is not first  # dropped after it


def test_a_scan_inside_gives_what_it_gives_outside():
    source = "import torch\ndef f(x):\n    return torch.softmax(x, dim=-1)\n"
    outside = scan_source(source, "m.py", all_rules())
    with one_file():
        inside = scan_source(source, "m.py", all_rules())
    assert outside and [m.key() for m in inside] == [m.key() for m in outside]
