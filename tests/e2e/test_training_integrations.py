"""Works where users train: an optimized (rewritten) transformers model under DistributedDataParallel,
activation checkpointing, torch.compile and strict state-dict loading, on CPU.

Every test compares the optimized class (``adopter.optimize(BertModel, config=...)``) with the
original ``BertModel`` built from the same weights: losses and *all* parameter gradients within fp32
tolerance, and checks with :mod:`adopter.kernels.telemetry` that the fused path (not the guard's
fallback to the original computation) actually ran.

Also FSDP2 (``fully_shard``, 2 gloo processes), the Hugging Face ``Trainer`` and PEFT LoRA (the
Trainer and LoRA tests also on the shipped llama-tiny and tiny-bert configs; accelerate/peft
skipped when not installed); where wrapping sends a site to its fallback (a LoRA ``Linear``),
:func:`adopter.kernels.telemetry.fallback_summary` must say so.
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
def test_ddp_gloo_two_processes_spawned_each_optimizes(tmp_path, monkeypatch):
    # (spawned workers see no test fixture: no calibration, so the fused paths run at this size)
    monkeypatch.setenv("ADOPTER_CALIBRATION", "none")
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


# ------------------------------------------------------------------------------------------ fallback summary


def test_fallback_summary_groups_calls_per_site():
    from adopter.kernels.telemetry import KernelCall, fallback_summary

    calls = [
        KernelCall("linear_gelu", "torch", "", "/m/modeling_x.py", "XMLP.forward", 3),
        KernelCall("linear_gelu", "original", "Linear is not a Linear", "/m/modeling_x.py", "XMLP.forward", 2),
        KernelCall("linear_gelu", "original", "Linear has hooks", "/m/modeling_x.py", "XMLP.forward", 1),
        KernelCall("dropout_add_layer_norm", "torch", "", "/m/modeling_x.py", "XOut.forward", 4),
    ]
    summary = fallback_summary(calls)
    assert [(s.function, s.kernel, s.fused, s.original) for s in summary] == [
        ("XMLP.forward", "linear_gelu", 3, 3), ("XOut.forward", "dropout_add_layer_norm", 4, 0),
    ]  # fmt: skip
    assert summary[0].reasons == {"Linear is not a Linear": 2, "Linear has hooks": 1}
    assert str(summary[0]) == (
        "XMLP.forward (modeling_x.py) linear_gelu: 3 fused, 3 original (Linear is not a Linear: 2; Linear has hooks: 1)"
    )
    assert str(summary[1]) == "XOut.forward (modeling_x.py) dropout_add_layer_norm: 4 fused, 0 original"
    assert summary[1].to_json() == {
        "kernel": "dropout_add_layer_norm", "file": "/m/modeling_x.py", "function": "XOut.forward", "fused": 4,
        "original": 0, "backends": {"torch": 4}, "reasons": {},
    }  # fmt: skip
    assert fallback_summary([]) == []


def _sites(calls) -> dict:
    """(function, kernel) -> SiteSummary of ``calls``."""
    from adopter.kernels.telemetry import fallback_summary

    return {(s.function, s.kernel): s for s in fallback_summary(calls)}


# ------------------------------------------------------------------------------------------ FSDP2


def _fully_shard(model, granularity: str) -> None:
    """FSDP2 as users apply it: every BertLayer, then the root; ``"leaves"`` also shards each Linear
    and LayerNorm first (their FSDP hooks must send the guarded kernels to the original path: the
    fused path reading the sharded weights without the all-gather would be wrong)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    if granularity == "leaves":
        for module in list(model.modules()):
            if type(module) in (nn.Linear, nn.LayerNorm):
                fully_shard(module)
    for layer in model.encoder.layer:
        fully_shard(layer)
    fully_shard(model)


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str, optimized_cls, steps: int, granularity: str) -> None:
    """One FSDP2 rank: trains the original and the optimized model (same initial weights), both
    sharded with ``fully_shard``, on this rank's shard of :func:`make_batch`; saves losses, the
    full (unsharded) gradients and parameters, and the telemetry summary to ``out_dir``."""
    import torch.distributed as dist
    from adopter.kernels.telemetry import fallback_summary

    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
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
            model_type = f"{type(model).__module__}.{type(model).__qualname__}"
            _fully_shard(model, granularity)
            with count_kernel_calls() as calls:
                losses, grads = train(model, batch, steps=steps)
            # DTensor -> full tensor is a collective: every rank runs these in the same order
            results[name] = {
                "losses": losses,
                "grads": [{n: None if g is None else g.full_tensor() for n, g in step.items()} for step in grads],
                "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
                "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
                "summary": [s.to_json() for s in fallback_summary(calls.calls)],
                "type": model_type,
                "fsdp_type": type(model).__name__,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ranks(worker, args: tuple, tmp_path, timeout: float, world: int = 2, start_method: str = "fork"):
    """``worker(rank, world, port, str(tmp_path), *args)`` in ``world`` processes; their rank files."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        worker, args=(world, _free_port(), str(tmp_path), *args), nprocs=world, join=False, start_method=start_method
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} workers did not finish within {timeout:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method (the optimized class is built in memory)")
@pytest.mark.parametrize("granularity", ["layers", pytest.param("leaves", marks=pytest.mark.slow)])
def test_fsdp2_gloo_two_processes_matches_original(Optimized, tmp_path, granularity):  # noqa: N803
    """FSDP2 (``fully_shard``) on 2 gloo ranks: the optimized model's losses, full gradients and
    updated parameters equal the original's under FSDP2 on every rank, and a single process
    training the original on the whole batch. Sharding BertLayers keeps the fused path; sharding
    each Linear/LayerNorm too puts FSDP hooks on them, so their guards take the original path, and
    :func:`fallback_summary` says so per site."""
    steps = 3
    ranks = _run_ranks(_fsdp_worker, (Optimized, steps, granularity), tmp_path, timeout=180)
    assert "__adopter_" in ranks[0]["optimized"]["type"], ranks[0]["optimized"]["type"]
    assert ranks[0]["optimized"]["fsdp_type"] == "FSDPBertModel", ranks[0]["optimized"]["fsdp_type"]
    for r, res in enumerate(ranks):
        orig, opt = res["original"], res["optimized"]
        assert orig["sharded"] and opt["sharded"], f"rank {r}: parameters are not DTensors"
        assert_same_training((orig["losses"], orig["grads"]), (opt["losses"], opt["grads"]), f"FSDP2 rank {r}")
        for name, value in orig["params"].items():
            torch.testing.assert_close(opt["params"][name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        assert not orig["summary"], f"rank {r}: the original model called adopter kernels: {orig['summary']}"
        sites = {(s["function"], s["kernel"]): s for s in opt["summary"]}
        for function, kernel in (("BertIntermediate.forward", "linear_gelu"), ("BertOutput.forward", "dropout_add_layer_norm"),
                                 ("BertSelfOutput.forward", "dropout_add_layer_norm")):  # fmt: skip
            site = sites[(function, kernel)]
            assert site["fused"] + site["original"] == 2 * steps, site  # 2 layers, once per step
            if granularity == "layers":
                assert site["original"] == 0, f"rank {r}: fused path not taken under FSDP2: {site}"
            else:
                assert site["fused"] == 0, f"rank {r}: fused path ran on FSDP-sharded modules: {site}"
                assert all(reason.startswith("FSDP") and reason.endswith("has hooks") for reason in site["reasons"]), site

    # each rank's grads are the all-reduced (reduce-scattered, then gathered) grads of the whole batch:
    # one process training the original on all of it computes the same, step after step
    torch.manual_seed(0)
    reference = BertModel(bert_config(0.0)).train()
    losses, grads = train(reference, make_batch(), steps=steps)
    for r, res in enumerate(ranks):
        for step, (full, sharded) in enumerate(zip(grads, res["optimized"]["grads"])):
            for name, g in full.items():
                torch.testing.assert_close(sharded[name], g, atol=ATOL, rtol=RTOL,
                                           msg=lambda m, n=name, s=step, r=r: f"rank {r} grad {n} step {s} vs 1 process: {m}")  # fmt: skip  # noqa: E501
        for name, p in reference.named_parameters():
            torch.testing.assert_close(res["optimized"]["params"][name], p.detach(), atol=ATOL, rtol=RTOL,
                                       msg=lambda m, n=name, r=r: f"rank {r} param {n} vs 1 process: {m}")  # fmt: skip
    for step, loss in enumerate(losses):  # equal shards, mean losses: the ranks' mean is the whole batch's
        mean = (ranks[0]["optimized"]["losses"][step] + ranks[1]["optimized"]["losses"][step]) / 2
        torch.testing.assert_close(mean, loss, atol=ATOL, rtol=RTOL, msg=lambda m, s=step: f"mean loss step {s}: {m}")


# ------------------------------------------------------------------------------------------ PEFT LoRA


def _lora(model, seed: int, target_modules, **kwargs):
    """``peft.get_peft_model`` with LoRA on ``target_modules``, A and B both random (B is zero by
    default, which would leave A without gradient in the first step) under ``seed``."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False, **kwargs)
    return peft.get_peft_model(model, config)


def _assert_lora_trained(expected, actual, what: str) -> None:
    assert_same_training(expected, actual, what)
    grads = actual[1][0]
    trained = sorted(n for n, g in grads.items() if g is not None)
    assert trained and all("lora_" in n for n in trained), f"{what}: gradients for {trained}"
    assert all(g.abs().sum() > 0 for g in (grads[n] for n in trained)), f"{what}: a LoRA weight got a zero gradient"


def test_peft_lora_matches_original_and_summary_names_the_lora_fallback(Optimized):  # noqa: N803
    """LoRA on query/value/every ``dense`` (lora_dropout and model dropout 0.1, same seeds): losses and
    LoRA gradients equal the LoRA-wrapped original's; the LoRA-wrapped ``intermediate.dense`` sends
    ``linear_gelu`` to the original path (reason: the guard's, naming PEFT's class), while
    ``dropout_add_layer_norm``, which only gets the LoRA layer's output, stays fused; after
    ``merge_and_unload`` the Linear is plain again and ``linear_gelu`` fuses."""
    pytest.importorskip("peft")
    from adopter.kernels.guard_checks import plain_reason as _plain
    from torch import nn

    original, optimized = make_pair(Optimized, dropout=0.1)
    targets = ["query", "value", "dense"]
    lora_original = _lora(original, 5, targets, lora_dropout=0.1)
    lora_optimized = _lora(optimized, 5, targets, lora_dropout=0.1)
    assert list(lora_optimized.state_dict()) == list(lora_original.state_dict())
    for key, value in lora_original.state_dict().items():
        torch.testing.assert_close(lora_optimized.state_dict()[key], value, atol=0, rtol=0, msg=key)
    batch = make_batch()
    steps = 3
    torch.manual_seed(7)
    expected = train(lora_original, batch, steps=steps)
    torch.manual_seed(7)
    with count_kernel_calls() as calls:
        actual = train(lora_optimized, batch, steps=steps)
    _assert_lora_trained(expected, actual, "PEFT LoRA")

    lora_dense = optimized.encoder.layer[0].intermediate.dense
    assert type(lora_dense).__module__.startswith("peft.tuners.lora"), type(lora_dense)
    why = _plain(lora_dense, nn.Linear)
    assert why, "the guard accepts a LoRA Linear as plain nn.Linear"
    sites = _sites(calls.calls)
    gelu = sites[("BertIntermediate.forward", "linear_gelu")]
    assert (gelu.fused, gelu.original, gelu.reasons) == (0, 2 * steps, {why: 2 * steps}), str(gelu)
    assert f"0 fused, {2 * steps} original ({why}: {2 * steps})" in str(gelu)
    for function in ("BertSelfOutput.forward", "BertOutput.forward"):
        site = sites[(function, "dropout_add_layer_norm")]
        assert (site.fused, site.original) == (2 * steps, 0), str(site)

    merged_original, merged_optimized = lora_original.merge_and_unload(), lora_optimized.merge_and_unload()
    assert type(merged_optimized.encoder.layer[0].intermediate.dense) is nn.Linear
    merged_original.eval(), merged_optimized.eval()
    with torch.no_grad(), count_kernel_calls() as calls:
        out = merged_optimized(**model_inputs(batch)).last_hidden_state
    with torch.no_grad():
        torch.testing.assert_close(out, merged_original(**model_inputs(batch)).last_hidden_state, atol=ATOL, rtol=RTOL)
    gelu = _sites(calls.calls)[("BertIntermediate.forward", "linear_gelu")]
    assert (gelu.fused, gelu.original) == (2, 0), str(gelu)


# ------------------------------------------------------------------------------------------ shipped tiny configs

LLAMA_SHRINK = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "vocab_size": 1000}
LLAMA_MUST_FUSE = {"rms_norm", "gated_mlp", "rotary", "linear_cross_entropy"}


