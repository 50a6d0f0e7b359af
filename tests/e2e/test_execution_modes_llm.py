"""Every new LLM kernel path (issue 24) in every way a rewritten model runs: eager, ``torch.fx``,
TorchScript and ``torch.compile`` without a graph break (as ``test_execution_modes.py`` and
``test_compile_modes.py`` check the older kernels).

The subjects are the project's fixtures and three corpus models (read, never edited), each
rewritten by the real scan + rewrite with the four LLM rules and loaded from a real file (TorchScript
reads the source of what it compiles):

* RMSNorm forms: litgpt's ``x * x`` over ``self.dim`` (with and without the unit offset), the
  weight multiplied before the cast back, Meta-llama's ``_norm`` helper with ``.type_as``, a
  helper defined by a same-file base, the norm without float32 upcast;
* rotary forms: the complex ``view_as_real(view_as_complex(...) * freqs_cis)`` (both operand
  orders), the real pairs ``reshape(..., -1, 2).unbind(-1)`` rotated and ``stack``-ed /
  ``flatten``-ed, the half rotation written inline (``cat((-x2, x1))``), ``rotate_half`` as a
  ``@staticmethod`` (through ``self`` and the class) and as a method, GPT-J's interleaved rotation;
* gated MLPs: one ``gate_up`` projection split by ``.chunk``/``.split``/``torch.chunk``/
  ``torch.split`` (gate first or second), Linears built by a same-file factory or subclass;
* the written-out cross entropy ``F.cross_entropy(logits.view(-1, V), targets.view(-1),
  ignore_index=-1)`` and its spellings (a loss module, shifted targets, ``.float()``, ``flatten``).

What must hold for each (modes are separate tests, so a report names the path and the mode):

* eager: the rewritten model takes the fused path (telemetry) and computes the original's outputs
  and gradients (training; the fused cross entropy returns ``logits=None``, by design);
* fx: where the original traces, the rewritten model traces (the guards see proxies and record the
  user's ops) and the traced graph computes the original's outputs and gradients;
* TorchScript: where the original scripts, the rewritten model scripts (it keeps the user's
  statements behind ``torch.jit.is_scripting()``) and computes what the scripted original does;
* dynamo: one graph (``fullgraph=True``, and no graph break counted), the fused kernel in it, and
  the compiled model computes what the eager rewritten one does, forward and backward (backend
  ``aot_eager``: the autograd Functions and custom ops are traced by AOT autograd too).
"""
from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from adopter.kernels.guarded_linear_cross_entropy import LogitsNotComputedWarning
from adopter.kernels.telemetry import count_kernel_calls
from adopter.rewrite import rewrite_source
from torch import nn

from adopter.core.rules import all_rules
from adopter.core.scan import scan_source

# training with labels drops the logits, by design (the warning has its own tests)
pytestmark = pytest.mark.filterwarnings(
    f"ignore::{LogitsNotComputedWarning.__module__}.LogitsNotComputedWarning",
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
)

TESTS = Path(__file__).parents[1]
LLM_RULES = ("RMSNorm", "rotary_embedding", "gated_MLP", "linear_cross_entropy")
RMS = "rules/RMSNorm/positive_outside_hf.py"
ROPE = "rules/rotary_embedding/positive_forms.py"
MLP = "rules/gated_MLP/positive_outside_hf.py"
LCE = "rules/linear_cross_entropy/written_out.py"


# ---------------------------------------------------------------- loading the rewritten files


