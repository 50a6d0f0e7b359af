"""Source rewriting (issue 3): per-rule edit synthesis on bowler/fissix, our own file I/O.

    rewrite_source(text, matches, *, filename, rules=()) -> RewriteResult
    rewrite_file(path, rules=None, write=False) -> FileRewrite
    load_rewritten_module(original_module, new_text) -> module   (adopter.rewrite.loader)
"""

from adopter.rewrite import fissix_cache  # noqa: F401  (before fissix loads its grammar)
from adopter.rewrite.engine import (
    FileRewrite,
    MatchOutcome,
    RewriteResult,
    codemod_for,
    rewrite_file,
    rewrite_source,
)

__all__ = ["FileRewrite", "MatchOutcome", "RewriteResult", "codemod_for", "rewrite_file", "rewrite_source"]
