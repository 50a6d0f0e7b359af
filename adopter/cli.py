"""`adopter` command line: one sub-command per module in :mod:`adopter.commands`.

Each command module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Commands are imported lazily so `adopter scan` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from adopter.core.extras import MissingExtra
from adopter.errors import EXIT_ERROR, UserError

__all__ = ["COMMANDS", "EXIT_STATUS_HELP", "UserError", "build_parser", "main"]

COMMANDS = {
    "scan": "adopter.commands.scan",
    "rules": "adopter.commands.rules",
    "rewrite": "adopter.commands.rewrite",
    "trace": "adopter.commands.trace",
    "verify": "adopter.commands.verify",
    "calibrate": "adopter.commands.calibrate",
}


EXIT_STATUS_HELP = """\
exit status (every command):
  0  done; nothing to report
  1  done, and the answer is "no": `rewrite --check` found changes, `verify` found the
     rewrite not equivalent or the regression gate failed, `trace` could not capture the model
  2  error: bad arguments, or some input could not be analysed (a file that does not parse or
     cannot be read or written, an unknown model). Commands keep going past such a file:
     every other file is still analysed and reported, then the exit status is 2.
  141 the output pipe was closed by its reader (`adopter scan . | head -1`): stopped quietly.
  A path that is not Python (no .py suffix, no python #! line), or not a regular file (a FIFO,
  a device) found in a directory, is skipped with a notice, not an error; named directly, a
  path that is not a regular file is exit 2. Files larger than --max-file-size are errors."""


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="adopter",
        description="Find where optimized kernels fit in PyTorch model source, rewrite it, prove it.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, path in COMMANDS.items():
        module = importlib.import_module(path)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP), epilog=EXIT_STATUS_HELP,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        status = int(modules[args.command].run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away (`adopter scan . | head -1`): stop quietly, as Unix tools do.
        _silence_stdout()
        return 128 + 13  # killed by SIGPIPE, as the shell reports it
    except UserError as exc:
        print(f"adopter {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except MissingExtra as exc:
        print(f"adopter {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("adopter: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what is still buffered
    cannot raise BrokenPipeError again at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
