"""The one way every command reads a Python source file: what may be read, how it decodes,
its lines, and the stamp a later write checks against.

* Only regular files are read. A FIFO, a device, a socket (or a link to one) is refused
  before it is opened (and opened non-blocking, so one swapped in after the check cannot
  block either); a file over the size limit is refused before it is read: analysis costs
  about 200x a file's size in memory, and no model source is megabytes long.
* Bytes decode as the interpreter decodes them (:func:`tokenize.detect_encoding`: PEP 263
  cookie or BOM, else UTF-8); an unknown cookie is an error, as it is to Python.
* Lines are split where Python splits them (``\\n``, ``\\r\\n``, ``\\r``), never at the other
  characters :meth:`str.splitlines` breaks on (form feed, ``\\v``, ``\\x1c``-``\\x1e``,
  ``\\x85``, ``\\u2028``, ``\\u2029``): analysis positions are Python's.
* :meth:`SourceText.encode_text` writes a new text back with every line the edit left alone
  byte for byte as it was (its own line ending, the BOM, the encoding, the last line's
  missing newline); only the lines the edit wrote take the file's dominant line ending.

Errors are :class:`SourceReadError` with a one-line message; ``skipped`` ones (not a
regular file) are notices, the rest errors.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import io
import os
import re
import stat
import tokenize
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_BYTES", "FileStamp", "SourceReadError", "SourceText", "file_kind", "format_size", "parse_size",
    "read_bytes", "read_source", "read_text_file", "source_lines",
]

# Hand-written model files are well under 1 MB (the largest in transformers 5 is ~0.3 MB);
# at ~200x a file's size in analysis memory, 2 MiB bounds a worker at about 0.5 GB.
DEFAULT_MAX_BYTES = 2 * 1024 * 1024

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class SourceReadError(Exception):
    """A file that is not read: ``message`` is one line; ``skipped``: a notice (not a regular
    file), not an error."""

    def __init__(self, message: str, *, skipped: bool = False):
        super().__init__(message)
        self.message = message
        self.skipped = skipped


@dataclass(frozen=True)
class FileStamp:
    """What a file was when it was read: a write replaces it only while it still is."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    links: int
    uid: int
    gid: int
    mode: int
    digest: str  # sha256 of the bytes read

    @classmethod
    def of(cls, st: os.stat_result, data: bytes) -> FileStamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_nlink, st.st_uid, st.st_gid,
                   stat.S_IMODE(st.st_mode), hashlib.sha256(data).hexdigest())


