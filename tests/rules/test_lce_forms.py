"""linear_cross_entropy forms of issue 24 (``written_out_forms.py``): the loss kept on the module
(llama2.c's ``self.last_loss`` with the logits returned alone) is matched and rewritten, the
rewritten model trains like the original (same loss and gradients, logits None while training,
the logits again in eval); a classifier over a pooled vector is no LM head (not listed); a
same-file chunked cross-entropy helper is followed when its branch is settled."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from adopter.kernels import count_kernel_calls
from adopter.rewrite import rewrite_source
from adopter.rewrite.scripting import python_view

from adopter.core.rules.linear_cross_entropy import RULE
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "linear_cross_entropy"
FORMS = FIXTURES / "written_out_forms.py"


def _rewritten(path: Path) -> tuple[dict, dict, str, list]:
    text = path.read_text()
    matches = scan_source(text, path.name, [RULE])
    result = rewrite_source(text, matches, filename=path.name, rules=[RULE])
    assert result.error == ""
    original, rewritten = {}, {}
    exec(compile(text, str(path), "exec"), original)
    exec(compile(result.new_text, f"<rewritten {path.name}>", "exec"), rewritten)
    return original, rewritten, python_view(result.new_text), matches


@pytest.fixture(scope="module")
def forms():
    return _rewritten(FORMS)


def test_pooled_classifiers_are_not_listed(forms):
    _, _, _, matches = forms
    listed = {m.class_name for m in matches}
    assert {"FirstTokenClassifier", "MeanPooledClassifier", "LastTokenClassifier"}.isdisjoint(listed)
    assert {"Llama2cLastLoss", "LastLossAfterBranches"} <= listed


def test_loss_on_self_rewrites_to_the_kernel(forms):
    _, _, new, _ = forms
    assert "logits, self.last_loss = lm_head_cross_entropy(" in new
    # the inference branch's head on the last position stays as written
    assert "logits = self.output(h[:, [-1], :])" in new
    # refused and pooled sites are untouched
    assert "loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))" in new
    assert "return logits.argmax(-1)" in new


def _train_step(model, tokens, targets):
    out = model(tokens, targets)
    loss = model.last_loss
    loss.backward()
    return out, loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cls", ["Llama2cLastLoss", "LastLossAfterBranches"])
def test_rewritten_model_trains_like_the_original(forms, cls):
    original, rewritten, _, _ = forms
    torch.manual_seed(0)
    a = original[cls]()
    b = rewritten[cls]()
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    tokens = torch.randint(0, 64, (2, 7))
    targets = torch.randint(0, 64, (2, 7))
    targets[0, :3] = -1 if cls == "Llama2cLastLoss" else -100  # each class's ignore_index
    logits_a, loss_a, grads_a = _train_step(a.train(), tokens, targets)
    with warnings.catch_warnings(), count_kernel_calls() as calls:
        warnings.simplefilter("ignore")
        logits_b, loss_b, grads_b = _train_step(b.train(), tokens, targets)
    assert {c.backend for c in calls.calls if c.kernel == "linear_cross_entropy"} == {"torch"}
    assert logits_a is not None and logits_b is None  # the convention: no logits when training
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(b(tokens, targets), a(tokens, targets))
        torch.testing.assert_close(b.last_loss, a.last_loss)
    if cls == "Llama2cLastLoss":
        with torch.no_grad():
            torch.testing.assert_close(b(tokens), a(tokens))
            assert b.last_loss is None


CHUNKED = FIXTURES / "written_out_chunked.py"


def test_chunked_helper_followed_where_the_call_settles_or_guards_the_branch():
    original, rewritten, new, matches = _rewritten(CHUNKED)
    assert {m.class_name for m in matches} == {"UnchunkedLoss", "UnchunkedPositional", "ChunkSizeFromTheModule",
                                               "ChunkSizeFromTheConfig"}
    assert new.count("lm_head_cross_entropy(") == 4  # the four sites
    # a chunk size read off the module / config is tested at run time, never baked in; the helper's
    # call is kept for any other value
    assert "if self.loss_chunk_size == 0:" in new and "if self.config.loss_chunk_size == 0:" in new
    assert "loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=self.loss_chunk_size)" in new
    assert ("loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], "
            "chunk_size=self.config.loss_chunk_size)") in new
    # the chunked literal and the chunk size a method computes stay as written
    assert "chunk_size=16)" in new and "chunk_size=self.chunk_size())" in new
    # the early return of the logits runs the head on its path
    assert "if targets is None:\n            logits = self.lm_head(x)\n            return logits" in new


@pytest.mark.parametrize("cls, ignore", [("UnchunkedLoss", -100), ("UnchunkedPositional", -1)])
def test_rewritten_chunked_helper_site_trains_like_the_original(cls, ignore):
    original, rewritten, _, _ = _rewritten(CHUNKED)
    torch.manual_seed(0)
    a = original[cls]()
    b = rewritten[cls]()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (2, 9))
    targets = torch.randint(0, 64, (2, 9))
    targets[1, 2:5] = ignore
    logits_a, loss_a = a.train()(idx, targets)
    loss_a.backward()
    with warnings.catch_warnings(), count_kernel_calls() as calls:
        warnings.simplefilter("ignore")
        logits_b, loss_b = b.train()(idx, targets)
    loss_b.backward()
    assert {c.backend for c in calls.calls if c.kernel == "linear_cross_entropy"} == {"torch"}
    assert logits_b is None
    torch.testing.assert_close(loss_b, loss_a)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, msg=name)
    with torch.no_grad():
        for got, want in zip(b.eval()(idx, targets), a.eval()(idx, targets)):
            torch.testing.assert_close(got, want)


def _fused_backends(calls) -> list:
    return [c.backend for c in calls.calls if c.kernel == "linear_cross_entropy"]


@pytest.mark.parametrize("cls", ["ChunkSizeFromTheModule", "ChunkSizeFromTheConfig"])
@pytest.mark.parametrize("chunk", [0, 5])
def test_guarded_chunk_size_runs_the_branch_the_value_picks(cls, chunk):
    """chunk 0: the fused kernel runs (the helper's plain cross entropy); chunk 5: the helper's
    chunked sum runs as written (no kernel call). Same loss and gradients either way, and the same
    outputs in eval, for an all-ignored batch (0 from the chunked sum, nan from the mean) and, for
    the config form, without targets."""
    original, rewritten, _, _ = _rewritten(CHUNKED)
    torch.manual_seed(0)
    a = original[cls](loss_chunk_size=chunk)
    b = rewritten[cls](loss_chunk_size=chunk)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (2, 9))
    targets = torch.randint(0, 64, (2, 9))
    targets[1, 2:5] = -100
    logits_a, loss_a = a.train()(idx, targets)
    loss_a.backward()
    with warnings.catch_warnings(), count_kernel_calls() as calls:
        warnings.simplefilter("ignore")
        logits_b, loss_b = b.train()(idx, targets)
    loss_b.backward()
    if chunk == 0:
        assert _fused_backends(calls) == ["torch"]
        assert logits_b is None
    else:
        assert _fused_backends(calls) == []  # the helper's call, not the kernel
        torch.testing.assert_close(logits_b, logits_a)
    torch.testing.assert_close(loss_b, loss_a)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, msg=name)
    ignored = torch.full_like(targets, -100)
    with torch.no_grad():
        for t in (targets, ignored):
            for got, want in zip(b.eval()(idx, t), a.eval()(idx, t)):
                torch.testing.assert_close(got, want, equal_nan=True)
        if cls == "ChunkSizeFromTheConfig":
            torch.testing.assert_close(b(idx), a(idx))
    # the value is read at each call: the same rewritten model switches path with its config
    if cls == "ChunkSizeFromTheConfig":
        b.config.loss_chunk_size = 5 - chunk
        with warnings.catch_warnings(), count_kernel_calls() as calls:
            warnings.simplefilter("ignore")
            _, loss_b = b.train()(idx, targets)
        assert _fused_backends(calls) == (["torch"] if chunk else [])
        a.config.loss_chunk_size = 5 - chunk
        torch.testing.assert_close(loss_b, a.train()(idx, targets)[1])


def test_all_ignored_batch_in_training_follows_the_branch():
    """The one place the two branches differ: an all-ignored batch, 0 from the chunked sum and nan
    from the mean; the guarded rewrite gives what the original gives for each chunk size."""
    original, rewritten, _, _ = _rewritten(CHUNKED)
    idx = torch.randint(0, 64, (2, 9))
    ignored = torch.full((2, 9), -100)
    for chunk in (0, 5):
        torch.manual_seed(0)
        a = original["ChunkSizeFromTheConfig"](loss_chunk_size=chunk)
        b = rewritten["ChunkSizeFromTheConfig"](loss_chunk_size=chunk)
        b.load_state_dict(a.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_b = b.train()(idx, ignored)[1]
        loss_a = a.train()(idx, ignored)[1]
        assert torch.isnan(loss_a).item() == (chunk == 0)
        torch.testing.assert_close(loss_b, loss_a, equal_nan=True)


VOCAB_OR_LABELS = '''
import torch.nn as nn
import torch.nn.functional as F


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)


class TokenTagger(nn.Module):
    """A token classifier: a head over every token, but over cfg.num_labels tags."""
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(cfg)
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(self, ids, labels=None):
        logits = self.classifier(self.encoder.tok(ids))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return loss, logits


class MaskedLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(cfg)
        n_tokens = cfg.vocab_size
        self.decoder = nn.Linear(cfg.dim, n_tokens)

    def forward(self, ids, labels=None):
        logits = self.decoder(self.encoder.tok(ids))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return loss, logits


class TiedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.n_tokens, cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.n_out, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, ids, targets):
        logits = self.head(self.wte(ids))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''


def test_a_head_over_labels_is_not_a_vocabulary_head():
    # a token classifier computes a linear + cross entropy too, but over a few labels: the fused
    # loss saves nothing there and would drop the logits in training (BertForTokenClassification)
    listed = {m.class_name for m in scan_source(VOCAB_OR_LABELS, "heads.py", [RULE])}
    assert "TokenTagger" not in listed
    assert {"MaskedLM", "TiedHead"} <= listed
