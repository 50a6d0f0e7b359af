"""Matcher on hand-built structures: data-flow consistency, wildcard, alternatives, init, dedup."""

from dataclasses import replace

import pytest

from adopter.core.dsl import Span, Var
from adopter.core.dsl_text import parse_pattern
from adopter.core.match import match_init, match_pattern, match_structures
from adopter.core.rules import Rule
from adopter.core.rules._common import intermediates_unused
from adopter.core.structures import ClassInfo, FileStructures, FunctionStructures, InitBinding, PathStructure


def nodes(text, first_line=10, function="M.forward"):
    out = []
    for i, n in enumerate(parse_pattern(text).nodes):
        line = first_line + i
        out.append(replace(n, span=Span(line, 8, line, 40, function, line, line)))
    return tuple(out)


def inits(text, first_line=3):
    out = []
    for i, n in enumerate(parse_pattern(text).nodes):
        line = first_line + i
        span = Span(line, 8, line, 40, "M.__init__", line, line)
        out.append(InitBinding(n.output.name, replace(n, span=span), span=span))
    return tuple(out)


def structures(paths, init_text, function="forward", cls="M", extra_functions=()):
    fs = FunctionStructures(cls, function, tuple(PathStructure(p) for p in paths))
    ci = ClassInfo(cls, ("torch.nn.Module",), True, inits(init_text))
    return FileStructures("m.py", (ci,), (fs,) + tuple(extra_functions))


DLN = """
rule Dropout_LayerNorm
init:
    torch.nn.Dropout($p) -> $drop; torch.nn.LayerNorm($shape, eps=$eps) -> $ln
    => k.Fused($shape, $p, eps=$eps) -> $ln
forward:
    torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out
    => k.Fused@$ln($x, $res) -> $out
"""
DLN_RULE = Rule("Dropout_LayerNorm", "k.Fused", "test", DLN, preconditions=(intermediates_unused("$y", "$sum"),))
INIT = (
    "torch.nn.Linear(`config.h`, `config.h`) -> self.dense; "
    "torch.nn.LayerNorm(`config.h`, eps=`config.eps`) -> self.LayerNorm; "
    "torch.nn.Dropout(`config.p`) -> self.dropout"
)
FIG1 = (
    "torch.nn.Linear@self.dense(hidden_states) -> hidden_states#1; "
    "torch.nn.Dropout@self.dropout(hidden_states#1) -> hidden_states#2; "
    "hidden_states#2 + input_tensor -> tmp_1; "
    "torch.nn.LayerNorm@self.LayerNorm(tmp_1) -> hidden_states#3"
)


def test_fig1_matches_with_bindings_and_init():
    s = structures([nodes(FIG1)], INIT)
    (m,) = match_structures(s, [DLN_RULE])
    assert m.rule == "Dropout_LayerNorm" and m.class_name == "M" and m.function == "forward"
    assert m.lines == [11, 12, 13]
    assert m.bindings["$x"] == Var("hidden_states", 1)
    assert m.bindings["$res"] == Var("input_tensor")
    assert m.bindings["$drop"] == Var("self.dropout")
    assert [ib.attr for ib in m.init_nodes] == ["self.dropout", "self.LayerNorm"]
    assert m.init_bindings["$p"].text == "config.p" and m.init_bindings["$eps"].text == "config.eps"
    assert m.to_json() == {"rule": "Dropout_LayerNorm", "file": "m.py", "class": "M", "function": "forward",
                           "lines": [11, 12, 13], "status": "static"}


def test_extraneous_nodes_between_still_match_and_add_is_commutative():
    text = (
        "torch.nn.Dropout@self.dropout(h) -> h#1; torch.Tensor.size(x) -> n; torch.nn.Linear@self.dense(x) -> z; "
        "input_tensor + h#1 -> t; torch.nn.LayerNorm@self.LayerNorm(t) -> h#2"
    )
    (m,) = match_structures(structures([nodes(text)], INIT), [DLN_RULE])
    assert m.lines == [10, 13, 14]


