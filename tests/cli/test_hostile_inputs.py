"""Issue 23: hostile and unusual inputs to `adopter scan`, `adopter rewrite` and ``optimize()``.

Every command here runs as a real subprocess, the way a user runs it, under a timeout (a hang
is a test failure, never a stuck suite) and a 4 GiB address-space limit (an endless file is a
failure, never a machine out of memory). What is covered: FIFOs, devices and huge files where
source is expected (and ``--max-file-size``), symbolic link loops, unreadable directories,
coding cookies and BOMs, mixed line endings, form feeds, a file edited while ``--write``
analyses it (lost update), a run killed between writing its temporary file and replacing the
source (stale temporary files), owner/mode and hard links kept by ``--write``, two runs at once,
a reader that closes the pipe early, rule files that are not UTF-8, and a module edited or
deleted after it was imported but before ``optimize()`` reads it.

The last group holds guarantees that already held before issue 23 (their docstrings say so).

``--write`` exposes a test hook: ``adopter.rewrite.source_io.before_replace``, a callable
``before_replace(path)`` called for each file after its new content is in the temporary file,
just before the file is checked unchanged and replaced. ``run_cli(..., hook=SOURCE)`` installs
the function ``before_replace`` that ``SOURCE`` defines.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIG1 = ROOT / "tests" / "fixtures" / "rules" / "Dropout_LayerNorm" / "positive_fig1.py"
MODEL = FIG1.read_text(encoding="utf-8")  # BertSelfOutput + BertOutput: scan finds 2 Dropout_LayerNorm matches
MODEL_MATCHES = [("Dropout_LayerNorm", "BertOutput", "forward"), ("Dropout_LayerNorm", "BertSelfOutput", "forward")]
NOBODY = 65534
MEMORY_LIMIT = 4 * 1024**3  # address space of each CLI run

# The code of this checkout, whatever is installed: `adopter.rewrite`, `.tracing` and `.kernels`
# live at the repository root and install inside the package, so the root joins its path.
BOOT = """\
import sys
ROOT = {root!r}
sys.path.insert(0, ROOT)
import adopter
if ROOT not in adopter.__path__:
    adopter.__path__.append(ROOT)
assert adopter.__file__.startswith(ROOT), adopter.__file__
"""

HOOK = """\
import adopter.rewrite.source_io as _source_io
_hook = {{}}
exec({source!r}, _hook)
_source_io.before_replace = _hook["before_replace"]
"""

MAIN = """\
from adopter.cli import main
sys.exit(main({args!r}))
"""


def cli_command(args, hook: str | None = None) -> list[str]:
    """The command line of `adopter ARGS...` running this checkout's code (``hook``: see module doc)."""
    code = BOOT.format(root=str(ROOT))
    if hook is not None:
        code += HOOK.format(source=hook)
    code += MAIN.format(args=[str(a) for a in args])
    return [sys.executable, "-c", code]


def _reachable_by_others(path) -> bool:
    p = Path(path).resolve()
    return all(d.stat().st_mode & 0o001 for d in p.parents) and bool(p.stat().st_mode & 0o005)


def _as_user_preexec(uid: int):
    """How a child started by root runs without root's permission override: as ``uid`` when the
    interpreter, its libraries and this checkout are reachable for that user; else (here Python
    lives under /root, mode 0700) as uid 0 without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH in its
    bounding set, so the interpreter never gets them: file modes then apply to it as to any user."""
    paths = [sys.executable, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], ROOT]
    if all(_reachable_by_others(p) for p in paths):
        def drop():
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

        return drop
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2

    def drop_override():
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop_override


def _preexec(as_user):
    user = _as_user_preexec(as_user) if as_user is not None and os.geteuid() == 0 else None

    def preexec():
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        except (ImportError, ValueError, OSError):
            pass
        if user is not None:
            user()

    return preexec


