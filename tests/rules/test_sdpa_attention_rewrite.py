"""The sdpa_attention rewrite of its positive fixture computes what the original computes: every
class built twice with the same weights, eval and train (dropout drawn from the same seed),
forward and backward, and the fused path taken where no dropout is drawn."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "rules" / "sdpa_attention"
SNAPSHOTS = ROOT / "rules" / "sdpa_attention"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _floats(xs):
    return [x for x in xs if x is not None and x.is_floating_point()]


def _run_pair(stem: str, name: str, spec, train: bool, tracked=_floats):
    """The fixture ``stem``'s class ``name`` and its rewritten twin, same weights, in train or eval,
    each run forward and backward (``out.pow(2).sum()``) on the same inputs and dropout seed:
    ``(original, rewritten, (out, grads) of the original, (out, grads) of the rewritten, the
    rewritten run's kernel calls)``; grads are the parameters' then the ``tracked`` inputs'."""
    args, kwargs, inputs = spec
    before = _load(FIXTURES / f"{stem}.py", f"sdpa_before_{stem}")
    after = _load(SNAPSHOTS / f"{stem}.rewritten.py", f"sdpa_after_{stem}")
    torch.manual_seed(0)
    original = getattr(before, name)(*args, **kwargs)
    rewritten = getattr(after, name)(*args, **kwargs)
    rewritten.load_state_dict(original.state_dict())
    assert list(rewritten.state_dict()) == list(original.state_dict())
    original.train(train), rewritten.train(train)
    torch.manual_seed(1)
    xs = inputs()
    grad_inputs = tracked(xs)
    for x in grad_inputs:
        x.requires_grad_()
    results = []
    for model in (original, rewritten):
        torch.manual_seed(2)  # (the same dropout draws)
        with count_kernel_calls() as calls:
            out = model(*xs)
        out.pow(2).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]
                        + [x.grad.clone() for x in grad_inputs], calls))
        for x in grad_inputs:
            x.grad = None
    (out_a, grads_a, _), (out_b, grads_b, calls) = results
    return original, rewritten, (out_a, grads_a), (out_b, grads_b), calls


def _close(b, a):
    """Equal up to float32 rounding of another order of operations, relative to the tensor's scale
    (a weight gradient of magnitude 37 differs by 3e-5 at one element on some CPUs)."""
    torch.testing.assert_close(b, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=1e-4)


def _equal(b, a):
    assert torch.equal(b, a), (b - a).abs().max()


CASES = {
    "VitAttention": ((32,), {"num_heads": 4, "attn_drop": 0.2}, lambda: (torch.randn(2, 9, 32),)),
    "CausalSelfAttention": ((32, 4, 16), {"dropout": 0.2}, lambda: (torch.randn(2, 11, 32),)),
    "EinsumAttention": ((32,), {"heads": 4, "dim_head": 8, "dropout": 0.2}, lambda: (torch.randn(2, 7, 32),)),
    "MaskedAttention": ((32, 4), {"dropout": 0.2},
                        lambda: (torch.randn(2, 7, 32), torch.randn(2, 1, 1, 7).clamp(max=0) * 1e4)),
    "PaddingMaskAttention": ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.arange(7)[None] < torch.tensor([[7], [4]]))),
    "GroupedQueryAttention": ((32, 8, 2), {}, lambda: (torch.randn(2, 7, 32),)),
}
SPELLINGS = {
    "OneLiner": ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
    "MethodMatmul": ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32),)),
    "RelativeBias": ((32, 4, 3), {}, lambda: (torch.randn(2, 9, 32),)),  # (a learned bias: its gradient)
    "ConditionalFill": ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.arange(7)[None, None, None] < 5)),
    "BoolAdded": ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.rand(2, 1, 1, 7) > 0.5)),
}
CASTS = {
    "UpcastTypeAs": ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32),)),
    "SoftmaxDtypeTo": ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32), torch.randn(2, 1, 1, 7))),
    "PartialSoftmax": ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32),)),
    "PartialUpcast": ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
}
_KEEP = torch.arange(7)[None] < torch.tensor([[7], [4]])  # (padding: batch 1 keeps its first 4 keys)
MASKS = {
    "PaddingAndCausal": ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32), _KEEP)),
    "CosineCausal": ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
    "FillsThenBias": ((32, 4), {}, lambda: (torch.randn(2, 7, 32), ~_KEEP)),
}
ALL = {**{("positive", n): c for n, c in CASES.items()}, **{("positive_spellings", n): c for n, c in SPELLINGS.items()},
       **{("positive_casts", n): c for n, c in CASTS.items()}, **{("positive_masks", n): c for n, c in MASKS.items()}}