def source_lines(text: str, keepends: bool = False) -> list[str]:
    """``text``'s lines as Python counts them (``\\n``, ``\\r\\n``, ``\\r``; a form feed is
    whitespace inside a line, not a line break)."""
    lines = _LINE.findall(text)
    if keepends:
        return lines
    return [line.rstrip("\r\n") for line in lines]


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def format_size(size: int) -> str:
    for unit, scale in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def parse_size(text: str) -> int:
    """``4M``, ``512K``, ``1G``, ``2000`` (bytes), ``0`` (no limit) -> bytes; ``ValueError`` else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)[iI]?[bB]?\s*", text or "")
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4M, 512K, 2000000, 0 for no limit)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit])


def _os_message(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "symbolic link loop"
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "not readable (permission denied)"
    return f"cannot read: {exc.strerror or exc}"


def read_bytes(path: str | os.PathLike, max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[bytes, FileStamp]:
    """The bytes of a regular file of at most ``max_bytes`` (``None``/0: no limit) and its stamp.
    Raises :class:`SourceReadError`."""
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except OSError as exc:
        raise SourceReadError(_os_message(exc)) from None
    _check(st, max_bytes)
    try:
        # Non-blocking: a FIFO put in its place after the check must not hang the open.
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SourceReadError(_os_message(exc)) from None
    try:
        st = os.fstat(fd)
        _check(st, max_bytes)
        chunks, total = [], 0
        limit = max_bytes or None
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if limit is not None and total > limit:  # grew after the check
                raise SourceReadError(_too_large(total, limit))
    except OSError as exc:
        raise SourceReadError(_os_message(exc)) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data, FileStamp.of(st, data)


def _too_large(size: int, limit: int) -> str:
    return (f"file too large ({format_size(size)}; the limit is {format_size(limit)}, "
            "--max-file-size raises it)")


def _check(st: os.stat_result, max_bytes: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise SourceReadError(f"not a regular file ({file_kind(st.st_mode)})", skipped=True)
    if max_bytes and st.st_size > max_bytes:
        raise SourceReadError(_too_large(st.st_size, max_bytes))


@dataclass(frozen=True)
class SourceText:
    """A decoded source file: ``text`` uses ``\\n`` newlines only; ``original`` is the decoded
    text with its own line endings (BOM removed), from which unedited lines are written back."""

    text: str
    encoding: str = "utf-8"
    newline: str = "\n"  # the file's dominant newline: "\n", "\r\n" or "\r"
    has_bom: bool = False
    original: str | None = None  # None: same as ``text``
    stamp: FileStamp | None = None

    @classmethod
    def decode(cls, data: bytes, stamp: FileStamp | None = None) -> SourceText:
        """Decode as the interpreter does. Raises :class:`SourceReadError` (unknown encoding,
        bytes not valid in the declared one)."""
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        except SyntaxError as exc:  # unknown cookie, BOM with a non-UTF-8 cookie
            raise SourceReadError(str(exc.msg)) from None
        try:
            raw = data.decode(encoding)  # utf-8-sig strips the BOM
        except UnicodeDecodeError as exc:
            shown = "UTF-8" if encoding in ("utf-8", "utf-8-sig") else encoding
            raise SourceReadError(f"not {shown} text: {exc.reason} at byte {exc.start}") from None
        except LookupError:
            raise SourceReadError(f"unknown encoding: {encoding}") from None
        crlf = raw.count("\r\n")
        cr = raw.count("\r") - crlf
        lf = raw.count("\n") - crlf
        newline = "\r\n" if crlf > max(lf, cr) else ("\r" if cr > lf else "\n")
        text = raw.replace("\r\n", "\n").replace("\r", "\n")
        return cls(text=text, encoding=encoding, newline=newline, has_bom=encoding == "utf-8-sig",
                   original=None if raw == text else raw, stamp=stamp)

    def with_text(self, text: str) -> SourceText:
        """The edited file: ``text`` with this file's encoding, line endings and stamp."""
        return SourceText(text=text, encoding=self.encoding, newline=self.newline, has_bom=self.has_bom,
                          original=self.restore_text(text), stamp=self.stamp)

    def restore(self) -> str:
        """The text with the file's line endings (still a ``str``)."""
        return self.original if self.original is not None else self.text

    def restore_text(self, new_text: str) -> str:
        """``new_text`` (an edit of ``text``) with this file's line endings: lines the edit left
        alone keep their own ending; lines it wrote take the dominant one."""
        if self.original is None and self.newline == "\n":
            return new_text
        raw = source_lines(self.restore(), keepends=True)
        old = [line.rstrip("\r\n") + ("\n" if line.endswith(("\n", "\r")) else "") for line in raw]
        new = source_lines(new_text, keepends=True)
        out: list[str] = []
        matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                out.extend(raw[i1:i2])
            else:
                out.extend(line[:-1] + self.newline if line.endswith("\n") else line for line in new[j1:j2])
        return "".join(out)

    def encode(self) -> bytes:
        # utf-8-sig re-adds the BOM on encode.
        return self.restore().encode(self.encoding)

    def encode_text(self, new_text: str) -> bytes:
        """The bytes of the file with ``new_text`` in place of ``text`` (see :meth:`restore_text`)."""
        return self.restore_text(new_text).encode(self.encoding)


def read_source(path: str | os.PathLike, max_bytes: int | None = DEFAULT_MAX_BYTES) -> SourceText:
    """Read and decode one Python source file (see the module docstring). Raises
    :class:`SourceReadError`."""
    data, stamp = read_bytes(path, max_bytes)
    return SourceText.decode(data, stamp)


def read_text_file(path: str | os.PathLike, what: str = "file", max_bytes: int | None = DEFAULT_MAX_BYTES) -> str:
    """A UTF-8 text file that is not Python (a rules file): same checks, strict UTF-8.
    Raises :class:`SourceReadError` with a message naming ``what``."""
    try:
        data, _ = read_bytes(path, max_bytes)
    except SourceReadError as exc:
        raise SourceReadError(f"cannot read {what} {os.fspath(path)}: {exc.message}", skipped=exc.skipped) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceReadError(f"cannot read {what} {os.fspath(path)}: not UTF-8 text: {exc.reason} at byte "
                              f"{exc.start}") from None