def run_command(cmd, cwd=None, timeout=60, as_user=None, preexec=True):
    """Run ``cmd`` to completion (text output); a run past ``timeout`` is killed (its whole process
    group) and fails the test. The result has ``pid`` (of the process started) as well."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=_preexec(as_user) if preexec else None,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"did not finish in {timeout} s (hang): {cmd[3:] if len(cmd) > 3 else cmd}\n"
                    f"stderr: {err.decode(errors='replace')[-2000:]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out.decode(errors="replace"),
                                         err.decode(errors="replace"))
    result.pid = proc.pid
    return result


def run_cli(args, cwd=None, timeout=60, hook=None, as_user=None):
    """`adopter ARGS...` as a subprocess of this checkout's code. ``hook``: Python source defining
    ``before_replace(path)`` (installed as ``adopter.rewrite.source_io.before_replace``);
    ``as_user``: a uid to run as (when root; see :func:`_as_user_preexec`)."""
    return run_command(cli_command(args, hook), cwd=cwd, timeout=timeout, as_user=as_user)


def lines_with(text: str, *needles: str) -> list[str]:
    """The lines of ``text`` containing every one of ``needles`` (case-insensitive)."""
    return [line for line in text.splitlines() if all(n.lower() in line.lower() for n in needles)]


def no_traceback(r) -> None:
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr + r.stdout, r.stderr[-3000:]


def matches_of(stdout: str) -> list[tuple]:
    return sorted((m["rule"], m["class"], m["function"]) for m in json.loads(stdout)["matches"])


def written_count(stdout: str) -> int:
    return sum(1 for f in json.loads(stdout)["files"] if f["written"])


def clean_rewrite(data: bytes, tmp_path: Path) -> bytes:
    """What a plain `rewrite --write` makes of ``data`` (in a scratch copy)."""
    scratch = Path(tempfile.mkdtemp(dir=tmp_path))
    (scratch / "m.py").write_bytes(data)
    r = run_cli(["rewrite", "--write", "-j", "1", scratch / "m.py"])
    assert r.returncode == 0, r.stderr
    return (scratch / "m.py").read_bytes()


def model_dir(tmp_path: Path, name: str = "pkg", files=("good.py",)) -> Path:
    d = tmp_path / name
    d.mkdir()
    for f in files:
        (d / f).write_text(MODEL, encoding="utf-8")
    return d


def snapshot(root: Path) -> dict:
    """path -> (kind, sha256, mtime_ns, mode) of everything under ``root``."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), digest, st.st_mtime_ns, st.st_mode)
    return out


needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no os.mkfifo on this platform")
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="chown to another user needs root")


@pytest.fixture
def public_tmp():
    """A temporary directory every user can read (pytest's base may be 0700): for runs as another user."""
    d = Path(tempfile.mkdtemp(prefix="adopter-hostile-"))
    os.chmod(d, 0o755)
    yield d
    for p in [d, *d.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, 0o755)
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ 1. FIFOs


@needs_fifo
@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p01_fifo_in_directory_is_skipped_with_notice(tmp_path, command):
    """A FIFO named x.py in a directory: the run finishes, says on one stderr line that x.py is not a
    regular file, processes the other files, and exits 0."""
    d = model_dir(tmp_path)
    os.mkfifo(d / "x.py")
    r = run_cli([command, d], timeout=20)
    no_traceback(r)
    assert len(lines_with(r.stderr, "x.py", "not a regular file")) == 1, r.stderr
    if command == "scan":
        assert "2 matches in 1 file" in r.stdout
    else:
        assert "+++" in r.stdout and "good.py" in r.stdout  # the diff of the other file
    assert r.returncode == 0, r.stderr


@needs_fifo
@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p01_fifo_named_directly_is_an_error(tmp_path, command):
    """A FIFO named on the command line: one line saying it is not a regular file, exit 2, no hang."""
    os.mkfifo(tmp_path / "x.py")
    r = run_cli([command, tmp_path / "x.py"], timeout=20)
    no_traceback(r)
    assert len(lines_with(r.stdout + r.stderr, "x.py", "not a regular file")) == 1, r.stdout + r.stderr
    assert r.returncode == 2


@needs_fifo
@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p01_fifo_as_rules_file_is_an_error(tmp_path, command):
    """--rules-file naming a FIFO: a one-line error (not a regular file), exit 2, no hang."""
    d = model_dir(tmp_path)
    os.mkfifo(tmp_path / "rules.fifo")
    r = run_cli([command, d / "good.py", "--rules-file", tmp_path / "rules.fifo"], timeout=20)
    no_traceback(r)
    assert len(r.stderr.strip().splitlines()) == 1 and "not a regular file" in r.stderr, r.stderr
    assert r.returncode == 2


