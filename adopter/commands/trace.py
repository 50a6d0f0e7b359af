"""`adopter trace --model ID`: scan a model's own source files, then confirm every match
against a torch.fx capture of the instantiated model (what actually executes)."""

from __future__ import annotations

import json
import sys
import time

HELP = "scan a model's source and confirm the matches with a torch.fx trace of the built model"


def add_arguments(parser):
    from adopter.commands._model import USER_MODEL_EPILOG, add_model_args

    add_model_args(parser, help_prefix="the model to build and trace (--list-models shows the shipped ids): ")
    parser.epilog = USER_MODEL_EPILOG + "\n" + (parser.epilog or "")
    parser.add_argument("--device", choices=("cpu", "cuda", "meta"), default=None,
                        help="where to build the model (default: cuda if available, else cpu; "
                             "meta builds without allocating weights)")
    parser.add_argument("--attn-implementation", choices=("eager", "sdpa"), default=None,
                        help="attention implementation of transformers models (default: the model's)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                        help="override a config value, e.g. --set num_hidden_layers=2 (may repeat)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("--rules", metavar="NAME,...", help="comma-separated rule names (default: all built-in rules)")
    parser.add_argument("--rules-file", metavar="FILE", action="append", default=[],
                        help="additional rules in the DSL; may repeat")
    parser.add_argument("--list-models", action="store_true", help="print the known model ids and exit")


def _parse_overrides(items: list[str]) -> dict:
    from adopter.errors import UserError

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw  # a bare string such as gelu_new
        out[key.strip()] = value
    return out


def run(args) -> int:
    from adopter.configs import known_model_ids
    from adopter.errors import UserError

    if args.list_models:
        print("\n".join(known_model_ids()))
        return 0
    if not args.model:
        raise UserError("--model ID is required (known model ids: " + ", ".join(known_model_ids()) + ")")
    from adopter.commands._model import resolve_user_model
    from adopter.commands.scan import format_text, select_rules
    from adopter.core.scan import scan_paths
    from adopter.tracing import (
        CaptureError,
        TracingError,
        build_model,
        capture_model,
        confirm_matches,
        runtime_reach,
    )

    rules = select_rules(args)
    overrides = _parse_overrides(args.overrides)
    user = resolve_user_model(args)  # package.module:Name: imports the user's module
    if user is not None and overrides:
        raise UserError("--set overrides config values of shipped models; give your model's arguments in --model-args")
    start = time.perf_counter()
    try:
        if user is not None:
            from adopter.tracing.user_model import build_user_model

            built = build_user_model(user, device=args.device, attn_implementation=args.attn_implementation)
        else:
            built = build_model(
                args.model, device=args.device, attn_implementation=args.attn_implementation,
                config_overrides=overrides or None,
            )
    except TracingError as exc:
        raise UserError(str(exc)) from None
    if not built.source_files:
        raise UserError(f"no source files found for the classes of {args.model}")
    report = scan_paths(built.source_files, rules)

    capture_info: dict = {}
    code = 0
    try:
        capture = capture_model(built.model, built.example_inputs)
        capture_info = {"method": capture.method, "seconds": round(capture.seconds, 3)}
        if capture.errors:
            capture_info["failed"] = capture.errors
        static = list(report.matches)
        report.matches = confirm_matches(built.model, built.example_inputs, static, capture=capture,
                                         scanned_files=built.source_files)
        # what the source left untyped, typed by the built model
        report.matches = runtime_reach(built.model, built.example_inputs, static, report.matches,
                                       built.source_files, rules)
        attn = getattr(built.config, "_attn_implementation", None)
        if attn:
            from adopter.tracing.confirm import with_config_note

            report.matches = [with_config_note(m, attn) for m in report.matches]
    except CaptureError as exc:
        capture_info = {"method": None, "failed": exc.errors}
        reason = f"model could not be traced: {exc}"
        from adopter.tracing.trace_codes import traced

        report.matches = [m if m.status == "refused" else traced(m, "untraced", reason, "capture-failed")
                          for m in report.matches]
        print(f"adopter trace: could not trace {args.model}: {exc}; static matches reported as untraced",
              file=sys.stderr)
        code = 1
    seconds = time.perf_counter() - start

    if args.format == "json":
        payload = report.to_json()
        payload["model"] = {
            "id": built.model_id,
            "class": type(built.model).__name__,
            "device": built.device,
            "attn_implementation": getattr(built.config, "_attn_implementation", None),
            "source_files": built.source_files,
        }
        payload["capture"] = capture_info
        payload["seconds"] = round(seconds, 3)
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        attn = getattr(built.config, "_attn_implementation", None)
        if not getattr(type(built.model), "_supports_sdpa", False) and not args.attn_implementation:
            attn = None  # no attention in this model (ResNet): nothing to say
        how = (f"captured with {capture_info['method']} in {capture_info['seconds']:.2f} s"
               if capture_info.get("method") else "not captured")
        print(f"model {built.model_id}: {type(built.model).__name__} on {built.device}"
              + (f", attention {attn}" if attn else "") + f"; {how}; {seconds:.2f} s total")
        print(format_text(report, confirmed=True))
    return code