def test_unconnected_layers_do_not_match():
    # the add reads the *old* version of h: dropout output is not what gets normalized
    text = "torch.nn.Dropout@self.dropout(h) -> h#1; h + r -> t; torch.nn.LayerNorm@self.LayerNorm(t) -> h#2"
    assert match_structures(structures([nodes(text)], INIT), [DLN_RULE]) == []
    # layer norm on something else than the sum
    text = "torch.nn.Dropout@self.dropout(h) -> h#1; h#1 + r -> t; torch.nn.LayerNorm@self.LayerNorm(r) -> h#2"
    assert match_structures(structures([nodes(text)], INIT), [DLN_RULE]) == []


def test_order_matters():
    text = "torch.nn.LayerNorm@self.LayerNorm(t) -> h#2; torch.nn.Dropout@self.dropout(h) -> h#1; h#1 + r -> t"
    assert match_structures(structures([nodes(text)], INIT), [DLN_RULE]) == []


def test_init_must_bind_the_called_modules():
    init = "torch.nn.LayerNorm(`config.h`) -> self.LayerNorm; torch.nn.Dropout(0.1) -> self.other"
    s = structures([nodes(FIG1)], init)
    assert match_structures(s, [DLN_RULE]) == []


def test_keyword_and_positional_constructor_args_are_the_same():
    init = "torch.nn.LayerNorm(normalized_shape=768, eps=1e-12) -> self.LayerNorm; torch.nn.Dropout(p=0.1) -> self.dropout"
    (m,) = match_structures(structures([nodes(FIG1)], init), [DLN_RULE])
    assert m.init_bindings == {"$p": parse_pattern("f(0.1)").nodes[0].args[0].value,
                               "$shape": parse_pattern("f(768)").nodes[0].args[0].value,
                               "$eps": parse_pattern("f(1e-12)").nodes[0].args[0].value}
    # eps not given: the optional keyword stays unbound
    init = "torch.nn.LayerNorm(768) -> self.LayerNorm; torch.nn.Dropout(0.1) -> self.dropout"
    (m,) = match_structures(structures([nodes(FIG1)], init), [DLN_RULE])
    assert "$eps" not in m.init_bindings


def test_intermediate_used_elsewhere_is_rejected_with_reason():
    text = FIG1 + "; torch.nn.Linear@self.dense(hidden_states#2) -> extra"
    rejected = []
    assert match_structures(structures([nodes(text)], INIT), [DLN_RULE], rejected=rejected) == []
    assert "also used" in rejected[0].reason


def test_veto_on_one_path_vetoes_all_paths():
    clean = nodes(FIG1)
    leaky = clean + nodes("torch.nn.Linear@self.dense(hidden_states#2) -> extra", first_line=20)
    assert match_structures(structures([clean, leaky], INIT), [DLN_RULE]) == []


def test_dedup_across_paths():
    common = nodes(FIG1)
    branch_a = common + nodes("torch.relu(hidden_states#3) -> a", first_line=30)
    branch_b = common + nodes("torch.tanh(hidden_states#3) -> b", first_line=40)
    found = match_structures(structures([branch_a, branch_b], INIT), [DLN_RULE])
    assert len(found) == 1


def test_branch_only_path_matches_like_fig3():
    rule = Rule("Conv_BatchNorm", "k", "t", """
rule Conv_BatchNorm
init:
    torch.nn.Conv2d($a, $b) -> $conv; torch.nn.BatchNorm2d($n) -> $bn => k($a, $b) -> $conv
forward:
    torch.nn.Conv2d@$conv($x) -> $c; torch.nn.BatchNorm2d@$bn($c) -> $o => k@$conv($x) -> $o
""")
    init = ("torch.nn.Conv2d(`config.h`, `config.h`, kernel_size=3) -> self.convolution1; "
            "torch.nn.BatchNorm2d(`config.h`) -> self.batch_norm1")
    no_bn = nodes("torch.nn.Conv2d@self.convolution1(h) -> h#1")
    with_bn = no_bn + nodes("torch.nn.BatchNorm2d@self.batch_norm1(h#1) -> h#2", first_line=12)
    (m,) = match_structures(structures([no_bn, with_bn], init), [rule])
    assert m.lines == [10, 12]