# ------------------------------------------------------------------ 2. devices and huge files


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p02_link_to_dev_zero_in_directory_is_skipped(tmp_path, command):
    """big.py -> /dev/zero in a directory: skipped as not a regular file (no endless read, no
    MemoryError), the other file processed, exit 0."""
    d = model_dir(tmp_path)
    os.symlink("/dev/zero", d / "big.py")
    r = run_cli([command, d], timeout=30)
    no_traceback(r)
    assert len(lines_with(r.stderr, "big.py", "not a regular file")) == 1, r.stderr
    assert "good.py" in r.stdout
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_p02_link_to_dev_zero_named_directly_is_an_error(tmp_path):
    """big.py -> /dev/zero named on the command line: not a regular file, exit 2, promptly."""
    os.symlink("/dev/zero", tmp_path / "big.py")
    r = run_cli(["scan", tmp_path / "big.py"], timeout=30)
    no_traceback(r)
    assert len(lines_with(r.stdout + r.stderr, "big.py", "not a regular file")) == 1, r.stdout + r.stderr
    assert r.returncode == 2


def test_p02_huge_sparse_file_is_refused_quickly(tmp_path):
    """A 2 GB (sparse) huge.py is reported as too large within 15 s, exit 2, the other files scanned."""
    d = model_dir(tmp_path)
    with open(d / "huge.py", "wb") as f:
        f.truncate(2 * 1024**3)
    r = run_cli(["scan", d, "--format", "json"], timeout=15)
    no_traceback(r)
    data = json.loads(r.stdout)
    assert [e["file"].endswith("huge.py") and "too large" in e["message"] for e in data["errors"]] == [True], data
    assert matches_of(r.stdout) == MODEL_MATCHES
    assert r.returncode == 2


def _three_mb_model(path: Path) -> None:
    padding = "".join(f"# padding {i:06d} " + "x" * 80 + "\n" for i in range(31_000))
    path.write_text(MODEL + padding, encoding="utf-8")
    assert 3_000_000 < path.stat().st_size < 3_500_000


def test_p02_max_file_size_default_and_raised_scan(tmp_path):
    """A valid 3 MB model file is refused by default (2 MiB limit: too large, exit 2) and scanned with
    --max-file-size 4M; 0 means no limit, a plain byte count works, 512K refuses it."""
    _three_mb_model(tmp_path / "big.py")
    r = run_cli(["scan", tmp_path / "big.py", "--format", "json"])
    no_traceback(r)
    assert r.returncode == 2 and "too large" in json.loads(r.stdout)["errors"][0]["message"], r.stdout[-2000:]
    for size in ("4M", "0", "4000000"):
        r = run_cli(["scan", tmp_path / "big.py", "--format", "json", "--max-file-size", size])
        assert r.returncode == 0, (size, r.stderr)
        assert matches_of(r.stdout) == MODEL_MATCHES
    r = run_cli(["scan", tmp_path / "big.py", "--format", "json", "--max-file-size", "512K"])
    assert r.returncode == 2 and "too large" in r.stdout


def test_p02_max_file_size_default_and_raised_rewrite(tmp_path):
    """rewrite --write: the 3 MB file is refused by default (too large, exit 2, file untouched) and
    rewritten with --max-file-size 4M (exit 0)."""
    path = tmp_path / "big.py"
    _three_mb_model(path)
    before = path.read_bytes()
    r = run_cli(["rewrite", "--write", path])
    no_traceback(r)
    assert r.returncode == 2 and lines_with(r.stdout + r.stderr, "big.py", "too large"), r.stderr
    assert path.read_bytes() == before
    r = run_cli(["rewrite", "--write", path, "--max-file-size", "4M"])
    assert r.returncode == 0, r.stderr
    assert path.read_bytes() != before and "1 file(s) rewritten" in r.stderr


@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p02_bad_max_file_size_is_a_usage_error(tmp_path, command):
    """--max-file-size lots: one error line about the value (not an unknown option), exit 2."""
    d = model_dir(tmp_path)
    r = run_cli([command, d, "--max-file-size", "lots"])
    no_traceback(r)
    errors = lines_with(r.stderr, "error")
    assert len(errors) == 1 and "lots" in errors[0] and "unrecognized" not in r.stderr, r.stderr
    assert r.returncode == 2


# ------------------------------------------------------------------ 3. lost update


