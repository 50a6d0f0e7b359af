"""Works where users train: an optimized (rewritten) transformers model under DistributedDataParallel,
activation checkpointing, torch.compile and strict state-dict loading, on CPU.

Every test compares the optimized class (``adopter.optimize(BertModel, config=...)``) with the
original ``BertModel`` built from the same weights: losses and *all* parameter gradients within fp32
tolerance, and checks with :mod:`adopter.kernels.telemetry` that the fused path (not the guard's
fallback to the original computation) actually ran.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels.telemetry import count_kernel_calls
from transformers import BertConfig, BertModel

from adopter import kernels, optimize

ATOL, RTOL = 1e-5, 1e-4
# kernels a rewritten BertModel calls; the fused path of these must run (telemetry backend != "original")
MUST_FUSE = {"dropout_add_layer_norm", "linear_gelu"}
KERNELS_DIR = Path(kernels.__file__).resolve().parent
HIDDEN = 32


def bert_config(dropout: float = 0.0) -> BertConfig:
    return BertConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def Optimized():  # noqa: N802 - a class
    cls = optimize(BertModel, config=bert_config(0.1))
    applied = set(cls.adopter_report.applied_rules)
    assert {"Dropout_LayerNorm", "biased_GeLU"} <= applied, cls.adopter_report.summary()
    return cls


def make_pair(Optimized, dropout: float = 0.0, seed: int = 0):  # noqa: N803
    """(original, optimized) in training mode, with the same weights (optimized loads the original's
    state dict strictly)."""
    config = bert_config(dropout)
    torch.manual_seed(seed)
    original = BertModel(config)
    optimized = Optimized(config)
    optimized.load_state_dict(original.state_dict(), strict=True)
    return original.train(), optimized.train()


def make_batch(rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    """A fixed batch of 4 sequences (two of them padded) with regression targets."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, 100, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 9:] = 0
    mask[3, 6:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "target": torch.randn(4, 12, HIDDEN, generator=g),
        "pooled_target": torch.randn(4, HIDDEN, generator=g),
    }
    return {k: v[rows] for k, v in batch.items()}


def model_inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def loss_of(outputs, batch) -> torch.Tensor:
    last, pooled = outputs[0], outputs[1]
    return F.mse_loss(last, batch["target"]) + F.mse_loss(pooled, batch["pooled_target"])


def default_forward(model, batch):
    out = model(**model_inputs(batch))
    return out.last_hidden_state, out.pooler_output


def train(model, batch, steps: int = 2, forward=default_forward, params=None):
    """``steps`` SGD steps; per step the loss and every parameter's gradient."""
    named = dict((params or model).named_parameters())
    opt = torch.optim.SGD(named.values(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward(model, batch), batch)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in named.items()})
        opt.step()
    return losses, grads


def assert_same_training(expected, actual, what: str) -> None:
    (e_losses, e_grads), (a_losses, a_grads) = expected, actual
    for step, (e, a) in enumerate(zip(e_losses, a_losses)):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, msg=lambda m, s=step: f"{what}: loss at step {s}: {m}")
    for step, (e, a) in enumerate(zip(e_grads, a_grads)):
        assert a.keys() == e.keys(), f"{what}: parameters differ: {sorted(a.keys() ^ e.keys())}"
        missing = sorted(n for n in e if e[n] is not None and a[n] is None)
        assert not missing, f"{what}: step {step}: no gradient for {missing} (the original has one)"
        for name in e:
            if e[name] is None:
                continue
            torch.testing.assert_close(
                a[name], e[name], atol=ATOL, rtol=RTOL, msg=lambda m, n=name, s=step: f"{what}: grad {n} step {s}: {m}"
            )


def fused_kernels(calls) -> set[str]:
    return {c.kernel for c in calls if c.fused}


def assert_fused_ran(calls, what: str) -> None:
    missing = MUST_FUSE - fused_kernels(calls)
    assert not missing, f"{what}: fused path never ran for {sorted(missing)}; calls: {[c.to_json() for c in calls]}"


# ------------------------------------------------------------------------------------------ state dict


