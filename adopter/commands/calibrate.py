"""`adopter calibrate`: measure where each kernel's fused path pays on this machine."""

from __future__ import annotations

import sys

HELP = "measure, on this machine, at which sizes each kernel's fused path is faster (the per-call cost model)"
DESCRIPTION = """\
Times every guarded kernel against its original path (alternating rounds, CPU) over a range of
sizes, in training (forward and backward) and inference, at each thread count asked for, and writes
the calibration the kernels read at every call to decide whether their fused path pays: by default
the user's own ($XDG_CACHE_HOME/adopter/calibration-cpu.json, taking precedence over the shipped
one); ADOPTER_CALIBRATION=FILE makes the kernels read FILE instead."""


def add_arguments(parser):
    parser.add_argument("--threads", metavar="N[,N...]", default=None,
                        help="torch thread counts to calibrate (default: 1 and torch's current count)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per point (default: 9)")
    parser.add_argument("--kernels", metavar="NAME[,NAME...]", default=None, help="only these kernels")
    parser.add_argument("--output", "-o", metavar="FILE", default=None,
                        help="where to write the calibration (default: the user's calibration file)")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only the summary")


def _counts(text: str | None, what: str) -> list[str]:
    from adopter.errors import UserError

    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if text is not None and not items:
        raise UserError(f"--{what}: empty list")
    return items


def run(args) -> int:
    import torch

    from adopter.errors import UserError
    from adopter.kernels import cost
    from adopter.verification.calibrate import calibrate, cases, summary_lines, write

    try:
        threads = [int(n) for n in _counts(args.threads, "threads")] or sorted({1, torch.get_num_threads()})
    except ValueError:
        raise UserError(f"--threads: not a list of integers: {args.threads!r}") from None
    if any(n < 1 for n in threads):
        raise UserError("--threads: thread counts must be at least 1")
    if args.rounds < 3:
        raise UserError("--rounds: at least 3 rounds are needed for an interval")
    kernels = set(_counts(args.kernels, "kernels")) or None
    if kernels:
        known = {c.kernel for c in cases()}
        unknown = sorted(kernels - known)
        if unknown:
            raise UserError(f"--kernels: unknown kernel(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    path = args.output or cost.user_path("cpu")
    progress = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    data = calibrate(threads=threads, rounds=args.rounds, kernels=kernels, progress=progress)
    write(data, path)
    cost.reload()
    for line in summary_lines(data):
        print(line)
    print(f"calibration written to {path}")
    return 0
