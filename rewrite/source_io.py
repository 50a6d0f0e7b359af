"""Our own file I/O for rewriting: diffs and guarded atomic writes.

Bowler's own writer prompts on a terminal, drops CRLF and non-UTF-8 encodings and
logs unparsable files with exit 0, so we never let it touch files. Files are read with
:mod:`adopter.core.source_file` (the one reader of every command: regular files only,
size limit, decoding as Python does) and written back here: atomically, only while the
file is still what was read, keeping owner, group and mode, never splitting hard links.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import tempfile
from collections.abc import Callable

from adopter.core.source_file import FileStamp, SourceReadError, SourceText, read_bytes, read_source

__all__ = [
    "ChangedSinceRead", "SourceText", "WriteRefused", "before_replace", "read_source", "remove_stale_temp_files",
    "unified_diff", "write_atomic",
]


class WriteRefused(Exception):
    """The file is left as it is, for the one-line reason given (never a partial write)."""


class ChangedSinceRead(WriteRefused):
    """The file changed after it was read (a user's edit saved meanwhile): not overwritten."""


# Test seam: called with the path after the new content is in its temporary file and just
# before the file is checked and replaced (tests make a concurrent edit, or a kill, happen
# exactly there).
before_replace: Callable[[str], None] | None = None

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


TEMP_PREFIX = ".adopter-"
# Our temporary files: ``.adopter-<pid of the writer>-<random>.tmp``.
_TEMP_NAME = re.compile(r"\.adopter-(\d+)-[A-Za-z0-9_]+\.tmp\Z")
_CLEANED: set[str] = set()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale_temp_files(directory: str) -> list[str]:
    """Remove the temporary files a killed run of ours left in ``directory`` (named as ours,
    owned by this user, their writer process gone); never anyone else's. Once per directory
    per process. Returns the removed paths."""
    directory = os.path.abspath(directory)
    if directory in _CLEANED:
        return []
    _CLEANED.add(directory)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        match = _TEMP_NAME.match(name)
        if not match or _alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or not os.path.isfile(path) or os.path.islink(path):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def _changed(path: str, stamp: FileStamp) -> bytes | None:
    """The file's current bytes when it changed since ``stamp`` was taken, else None."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ChangedSinceRead(f"changed since it was read ({exc.strerror or exc}); not written") from None
    same_file = (st.st_dev, st.st_ino) == (stamp.device, stamp.inode)
    try:
        data, now = read_bytes(path, None)
    except SourceReadError as exc:
        raise ChangedSinceRead(f"changed since it was read ({exc.message}); not written") from None
    # mtime and size alone can miss an edit within the clock's granularity: the content decides.
    if same_file and now.digest == stamp.digest and st.st_size == stamp.size:
        return None
    return data


def write_atomic(path: str, data: bytes, stamp: FileStamp | None = None) -> bool:
    """Replace ``path`` with ``data`` atomically, keeping its owner, group and mode.

    The temporary file lives in the same directory so ``os.replace`` is a rename on one
    file system; a crash leaves either the old or the new file, never half of one (and the
    temporary file, which the next run removes). With ``stamp`` (what was read), the file is
    replaced only while it is still that: else :class:`ChangedSinceRead`, or ``False`` when
    it already holds ``data`` (another run wrote the same rewrite: not this run's write).
    A file with several hard links, or whose owner cannot be kept, is refused
    (:class:`WriteRefused`). Returns whether this call wrote the file."""
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temp_files(directory)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if stamp is not None and st is None:
        raise ChangedSinceRead("changed since it was read (it was removed); not written")
    if st is not None and st.st_nlink > 1:
        raise WriteRefused(f"has {st.st_nlink} hard links: replacing it would split them (the other names would "
                           "keep the old text); not written")
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if st is not None:
            os.chmod(tmp, st.st_mode & 0o7777)
            if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.chown(tmp, st.st_uid, st.st_gid)
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.EACCES):
                        raise
                    raise WriteRefused(f"its owner {st.st_uid}:{st.st_gid} cannot be kept ({exc.strerror}); "
                                       "not written") from None
                os.chmod(tmp, st.st_mode & 0o7777)  # chown clears set-id bits
        if before_replace is not None:
            before_replace(path)
        if stamp is not None:
            current = _changed(path, stamp)
            if current is not None:
                if current == data:
                    os.unlink(tmp)
                    return False
                raise ChangedSinceRead("changed since it was read (edited meanwhile); not written")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True