def _shipped_config(model_id: str, **overrides):
    """A shipped config (``adopter/configs/``) with ``overrides`` (shrunk for CPU tests)."""
    from adopter.tracing.models import _config_from_dict

    from adopter.configs import load_config_dict

    config = _config_from_dict(load_config_dict(model_id))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def llama_tiny():
    """(LlamaForCausalLM, its optimized class, the shrunk llama-tiny config)."""
    from transformers import LlamaForCausalLM

    config = _shipped_config("llama-tiny", **LLAMA_SHRINK)
    optimized = optimize(LlamaForCausalLM, config=config)
    assert {"RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy"} <= set(
        optimized.adopter_report.applied_rules
    ), optimized.adopter_report.summary()
    return LlamaForCausalLM, optimized, config


@pytest.fixture(scope="module")
def tiny_bert_classifier():
    """(BertForSequenceClassification, its optimized class, the tiny-bert config: dropout 0.1)."""
    from transformers import BertForSequenceClassification

    config = _shipped_config("tiny-bert", vocab_size=1000)
    assert config.hidden_dropout_prob > 0
    return BertForSequenceClassification, optimize(BertForSequenceClassification, config=config), config


def _same_weights(cls, optimized_cls, config):
    torch.manual_seed(0)
    original = cls(config)
    optimized = optimized_cls(config)
    optimized.load_state_dict(original.state_dict(), strict=True)
    return original.train(), optimized.train()