def test_wildcard_and_alternatives():
    seq = nodes("torch.matmul(q, kt) -> s; s * scale -> s#1; torch.nn.functional.softmax(s#1, dim=-1) -> p")
    pat = parse_pattern("torch.matmul|torch.bmm($q, $k) -> $s; *; torch.softmax|torch.nn.functional.softmax($s2) -> $p")
    ((positions, b),) = match_pattern(pat, seq)
    assert positions == (0, 1, 2) and b["$s2"] == Var("s", 1)
    # the wildcard needs a node of its own between the two
    seq2 = nodes("torch.matmul(q, kt) -> s; torch.nn.functional.softmax(s, dim=-1) -> p")
    assert match_pattern(pat, seq2) == []
    # constants in patterns must agree (quotes and spacing normalized)
    p2 = parse_pattern("torch.nn.functional.softmax($x, dim=-1) -> $y")
    assert len(match_pattern(p2, seq)) == 1
    p3 = parse_pattern("torch.nn.functional.softmax($x, dim=1) -> $y")
    assert match_pattern(p3, seq) == []
    p4 = parse_pattern("f($x, 'gelu') -> $y")
    assert len(match_pattern(p4, nodes('f(a, "gelu") -> b'))) == 1


def test_consistent_binding_of_repeated_variable():
    pat = parse_pattern("torch.nn.Linear@$a($x) -> $o1; torch.nn.Linear@$b($x) -> $o2")
    same = nodes("torch.nn.Linear@self.q(h) -> q; torch.nn.Linear@self.k(h) -> k")
    other = nodes("torch.nn.Linear@self.q(h) -> q; torch.nn.Linear@self.k(e) -> k")
    assert len(match_pattern(pat, same)) == 1
    assert match_pattern(pat, other) == []
    # SSA: same name, different versions are different values
    versions = nodes("torch.nn.Linear@self.q(h#1) -> q; torch.nn.Linear@self.k(h#2) -> k")
    assert match_pattern(pat, versions) == []


def test_match_init_any_order():
    pat = parse_pattern("torch.nn.Dropout($p) -> $d; torch.nn.LayerNorm($s) -> $l")
    ib = inits("torch.nn.LayerNorm(8) -> self.ln; torch.nn.Dropout(0.5) -> self.drop")
    init_nodes, b = match_init(pat, ib, {})
    assert [i.attr for i in init_nodes] == ["self.drop", "self.ln"] and b["$p"].text == "0.5"


def test_helper_match_reported_once_under_the_helper():
    rule = Rule("softmax", "k", "t", "rule softmax\nforward:\n    torch.softmax($x) -> $y => k($x) -> $y\n")
    helper = nodes("torch.softmax(s) -> p", first_line=50, function="helper")
    fa = FunctionStructures("A", "forward", (PathStructure(helper),))
    fb = FunctionStructures("B", "forward", (PathStructure(helper),))
    fh = FunctionStructures(None, "helper", (PathStructure(helper),))
    s = FileStructures("m.py", (ClassInfo("A", (), True, ()), ClassInfo("B", (), True, ())), (fa, fb, fh))
    (m,) = match_structures(s, [rule])
    assert (m.class_name, m.function, m.lines) == (None, "helper", [50])


def test_user_rule_file_variants_group(tmp_path):
    from adopter.core.rules import load_rules_file

    f = tmp_path / "r.adopter"
    f.write_text(DLN + "\nrule DLN2\nforward:\n    torch.nn.Dropout($x) -> $y => k($x) -> $y\n" + DLN)
    rules = load_rules_file(f)
    assert [r.name for r in rules] == ["Dropout_LayerNorm", "DLN2"]
    assert len(rules[0].variants) == 2 and rules[0].kernel == "k.Fused"


