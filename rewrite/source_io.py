"""Our own file I/O for rewriting: decoding, newline style, diffs and atomic writes.

Bowler's own writer prompts on a terminal, drops CRLF and non-UTF-8 encodings and
logs unparsable files with exit 0, so we never let it touch files. Here a file is
read as bytes, decoded with the encoding Python itself would use (PEP 263 cookie or
BOM, :func:`tokenize.detect_encoding`), and its text is normalized to ``\\n`` for
the tree; :meth:`SourceText.restore` puts the original newline style, final-newline
state and encoding back.
"""

from __future__ import annotations

import difflib
import io
import os
import tempfile
import tokenize
from dataclasses import dataclass


@dataclass(frozen=True)
class SourceText:
    """A decoded source file: ``text`` uses ``\\n`` newlines only."""

    text: str
    encoding: str = "utf-8"
    newline: str = "\n"  # the file's dominant newline: "\n", "\r\n" or "\r"
    has_bom: bool = False

    @classmethod
    def decode(cls, data: bytes) -> SourceText:
        """Decode like the interpreter does; raises ``SyntaxError``/``UnicodeDecodeError``."""
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        has_bom = encoding == "utf-8-sig"
        raw = data.decode(encoding)  # utf-8-sig strips the BOM
        crlf = raw.count("\r\n")
        cr = raw.count("\r") - crlf
        lf = raw.count("\n") - crlf
        newline = "\r\n" if crlf > max(lf, cr) else ("\r" if cr > lf else "\n")
        text = raw.replace("\r\n", "\n").replace("\r", "\n")
        return cls(text=text, encoding=encoding, newline=newline, has_bom=has_bom)

    def with_text(self, text: str) -> SourceText:
        return SourceText(text=text, encoding=self.encoding, newline=self.newline, has_bom=self.has_bom)

    def restore(self) -> str:
        """The text with the file's newline style back (still a ``str``)."""
        return self.text.replace("\n", self.newline) if self.newline != "\n" else self.text

    def encode(self) -> bytes:
        # utf-8-sig re-adds the BOM on encode.
        return self.restore().encode(self.encoding)


def read_source(path: str) -> SourceText:
    with open(path, "rb") as handle:
        return SourceText.decode(handle.read())


def unified_diff(old: str, new: str, filename: str) -> str:
    """A unified diff of two ``\\n`` texts, ``a/``/``b/`` headers as git prints them."""
    if old == new:
        return ""
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=filename if os.path.isabs(filename) else f"a/{filename}",
        tofile=filename if os.path.isabs(filename) else f"b/{filename}",
    )
    out = []
    for line in lines:
        if not line.endswith("\n"):
            # Like git: mark a last line without newline so the diff stays applicable.
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, keeping its permission bits.

    The temporary file lives in the same directory so ``os.replace`` is a rename on
    one file system; a crash leaves either the old or the new file, never half of one.
    """
    directory = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else None
    fd, tmp = tempfile.mkstemp(prefix=".adopter-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
