"""`adopter verify`: optimize a model, prove the rewrite equivalent, measure it, gate it.

    adopter verify --model bert-base-uncased [--json out.json] [--plot out.png]
    adopter verify --model tiny-bert --baseline benchmarks/baselines/tiny-bert.json --max-regression 5%
    adopter verify --model mypkg.model:Net --model-args net.json --blocks 6
    adopter verify --model microsoft/resnet-50 --mode inference --batch-sizes 1,8

Steps: build the model (known id: shipped config, random weights; or a local directory with
config.json and optionally weights; or your own class, package.module:Name, with the arguments and
example inputs of --model-args or a factory), optimize its class (scan + trace + rewrite + in-memory
load, each rule checked for equivalence on a shrunk config, or on your arguments), check the optimized
model against the original at full size (same weights, forward and backward), then benchmark a
training step of both (pytest-benchmark, alternating rounds; or, with --mode inference, eval forwards
under no_grad over a batch-size sweep), measure what each kernel contributes (each switched off in
turn), and compare against a baseline. On CPU with one thread the speed verdict is the ratio of
process CPU times (it holds on a busy machine); a wide interval gets more pairs, and one that stays
wide on a busy machine is "inconclusive: machine too busy".

Exit status: 0 equivalent (and gate passed), 1 not equivalent or gate failed, 2 bad input.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

HELP = "optimize a model, check equivalence, benchmark training, and gate regressions"

DEFAULT_MODEL = "bert-base-uncased"
# Budgeted for `adopter verify --model bert-base-uncased` to finish in < 3 minutes on a
# shared 2-core CPU: one single-threaded bert-base training step at 4 x 32 tokens takes
# ~1.5 s there; the timed rounds get DEFAULT_BENCH_SECONDS.
DEFAULT_BATCH_SIZE = 4
DEFAULT_SEQ_LEN = 32
DEFAULT_BENCH_SECONDS = 20.0
# --threads: none given (and no baseline's), the run keeps torch's own thread count in this process
# (OMP_NUM_THREADS, else one per core), the count the user's training runs at
DEFAULT_THREADS = None
DEFAULT_INFERENCE_BATCHES = (1, 8)
# mirrors adopter.verification.benchmark (not imported here: commands import torch only in run)
MIN_BLOCKS, MAX_BLOCKS = 6, 30


def add_arguments(parser) -> None:
    from adopter.commands._model import USER_MODEL_EPILOG, add_model_args

    add_model_args(parser, default=DEFAULT_MODEL, help_prefix=f"the model (default {DEFAULT_MODEL}): ")
    parser.epilog = (USER_MODEL_EPILOG + "  The benchmark trains on those example inputs as given (their first dimension "
                     "is the batch size);\n  --batch-size and --seq-len are for shipped and config-directory models.\n\n"
                     + (parser.epilog or ""))
    parser.add_argument("--rules", default=None, help="comma-separated rule names (default: all rules)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"benchmark batch size (default: the baseline's, the shipped config's, else {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"benchmark sequence length, text models (default: the baseline's, the shipped config's, else "
                             f"{DEFAULT_SEQ_LEN})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: the baseline's, else torch's own count here, as training "
                             "would use: OMP_NUM_THREADS, else one per core); on a shared machine multi-threaded step "
                             "times swing tenfold and are timed by wall clock, single-threaded ones by a few percent "
                             "(process CPU time): --threads 1 for steady ratios")
    parser.add_argument(
        "--blocks", type=int, default=None,
        help="alternating original/optimized benchmark blocks (pairs) (default: as many as fit "
             f"--bench-seconds, {MIN_BLOCKS} to {MAX_BLOCKS})",
    )  # fmt: skip
    parser.add_argument(
        "--bench-seconds", type=float, default=DEFAULT_BENCH_SECONDS,
        help="time budget for the timed benchmark rounds when --blocks is not given (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per block (default %(default)s)")
    parser.add_argument(
        "--max-bench-seconds", type=float, default=None,
        help="while the speed ratio's interval is wide, measure more pairs up to this many seconds "
             "(default: three times --bench-seconds)",
    )  # fmt: skip
    parser.add_argument("--mode", choices=("train", "inference"), default=None,
                        help="train: forward+backward+AdamW steps (default); inference: eval forwards under "
                             "no_grad over a batch-size sweep (latency, throughput, peak memory)")
    parser.add_argument("--batch-sizes", default=None, metavar="N,N,...",
                        help="inference batch-size sweep (default: the baseline's, the shipped config's, else "
                             f"{','.join(map(str, DEFAULT_INFERENCE_BATCHES))})")
    parser.add_argument("--channels-last", action="store_true",
                        help="benchmark (and check equivalence) with image inputs in channels_last memory format, "
                             "both models: the layout CPU convolution inference is usually served in")
    parser.add_argument("--no-ablation", action="store_true",
                        help="skip the per-kernel contribution (each kernel switched off in turn)")
    parser.add_argument("--ablation-seconds", type=float, default=20.0,
                        help="time budget of the per-kernel ablation (default %(default)s)")
    parser.add_argument("--attn-implementation", default=None, metavar="NAME",
                        help="transformers attention implementation of the original (eager, sdpa, ...; default: "
                             "the model's). Rules that match eager attention code need the eager path.")
    parser.add_argument("--no-benchmark", action="store_true", help="equivalence check only")
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON")
    parser.add_argument("--benchmark-json", metavar="FILE", help="where pytest-benchmark's JSON goes "
                        "(default: next to --json, else .benchmarks/)")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of speed and memory (needs matplotlib)")
    parser.add_argument("--baseline", metavar="FILE", help="regression gate: compare with this verify JSON")
    parser.add_argument("--max-regression", default="5%", help="gate threshold, a percentage such as 5%% (default 5%%): the largest loss in speed or memory "
                        "ratio against the baseline that still passes")
    parser.add_argument("--save-baseline", metavar="FILE", help="write this run's result as a baseline")
    parser.add_argument("--quiet", action="store_true", help="no progress messages on stderr")


class _Progress:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def _safe_name(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id.strip("/").replace("/", "__"))


def _shipped_verify_settings(model: str) -> dict:
    """``_adopter_verify`` of a shipped config (benchmark batch size / sequence length), or {}."""
    from adopter import configs

    try:
        return dict(configs.load_config_dict(model).get("_adopter_verify") or {})
    except (KeyError, ValueError, OSError):
        return {}


def run(args) -> int:
    from adopter.commands._model import is_user_ref, resolve_user_model
    from adopter.errors import UserError
    from adopter.verification.gate import PlotUnavailable, load_json, parse_threshold, require_matplotlib

    if is_user_ref(args.model) and (args.batch_size is not None or args.seq_len is not None):
        raise UserError("--batch-size/--seq-len apply to shipped models; for --model package.module:Name "
                        "set the example inputs' shapes in --model-args")

    # Validate everything cheap before the long steps.
    try:
        threshold = parse_threshold(args.max_regression)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.plot:
        if args.no_benchmark:
            raise UserError("--plot needs the benchmark (drop --no-benchmark)")
        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            raise UserError(str(exc)) from None
    baseline = None
    if args.baseline:
        if args.no_benchmark:
            raise UserError("--baseline needs the benchmark (drop --no-benchmark)")
        try:
            baseline = load_json(args.baseline, "baseline")
        except ValueError as exc:
            raise UserError(str(exc)) from None
    # A gate run measures with the baseline's settings unless told otherwise: ratios are only
    # comparable at the same batch size, sequence length and thread count.
    settings = (baseline or {}).get("benchmark") or {}
    # then the shipped config's own benchmark shape (llama-tiny trains at 4 x 512 tokens: its
    # LM-head loss is what the rule pack saves memory on), then the defaults.
    model_settings = _shipped_verify_settings(args.model)
    if args.batch_size is None:
        args.batch_size = int(settings.get("batch_size") or model_settings.get("batch_size") or DEFAULT_BATCH_SIZE)
    if args.seq_len is None:
        args.seq_len = int(settings.get("seq_len") or model_settings.get("seq_len") or DEFAULT_SEQ_LEN)
    if args.attn_implementation is None and baseline is not None:
        args.attn_implementation = (baseline.get("model") or {}).get("attn_implementation")
    if args.threads is None:
        args.threads = int(settings["threads"]) if settings.get("threads") else DEFAULT_THREADS
    if args.mode is None:
        args.mode = settings.get("mode") or "train"
    if not args.channels_last and settings.get("input_layout") == "channels_last":
        args.channels_last = True  # measured as the baseline was
    if baseline is not None and (settings.get("mode") or "train") != args.mode:
        raise UserError(f"--mode {args.mode} against a baseline measured in {settings.get('mode') or 'train'} mode")
    batch_sizes = None
    if args.mode == "inference":
        if args.batch_sizes is not None:
            try:
                batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
            except ValueError:
                raise UserError(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}") from None
            if not batch_sizes or min(batch_sizes) < 1:
                raise UserError("--batch-sizes needs positive integers")
        else:
            batch_sizes = ([int(b["batch_size"]) for b in settings.get("sweep") or []]
                           or list(model_settings.get("inference_batch_sizes") or DEFAULT_INFERENCE_BATCHES))
        if is_user_ref(args.model) and args.batch_sizes is not None:
            raise UserError("--batch-sizes applies to shipped models; for --model package.module:Name "
                            "set the example inputs' shapes in --model-args")
        args.batch_size = batch_sizes[0]
    elif args.batch_sizes is not None:
        raise UserError("--batch-sizes is for --mode inference")
    for name in ("batch_size", "seq_len", "blocks", "rounds", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")

    user = resolve_user_model(args)  # package.module:Name: imports the user's module
    progress = _Progress(args.quiet)
    from adopter.verification.run import VerifyOptions, run_verify

    options = VerifyOptions(
        model=args.model,
        rules=args.rules,
        device=args.device,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        threads=args.threads,
        attn_implementation=args.attn_implementation,
        blocks=args.blocks,
        bench_seconds=args.bench_seconds,
        rounds=args.rounds,
        mode=args.mode,
        batch_sizes=batch_sizes,
        max_bench_seconds=args.max_bench_seconds,
        ablation=not args.no_ablation,
        channels_last=args.channels_last,
        ablation_seconds=args.ablation_seconds,
        benchmark=not args.no_benchmark,
        benchmark_json=args.benchmark_json
        or (
            os.path.splitext(args.json)[0] + ".pytest-benchmark.json"
            if args.json
            else os.path.join(".benchmarks", f"verify_{_safe_name(args.model)}.pytest-benchmark.json")
        ),
        baseline=baseline,
        baseline_path=args.baseline,
        max_regression=threshold,
        user_model=user,
    )
    # stdout is the report's: what the model prints while it is built and run goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        outcome = run_verify(options, progress)

    from adopter.verification.gate import format_report, write_json, write_plot

    print(format_report(outcome.result, outcome.gate))
    if args.json:
        write_json(args.json, outcome.result)
        progress(f"wrote {args.json}")
    if args.save_baseline and outcome.result.get("benchmark"):
        write_json(args.save_baseline, outcome.result)
        progress(f"wrote baseline {args.save_baseline}")
    elif args.save_baseline:
        raise UserError("--save-baseline needs the benchmark (drop --no-benchmark)")
    if args.plot and outcome.result.get("benchmark"):
        write_plot(outcome.result, args.plot)
        progress(f"wrote {args.plot}")
    return outcome.exit_code