def test_same_statements_connected_differently_on_another_path_are_vetoed():
    rule = Rule("QK", "k", "t", """
rule QK
forward:
    torch.nn.Linear@$a($x) -> $ao; torch.nn.Linear@$b($x) -> $bo => k@$a($x) -> $ao
""")
    init = "torch.nn.Linear(8, 8) -> self.q; torch.nn.Linear(8, 8) -> self.k"
    # same two statements (same spans) on both paths; on the second the key projection reads
    # another value (cross-attention), so fusing the statements would break that path
    self_path = nodes("torch.nn.Linear@self.q(h) -> q; torch.nn.Linear@self.k(h) -> k")
    cross_path = nodes("torch.nn.Linear@self.q(h) -> q; torch.nn.Linear@self.k(enc) -> k")
    rejected = []
    assert match_structures(structures([self_path], init), [rule]) != []
    assert match_structures(structures([self_path, cross_path], init), [rule], rejected=rejected) == []
    assert "another control-flow path" in rejected[0].reason
    # a path that does not run the second statement does not veto
    only_q = nodes("torch.nn.Linear@self.q(h) -> q")
    assert len(match_structures(structures([self_path, only_q], init), [rule])) == 1


CONV_SOURCE = '''
from torch import nn


class DepthwiseConv2d(nn.Conv2d):
    def __init__(self, in_channels, kernel_size=3):
        super().__init__(in_channels=in_channels, out_channels=in_channels, kernel_size=kernel_size,
                         groups=in_channels)


class DeeperConv2d(DepthwiseConv2d):
    pass


class PaddedConv2d(nn.Conv2d):
    def forward(self, x):
        return super().forward(nn.functional.pad(x, (1, 1, 1, 1)))


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = DepthwiseConv2d(d, kernel_size=3)
        self.deeper = DeeperConv2d(d)
        self.padded = PaddedConv2d(d, d, 3)
        self.norm = nn.BatchNorm2d(d)
        self.norm2 = nn.BatchNorm2d(d)
        self.norm3 = nn.BatchNorm2d(d)

    def forward(self, x):
        a = self.norm(self.conv(x))
        b = self.norm2(self.deeper(x))
        c = self.norm3(self.padded(x))
        return a + b + c
'''

CBN = """
rule CBN
init:
    torch.nn.Conv2d($cin, $cout) -> $conv; torch.nn.BatchNorm2d($nf) -> $bn
    => k.Fused($cin, $cout) -> $conv
forward:
    torch.nn.Conv2d@$conv($x) -> $c; torch.nn.BatchNorm2d@$bn($c) -> $out
    => k.Fused@$conv($x) -> $out
"""


def test_same_file_layer_subclass_matches_as_its_torch_parent_when_the_rule_opts_in():
    from adopter.core.extract import extract_source
    from adopter.core.match import layer_subclass_aliases

    s = extract_source(CONV_SOURCE, "modeling_toy.py")
    aliases = layer_subclass_aliases(s, CONV_SOURCE)
    # forward inherited (also through a same-file base) -> Conv2d; own forward -> not a Conv2d
    assert {k.rsplit(".", 1)[-1] for k, v in aliases.items() if v == "torch.nn.Conv2d"} == {
        "DepthwiseConv2d", "DeeperConv2d"}
    assert not any(k.endswith("PaddedConv2d") for k in aliases)
    assert layer_subclass_aliases(s, None) == {}

    opted_in = Rule("CBN", "k.Fused", "t", CBN, match_subclasses=True)
    found = match_structures(s, [opted_in], source=CONV_SOURCE)
    assert sorted(m.lines[0] for m in found) == [31, 32]
    # the matched node keeps its own type (the rewrite must know it is a subclass)
    assert all(m.nodes[0].node.type.endswith(("DepthwiseConv2d", "DeeperConv2d")) for m in found)
    # the subclass's constructor arguments are not matched against Conv2d's signature
    assert all("$cout" not in m.init_bindings for m in found)
    # rules that do not opt in see only torch.nn.Conv2d
    assert match_structures(s, [Rule("CBN", "k.Fused", "t", CBN)], source=CONV_SOURCE) == []
    # the built-in Conv_BatchNorm opts in (its codemod maps or skips subclass constructors)
    from adopter.core.rules import get_rules

    (builtin,) = get_rules(["Conv_BatchNorm"])
    assert builtin.match_subclasses
    assert sorted(m.lines[0] for m in match_structures(s, [builtin], source=CONV_SOURCE)) == [31, 32]