@pytest.mark.parametrize("case", sorted(ALL), ids=lambda c: f"{c[0]}:{c[1]}")
@pytest.mark.parametrize("train", [False, True])
def test_rewritten_equals_original(case, train):
    stem, name = case
    original, _, (out_a, grads_a), (out_b, grads_b), calls = _run_pair(stem, name, ALL[case], train)
    for a, b in zip([out_a, *grads_a], [out_b, *grads_b], strict=True):
        _close(b, a)
    paths = {c.fused for c in calls.calls if c.kernel == "sdpa"}
    draws = train and any(getattr(m, "p", 0) > 0 for m in original.modules()) or (
        train and name == "EinsumAttention")
    assert paths == ({False} if draws else {True}), calls.calls
    assert not math.isnan(out_b.sum().item())


def test_torchscript_compiles_the_source_statements(tmp_path):
    """With the TorchScript guard (``--torchscript always``) a scripted module runs the statements
    the rewrite kept under ``torch.jit.is_scripting()``; eagerly the kernel runs."""
    from adopter.rewrite import rewrite_source

    from adopter.core.rules import get_rules
    from adopter.core.scan import scan_source

    text = (FIXTURES / "positive.py").read_text()
    rules = get_rules(["sdpa_attention"])
    result = rewrite_source(text, scan_source(text, "positive.py", rules), filename="positive.py", rules=rules,
                            torchscript_guard=True)
    assert "torch.jit.is_scripting()" in result.new_text
    path = tmp_path / "guarded.py"
    path.write_text(result.new_text)
    before, after = _load(FIXTURES / "positive.py", "sdpa_ts_before"), _load(path, "sdpa_ts_after")
    for name, (args, kwargs, inputs) in CASES.items():
        torch.manual_seed(0)
        original = getattr(before, name)(*args, **kwargs).eval()
        rewritten = getattr(after, name)(*args, **kwargs).eval()
        rewritten.load_state_dict(original.state_dict())
        xs = inputs()
        scripted = torch.jit.script(rewritten)
        with torch.no_grad():
            torch.testing.assert_close(scripted(*xs), original(*xs), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(rewritten(*xs), original(*xs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_casts_and_partials_equal_exactly(name, dtype):
    """The float32-softmax-cast-back and partial-softmax forms: in training with dropout drawn
    (seeded alike) and in bfloat16 (where the source rounds a float32 softmax: no SDPA) the rewrite
    runs the source's ops and equals it bitwise, forward and backward; in float32 eval it fuses."""
    before = _load(FIXTURES / "positive_casts.py", "sdpa_casts_before")
    after = _load(SNAPSHOTS / "positive_casts.rewritten.py", "sdpa_casts_after")
    args, kwargs, inputs = CASTS[name]
    for train in (False, True):
        torch.manual_seed(0)
        original = getattr(before, name)(*args, **kwargs).to(dtype).train(train)
        rewritten = getattr(after, name)(*args, **kwargs).to(dtype).train(train)
        rewritten.load_state_dict(original.state_dict())
        torch.manual_seed(1)
        xs = [x.to(dtype).requires_grad_() if x.is_floating_point() else x for x in inputs()]
        results = []
        for model in (original, rewritten):
            torch.manual_seed(2)
            with count_kernel_calls() as calls:
                out = model(*xs)
            out.float().pow(2).sum().backward()
            grads = [p.grad.clone() for p in model.parameters()] + [xs[0].grad.clone()]
            xs[0].grad = None
            results.append((out.detach(), grads, calls))
        (out_a, grads_a, _), (out_b, grads_b, calls) = results
        paths = {c.fused for c in calls.calls if c.kernel == "sdpa"}
        draws = train and kwargs.get("p", 0) > 0
        fused = not draws and (dtype == torch.float32 or name == "PartialSoftmax")  # (no casts: bf16 SDPA)
        assert paths == {fused}, calls.calls
        if fused:
            tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
            torch.testing.assert_close(out_b, out_a, **tol)
        else:  # the source's own ops: bitwise
            assert torch.equal(out_b, out_a)
            assert all(torch.equal(b, a) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("keep", ["some", "none", "absent"])
def test_fills_under_branches(causal, keep):
    """Two fills of -finfo.max, each under its own `if`: the kernel gets None for a branch that did
    not run; a row with every key filled (no key kept, and causal or not) is uniform in the source:
    the kernel runs the source's ops, bitwise; otherwise it fuses (float32, eval)."""
    before = _load(FIXTURES / "positive_masks.py", "sdpa_masks_before")
    after = _load(SNAPSHOTS / "positive_masks.rewritten.py", "sdpa_masks_after")
    torch.manual_seed(0)
    original = before.PaddingAndCausal(32, 4, causal=causal).eval()
    rewritten = after.PaddingAndCausal(32, 4, causal=causal).eval()
    rewritten.load_state_dict(original.state_dict())
    x = torch.randn(2, 7, 32, requires_grad=True)
    mask = {"some": _KEEP, "none": torch.zeros(2, 7, dtype=torch.bool), "absent": None}[keep]
    results = []
    for model in (original, rewritten):
        with count_kernel_calls() as calls:
            out = model(x, mask)
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad.clone(), calls))
        x.grad = None
    (out_a, grad_a, _), (out_b, grad_b, calls) = results
    paths = {c.fused for c in calls.calls if c.kernel == "sdpa"}
    if keep == "none":  # every row fully filled: uniform rows in the source, not SDPA's
        assert paths == {False}, calls.calls
        assert torch.equal(out_b, out_a) and torch.equal(grad_b, grad_a)
    else:
        assert paths == {True}, calls.calls
        torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grad_b, grad_a, atol=1e-5, rtol=1e-4)


def test_softmax_partials_only_attributes_bound_to_the_softmax_alone():
    """An attribute the class binds to the softmax partial and to anything else is not read as the
    softmax (extraction may still see one binding); positional bound arguments are not read."""
    import ast

    from adopter.core.rules.sdpa_attention.site import softmax_partials

    tree = ast.parse(
        "import functools\nfrom functools import partial as P\nimport torch.nn.functional as F\nimport torch\n"
        "class A:\n"
        "    def __init__(self, sparse):\n"
        "        self.a = P(F.softmax, dim=-1)\n"
        "        self.b = functools.partial(torch.softmax, dim=-1, dtype=torch.float32)\n"
        "        self.c = P(F.softmax, dim=-1)\n"
        "        if sparse:\n"
        "            self.c = torch.sigmoid\n"
        "        self.d = P(F.softmax, -1)\n"
        "        self.e = P(F.softmax, dim=-1)\n"
        "        self.e = P(F.softmax, dim=1)\n"
        "        self.f = P(F.relu, inplace=False)\n")
    found = softmax_partials(tree.body[-1], tree)
    assert {a: sorted(kw) for a, kw in found.items()} == {"a": ["dim"], "b": ["dim", "dtype"]}


# (class, constructor arguments, inputs) with the mask's branch taken / not taken: the flags, the
# lengths, the remembered tokens (more keys than queries: the causal mask aligned to the last key)
_LENGTHS = torch.tensor([7, 4])
BRANCH_MASKS = {
    ("FlagCausal", True): ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32), _KEEP)),
    ("FlagCausal", False): ((32, 4), {"p": 0.2, "causal": False}, lambda: (torch.randn(2, 7, 32),)),
    ("CausalWithMemory", True): ((32, 4), {}, lambda: (torch.randn(2, 5, 32), torch.randn(2, 3, 32))),
    ("CausalWithMemory", False): ((32, 4), {"causal": False}, lambda: (torch.randn(2, 5, 32), torch.randn(2, 3, 32))),
    ("LengthsMask", True): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), _LENGTHS)),
    ("LengthsMask", False): ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
    ("AlibiThenCausal", True): ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
    ("AlibiThenCausal", False): ((32, 4), {"alibi": False, "causal": False}, lambda: (torch.randn(2, 7, 32),)),
}