def _lm_batch(n: int = 2, seq: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 1000, (n, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[-1, -3:] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.slow
def test_peft_lora_llama_matches_original(request):
    """LoRA on every Linear but lm_head (``"all-linear"``) of llama-tiny, trained on its own loss: same
    losses and LoRA gradients; the LoRA-wrapped gate/up/down send ``gated_mlp`` to the original
    path (the summary says why), RMSNorm, rotary and the fused linear + cross-entropy stay fused."""
    pytest.importorskip("peft")
    from adopter.kernels.guard_checks import plain_reason as _plain
    from torch import nn

    cls, optimized_cls, config = request.getfixturevalue("llama_tiny")  # after the importorskip
    original, optimized = _same_weights(cls, optimized_cls, config)
    lora_original = _lora(original, 5, "all-linear", task_type="CAUSAL_LM")
    lora_optimized = _lora(optimized, 5, "all-linear", task_type="CAUSAL_LM")
    batch = _lm_batch()
    steps = 3

    losses = {}
    for name, model in (("original", lora_original), ("optimized", lora_optimized)):
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD(named.values(), lr=0.1, momentum=0.9)
        with count_kernel_calls() as calls:
            result = ([], [])
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                value = model(**batch).loss
                value.backward()
                result[0].append(value.detach().clone())
                result[1].append({n: None if p.grad is None else p.grad.detach().clone() for n, p in named.items()})
                opt.step()
        losses[name] = (result, calls.calls)
    _assert_lora_trained(losses["original"][0], losses["optimized"][0], "PEFT LoRA llama-tiny")
    assert not losses["original"][1]
    sites = _sites(losses["optimized"][1])
    gate = optimized.model.layers[0].mlp.gate_proj
    assert type(gate).__module__.startswith("peft.tuners.lora"), type(gate)
    mlp = sites[("LlamaMLP.forward", "gated_mlp")]
    assert (mlp.fused, mlp.reasons) == (0, {_plain(gate, nn.Linear): 2 * steps}), str(mlp)
    fused = {kernel for (_, kernel), s in sites.items() if s.fused and not s.original}
    assert {"rms_norm", "rotary"} <= fused, [str(s) for s in sites.values()]
    # the loss site is in the summary (the test below checks it stays fused)
    loss_site = sites[("LlamaForCausalLM.forward", "linear_cross_entropy")]
    assert loss_site.fused + loss_site.original == steps, str(loss_site)


@pytest.mark.slow
def test_peft_causal_lm_keeps_the_fused_loss(request):
    """Under PEFT's standard causal-LM wrapper (task_type="CAUSAL_LM") the fused LM-head loss still
    runs: PEFT passes ``output_attentions=None``, Llama hands its keywords on to the loss, and the
    guard accepts keywords transformers' loss provably ignores (its bytecode never reads them)."""
    pytest.importorskip("peft")
    cls, optimized_cls, config = request.getfixturevalue("llama_tiny")  # after the importorskip
    _, optimized = _same_weights(cls, optimized_cls, config)
    lora = _lora(optimized, 5, ["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with count_kernel_calls() as calls:
        lora(**_lm_batch()).loss.backward()
    loss_site = _sites(calls.calls)[("LlamaForCausalLM.forward", "linear_cross_entropy")]
    assert (loss_site.fused, loss_site.original) == (1, 0), str(loss_site)


# ------------------------------------------------------------------------------------------ HF Trainer


def _trainer_dataset(name: str, n: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 1000, (12,), generator=g)
        if name == "llama-tiny":
            labels = ids.clone()
            labels[-(i % 4) - 1:] = -100  # a different number of label tokens per row: num_items_in_batch matters
        else:
            labels = torch.tensor(i % 2)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _train_with_trainer(model, name: str, out_dir, grad_accum: int):
    """3 optimizer steps of ``transformers.Trainer`` (CPU, seed 0, loss logged every step); the
    logged losses and grad norms, the gradients before each optimizer step, the final parameters
    and the kernel calls."""
    import transformers

    grads = []

    class RecordGrads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})

    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
        report_to=[], use_cpu=True, seed=0, logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_trainer_dataset(name), callbacks=[RecordGrads()]
    )
    with count_kernel_calls() as calls:
        trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "losses": [torch.tensor(h["loss"]) for h in logged],
        "grad_norms": [torch.tensor(h["grad_norm"]) for h in logged],
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "calls": calls.calls,
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-bert", "llama-tiny"])
def test_hf_trainer_matches_original(request, name, tmp_path):
    """``transformers.Trainer`` (with accelerate) on the shipped tiny configs: the optimized model
    logs the same losses and grad norms, has the same gradients before every optimizer step and
    the same parameters after 3 steps as the original. tiny-bert (sequence classification) trains
    with dropout 0.1 (Trainer seeds both runs alike); llama-tiny accumulates 2 micro-batches with
    different label counts (the Trainer passes ``num_items_in_batch`` to the model's loss)."""
    pytest.importorskip("accelerate")
    fixture = "tiny_bert_classifier" if name == "tiny-bert" else "llama_tiny"
    cls, optimized_cls, config = request.getfixturevalue(fixture)
    grad_accum = 1 if name == "tiny-bert" else 2
    must_fuse = MUST_FUSE if name == "tiny-bert" else LLAMA_MUST_FUSE
    original, optimized = _same_weights(cls, optimized_cls, config)
    expected = _train_with_trainer(original, name, tmp_path / "original", grad_accum)
    actual = _train_with_trainer(optimized, name, tmp_path / "optimized", grad_accum)

    assert len(expected["losses"]) == len(actual["losses"]) == len(expected["grads"]) == len(actual["grads"]) == 3
    assert_same_training((expected["losses"], expected["grads"]), (actual["losses"], actual["grads"]), f"Trainer {name}")
    torch.testing.assert_close(torch.stack(actual["grad_norms"]), torch.stack(expected["grad_norms"]), atol=ATOL, rtol=RTOL)
    for key, value in expected["params"].items():
        torch.testing.assert_close(actual["params"][key], value, atol=ATOL, rtol=RTOL, msg=lambda m, k=key: f"{k}: {m}")
    assert not expected["calls"], "the original model called adopter kernels"
    sites = _sites(actual["calls"])
    fused = {kernel for (_, kernel), s in sites.items() if s.fused and not s.original}
    assert must_fuse <= fused, [str(s) for s in sites.values()]