# ---------------------------------------------------------------- preferred path variant

OPTIONAL_SOURCE = '''
from torch import nn


class Base(nn.Module):
    def __init__(self, cross=False, p=0.0):
        super().__init__()
        if cross:
            self.both = nn.Linear(4, 8)
            self.only_cross = nn.Linear(4, 4)
        else:
            self.both = nn.Linear(4, 12)
        if p > 1:
            raise ValueError(p)
        elif p > 0:
            self.raising = nn.Dropout(p)
        else:
            self.raising = nn.Dropout(0.0)
        self.maybe = nn.Dropout(p) if p else None
        self.plain = nn.Linear(4, 4)


class Child(Base):
    def __init__(self, cross=False):
        super().__init__(cross)
        if cross:
            self.plain = nn.Linear(4, 4)

    def forward(self, hidden_states, mask=None, encoder_hidden_states=None, *, cache=None, scale=1.0):
        return self.plain(hidden_states)
'''


def test_optional_module_attrs_are_those_some_instances_lack():
    from adopter.core.extract import extract_source
    from adopter.core.match import optional_module_attrs

    s = extract_source(OPTIONAL_SOURCE, "modeling_opt.py")
    classes = {c.name: c for c in s.classes}
    # both branches bind self.both; a raising branch does not count; `x if p else None` is optional
    assert optional_module_attrs(s, classes["Base"], OPTIONAL_SOURCE) == {"self.only_cross", "self.maybe"}
    # the closest class that binds an attribute decides: Child binds self.plain only under `if cross`
    assert optional_module_attrs(s, classes["Child"], OPTIONAL_SOURCE) == {
        "self.only_cross", "self.maybe", "self.plain"}
    # without the source: one conditional binding site is optional, several are taken as if/else
    assert optional_module_attrs(s, classes["Base"], None) == {"self.only_cross", "self.maybe"}
    assert optional_module_attrs(s, None, OPTIONAL_SOURCE) == frozenset()


def test_optional_inputs_default_to_none():
    from adopter.core.extract import extract_source
    from adopter.core.match import optional_inputs

    s = extract_source(OPTIONAL_SOURCE, "modeling_opt.py")
    (fs,) = [f for f in s.functions if f.class_name == "Child"]
    assert optional_inputs(fs, OPTIONAL_SOURCE) == {"mask", "encoder_hidden_states", "cache"}
    assert optional_inputs(fs, None) == frozenset()


def _extra_node_rule(extra_of_path):
    """A rule over ``softmax`` whose precondition adds the path's projection (as the attention
    rules do): the variants of one match differ only in that node."""
    def add_projection(ctx):
        ctx.extra["extra_nodes"] = [n for n in ctx.path.nodes if getattr(n, "type", "") == "torch.nn.Linear"]

    return Rule("SM", "k", "t", "rule SM\nforward:\n    torch.softmax($x) -> $y => k($x) -> $y\n",
                preconditions=(add_projection,), dedup="class", rehome=False, veto_across_paths=extra_of_path)


def test_the_variant_every_instance_runs_is_reported():
    init = inits("torch.nn.Linear(4, 4) -> self.q_attn; torch.nn.Linear(4, 12) -> self.c_attn")
    # self.q_attn is built under a condition at one site: optional; self.c_attn unconditionally
    init = (replace(init[0], conditional=True), init[1])
    cross = nodes("torch.nn.Linear@self.q_attn(h) -> q", first_line=20) + nodes("torch.softmax(q) -> p", 30)
    plain = nodes("torch.nn.Linear@self.c_attn(h) -> q", first_line=25) + nodes("torch.softmax(q) -> p", 30)
    for veto in (True, False):
        for paths in ((cross, plain), (plain, cross)):
            fs = FunctionStructures("M", "forward", tuple(PathStructure(p) for p in paths))
            s = FileStructures("m.py", (ClassInfo("M", ("torch.nn.Module",), True, init),), (fs,))
            (m,) = match_structures(s, [_extra_node_rule(veto)])
            assert m.lines == [25, 30], (veto, m.lines)