@pytest.mark.parametrize("case", sorted(BRANCH_MASKS), ids=lambda c: f"{c[0]}:{'taken' if c[1] else 'not-taken'}")
@pytest.mark.parametrize("train", [False, True])
def test_masks_built_in_branches(case, train):
    """A mask built under an `if` from the scores' shape (positive_branch_masks): the rewrite keeps
    the building statements (the sizes read from the query and key) and passes the mask only where
    the branch ran; eval and train, forward and backward, equal the source's, the branch taken and
    not. The fused path runs where no dropout is drawn; with dropout drawn the source's ops run,
    bitwise equal."""
    name, _taken = case
    original, _, (out_a, grads_a), (out_b, grads_b), calls = _run_pair(
        "positive_branch_masks", name, BRANCH_MASKS[case], train)
    paths = {c.fused for c in calls.calls if c.kernel == "sdpa"}
    draws = train and any(getattr(m, "p", 0) > 0 for m in original.modules())
    assert paths == ({False} if draws else {True}), calls.calls
    for a, b in zip([out_a, *grads_a], [out_b, *grads_b], strict=True):
        # (the source's ops with the user's dropout where it is drawn)
        (_equal if draws else _close)(b, a)
    assert not math.isnan(out_b.sum().item())


def test_offset_causal_mask_is_the_sources_not_sdpas_top_left():
    """More keys than queries: the source's `triu(j - i + 1)` lets query row r see keys up to
    r + (j - i) (aligned to the last key); SDPA's `is_causal` would align to the first key. The
    rewrite passes the source's mask, and the output equals the source's, not the top-left one."""
    before = _load(FIXTURES / "positive_branch_masks.py", "sdpa_offset_before")
    after = _load(SNAPSHOTS / "positive_branch_masks.rewritten.py", "sdpa_offset_after")
    torch.manual_seed(0)
    original = before.CausalWithMemory(32, 4).eval()
    rewritten = after.CausalWithMemory(32, 4).eval()
    rewritten.load_state_dict(original.state_dict())
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 3, 32)
    with torch.no_grad(), count_kernel_calls() as calls:
        out_a, out_b = original(x, memory), rewritten(x, memory)
        context = torch.cat((memory, x), dim=1)
        q = original.q(x).view(2, 5, 4, -1).transpose(1, 2)
        k, v = original.kv(context).view(2, 8, 2, 4, -1).permute(2, 0, 3, 1, 4)
        top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert {c.fused for c in calls.calls if c.kernel == "sdpa"} == {True}
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(top_left.transpose(1, 2).reshape(2, 5, 32), out_a, atol=1e-3)