def test_p03_file_edited_during_write_is_not_overwritten(tmp_path):
    """A file saved by the user while --write analysed it keeps the user's edit (it is not replaced):
    one line says it changed since it was read, exit 2."""
    d = model_dir(tmp_path)
    path = d / "good.py"
    original = path.read_bytes()
    hook = "def before_replace(path):\n    with open(path, 'a') as f:\n        f.write('# user edit\\n')\n"
    r = run_cli(["rewrite", "--write", "-j", "1", d], hook=hook)
    no_traceback(r)
    assert path.read_bytes() == original + b"# user edit\n"
    assert len(lines_with(r.stderr, "good.py", "changed since it was read")) == 1, r.stderr
    assert r.returncode == 2


# ------------------------------------------------------------------ 4. symbolic link loops


def _loop_dir(tmp_path: Path) -> Path:
    d = model_dir(tmp_path)
    os.symlink("b.py", d / "a.py")
    os.symlink("a.py", d / "b.py")
    return d


def test_p04_symlink_loop_in_directory_scan(tmp_path):
    """scan DIR with a.py <-> b.py looping: one line per looping file (symbolic link loop), no
    traceback, exit 2, and the good file's matches still reported."""
    d = _loop_dir(tmp_path)
    r = run_cli(["scan", d])
    no_traceback(r)
    out = r.stdout + r.stderr
    assert len(lines_with(out, "a.py", "symbolic link loop")) == 1, out
    assert len(lines_with(out, "b.py", "symbolic link loop")) == 1, out
    assert r.returncode == 2
    r = run_cli(["scan", d, "--format", "json"])
    no_traceback(r)
    data = json.loads(r.stdout)
    loops = sorted(Path(e["file"]).name for e in data["errors"] if "symbolic link loop" in e["message"])
    assert loops == ["a.py", "b.py"], data["errors"]
    assert matches_of(r.stdout) == MODEL_MATCHES
    assert r.returncode == 2


def test_p04_symlink_loop_in_directory_rewrite(tmp_path):
    """rewrite DIR with a symbolic link loop: one line per looping file, no traceback, exit 2, the
    good file still rewritten (its diff printed)."""
    d = _loop_dir(tmp_path)
    r = run_cli(["rewrite", d])
    no_traceback(r)
    out = r.stdout + r.stderr
    assert len(lines_with(out, "a.py", "symbolic link loop")) == 1, out
    assert len(lines_with(out, "b.py", "symbolic link loop")) == 1, out
    assert "+++" in r.stdout and "good.py" in r.stdout
    assert r.returncode == 2


@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p04_symlink_loop_named_directly(tmp_path, command):
    """A looping link named on the command line is reported as a symbolic link loop (not as a
    missing file), exit 2."""
    d = _loop_dir(tmp_path)
    r = run_cli([command, d / "a.py"])
    no_traceback(r)
    out = r.stdout + r.stderr
    assert lines_with(out, "symbolic link loop") and "no such file" not in out.lower(), out
    assert r.returncode == 2


# ------------------------------------------------------------------ 5. encodings

ENCODED = {
    "latin1": ("# -*- coding: latin-1 -*-\n# café\n" + MODEL).encode("latin-1"),
    "eucjp": ("# -*- coding: euc-jp -*-\n# 日本語のコメント\n" + MODEL).encode("euc-jp"),
    "bom": b"\xef\xbb\xbf" + MODEL.encode("utf-8"),
}
CODECS = {"latin1": "latin-1", "eucjp": "euc-jp", "bom": "utf-8-sig"}


@pytest.mark.parametrize("kind", sorted(ENCODED))
def test_p05_scan_reads_coding_cookies_and_bom(tmp_path, kind):
    """A model file in latin-1 or euc-jp (with its coding cookie) or UTF-8 with a BOM is scanned as
    Python reads it: exit 0, the same 2 matches as the plain file."""
    path = tmp_path / f"{kind}.py"
    path.write_bytes(ENCODED[kind])
    r = run_cli(["scan", path, "--format", "json"])
    no_traceback(r)
    assert r.returncode == 0, r.stdout
    assert matches_of(r.stdout) == MODEL_MATCHES


def test_p05_scan_unknown_encoding_is_an_error(tmp_path):
    """A coding cookie naming no codec: an error saying unknown encoding, exit 2."""
    path = tmp_path / "nosuch.py"
    path.write_text("# -*- coding: nosuch -*-\n" + MODEL, encoding="ascii")
    r = run_cli(["scan", path, "--format", "json"])
    no_traceback(r)
    errors = json.loads(r.stdout)["errors"]
    assert len(errors) == 1 and "unknown encoding" in errors[0]["message"], errors
    assert r.returncode == 2


