"""`adopter` command line: one sub-command per module in :mod:`adopter.commands`.

Each command module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Commands are imported lazily so `adopter scan` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "scan": "adopter.commands.scan",
    "rules": "adopter.commands.rules",
    "rewrite": "adopter.commands.rewrite",
    "trace": "adopter.commands.trace",
    "verify": "adopter.commands.verify",
}


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="adopter",
        description="Find where optimized kernels fit in PyTorch model source, rewrite it, prove it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, path in COMMANDS.items():
        module = importlib.import_module(path)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except UserError as exc:
        print(f"adopter {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("adopter: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