@pytest.mark.parametrize("name", ["LengthsMask", "FlagCausal"])
def test_branch_masks_that_block_a_whole_row_run_the_sources_ops(name):
    """A mask built in a branch that leaves a query row no key (a sequence of length 0; a padding
    that keeps no key): the source's softmax of that row is NaN (-inf fills) or uniform (-finfo.max
    fills), not SDPA's; the kernel's guards see the mask the branch built and run the source's ops,
    bitwise equal, NaN where the source is NaN."""
    before = _load(FIXTURES / "positive_branch_masks.py", "sdpa_blocked_before")
    after = _load(SNAPSHOTS / "positive_branch_masks.rewritten.py", "sdpa_blocked_after")
    torch.manual_seed(0)
    original = getattr(before, name)(32, 4).eval()
    rewritten = getattr(after, name)(32, 4).eval()
    rewritten.load_state_dict(original.state_dict())
    x = torch.randn(2, 7, 32)
    blocking = torch.tensor([7, 0]) if name == "LengthsMask" else torch.zeros(2, 7, dtype=torch.bool)
    with torch.no_grad(), count_kernel_calls() as calls:
        out_a, out_b = original(x, blocking), rewritten(x, blocking)
    assert {c.fused for c in calls.calls if c.kernel == "sdpa"} == {False}, calls.calls
    assert torch.equal(out_b.isnan(), out_a.isnan()) and out_a.isnan().any() == (name == "LengthsMask")
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0, equal_nan=True)