# ------------------------------------------------------------------ 6. mixed line endings


def _mixed_endings() -> bytes:
    lines = MODEL.splitlines()
    out = [line + ("\n" if i % 4 == 3 else "\r\n") for i, line in enumerate(lines)]
    out[-1] = lines[-1]  # no final newline
    return "".join(out).encode("utf-8")


def test_p06_mixed_line_endings_are_kept_line_by_line(tmp_path):
    """rewrite --write on a file with mostly CRLF and some LF lines (no final newline): every line
    outside the rewritten code keeps its exact bytes, ending included; still no final newline."""
    path = tmp_path / "mixed.py"
    original = _mixed_endings()
    path.write_bytes(original)
    r = run_cli(["rewrite", "--write", "-j", "1", path])
    assert r.returncode == 0, r.stderr
    new = path.read_bytes()
    assert new != original
    a, b = original.splitlines(keepends=True), new.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, [x.rstrip(b"\r\n") for x in a], [x.rstrip(b"\r\n") for x in b],
                                      autojunk=False)
    kept = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                assert a[i] == b[j], f"line {i + 1}: {a[i]!r} became {b[j]!r}"
            kept += i2 - i1
    assert kept >= len(a) - 5  # only the rewritten forward's lines differ
    assert not new.endswith((b"\n", b"\r"))


# ------------------------------------------------------------------ 7. unreadable directories


def _unreadable_tree(public_tmp: Path) -> Path:
    pkg = public_tmp / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for p in (pkg / "good.py", pkg / "sub" / "inner.py"):
        p.write_text(MODEL, encoding="utf-8")
        os.chmod(p, 0o644)
    os.chmod(pkg, 0o755)
    os.chmod(pkg / "sub", 0o000)
    try:
        probe = run_command([sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", str(pkg / "sub")],
                            as_user=NOBODY)
    except subprocess.SubprocessError as exc:  # e.g. no CAP_SETPCAP to give up the override
        pytest.skip(f"cannot run a child without root's permission override here: {exc}")
    if probe.returncode == 0:
        pytest.skip("cannot make a directory unreadable for the child process here")
    return pkg


def _unreadable_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "sub" in line and re.search(r"not readable|permission denied", line, re.IGNORECASE)]


def test_p07_unreadable_subdirectory_scan(public_tmp):
    """scan pkg with pkg/sub unreadable: an error naming sub (not readable / permission denied),
    exit 2, and the good file still scanned."""
    pkg = _unreadable_tree(public_tmp)
    r = run_cli(["scan", pkg, "--format", "json"], cwd=public_tmp, as_user=NOBODY)
    no_traceback(r)
    data = json.loads(r.stdout)
    assert _unreadable_lines("\n".join(e["file"] + ": " + e["message"] for e in data["errors"])), data
    assert matches_of(r.stdout) == MODEL_MATCHES
    assert r.returncode == 2
    r = run_cli(["scan", pkg], cwd=public_tmp, as_user=NOBODY)
    assert len(_unreadable_lines(r.stdout + r.stderr)) == 1 and r.returncode == 2, r.stdout + r.stderr


def test_p07_unreadable_subdirectory_rewrite(public_tmp):
    """rewrite pkg with pkg/sub unreadable: one line naming sub, exit 2, the good file's diff printed."""
    pkg = _unreadable_tree(public_tmp)
    r = run_cli(["rewrite", pkg], cwd=public_tmp, as_user=NOBODY)
    no_traceback(r)
    assert len(_unreadable_lines(r.stdout + r.stderr)) == 1, r.stdout + r.stderr
    assert "+++" in r.stdout and "good.py" in r.stdout
    assert r.returncode == 2


# ------------------------------------------------------------------ 8. a reader that stops early