def _load(text: str, name: str, folder: Path) -> types.ModuleType:
    path = folder / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and TorchScript look the module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``files(rel)`` -> (original module, rewritten module), rewritten once per file."""
    folder = tmp_path_factory.mktemp("llm_modes")
    rules = [r for r in all_rules() if r.name in LLM_RULES]
    loaded: dict[str, tuple] = {}

    def get(rel: str):
        if rel not in loaded:
            source = TESTS / ("fixtures/" + rel if not rel.startswith("corpus/") else rel)
            text = source.read_text()
            result = rewrite_source(text, scan_source(text, source.name, rules), filename=source.name, rules=rules)
            applied = [o for o in result.outcomes if o.applied]
            assert applied, [o.reason for o in result.outcomes]
            stem = "llm_modes_" + rel.replace("/", "_").removesuffix(".py")
            loaded[rel] = (_load(text, stem + "_original", folder), _load(result.new_text, stem + "_rewritten", folder))
        return loaded[rel]

    yield get
    for name in [n for n in sys.modules if n.startswith("llm_modes_")]:
        del sys.modules[name]


# ---------------------------------------------------------------- the subjects


@dataclass(frozen=True)
class Subject:
    """One new kernel path on one subject: ``make(module)`` builds the callable (a module in
    training mode, or a function) from a loaded file; ``inputs()`` gives fresh arguments (floating
    activations require grad)."""

    path: str
    file: str
    kernels: tuple[str, ...]  # telemetry kernel names that must take the fused path in eager
    make: Callable[[types.ModuleType], Any]
    inputs: Callable[[], tuple]
    # what fuses under torch.compile, when not ``kernels``: an nn.CrossEntropyLoss built inside
    # forward reaches the kernel as a lambda of dynamo's whose arguments cannot be read, so the
    # compiled code runs the source's statements there (one graph still, the same values)
    compiled_kernels: tuple[str, ...] | None = None


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _act(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed)).requires_grad_()


def _angles(*shape: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.rand(*shape, generator=_g(seed)) * 6.0
    return theta.cos(), theta.sin()


def _freqs_cis(seq: int, pairs: int) -> torch.Tensor:
    theta = torch.rand(seq, pairs, generator=_g(2)) * 6.0
    return torch.polar(torch.ones_like(theta), theta)


def _ids(vocab: int, shape=(2, 9), seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=_g(seed))


def _targets(vocab: int, ignore: int, shape=(2, 9)) -> torch.Tensor:
    t = _ids(vocab, shape, seed=4)
    t[0, :3] = ignore  # a masked prompt: the ignored rows must drop out of the fused loss too
    return t


def _config(vocab: int = 37, n_embd: int = 16) -> types.SimpleNamespace:
    return types.SimpleNamespace(vocab_size=vocab, n_embd=n_embd)


SUBJECTS = {
    # -- RMSNorm forms
    "rms_xx_dim_attr": Subject("rms_norm", RMS, ("rms_norm",), lambda m: m.LitGPTRMSNorm(16),
                               lambda: (_act(2, 5, 16),)),
    "rms_xx_dim_attr_offset": Subject("rms_norm", RMS, ("rms_norm",),
                                      lambda m: m.LitGPTRMSNorm(16, add_unit_offset=True), lambda: (_act(2, 5, 16),)),
    "rms_weight_before_cast_offset": Subject("rms_norm", RMS, ("rms_norm",),
                                             lambda m: m.LitGPTScaleRMSNorm(16, add_unit_offset=True),
                                             lambda: (_act(2, 5, 16),)),
    "rms_norm_helper_type_as": Subject("rms_norm", RMS, ("rms_norm",), lambda m: m.MetaLlamaRMSNorm(16),
                                       lambda: (_act(2, 5, 16),)),
    "rms_helper_in_base": Subject("rms_norm", RMS, ("rms_norm",), lambda m: m.HelperInBaseRMSNorm(16),
                                  lambda: (_act(2, 5, 16),)),
    "rms_negated_offset_branch": Subject("rms_norm", RMS, ("rms_norm",),
                                         lambda m: m.NegatedBranchRMSNorm(16, plain=False), lambda: (_act(2, 5, 16),)),
    "rms_no_upcast_xx": Subject("rms_norm", RMS, ("rms_norm",), lambda m: m.NoUpcastSquareRMSNorm(16),
                                lambda: (_act(2, 5, 16),)),
    # (whole models with one layer: compiling inlines every layer, and one shows each path)
    "rms_litgpt_block_model": Subject("rms_norm", "rms_norm_models/litgpt_block.py", ("rms_norm", "gated_mlp"),
                                      lambda m: m.GPT(m.Config(unit_offset=True, n_layer=1)), lambda: (_ids(96),)),
    # -- rotary forms
    "rope_complex_attention": Subject("rotary", "rotary_models/meta_llama_attention.py", ("rotary",),
                                      lambda m: m.Attention(), lambda: (_act(2, 9, 32),)),
    "rope_complex_freqs_first": Subject("rotary", ROPE, ("rotary",), lambda m: m.apply_rotary_emb_mistral,
                                        lambda: (_act(2, 9, 4, 8), _act(2, 9, 2, 8, seed=5), _freqs_cis(9, 4))),
    "rope_real_pairs_stack": Subject("rotary", ROPE, ("rotary",), lambda m: m.apply_rotary_emb_real,
                                     lambda: (_act(2, 9, 4, 8), _act(2, 9, 2, 8, seed=5),
                                              *(a.view(1, 9, 1, 4) for a in _angles(9, 4)))),
    "rope_pairs_interleaved_inline": Subject("rotary", ROPE, ("rotary",), lambda m: m.apply_interleaved_inline,
                                             lambda: (_act(2, 4, 9, 8), *_angles(9, 4))),
    "rope_pairs_halves_cat": Subject("rotary", ROPE, ("rotary",), lambda m: m.apply_halves_written_out,
                                     lambda: (_act(2, 4, 9, 8), *_angles(9, 4))),
    "rope_inline_cat_attention": Subject("rotary", "rotary_models/litgpt_attention.py", ("rotary",),
                                         lambda m: m.CausalSelfAttention(), lambda: (_act(2, 9, 32),)),
    "rope_inline_cat_in_product": Subject("rotary", ROPE, ("rotary",), lambda m: m.apply_rope_in_product,
                                          lambda: (_act(2, 4, 9, 8), *_angles(9, 8))),
    "rope_staticmethod": Subject("rotary", ROPE, ("rotary",), lambda m: m.NeoXAttention(8),
                                 lambda: (_act(2, 4, 9, 16), _act(2, 4, 9, 8, seed=5), *_angles(9, 8))),
    "rope_method": Subject("rotary", ROPE, ("rotary",), lambda m: m.MethodRotary(),
                           lambda: (_act(2, 4, 9, 8), *_angles(9, 8))),
    "rope_interleaved_inherited_staticmethod": Subject("rotary", ROPE, ("rotary",), lambda m: m.InterleavedChild(),
                                                       lambda: (_act(2, 4, 9, 8), *_angles(9, 8))),
    "rope_gptj_every_two": Subject("rotary", ROPE, ("rotary",), lambda m: m.apply_gptj,
                                   lambda: (_act(2, 9, 4, 8), *reversed(_angles(2, 9, 4)))),
    # -- gated MLPs
    "mlp_gate_up_chunk": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.Phi3MLP(16, 24),
                                 lambda: (_act(2, 5, 16),)),
    "mlp_gate_up_chunk_gate_second": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.GeGLUFeedForward(16, 24),
                                             lambda: (_act(2, 5, 16),)),
    "mlp_gate_up_split": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.SwiGLUSplit(16, 24),
                                 lambda: (_act(2, 5, 16),)),
    "mlp_gate_up_torch_chunk": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.TorchChunkSwiGLU(16, 24),
                                       lambda: (_act(2, 5, 16),)),
    "mlp_gate_up_torch_split_list": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.TorchSplitGeGLU(16, 24),
                                            lambda: (_act(2, 5, 16),)),
    "mlp_factory_linear": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.FactoryMLP(16, 24),
                                  lambda: (_act(2, 5, 16),)),
    "mlp_linear_subclass": Subject("gated_mlp", MLP, ("gated_mlp",), lambda m: m.NoBiasLinearMLP(16, 24),
                                   lambda: (_act(2, 5, 16),)),
    # -- the written-out cross entropy
    "lce_nanogpt_view_ignore": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                       lambda m: m.NanoGPT(_config()), lambda: (_ids(37), _targets(37, -1))),
    "lce_shifted_loss_module": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                       lambda m: m.GPT2Shifted(_config()), lambda: (_ids(37), _targets(37, -100)),
                                       compiled_kernels=()),
    "lce_inline_shift_sum": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                    lambda m: m.InlineShiftSum(_config()), lambda: (_ids(37),)),
    "lce_loss_module_in_init": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                       lambda m: m.LossModuleInInit(_config()), lambda: (_ids(37), _targets(37, -1))),
    "lce_inline_loss_module": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                      lambda m: m.InlineLossModule(_config()), lambda: (_ids(37), _targets(37, 0)),
                                      compiled_kernels=()),
    "lce_upcast_before_view": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                      lambda m: m.UpcastBeforeView(_config()), lambda: (_ids(37), _targets(37, -100))),
    "lce_flatten_dict_output": Subject("linear_cross_entropy", LCE, ("linear_cross_entropy",),
                                       lambda m: m.FlattenImportedFunction(_config()),
                                       lambda: (_ids(37), _targets(37, -100))),
    # -- corpus models, whole (read-only subjects)
    "corpus_nanogpt": Subject("linear_cross_entropy", "corpus/llm_styles/nanogpt_llm.py", ("linear_cross_entropy",),
                              lambda m: m.GPT(m.GPTConfig(n_layer=1)), lambda: (_ids(128), _targets(128, -1))),
    "corpus_llama_meta": Subject("rotary+rms_norm+gated_mlp+linear_cross_entropy", "corpus/llm_styles/llama_meta.py",
                                 ("rms_norm", "rotary", "gated_mlp", "linear_cross_entropy"),
                                 lambda m: m.Transformer(m.ModelArgs(n_layers=1)), lambda: (_ids(256), _targets(256, -1))),
    "corpus_litgpt": Subject("rotary+rms_norm+gated_mlp", "corpus/llm_styles/litgpt_model.py",
                             ("rms_norm", "rotary", "gated_mlp"), lambda m: m.GPT(m.Config(n_layer=1)), lambda: (_ids(250),)),
}


def _build(files, name: str):
    """(subject, original, rewritten): the same weights in both (perturbed: RMSNorm weights start
    at one, where a wrong scale would not show), training mode."""
    subject = SUBJECTS[name]
    original_module, rewritten_module = files(subject.file)
    torch.manual_seed(0)
    original = subject.make(original_module)
    torch.manual_seed(0)
    rewritten = subject.make(rewritten_module)
    if isinstance(original, nn.Module):
        with torch.no_grad():
            for p in original.parameters():
                p.add_(torch.randn(p.shape, generator=_g(7)) * 0.1)
        rewritten.load_state_dict(original.state_dict())
        original.train()
        rewritten.train()
    return subject, original, rewritten


# ---------------------------------------------------------------- running and comparing


def _flat(out: Any) -> list:
    """The tensors of a model output, in order (None kept: a dropped logits tensor)."""
    if out is None or isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flat(v)]
    return []


def _params(fn: Any) -> list[torch.Tensor]:
    """The parameters by name (a traced or scripted copy registers them in another order; a tied
    weight under each of its names)."""
    if not isinstance(fn, nn.Module):
        return []
    return [p for _, p in sorted(fn.named_parameters(remove_duplicate=False), key=lambda item: item[0])]


def _step(fn: Any, inputs: tuple, params: list[torch.Tensor], keep: list[int] | None = None):
    """(outputs, gradients of a weighted sum of the outputs at ``keep`` (default: every floating
    one) with respect to ``params`` and the inputs that require grad)."""
    inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    outs = _flat(fn(*inputs))
    if keep == []:
        return outs, ()
    if keep is None:
        keep = [i for i, o in enumerate(outs) if o is not None and o.is_floating_point()]
    gen = _g(11)
    loss = sum((outs[i].float() * torch.randn(outs[i].shape, generator=gen)).sum() for i in keep)
    wrt = [*params, *(t for t in inputs if t.requires_grad)]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return outs, grads


def _same(got, want, exact: bool = False, atol: float = 2e-5, rtol: float = 1e-4, what: str = "") -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None:
            assert a is None and b is None, f"{what} #{i}"
            continue
        if exact:
            assert torch.equal(a, b), f"{what} #{i}"
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, i=i: f"{what} #{i}: {m}")


def _compare(got_fn, want_fn, inputs, got_params, want_params, dropped_ok: bool = False, **tol) -> None:
    """``got_fn`` against ``want_fn``: outputs, then gradients over the outputs both computed
    (``dropped_ok``: ``got_fn`` may return None where ``want_fn`` has the logits)."""
    got, _ = _step(got_fn, inputs, got_params, keep=[])
    want, _ = _step(want_fn, inputs, want_params, keep=[])
    assert len(got) == len(want)
    keep = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None and b is not None:
            assert dropped_ok, f"output #{i} is None, the original's is not"
            continue
        if b is None:
            assert a is None, f"output #{i} is a tensor, the original's is None"
            continue
        if a is not None and a.is_floating_point():
            keep.append(i)
    got, got_grads = _step(got_fn, inputs, got_params, keep)
    want, want_grads = _step(want_fn, inputs, want_params, keep)
    _same([got[i] for i in keep], [want[i] for i in keep], what="outputs", **tol)
    _same(got_grads, want_grads, what="gradients", **tol)


def _fused_kernels(fn, inputs) -> set[str]:
    with count_kernel_calls() as counted:
        _step(fn, inputs, _params(fn), keep=None)
    return {c.kernel for c in counted.calls if c.fused}


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


NAMES = sorted(SUBJECTS)


# ---------------------------------------------------------------- eager


@pytest.mark.parametrize("name", NAMES)
def test_eager_rewrite_fuses_and_computes_the_original(files, name):
    subject, original, rewritten = _build(files, name)
    inputs = subject.inputs()
    missing = set(subject.kernels) - _fused_kernels(rewritten, inputs)
    assert not missing, f"{sorted(missing)} did not take the fused path"
    _compare(rewritten, original, inputs, _params(rewritten), _params(original),
             dropped_ok="linear_cross_entropy" in subject.kernels)


# ---------------------------------------------------------------- fx


@pytest.mark.parametrize("name", NAMES)
def test_fx_traced_rewrite_computes_the_original(files, name):
    subject, original, rewritten = _build(files, name)
    inputs = subject.inputs()
    try:
        torch.fx.symbolic_trace(subject.make(files(subject.file)[0]))  # a fresh one: tracing may set attributes
    except Exception as error:  # noqa: BLE001  (what the original cannot do is no failure of the rewrite)
        pytest.skip(f"the original does not fx-trace: {_first_line(error)}")
    traced = torch.fx.symbolic_trace(rewritten)
    # the guards saw proxies: the graph holds the user's computation, which then runs unfused
    with count_kernel_calls() as counted:
        _compare(traced, original, inputs, _params(traced), _params(original))
    assert not any(c.fused for c in counted.calls), counted.calls


# ---------------------------------------------------------------- TorchScript


@pytest.mark.parametrize("name", NAMES)
def test_scripted_rewrite_computes_the_scripted_original(files, name):
    subject, original, rewritten = _build(files, name)
    inputs = subject.inputs()
    try:
        scripted_original = torch.jit.script(original)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"the original does not script: {_first_line(error)}")
    scripted = torch.jit.script(rewritten)
    # the user's statements, compiled by TorchScript: what the scripted original computes, bit for bit
    _compare(scripted, scripted_original, inputs, _params(scripted), _params(scripted_original), exact=True)


# ---------------------------------------------------------------- dynamo


def _capturing_aot_eager(seen: list[str]):
    """``aot_eager``, recording each captured call's target and the source line that made it (an
    autograd Function's ``.apply`` shows in its node's stack trace)."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        for graph in (m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)):
            seen.extend(f"{n.target} {n.meta.get('stack_trace') or ''}" for n in graph.graph.nodes
                        if n.op in ("call_function", "call_method"))
        return aot_eager(gm, example_inputs)

    return backend


