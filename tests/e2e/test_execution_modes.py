"""Every way a rewritten model runs (issue 21): eager, fx-traced, scripted, compiled, exported,
and every method of its class, agree with each other and with the user's model.

``tests/fixtures/modes/zoo.py`` (a timm-style CNN whose ``forward_features`` and
``forward_intermediates`` share a Conv+BN pair and hold an ``nn.Sequential`` stem, an HF-BERT
layer, a Llama block) is rewritten by the real scan + rewrite and both versions are loaded. What
must hold, per model and mode (eval, and training with the same seed):

* fx: the traced rewritten model computes what the eager rewritten model computes (the user's
  computation is traced: a Conv/Linear+BatchNorm pair as its two modules, so the graph follows a
  later ``train()``/``eval()``), bit for bit where the eager kernels run the original too, within
  rounding where they fuse (a frozen model's eager fold, two documented cases); and the traced
  graph scripts;
* TorchScript: the rewritten model scripts, and computes what the scripted and the eager original
  compute, bit for bit (the rewrite keeps the user's statements for TorchScript);
* dynamo (``backend="eager"``, one graph) and ``torch.export``: what the eager rewritten model
  computes, within rounding (a kernel may take another implementation under the compiler);
* every method: ``forward_features`` and ``forward_intermediates`` of the rewritten class answer
  the same, and the eager rewrite matches the original within the kernels' tolerance.
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls, freeze, unfreeze
from adopter.rewrite import rewrite_source
from adopter.rewrite.scripting import SCRIPTING_TEST, python_view

from adopter.core.rules import all_rules
from adopter.core.scan import scan_source

ZOO = Path(__file__).parents[1] / "fixtures" / "modes" / "zoo.py"


def _module(text: str, name: str, folder: Path) -> types.ModuleType:
    # a real file: TorchScript reads the source of what it compiles through inspect/linecache
    import importlib.util
    import sys

    path = folder / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    text = ZOO.read_text()
    result = rewrite_source(text, scan_source(text, "zoo.py", all_rules()), filename="zoo.py")
    assert result.outcomes and all(o.applied for o in result.outcomes), [o.reason for o in result.outcomes]
    folder = tmp_path_factory.mktemp("modes")
    return _module(text, "zoo_original", folder), _module(result.new_text, "zoo_rewritten", folder), result.new_text


MODELS = {
    "ConvNet": lambda: torch.randn(2, 3, 12, 12),
    "BertLayer": lambda: torch.randn(2, 5, 32),
    "LlamaBlock": lambda: torch.randn(2, 5, 32),
    "Head": lambda: torch.randn(4, 32),
}


def _pair(zoo, name: str, training: bool, frozen: bool = False):
    """The original and the rewritten ``name`` with the same state; the rewritten one under
    ``adopter.kernels.freeze`` when ``frozen`` (eval only)."""
    original_module, rewritten_module, _ = zoo
    torch.manual_seed(0)
    original = getattr(original_module, name)()
    for bn in (m for m in original.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)):
        bn.running_mean.uniform_(-1, 1)  # statistics a fold visibly depends on
        bn.running_var.uniform_(0.5, 2.0)
    rewritten = getattr(rewritten_module, name)()
    rewritten.load_state_dict(original.state_dict())  # state-dict compatible both ways
    original.load_state_dict(rewritten.state_dict())
    if frozen:
        assert not training
        return original.eval(), freeze(rewritten)
    return original.train(training), rewritten.train(training)


def _run(model, x, seed: int = 1):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(x)


def test_the_rewrite_keeps_the_users_statements_for_torchscript(zoo):
    _, _, text = zoo
    # one guard per region of rewritten statements: 14 sites, the Sequential built in __init__
    # needs none, and adjacent sites share one (the QKV projections then the written-out
    # attention; Dropout+LayerNorm then Linear+GeLU; the two rotary statements)
    assert text.count(f"if {SCRIPTING_TEST}:") == 10
    assert SCRIPTING_TEST not in python_view(text)
    again = scan_source(text, "zoo.py", all_rules())
    assert not [m for m in again if m.status != "refused"]  # the kept statements are not matched again


# Where fx records the user's computation and the eager kernel computes it fused, the two agree
# within rounding only: the fused rotary rounds its two products differently from the written
# expression; a frozen model's eager BatchNorm fold (fx records the Conv/Linear and the BatchNorm);
# the written-out attention as SDPA (fx records the source's matmul-softmax-matmul; in training the
# dropout it draws sends the kernel to those very ops).
FX_WITHIN_ROUNDING = {("LlamaBlock", "eval"), ("LlamaBlock", "train"), ("BertLayer", "eval")}
_BATCH_NORMS = (torch.nn.modules.batchnorm._BatchNorm,)


@pytest.mark.parametrize("mode", ["eval", "eval-frozen", "train"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fx_traced_rewrite_agrees_with_eager(zoo, name, mode):
    training, frozen = mode == "train", mode == "eval-frozen"
    original, rewritten = _pair(zoo, name, training, frozen)
    x = MODELS[name]()
    traced = torch.fx.symbolic_trace(rewritten)
    # the pairs a kernel folds are recorded as the user's modules, not as the fold's ops
    targets = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    bns = {n for n, m in rewritten.named_modules() if isinstance(m, _BATCH_NORMS)}
    assert bns <= targets, (bns, targets)
    assert "fold_batch_norm" not in traced.code
    with count_kernel_calls() as calls:
        eager = _run(rewritten, x)
    folded = any(c.fused and c.kernel in ("conv_bn", "linear_bn") for c in calls.calls)
    if frozen and bns:
        assert folded, calls.calls  # the eager frozen model runs the fold the graph does not record
    if folded or (name, "eval" if mode == "eval-frozen" else mode) in FX_WITHIN_ROUNDING:
        torch.testing.assert_close(_run(traced, x), eager, rtol=1e-4, atol=1e-5)
    else:
        assert torch.equal(_run(traced, x), eager)
    torch.testing.assert_close(_run(traced, x), _run(original, x), rtol=1e-4, atol=1e-5)
    # and the traced graph scripts (timm's test_model_forward_fx_torchscript): plain torch ops
    assert torch.equal(_run(torch.jit.script(traced), x), _run(traced, x))
    if not training:
        # traced in eval, switched to training: the graph follows as the original does (batch
        # statistics, running statistics updated alike)
        unfreeze(rewritten)
        traced.train(), original.train()
        torch.testing.assert_close(_run(traced, x), _run(original, x), rtol=1e-4, atol=1e-5)
        for key, want in original.state_dict().items():
            torch.testing.assert_close(traced.state_dict()[key], want, msg=key)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_scripted_rewrite_computes_the_users_model(zoo, name, training):
    original, rewritten = _pair(zoo, name, training)
    x = MODELS[name]()
    scripted = torch.jit.script(rewritten)
    want = _run(torch.jit.script(original), x)
    assert torch.equal(_run(scripted, x), want)
    assert torch.equal(_run(original, x), want)
    torch.testing.assert_close(_run(rewritten, x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("frozen", [False, True], ids=["eval", "eval-frozen"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_dynamo_and_export_run_the_rewrite(zoo, name, frozen):
    torch._dynamo.reset()
    _, rewritten = _pair(zoo, name, training=False, frozen=frozen)
    x = MODELS[name]()
    want = _run(rewritten, x)
    # (a kernel may take another implementation under the compiler: close, not bit for bit)
    torch.testing.assert_close(_run(torch.compile(rewritten, backend="eager", fullgraph=True), x), want)
    exported = torch.export.export(rewritten, (x,))
    torch.testing.assert_close(_run(exported.module(), x), want)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_every_method_of_a_class_runs_the_same_rewrite(zoo, training):
    original, rewritten = _pair(zoo, "ConvNet", training)
    x = MODELS["ConvNet"]()
    features = _run(rewritten.forward_features, x)
    final, intermediates = _run(rewritten.forward_intermediates, x)
    assert torch.equal(final, features) and torch.equal(intermediates[-1], features)
    torch.testing.assert_close(features, _run(original.forward_features, x), rtol=1e-4, atol=1e-5)
    scripted = torch.jit.script(rewritten)
    s_final, s_intermediates = _run(scripted.forward_intermediates, x)
    assert torch.equal(s_final, _run(scripted.forward_features, x))


def test_guarded_sequential_prints_and_scripts_as_the_users_sequential(zoo):
    original, rewritten = _pair(zoo, "ConvNet", training=False)
    assert repr(rewritten) == repr(original)
    assert isinstance(rewritten.stem, torch.nn.Sequential)
    assert type(rewritten.stem) is not torch.nn.Sequential  # the one thing that tells them apart
    scripted = torch.jit.script(rewritten.stem)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(_run(scripted, x), _run(original.stem, x))


@pytest.mark.slow
def test_optimize_rewrites_every_method_that_runs_a_confirmed_pair(monkeypatch):
    # The trace runs forward only; forward_intermediates runs the pair forward_features runs and
    # is confirmed through it, so the optimized class answers one way from both methods.
    monkeypatch.syspath_prepend(str(ZOO.parent))
    import zoo as zoo_module

    from adopter import optimize

    optimized = optimize(zoo_module.ConvNet, example_inputs=(MODELS["ConvNet"](),))
    report = str(optimized.adopter_report)
    assert "(ConvNet.forward_intermediates)" in report.split("\nnot applied (")[0], report
    torch.manual_seed(0)
    model = optimized().eval()
    x = MODELS["ConvNet"]()
    assert torch.equal(_run(model.forward_features, x), _run(model.forward_intermediates, x)[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_onnx_export_of_the_rewrite_computes_the_eager_result(zoo, name, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    _, rewritten = _pair(zoo, name, training=False)
    x = MODELS[name]()
    program = torch.onnx.export(rewritten, (x,), dynamo=True, verbose=False)
    program.save(str(tmp_path / "model.onnx"))
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), _run(rewritten, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("frozen", [False, True], ids=["eval", "eval-frozen"])
def test_a_traced_fold_scripts_with_optional_parameters(frozen):
    # TorchScript types a conv's bias and a BatchNorm's statistics Optional[Tensor] (timm's
    # test_model_forward_fx_torchscript on inception_next / swiftformer): the graph records the
    # modules, which script; a frozen model's eager fold agrees within rounding
    from adopter.kernels import conv_bn

    class Stem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))

        def forward(self, x):
            return conv_bn(self.stem[0], self.stem[1], x)

    model = Stem().eval()
    model.stem[1].running_mean.uniform_(-1, 1)
    model.stem[1].running_var.uniform_(0.5, 2.0)
    if frozen:
        freeze(model)
    traced = torch.fx.symbolic_trace(model)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["stem.0", "stem.1"]
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(_run(torch.jit.script(traced), x), _run(traced, x))
    with count_kernel_calls() as calls:
        eager = _run(model, x)
    assert [c.fused for c in calls.calls] == [frozen]  # (unfrozen at this size: the layers)
    if frozen:
        torch.testing.assert_close(_run(traced, x), eager, rtol=1e-4, atol=1e-5)
    else:
        assert torch.equal(_run(traced, x), eager)
