"""Issue 35 (item 8): the TorchScript guard keeps every comment where it was. A rewrite that deletes
a region's first statements (an inline rotation's halves) leaves the rewritten line's own comment
right below the other one: it belongs in the rewritten copy, not above the ``if`` and not dropped
from that copy; a comment above the whole region stays above the guard."""
from adopter.rewrite.scripting import keep_original_for_torchscript

ORIGINAL = '''\
import torch


def forward(q, cos, sin):
    if q.dim() == 4:
        # split the query into halves
        half = q.shape[-1] // 2
        q1, q2 = q[..., :half], q[..., half:]
        # rotate the queries
        q = q * cos + torch.cat((-q2, q1), dim=-1) * sin
    return q
'''

REWRITTEN = '''\
import torch
from adopter.kernels import rotary


def forward(q, cos, sin):
    if q.dim() == 4:
        # split the query into halves
        # rotate the queries
        q = rotary(q, cos, sin)
    return q
'''

GUARDED = '''\
import torch
from adopter.kernels import rotary


def forward(q, cos, sin):
    if q.dim() == 4:
        # split the query into halves
        if torch.jit.is_scripting():
            half = q.shape[-1] // 2
            q1, q2 = q[..., :half], q[..., half:]
            # rotate the queries
            q = q * cos + torch.cat((-q2, q1), dim=-1) * sin
        else:
            # rotate the queries
            q = rotary(q, cos, sin)
    return q
'''


def test_a_rewritten_lines_comment_goes_with_it_into_the_guard():
    assert keep_original_for_torchscript(ORIGINAL, REWRITTEN) == GUARDED


def test_a_comment_above_the_whole_region_stays_above_the_guard():
    original = ORIGINAL.replace("        # split the query into halves\n", "").replace(
        "        half = q.shape[-1] // 2\n        q1, q2 = q[..., :half], q[..., half:]\n", "")
    original = original.replace("torch.cat((-q2, q1), dim=-1)", "q.flip(-1)")
    rewritten = REWRITTEN.replace("        # split the query into halves\n", "")
    guarded = keep_original_for_torchscript(original, rewritten)
    assert guarded.count("# rotate the queries") == 1
    assert guarded.index("# rotate the queries") < guarded.index("if torch.jit.is_scripting():")
