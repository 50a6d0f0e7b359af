"""linear_cross_entropy analyses each site once: the precondition's analysis is kept per file across
the paths through a site, and the site it finds travels on the match (``Match.site``) to the
codemod, which does not analyse it again. The site holds positions and names only, so the codemod
reads it off its own parse of the text and a match pickles (scan workers send matches back)."""
from __future__ import annotations

import pickle
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from adopter.rewrite import rewrite_source

import adopter.core.rules.linear_cross_entropy.analysis as analysis
import adopter.core.rules.linear_cross_entropy.codemod as codemod
from adopter.core.extract import extract_source
from adopter.core.rules.linear_cross_entropy import RULE, CrossEntropySite, LossFunctionSite
from adopter.core.scan import scan_source

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rules" / "linear_cross_entropy"

# the head's forward has several paths (the aux loss's ``if`` and the helper's, inlined): the
# precondition is asked on each
MANY_PATHS = textwrap.dedent("""\
    import torch
    from torch import nn


    def aux_loss_of(router_logits, k):
        if k > 1:
            return router_logits.sum() / k
        return router_logits.mean()


    class ForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.vocab_size = config.vocab_size

        def forward(self, hidden_states, router_logits, labels=None, output_router_logits=False, **kwargs):
            logits = self.lm_head(hidden_states)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
            aux_loss = None
            if output_router_logits:
                aux_loss = aux_loss_of(router_logits, 2)
            return logits, loss, aux_loss
""")


@pytest.fixture
def analyses(monkeypatch) -> Counter:
    """How often each head position is analysed (the precondition's and the codemod's calls)."""
    calls: Counter = Counter()
    real = analysis.analyse

    def counted(source, span, class_name):
        calls[(span.line, span.col)] += 1
        return real(source, span, class_name)

    monkeypatch.setattr(analysis, "analyse", counted)
    monkeypatch.setattr(codemod, "analyse", counted)
    return calls


@pytest.mark.parametrize("name", ["positive.py", "written_out.py", "written_out_chunked.py", "many_paths"])
def test_each_site_is_analysed_once_from_scan_to_rewrite(name, analyses):
    text = MANY_PATHS if name == "many_paths" else (FIXTURES / name).read_text()
    if name == "many_paths":
        forward = next(f for f in extract_source(text, "m.py").functions if f.function == "forward")
        assert len(forward.paths) > 1
    matches = scan_source(text, name, [RULE])
    assert matches and all(isinstance(m.site, (LossFunctionSite, CrossEntropySite)) for m in matches)
    assert set(analyses.values()) == {1}
    scanned = Counter(analyses)
    # as a scan worker sends them back
    result = rewrite_source(text, pickle.loads(pickle.dumps(matches)), filename=name, rules=[RULE])
    assert result.outcomes and all(o.applied for o in result.outcomes)
    assert analyses == scanned  # the codemod analysed nothing


def test_a_match_without_a_site_is_analysed_by_the_codemod(analyses):
    text = (FIXTURES / "written_out.py").read_text()
    matches = scan_source(text, "written_out.py", [RULE])
    carried = rewrite_source(text, matches, filename="written_out.py", rules=[RULE])
    bare = [replace(m, site=None) for m in matches]
    analysed = rewrite_source(text, bare, filename="written_out.py", rules=[RULE])
    assert analysed.new_text == carried.new_text != text
    assert sum(analyses.values()) == len(analyses) + len(matches)  # once more per match, by the codemod


def test_a_file_naming_no_cross_entropy_is_not_read_for_the_written_out_form():
    from adopter.core.rules.linear_cross_entropy.file_facts import might_be_cross_entropy

    assert not might_be_cross_entropy("def helper(x):\n    return x\n")
    assert might_be_cross_entropy("loss = F.cross_entropy(logits, y)\n")
    assert might_be_cross_entropy("loss_fct = CrossEntropyLoss()\n")
    # identifiers are NFKC-normalised: a fullwidth spelling is still torch's cross_entropy
    assert might_be_cross_entropy("loss = F.\uff43ross_entropy(logits, y)\n")