# what each fused kernel leaves in the captured graph (the original computations have none of it)
FUSED_IN_GRAPH = {
    "rms_norm": "RMSNormFunction.apply",
    "linear_cross_entropy": "adopter.linear_cross_entropy",
    "rotary": "addcmul",  # the in-place rotated term of every layout (the written expressions add)
    "gated_mlp": "GatedActFunction.apply",
}


@pytest.mark.parametrize("name", NAMES)
def test_compiled_rewrite_is_one_graph_and_computes_the_eager_rewrite(files, name):
    from torch._dynamo.utils import counters

    subject, original, rewritten = _build(files, name)
    inputs = subject.inputs()
    # the reference: the eager rewrite, or the original where the compiled code runs the source's
    # statements (the fused loss drops the logits, the source's returns them)
    reference = rewritten if subject.compiled_kernels is None else original
    torch._dynamo.reset()
    counters.clear()
    seen: list[str] = []
    compiled = torch.compile(rewritten, backend=_capturing_aot_eager(seen), fullgraph=True)
    try:
        _compare(compiled, reference, inputs, _params(rewritten), _params(reference), atol=1e-5, rtol=1e-5)
        assert not counters["graph_break"], dict(counters["graph_break"])
        captured = "\n".join(seen)
        wanted = subject.kernels if subject.compiled_kernels is None else subject.compiled_kernels
        for kernel in wanted:
            assert FUSED_IN_GRAPH[kernel] in captured, f"{kernel}: the fused kernel is not in the graph"
    finally:
        torch._dynamo.reset()