def test_state_dict_keys_equal_and_strict_loading_both_ways(Optimized):  # noqa: N803
    original, optimized = make_pair(Optimized)
    assert list(optimized.state_dict()) == list(original.state_dict())
    assert [n for n, _ in optimized.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert [n for n, _ in optimized.named_buffers()] == [n for n, _ in original.named_buffers()]

    # original -> optimized (fresh, differently initialised instance)
    torch.manual_seed(1)
    fresh_optimized = Optimized(bert_config())
    result = fresh_optimized.load_state_dict(original.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    # optimized -> original: perturb the optimized weights first so the direction matters
    with torch.no_grad():
        for p in fresh_optimized.parameters():
            p.add_(0.01)
    torch.manual_seed(2)
    fresh_original = BertModel(bert_config())
    result = fresh_original.load_state_dict(fresh_optimized.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in fresh_optimized.state_dict().items():
        torch.testing.assert_close(fresh_original.state_dict()[key], value, atol=0, rtol=0)

    batch = make_batch()
    fresh_original.eval(), fresh_optimized.eval()
    with torch.no_grad():
        expected = fresh_original(**model_inputs(batch)).last_hidden_state
        actual = fresh_optimized(**model_inputs(batch)).last_hidden_state
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------ DDP


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, optimized_cls, steps: int) -> None:
    """One DDP rank: trains the original and the optimized model (same initial weights) on this
    rank's shard of :func:`make_batch`, saves losses/gradients/telemetry to ``out_dir``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # 2 ranks on a small machine; also keeps OpenMP out of a forked child
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if optimized_cls is None:  # spawned: every process optimizes for itself, as under torchrun
        optimized_cls = optimize(BertModel, config=bert_config(0.1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        per_rank = 4 // world
        batch = make_batch(slice(rank * per_rank, (rank + 1) * per_rank))
        config = bert_config(0.0)
        torch.manual_seed(0)
        original = BertModel(config)
        weights = {k: v.clone() for k, v in original.state_dict().items()}
        results = {}
        for name, cls in (("original", BertModel), ("optimized", optimized_cls)):
            model = original if cls is BertModel else cls(config)
            model.load_state_dict(weights, strict=True)
            model.train()
            ddp = DDP(model)  # find_unused_parameters=False: every parameter must get a gradient
            with count_kernel_calls() as calls:
                losses, grads = train(ddp, batch, steps=steps, params=model)
            results[name] = {
                "losses": losses,
                "grads": grads,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "calls": [c.to_json() for c in calls.calls],
                "type": f"{type(model).__module__}.{type(model).__qualname__}",
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ddp(tmp_path, optimized_cls, start_method: str, timeout: float, steps: int = 3):
    import torch.multiprocessing as mp

    world = 2
    ctx = mp.start_processes(
        _ddp_worker, args=(world, _free_port(), str(tmp_path), optimized_cls, steps), nprocs=world,
        join=False, start_method=start_method,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"DDP workers did not finish within {timeout:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_ddp_results(ranks, steps: int = 3) -> None:
    rank0 = ranks[0]
    assert "__adopter_" in rank0["optimized"]["type"], rank0["optimized"]["type"]
    for r, res in enumerate(ranks):
        orig, opt = res["original"], res["optimized"]
        assert len(opt["losses"]) == steps
        for s, grads in enumerate(opt["grads"]):
            missing = sorted(n for n, g in grads.items() if g is None)
            assert not missing, f"rank {r} step {s}: parameters without gradient (DDP would need find_unused_parameters): {missing}"  # noqa: E501
        assert_same_training((orig["losses"], orig["grads"]), (opt["losses"], opt["grads"]), f"DDP rank {r}")
        for name, value in orig["params"].items():
            torch.testing.assert_close(opt["params"][name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        calls = [c for c in opt["calls"] if c["fused"]]
        fused = {c["kernel"] for c in calls if c["count"] > 0}
        assert MUST_FUSE <= fused, f"rank {r}: fused path never ran for {sorted(MUST_FUSE - fused)}: {opt['calls']}"
        assert not [c for c in orig["calls"]], f"rank {r}: the original model called adopter kernels: {orig['calls']}"
    # the shards differ, so the local losses differ, but the all-reduced gradients are the same on every rank
    assert not torch.equal(ranks[0]["optimized"]["losses"][0], ranks[1]["optimized"]["losses"][0])
    for name, g0 in ranks[0]["optimized"]["grads"][0].items():
        torch.testing.assert_close(ranks[1]["optimized"]["grads"][0][name], g0, atol=ATOL, rtol=RTOL)

    # and they are the gradients of the whole batch in one process (the all-reduce averaged the shards)
    torch.manual_seed(0)
    reference = BertModel(bert_config(0.0)).train()
    _, grads = train(reference, make_batch(), steps=1)
    for name, g in grads[0].items():
        torch.testing.assert_close(rank0["optimized"]["grads"][0][name], g, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, n=name: f"all-reduced grad {n} vs full batch: {m}")  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method (the optimized class is built in memory)")
def test_ddp_gloo_two_processes_forked(Optimized, tmp_path):  # noqa: N803
    """2 gloo ranks forked from this process (they inherit the in-memory optimized class)."""
    _check_ddp_results(_run_ddp(tmp_path, Optimized, "fork", timeout=180))


@pytest.mark.slow
def test_ddp_gloo_two_processes_spawned_each_optimizes(tmp_path):
    """As under torchrun: fresh processes, each calls optimize() itself (the class cannot be pickled)."""
    _check_ddp_results(_run_ddp(tmp_path, None, "spawn", timeout=540))


# ------------------------------------------------------------------------------------------ checkpointing


def _checkpointed_whole_forward(use_reentrant: bool):
    """The whole model under one checkpoint; embeddings looked up outside so that the checkpoint
    has an input requiring grad (the reentrant variant needs one)."""
    from torch.utils.checkpoint import checkpoint

    def forward(model, batch):
        embeds = model.get_input_embeddings()(batch["input_ids"])

        def run(embeds, mask):
            out = model(inputs_embeds=embeds, attention_mask=mask)
            return out.last_hidden_state, out.pooler_output

        return checkpoint(run, embeds, batch["attention_mask"], use_reentrant=use_reentrant)

    return forward


def _plain_forward_embeds(model, batch):
    embeds = model.get_input_embeddings()(batch["input_ids"])
    out = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
    return out.last_hidden_state, out.pooler_output


def _setup_checkpointing(model, how: str, use_reentrant: bool):
    """-> (forward with checkpointing, the same forward without)."""
    if how == "layers":  # what Trainer(gradient_checkpointing=True) does: every BertLayer checkpointed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        assert all(layer.gradient_checkpointing for layer in model.encoder.layer)
        return default_forward, default_forward
    return _checkpointed_whole_forward(use_reentrant), _plain_forward_embeds


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("how", ["layers", "whole_forward"])
def test_activation_checkpointing_matches_original(Optimized, how, use_reentrant):  # noqa: N803
    """Dropout 0: the optimized model trained with checkpointing equals the original without."""
    original, optimized = make_pair(Optimized, dropout=0.0)
    batch = make_batch()
    forward_ckpt, forward_plain = _setup_checkpointing(optimized, how, use_reentrant)
    expected = train(original, batch, forward=forward_plain)
    with count_kernel_calls() as calls:
        actual = train(optimized, batch, forward=forward_ckpt)
    assert_same_training(expected, actual, f"checkpointed ({how}, use_reentrant={use_reentrant})")
    assert_fused_ran(calls.calls, f"checkpointed ({how}, use_reentrant={use_reentrant})")
    # the backward recomputed the layers, kernels included: more calls than one per site and step
    # (non-reentrant recomputation may stop early, once every tensor the backward needs is back)
    n_sites = {"dropout_add_layer_norm": 4, "linear_gelu": 2}  # per forward of a 2-layer BertModel
    for kernel, per_forward in n_sites.items():
        n = sum(c.count for c in calls.calls if c.kernel == kernel and c.fused)
        assert n > 2 * per_forward, f"{kernel}: {n} fused calls in 2 checkpointed steps: nothing recomputed"


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("how", ["layers", "whole_forward"])
def test_activation_checkpointing_reproduces_dropout(Optimized, how, use_reentrant):  # noqa: N803
    """Dropout 0.1 under the same seed: the recomputation draws the same masks, so the rewritten model
    with checkpointing equals the rewritten model without it."""
    _, plain = make_pair(Optimized, dropout=0.1)
    _, ckpt = make_pair(Optimized, dropout=0.1)
    batch = make_batch()
    forward_ckpt, forward_plain = _setup_checkpointing(ckpt, how, use_reentrant)
    torch.manual_seed(7)
    expected = train(plain, batch, forward=forward_plain)
    torch.manual_seed(7)
    with count_kernel_calls() as calls:
        actual = train(ckpt, batch, forward=forward_ckpt)
    assert_same_training(expected, actual, f"checkpointed with dropout ({how}, use_reentrant={use_reentrant})")
    assert_fused_ran(calls.calls, "checkpointed with dropout")
    # dropout was active: another seed gives another loss
    torch.manual_seed(8)
    _, other = make_pair(Optimized, dropout=0.1)
    other_loss = loss_of(forward_plain(other, batch), batch)
    assert not torch.allclose(other_loss, expected[0][0], atol=ATOL, rtol=RTOL), "dropout had no effect"


# ------------------------------------------------------------------------------------------ torch.compile


def _compiled(model, backend: str):
    torch._dynamo.reset()
    return torch.compile(model, backend=backend)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_matches_eager(Optimized, backend):  # noqa: N803
    original, optimized = make_pair(Optimized, dropout=0.0)
    _, eager_optimized = make_pair(Optimized, dropout=0.0)
    batch = make_batch()
    compiled = _compiled(optimized, backend)
    try:
        expected = train(original, batch)
        with count_kernel_calls() as calls:
            eager = train(eager_optimized, batch)
        actual = train(compiled, batch, params=optimized)
    finally:
        torch._dynamo.reset()
    assert_fused_ran(calls.calls, "eager optimized")
    assert_same_training(expected, eager, "eager optimized vs original")
    assert_same_training(eager, actual, f"torch.compile(backend={backend!r}) vs eager")


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager(Optimized):  # noqa: N803
    original, optimized = make_pair(Optimized, dropout=0.0)
    batch = make_batch()
    compiled = _compiled(optimized, "inductor")
    try:
        expected = train(original, batch)
        actual = train(compiled, batch, params=optimized)
    except Exception as exc:  # noqa: BLE001
        if "compiler" in str(exc).lower() and "not found" in str(exc).lower():  # no C++ toolchain here
            pytest.skip(f"inductor cannot compile here: {exc}")
        raise
    finally:
        torch._dynamo.reset()
    # inductor reorders float math: a looser tolerance than the eager backends
    for e, a in zip(expected[0], actual[0]):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-3)
    for e, a in zip(expected[1], actual[1]):
        for name in e:
            torch.testing.assert_close(a[name], e[name], atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def _in_kernels(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(KERNELS_DIR)
    except (OSError, ValueError):
        return False


def _kernel_breaks(explanation) -> list[str]:
    """Graph breaks whose user stack passes through the adopter.kernels package (or whose reason names it)."""
    found = []
    for br in explanation.break_reasons:
        frames = [f for f in br.user_stack if _in_kernels(f.filename)]
        if frames or str(KERNELS_DIR) in br.reason or "adopter.kernels" in br.reason:
            where = "; ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in frames)
            found.append(f"{br.reason.strip()} [at {where}]")
    return found


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torch_compile_no_graph_break_in_kernels(Optimized, mode):  # noqa: N803
    """``torch._dynamo.explain`` of the optimized model: graph breaks inside transformers are not ours,
    but none may come from adopter.kernels (the guarded kernels' run-time checks, telemetry, backend
    selection: e.g. os.environ or threading.local reads dynamo cannot trace). A failure lists each
    break's reason and the kernels frames it passed through."""
    original, optimized = make_pair(Optimized, dropout=0.1)
    batch = make_batch()
    explained = {}
    try:
        for name, model in (("original", original), ("optimized", optimized)):
            getattr(model, mode)()
            torch._dynamo.reset()
            explained[name] = torch._dynamo.explain(model)(**model_inputs(batch))
    finally:
        torch._dynamo.reset()
    explanation = explained["optimized"]
    breaks = _kernel_breaks(explanation)
    assert not breaks, (
        f"{len(breaks)} graph break(s) inside adopter.kernels (of {explanation.graph_break_count} in all, "
        f"{explanation.graph_count} graphs) in {mode} mode:\n  " + "\n  ".join(breaks)
    )
    # nor around them (e.g. a kernel call dynamo skips): no more breaks than the original model has
    assert explanation.graph_break_count <= explained["original"].graph_break_count, (
        f"optimized model: {explanation.graph_break_count} graph breaks, original: "
        f"{explained['original'].graph_break_count}:\n" + str(explanation)
    )