# positive_branch_bound: the branch's condition calls a function (`exists(mask)`, a counting method)
# or the branch rebinds what it reads (`mask = rearrange(mask, ...)`); the rewrite binds the mask in
# the branch. (class, variant) -> (constructor arguments, inputs); "taken" passes the mask (and sets
# the flag), "not-taken" passes None (and clears it), "padding-only" the first of two branches.
_QKV = lambda: tuple(torch.randn(2, 4, 7, 8) for _ in range(3))  # noqa: E731
_KEEP_LONG = torch.arange(9)[None] < torch.tensor([[9], [4]])  # (longer than the keys: sliced to 7)
BRANCH_BOUND = {
    ("ExistsRearranged", "taken"): ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32), _KEEP)),
    ("ExistsRearranged", "not-taken"): ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32), None)),
    ("NoneCheckIndexed", "taken"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.randn(2, 7).clamp(max=0) * 1e4)),
    ("NoneCheckIndexed", "not-taken"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), None)),
    ("PaddingThenCausal", "taken"): ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32), _KEEP)),
    ("PaddingThenCausal", "padding-only"): ((32, 4), {"p": 0.2, "causal": False},
                                            lambda: (torch.randn(2, 7, 32), _KEEP)),
    ("PaddingThenCausal", "not-taken"): ((32, 4), {"p": 0.2, "causal": False}, lambda: (torch.randn(2, 7, 32), None)),
    ("CountedCondition", "taken"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), _KEEP)),
    ("CountedCondition", "not-taken"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), None)),
    ("ExistsOneStatement", "taken"): ((), {}, lambda: (*_QKV(), _KEEP)),
    ("ExistsOneStatement", "not-taken"): ((), {}, lambda: (*_QKV(), None)),
    ("KeepSliced", "taken"): ((), {}, lambda: (*_QKV(), _KEEP_LONG)),
    ("KeepSliced", "not-taken"): ((), {}, lambda: (*_QKV(), None)),
    ("ExistsSliced", "taken"): ((), {}, lambda: (*_QKV(), _KEEP_LONG)),
    ("ExistsSliced", "not-taken"): ((), {}, lambda: (*_QKV(), None)),
    ("SelfThenCross", "taken"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.randn(2, 5, 32), _KEEP,
                                                       torch.arange(5)[None] < torch.tensor([[2], [5]]))),
    ("SelfThenCross", "self-only"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.randn(2, 5, 32), _KEEP, None)),
    ("SelfThenCross", "cross-only"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.randn(2, 5, 32), None,
                                                            torch.arange(5)[None] < torch.tensor([[2], [5]]))),
    ("SelfThenCross", "not-taken"): ((32, 4), {}, lambda: (torch.randn(2, 7, 32), torch.randn(2, 5, 32))),
}


@pytest.mark.parametrize("case", sorted(BRANCH_BOUND), ids=lambda c: f"{c[0]}:{c[1]}")
@pytest.mark.parametrize("train", [False, True])
def test_masks_bound_in_their_branch(case, train):
    """The condition evaluated once, where the source evaluates it (a counting condition counts
    alike), the mask the kernel gets bound in the branch (None where it did not run): eval and
    train, forward and backward, equal the source's, the branch taken and not; fused where no
    dropout is drawn, the source's ops (bitwise) where it is."""
    name, _ = case
    original, rewritten, (out_a, grads_a), (out_b, grads_b), calls = _run_pair(
        "positive_branch_bound", name, BRANCH_BOUND[case], train, tracked=lambda xs: _floats(xs[:3]))
    assert getattr(rewritten, "checks", 1) == getattr(original, "checks", 1) == 1
    paths = {c.fused for c in calls.calls if c.kernel == "sdpa"}
    draws = train and any(getattr(m, "p", 0) > 0 for m in original.modules())
    assert paths == ({False} if draws else {True}), calls.calls
    for a, b in zip([out_a, *grads_a], [out_b, *grads_b], strict=True):
        # (the source's ops with the user's dropout where it is drawn)
        (_equal if draws else _close)(b, a)
    assert not math.isnan(out_b.sum().item())