def test_p08_closed_pipe_is_not_a_crash(tmp_path):
    """`adopter scan DIR | head -1` with far more than a pipe buffer of output: no traceback, no
    BrokenPipeError message, and not an error exit (0, or death by SIGPIPE)."""
    d = tmp_path / "many"
    d.mkdir()
    classes = "".join(MODEL.split("\n\n\nclass BertOutput")[0].replace("BertSelfOutput", f"SelfOutput{k}")
                      for k in range(10))
    for i in range(300):
        (d / f"model_{i:04d}.py").write_text(classes, encoding="utf-8")
    proc = subprocess.Popen(cli_command(["scan", d]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_preexec(None))
    try:
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace")
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("scan did not end after its reader closed the pipe")
    assert first.strip()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
    assert rc in (0, 141, -signal.SIGPIPE), (rc, err[-2000:])


# ------------------------------------------------------------------ 9. rule files that are not UTF-8


@pytest.mark.parametrize("command", ["scan", "rewrite"])
def test_p09_rules_file_not_utf8_is_a_one_line_error(tmp_path, command):
    """A --rules-file with latin-1 bytes: one error line about the rules file, no traceback, exit 2."""
    d = model_dir(tmp_path)
    rules = tmp_path / "mine.rules"
    rules.write_bytes(b"rule x\n# caf\xe9\n")
    r = run_cli([command, d, "--rules-file", rules])
    no_traceback(r)
    assert len(r.stderr.strip().splitlines()) == 1 and "rules file" in r.stderr, r.stderr
    assert r.returncode == 2


# ------------------------------------------------------------------ 10. optimize() on a changed module

OPTIMIZE_MODULE = """\
import torch
from torch import nn


class Config:
    hidden_size = 16
    layer_norm_eps = 1e-12
    hidden_dropout_prob = 0.1


class SelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states
"""

OPTIMIZE_SCRIPT = """\
import importlib, json, os
sys.path.insert(0, {where!r})
import torch
from adopter import optimize
from adopter.errors import OptimizeError  # noqa: F401
modules = {{case: importlib.import_module("mymod_" + case) for case in ("kept", "deleted", "edited")}}
os.remove(modules["deleted"].__file__)
path = modules["edited"].__file__
with open(path) as f:
    text = f.read()
with open(path, "w") as f:
    f.write(text.replace("self.dense(hidden_states)", "self.dense(hidden_states) * 2"))
for case, mod in modules.items():
    try:
        optimize(mod.SelfOutput, init_args=(mod.Config(),),
                 example_inputs=(torch.randn(2, 3, 16), torch.randn(2, 3, 16)))
        print(json.dumps([case, "ok", ""]))
    except Exception as exc:
        print(json.dumps([case, type(exc).__name__, str(exc)]))
"""


def test_p10_optimize_refuses_a_module_changed_since_import(tmp_path):
    """optimize() on a class whose module file was deleted or edited after import raises OptimizeError
    saying the source changed since it was imported (never a FileNotFoundError, never an equivalence
    verdict about code that is not what runs); an untouched module is optimized."""
    pytest.importorskip("torch")
    for case in ("kept", "deleted", "edited"):
        (tmp_path / f"mymod_{case}.py").write_text(OPTIMIZE_MODULE, encoding="utf-8")
    code = BOOT.format(root=str(ROOT)) + OPTIMIZE_SCRIPT.format(where=str(tmp_path))
    r = run_command([sys.executable, "-c", code], cwd=tmp_path, timeout=300, preexec=False)
    assert r.returncode == 0, r.stderr[-3000:]
    results = {case: (kind, message) for case, kind, message in map(json.loads, r.stdout.splitlines())}
    assert results["kept"] == ("ok", ""), results
    for case in ("deleted", "edited"):
        kind, message = results[case]
        assert kind == "OptimizeError" and "changed since" in message, (case, kind, message)


# ------------------------------------------------------------------ 11. stale temporary files

KILL_HOOK = "import os, signal\ndef before_replace(path):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
TEMP_NAME = re.compile(r"^\.adopter-(\d+)-.+\.tmp$")


def test_p11_killed_write_leaves_original_and_a_named_temp_file_that_the_next_run_removes(tmp_path):
    """A --write killed between writing its temporary file and replacing the source leaves the source
    as it was and a .adopter-<pid>-<random>.tmp of the dead writer; the next --write removes that file
    and rewrites the source, leaving alone a user's .adopter-notes.tmp and a live process's temp file."""
    d = model_dir(tmp_path, files=("m.py",))
    original = (d / "m.py").read_bytes()
    r = run_cli(["rewrite", "--write", "-j", "1", d], hook=KILL_HOOK)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (d / "m.py").read_bytes() == original
    (stale,) = [p.name for p in d.iterdir() if p.name.startswith(".adopter-")]
    match = TEMP_NAME.match(stale)
    assert match and int(match.group(1)) == r.pid, stale
    notes, live = d / ".adopter-notes.tmp", d / f".adopter-{os.getpid()}-abc.tmp"
    notes.write_text("mine\n")
    live.write_text("in use\n")
    r = run_cli(["rewrite", "--write", "-j", "1", d])
    assert r.returncode == 0, r.stderr
    assert not (d / stale).exists()
    assert notes.read_text() == "mine\n" and live.read_text() == "in use\n"
    new = (d / "m.py").read_bytes()
    assert new != original
    compile(new, "m.py", "exec")


# ------------------------------------------------------------------ 12. form feeds


def test_p12_form_feed_lines_do_not_stop_rewrites(tmp_path):
    """A form feed alone on the first line, or between the imports and the class, changes nothing:
    as many rewrites as in the plain file, and the rewritten files compile."""
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "plain.py").write_text(MODEL, encoding="utf-8")
    (d / "ff_first.py").write_text("\x0c\n" + MODEL, encoding="utf-8")
    (d / "ff_middle.py").write_text(MODEL.replace("from torch import nn\n", "from torch import nn\n\x0c\n"),
                                    encoding="utf-8")
    r = run_cli(["rewrite", "--write", "--format", "json", "-j", "1", d])
    assert r.returncode == 0, r.stderr
    applied = {Path(f["file"]).name: len(f["applied"]) for f in json.loads(r.stdout)["files"]}
    assert applied["plain.py"] >= 1
    assert applied["ff_first.py"] == applied["ff_middle.py"] == applied["plain.py"], applied
    for p in d.glob("*.py"):
        compile(p.read_bytes(), str(p), "exec")