CROSS_SOURCE = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.key = nn.Linear(4, 4)

    def forward(self, hidden_states, encoder_hidden_states=None):
        if encoder_hidden_states is not None:
            k = self.key(encoder_hidden_states)
        else:
            k = self.key(hidden_states)
        return torch.softmax(k, -1)
'''


def test_the_variant_not_reading_an_optional_input_is_reported():
    from adopter.core.extract import extract_source

    s = extract_source(CROSS_SOURCE, "m.py")
    (m,) = match_structures(s, [_extra_node_rule(False)], source=CROSS_SOURCE)
    assert m.lines == [15, 16]  # self.key(hidden_states): what runs when the caller passes no encoder states
    # without the source nothing says encoder_hidden_states is optional: the first path found is kept
    (m,) = match_structures(s, [_extra_node_rule(False)])
    assert m.lines == [13, 16]


def test_variant_rank_order():
    from adopter.core.match import variant_rank

    (m,) = match_structures(extract_source_cross(), [_extra_node_rule(False)], source=CROSS_SOURCE)
    core_only = replace(m, nodes=m.nodes[1:])
    # more nodes rank better when nothing else differs (T5: the path adding the position bias)
    assert variant_rank(m, frozenset()) < variant_rank(core_only, frozenset())
    # reading an optional input ranks worse than running fewer nodes ...
    reads_key_input = frozenset({"hidden_states"})
    assert variant_rank(core_only, frozenset(), reads_key_input) < variant_rank(m, frozenset(), reads_key_input)
    # ... and calling a module only some instances have ranks worse than reading an optional input
    assert variant_rank(core_only, frozenset({"self.key"}), frozenset({"p"})) < variant_rank(
        m, frozenset({"self.key"}))


def extract_source_cross():
    from adopter.core.extract import extract_source

    return extract_source(CROSS_SOURCE, "m.py")


def _counting_rule(reads_path: bool):
    asked = []

    def precondition(ctx):
        asked.append(len(ctx.path.nodes) if reads_path else ctx.match.function)
        return None

    return Rule("Dropout_LayerNorm", "k.Fused", "test", DLN, preconditions=(precondition,)), asked


@pytest.mark.parametrize("reads_path, times_asked", [(False, 1), (True, 3)], ids=["path-blind", "reads-path"])
def test_a_verdict_is_asked_once_per_function_unless_it_reads_the_path(reads_path, times_asked):
    common = nodes(FIG1)
    paths = [common + nodes(f"torch.relu(hidden_states#3) -> a{i}", first_line=30 + i) for i in range(3)]
    rule, asked = _counting_rule(reads_path)
    assert len(match_structures(structures(paths, INIT), [rule])) == 1
    assert len(asked) == times_asked


def test_only_nodes_reading_a_bound_variable_are_tried_and_all_of_them_are():
    # two LayerNorms of the sum's name, one of another value: the reader index must keep both
    text = FIG1 + "; torch.nn.LayerNorm@self.LayerNorm(other) -> z; torch.nn.LayerNorm@self.LayerNorm(tmp_1) -> w"
    found = match_pattern(parse_pattern(
        "torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out"),
        nodes(text))
    assert [positions for positions, _ in found] == [(1, 2, 3), (1, 2, 5)]


def test_a_verdict_that_read_producers_is_taken_only_where_they_are_the_same_nodes():
    # the sum's residual is produced by a different node on the third path: asked again there
    asked = []

    def precondition(ctx):
        made = ctx.producers().get(("input_tensor", 1))
        asked.append(made)
        return None if made is None or made.type == "torch.nn.Linear" else "not a projection"

    rule = Rule("Dropout_LayerNorm", "k.Fused", "test", DLN, preconditions=(precondition,))
    core = FIG1.replace("input_tensor", "input_tensor#1")
    linear = nodes("torch.nn.Linear@self.dense(x) -> input_tensor#1", first_line=5)
    other = nodes("torch.tanh(x) -> input_tensor#1", first_line=6)
    common = nodes(core)
    paths = [linear + common, linear + common, other + common]
    assert match_structures(structures(paths, INIT), [rule]) == []  # vetoed by the third path
    assert len(asked) == 2
