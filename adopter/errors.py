"""Errors meant for the user, shared by the CLI, the command modules and the orchestration
(``adopter.verification.run``) without either depending on the other."""

from __future__ import annotations

__all__ = ["EXIT_ERROR", "EXIT_FINDING", "EXIT_OK", "AdopterWarning", "OptimizeError", "UserError"]

# The exit-status convention of every `adopter` command (see `adopter --help`):
EXIT_OK = 0  # done, nothing to report
EXIT_FINDING = 1  # done, and the answer is "no": --check found changes, not equivalent, gate failed
EXIT_ERROR = 2  # bad input, or some file/model could not be analysed (the rest still was)


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


class OptimizeError(Exception):
    """optimize() cannot work on this class at all (one line, for the user)."""


class AdopterWarning(UserWarning):
    """Something optimize() could not do fully (e.g. the model cannot be traced); here, not in
    adopter.optimizing.optimize, so that the modules optimize imports can warn too."""


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, first line, at most 300 characters."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