# ------------------------------------------------------------------ 13. owner, mode and hard links


@needs_root
def test_p13_write_keeps_owner_group_and_mode(tmp_path):
    """--write on a file owned by another user (mode 0640): rewritten, and still that owner, group
    and mode."""
    path = tmp_path / "m.py"
    path.write_text(MODEL, encoding="utf-8")
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o640)
    r = run_cli(["rewrite", "--write", "-j", "1", path])
    assert r.returncode == 0, r.stderr
    assert path.read_text(encoding="utf-8") != MODEL
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o640)


def test_p13_write_refuses_a_hard_linked_file(tmp_path):
    """--write on a file with a second hard link leaves both names unchanged (still one inode),
    one line says it is a hard link, exit 2."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(MODEL, encoding="utf-8")
    os.link(a, b)
    r = run_cli(["rewrite", "--write", "-j", "1", a])
    no_traceback(r)
    assert len(lines_with(r.stdout + r.stderr, "a.py", "hard link")) == 1, r.stdout + r.stderr
    assert a.read_text(encoding="utf-8") == b.read_text(encoding="utf-8") == MODEL
    assert a.stat().st_ino == b.stat().st_ino and a.stat().st_nlink == 2
    assert r.returncode == 2


# ------------------------------------------------------------------ 14. two runs at once


def test_p14_concurrent_runs_do_not_claim_each_others_writes(tmp_path):
    """Run B rewrites the tree while run A is between reading and replacing its first file: A replaces
    nothing (the files already hold its result) and says so (0 written, exit 0), B wrote 3, and each
    file is rewritten exactly once."""
    d = model_dir(tmp_path, files=("m1.py", "m2.py", "m3.py"))
    b_out = tmp_path / "b.json"
    cmd_b = cli_command(["rewrite", "--write", "-j", "1", "--format", "json", d])
    hook = (
        "import subprocess\n"
        "_calls = []\n"
        "def before_replace(path):\n"
        "    _calls.append(path)\n"
        "    if len(_calls) == 1:\n"
        f"        with open({str(b_out)!r}, 'w') as out:\n"
        f"            rc = subprocess.run({cmd_b!r}, stdout=out, timeout=120).returncode\n"
        f"        open({str(b_out) + '.rc'!r}, 'w').write(str(rc))\n"
    )
    a = run_cli(["rewrite", "--write", "-j", "1", "--format", "json", d], hook=hook, timeout=180)
    no_traceback(a)
    assert b_out.exists(), "run B never ran: before_replace was not called"
    assert Path(str(b_out) + ".rc").read_text() == "0"
    assert written_count(b_out.read_text()) == 3
    assert written_count(a.stdout) == 0, a.stdout
    assert a.returncode == 0, a.stderr
    once = clean_rewrite(MODEL.encode("utf-8"), tmp_path)
    assert all((d / f"m{i}.py").read_bytes() == once for i in (1, 2, 3))
    assert run_cli(["rewrite", "--check", d]).returncode == 0


# ------------------------------------------------------------------ guarantees that already held


def test_already_holds_scan_never_executes_scanned_code(tmp_path):
    """Already holds (before issue 23): scan never imports or runs the scanned code."""
    marker = tmp_path / "MARKER"
    path = tmp_path / "evil.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\n" + MODEL, encoding="utf-8")
    r = run_cli(["scan", path, "--format", "json"])
    assert r.returncode == 0, r.stderr
    assert matches_of(r.stdout) == MODEL_MATCHES
    assert not marker.exists()


def test_already_holds_read_only_commands_change_no_byte(tmp_path):
    """Already holds (before issue 23): scan, rewrite --diff and rewrite --check change no file
    (content, mtime, mode) and create none."""
    d = model_dir(tmp_path, files=("a.py", "b.py"))
    (d / "sub").mkdir()
    (d / "sub" / "c.py").write_bytes(_mixed_endings())
    (d / "sub" / "latin.py").write_bytes(ENCODED["latin1"])
    (d / "broken.py").write_text("def f(:\n", encoding="utf-8")
    (d / "notes.txt").write_text("not python\n", encoding="utf-8")
    before = snapshot(tmp_path)
    for args in (["scan", d], ["scan", d, "--format", "json"], ["rewrite", d], ["rewrite", "--diff", d],
                 ["rewrite", "--check", d], ["rewrite", "--format", "json", d]):
        r = run_cli(args)
        no_traceback(r)
        assert snapshot(tmp_path) == before, args


@pytest.mark.parametrize("kind", sorted(ENCODED))
def test_already_holds_rewrite_keeps_encoding_and_bom(tmp_path, kind):
    """Already holds (before issue 23): rewrite --write keeps a file's encoding (coding cookie) and BOM."""
    path = tmp_path / f"{kind}.py"
    path.write_bytes(ENCODED[kind])
    r = run_cli(["rewrite", "--write", "-j", "1", path])
    assert r.returncode == 0, r.stderr
    new = path.read_bytes()
    assert new != ENCODED[kind]
    text = new.decode(CODECS[kind])  # still decodes with the file's codec
    assert text.splitlines()[:2] == ENCODED[kind].decode(CODECS[kind]).splitlines()[:2]
    assert new.startswith(b"\xef\xbb\xbf") == (kind == "bom")