@pytest.mark.parametrize("name", ["ExistsRearranged", "CountedCondition"])
def test_bound_masks_that_block_a_whole_row_run_the_sources_ops(name):
    """A mask bound in its branch that keeps no key for one sequence: the source's softmax of those
    rows is uniform (-finfo.max) or NaN (-inf), not SDPA's; the kernel's guards see the bound mask
    and run the source's ops, bitwise equal, NaN where the source is NaN."""
    before = _load(FIXTURES / "positive_branch_bound.py", "sdpa_bound_blocked_before")
    after = _load(SNAPSHOTS / "positive_branch_bound.rewritten.py", "sdpa_bound_blocked_after")
    torch.manual_seed(0)
    original = getattr(before, name)(32, 4).eval()
    rewritten = getattr(after, name)(32, 4).eval()
    rewritten.load_state_dict(original.state_dict())
    x = torch.randn(2, 7, 32)
    blocking = torch.stack((torch.ones(7, dtype=torch.bool), torch.zeros(7, dtype=torch.bool)))
    with torch.no_grad(), count_kernel_calls() as calls:
        out_a, out_b = original(x, blocking), rewritten(x, blocking)
    assert {c.fused for c in calls.calls if c.kernel == "sdpa"} == {False}, calls.calls
    assert out_a.isnan().any() == (name == "CountedCondition")
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0, equal_nan=True)


_FOLDED_BIAS = torch.randn(8, 1, 7).clamp(max=0) * 10  # ((batch * heads, 1, keys): broadcast over the queries)
BMM_PERMUTE = {
    "FoldedHeads": ((32, 4), {"p": 0.2}, lambda: (torch.randn(2, 7, 32),)),
    "ZeroBetaBaddbmm": ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
    "FoldedBias": ((32, 4), {}, lambda: (torch.randn(2, 7, 32), _FOLDED_BIAS.clone())),
    "PermutedKey": ((32, 4), {}, lambda: (torch.randn(2, 7, 32),)),
    "PrePermutedKey": ((32, 4), {"p": 0.2},
                       lambda: (torch.randn(2, 7, 32), torch.full((7, 7), -math.inf).triu(1))),
}
FOLDED = {"FoldedHeads", "ZeroBetaBaddbmm", "FoldedBias"}  # (rank 3: viewed as one head by the kernel)


@pytest.mark.parametrize("name", sorted(BMM_PERMUTE))
@pytest.mark.parametrize("train", [False, True])
def test_folded_heads_and_permuted_keys(name, train):
    """bmm/baddbmm attentions of heads folded into the batch and keys transposed by permute: the
    rewrite computes what the source computes, forward and backward. Rank-3 operands (heads folded
    into the batch) run fused as one head, as rank-4 permuted keys do, where no dropout is drawn;
    where it is, the source's ops run on the tensors as given, bitwise (``torch.matmul`` of rank-3
    tensors is ``bmm``; ``baddbmm``'s alpha with beta=0 is the product's scale, to the bit on CPU,
    forward — its backward scales the gradient in another order than ``(q @ kᵀ) * alpha``'s:
    float32 rounding)."""
    original, _, (out_a, grads_a), (out_b, grads_b), calls = _run_pair(
        "positive_bmm_permute", name, BMM_PERMUTE[name], train)
    sdpa_calls = [c for c in calls.calls if c.kernel == "sdpa"]
    assert sdpa_calls, calls.calls
    draws = train and any(getattr(m, "p", 0) > 0 for m in original.modules())
    fused = not draws
    assert {c.fused for c in sdpa_calls} == {fused}, calls.calls
    if name in FOLDED:
        assert out_b.shape == out_a.shape and out_b.dim() == 3
    (_close if fused else _equal)(out_b, out_a)
    for a, b in zip(grads_a, grads_b, strict=True):
        (_close if fused or name == "ZeroBetaBaddbmm" else _equal)(b, a)
    assert not math.isnan(out_b.sum().item())