def test_compiled_method_rotation_that_reads_self_runs_the_written_expression(files):
    """Under torch.compile a bound ``rotate_half`` is probed through its function with self=None (the
    module is no constant of the compiled code): a method patched in later that reads ``self`` fails
    that probe, and the written expression runs, in one graph, with the method's values."""
    _, rewritten_module = files(ROPE)

    class ScaledRotary(rewritten_module.MethodRotary):
        scale = 1.0

        def rotate_half(self, x):
            half = x.shape[-1] // 2
            return self.scale * torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    model = ScaledRotary()
    q, (cos, sin) = _act(2, 4, 9, 8), _angles(9, 8)
    want = q * cos + model.rotate_half(q) * sin
    torch._dynamo.reset()
    seen: list[str] = []
    try:
        got = torch.compile(model, backend=_capturing_aot_eager(seen), fullgraph=True)(q, cos, sin)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert not any(FUSED_IN_GRAPH["rotary"] in s for s in seen)


# ---------------------------------------------------------------- torch.export


@pytest.mark.parametrize("name", NAMES)
def test_exported_rewrite_computes_the_original(files, name):
    # non-strict export, as users export: the guards run outside tracing, the exported program
    # of the rewrite computes what the original does (eval, the forward a deployed model runs)
    subject, original, rewritten = _build(files, name)
    if not isinstance(original, nn.Module):
        pytest.skip("a function, not a module: nothing to export")
    original.eval()
    rewritten.eval()
    inputs = subject.inputs()
    with torch.no_grad():
        try:
            torch.export.export(subject.make(files(subject.file)[0]).eval(), inputs, strict=False)
        except Exception as error:  # noqa: BLE001  (what the original cannot do is no failure of the rewrite)
            pytest.skip(f"the original does not export: {_first_line(error)}")
        exported = torch.export.export(rewritten, inputs, strict=False).module()
        got, want = _flat(exported(*inputs)), _flat(original(*inputs))
    _same(got, want, what=name)