# Kills the writer when the n-th distinct file reaches the write window: at before_replace where it
# exists, else (code from before the hook) at os.replace onto the .py file.
KILL_AT_WINDOW = """\
import os, signal
_seen = []
def _window(path):
    path = os.path.abspath(path)
    if path not in _seen:
        _seen.append(path)
    if len(_seen) >= {n}:
        os.kill(os.getpid(), signal.SIGKILL)
def before_replace(path):
    _window(path)
_replace = os.replace
def _checked_replace(src, dst, *args, **kwargs):
    if str(dst).endswith(".py"):
        _window(dst)
    return _replace(src, dst, *args, **kwargs)
os.replace = _checked_replace
"""


def test_already_holds_kill_in_write_window_leaves_whole_files(tmp_path):
    """Already holds (before issue 23): a --write killed -9 in the write window leaves the file as it
    was; killed at the second file's window, the first file is completely rewritten (the result of a
    clean rewrite, it compiles) and the second untouched."""
    d = model_dir(tmp_path, files=("m1.py", "m2.py"))
    original = (d / "m1.py").read_bytes()
    r = run_cli(["rewrite", "--write", "-j", "1", d / "m1.py"], hook=KILL_AT_WINDOW.format(n=1))
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (d / "m1.py").read_bytes() == original
    r = run_cli(["rewrite", "--write", "-j", "1", d], hook=KILL_AT_WINDOW.format(n=2))
    assert r.returncode == -signal.SIGKILL, r.stderr
    first = (d / "m1.py").read_bytes()
    compile(first, "m1.py", "exec")
    assert first == clean_rewrite(original, tmp_path)
    assert (d / "m2.py").read_bytes() == original
