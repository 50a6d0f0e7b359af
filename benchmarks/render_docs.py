"""Run the commands whose output README.md and docs/*.md show, record each run, and render the
documents' output blocks and figures from those records.

    python benchmarks/render_docs.py                    # run everything, then re-render (minutes)
    python benchmarks/render_docs.py --skip-long        # everything but the multi-minute runs
    python benchmarks/render_docs.py --only NAME[,NAME] # run some entries, then re-render
    python benchmarks/render_docs.py --render-only      # re-render from the stored records
    python benchmarks/render_docs.py --check            # exit 1 when a document is not rendered
    python benchmarks/render_docs.py --list             # the entries, their commands and last runs

Each entry runs as a subprocess, as a user would type it (stdout and stderr together, in the
order written), and leaves ``benchmarks/results/docs/<name>.json``: the command, the directory it
ran in, its output and exit status, wall time, the date, the git commit (and the uncommitted
changes to code at the time), the Python, torch and transformers versions, CPU count and load,
and the figures the documents quote, computed from that run. A run whose exit status is not one
the entry expects (a traceback, say) is reported and not recorded.

The documents hold two kinds of markers; everything between a marker and ``<!-- /render_docs -->``
is replaced on rendering:

    <!-- render_docs: NAME -->        the output of entry NAME as a fenced block, then one line
    ...                               naming the command, the run (date, commit, versions) and
    <!-- /render_docs -->             the results file

    text <!-- render_docs: NAME#FIGURE -->275 s<!-- /render_docs --> text   (one figure, inline)

``tests/cli/test_docs_rendered.py`` checks that every marker's text is what rendering produces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "docs"
FORMAT = "adopter-render-docs/1"

# Changes to these paths cannot change a command's output (the README's Python blocks, which
# can, are stored in the record itself): they do not count as uncommitted code changes.
DOC_PATHS = ("README.md", "docs/", "benchmarks/results/docs/", "benchmarks/render_docs.py",
             "tests/cli/test_docs_rendered.py")

MARKER = re.compile(
    r"<!-- render_docs: (?P<name>[A-Za-z0-9_.-]+)(?:#(?P<figure>[A-Za-z0-9_.-]+))? -->"
    r"(?P<body>.*?)<!-- /render_docs -->",
    re.S,
)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def result_path(name: str) -> Path:
    return RESULTS / f"{name}.json"


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------------------------
# Figures: computed once, at run time, from the run's output and the files it wrote.

Figures = Callable[["RunOutput"], dict]


@dataclass
class RunOutput:
    output: str
    wall_s: float
    load_average_1min: float
    cwd: Path

    def json_file(self, name: str) -> dict:
        return json.loads((self.cwd / name).read_text())


def _wall(run: RunOutput) -> dict:
    return {"wall": f"{run.wall_s:.0f} s", "load": f"{run.load_average_1min:.2f}"}


def _verify_figures(json_name: str) -> Figures:
    def figures(run: RunOutput) -> dict:
        bench = run.json_file(json_name)["benchmark"]
        original, optimized = bench["original"], bench["optimized"]
        return {
            **_wall(run),
            "speed_ratio": f"{bench['speed_ratio']:.3f}",
            "speed_interval": f"{bench['speed_ratio_low']:.2f}–{bench['speed_ratio_high']:.2f}",
            "medians_ratio": f"{optimized['throughput'] / original['throughput']:.3f}",
            "median_step_original": f"{original['median_s'] * 1000:.0f} ms",
            "blocks": str(bench["blocks"]),
            "threads": str(bench["threads"]),
            **({"memory_ratio": f"{bench['memory_ratio']:.3f}"} if bench.get("memory_ratio") is not None else {}),
        }

    return figures


_PYTEST_SUMMARY = re.compile(r"^=*\s*(?P<outcome>\d+ (?:passed|failed|error)[^=]*?) in [0-9.]+s", re.M)
_PYTEST_SLOWEST = re.compile(r"^(?P<seconds>[0-9.]+)s (?:call|setup|teardown)\s+(?P<test>\S+)", re.M)


def _pytest_figures(run: RunOutput) -> dict:
    summary = _PYTEST_SUMMARY.search(run.output)
    if summary is None:
        raise ValueError("no pytest summary line in the output")
    figures = {**_wall(run), "wall_minutes": f"{run.wall_s / 60:.1f} minutes", "outcome": summary["outcome"].strip()}
    slowest = _PYTEST_SLOWEST.search(run.output)
    if slowest is not None:
        figures["slowest"] = f"{slowest['test']}, {float(slowest['seconds']):.0f} s"
    return figures


# ---------------------------------------------------------------------------------------------
# Entries: what the documents show.


@dataclass(frozen=True)
class Entry:
    name: str
    argv: tuple[str, ...]
    what: str
    shown: str = ""  # how the footer names the command; default: the command in backticks
    in_temp_dir: bool = False  # run in a fresh directory (the command writes files)
    copy_in: tuple[str, ...] = ()  # repository files the command reads, copied into that directory
    keep: tuple[str, ...] = ()  # files it writes there that are kept next to the record
    fence: str = ""  # the block's info string: "text" is reserved for the README's Python output
    expected_status: tuple[int, ...] = (0,)
    long: bool = False
    timeout_s: int = 600
    figures: Figures | None = None
    script: Callable[[], str] | None = None  # a Python script written to the directory as argv[1]
    env: dict = field(default_factory=dict)

    @property
    def command(self) -> str:
        return " ".join(_quote(a) for a in self.argv)


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[A-Za-z0-9_./=%@:,+-]+", arg) else f'"{arg}"'


def readme_python_blocks() -> str:
    readme = (ROOT / "README.md").read_text()
    return "\n\n".join(re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M))


def _stacking_figures(case: str) -> Figures:
    """Figures of a bench_stacking.py run: per variant the CPU-time speed vs eager and the peak
    memory vs eager; compile of optimized against optimized and against compile (per batch for
    inference cases: ``_b<batch>`` suffixes)."""

    def figures(run: RunOutput) -> dict:
        data = run.json_file(f"benchmarks/results/stacking_{case}.json")
        out = _wall(run)
        for r in data["runs"]:
            tag = f"_b{r['batch']}" if r["mode"] != "train" else ""
            for name, v in r["variants"].items():
                key = name.replace("+", "_")
                low, high = v["cpu_speed_ci95"]
                out[f"{key}_speed{tag}"] = f"{v['cpu_speed']:.2f}"
                out[f"{key}_interval{tag}"] = f"{low:.2f}–{high:.2f}"
                out[f"{key}_memory{tag}"] = f"{v['memory_vs_eager']:.2f}"
            target = r.get("target") or {}
            if target:
                out[f"vs_optimized{tag}"] = "{:.2f} [{:.2f}–{:.2f}]".format(*target["speed_vs_optimized_cpu"])
                out[f"vs_compile{tag}"] = "{:.2f} [{:.2f}–{:.2f}]".format(*target["speed_vs_compile_cpu"])
                out[f"memory_vs_optimized{tag}"] = f"{target['memory_vs_optimized']:.2f}"
                out[f"target{tag}"] = "met" if target.get("met") else "not met"
        return out

    return figures


def _inference_figures(json_name: str) -> Figures:
    def figures(run: RunOutput) -> dict:
        result = run.json_file(json_name)
        out = _wall(run)
        for b in result["benchmark"].get("sweep") or [result["benchmark"]]:
            tag = f"_b{b['batch_size']}"
            out[f"speed_ratio{tag}"] = f"{b['speed_ratio']:.3f}"
            out[f"speed_interval{tag}"] = f"{b['speed_ratio_low']:.2f}–{b['speed_ratio_high']:.2f}"
            out[f"latency_original{tag}"] = f"{b['original']['median_s'] * 1000:.0f} ms"
            out[f"latency_optimized{tag}"] = f"{b['optimized']['median_s'] * 1000:.0f} ms"
            out[f"memory_ratio{tag}"] = f"{b['memory_ratio']:.3f}"
        return out

    return figures


def _load_figures(model: str) -> Figures:
    def figures(run: RunOutput) -> dict:
        data = run.json_file(f"benchmarks/results/verify_load_{model}.json")
        out = {**_wall(run), "consistent": "consistent" if data["consistent"] else "NOT consistent"}
        for name in ("quiet", "loaded"):
            r = data[name]
            out[f"{name}_ratio"] = f"{r['speed_ratio']:.3f}"
            out[f"{name}_interval"] = f"{r['speed_ratio_low']:.2f}–{r['speed_ratio_high']:.2f}"
            out[f"{name}_wall_ratio"] = f"{r['speed_ratio_wall']:.3f}"
            out[f"{name}_wall_interval"] = f"{r['speed_ratio_wall_low']:.2f}–{r['speed_ratio_wall_high']:.2f}"
            out[f"{name}_load"] = f"{r['load']:.2f}"
            out[f"{name}_verdict"] = r["verdict"]
        return out

    return figures


ENTRIES = [  # in running order: the test suite last, as it checks the documents the others render
    Entry(
        "readme-scan",
        ("adopter", "scan", "tests/fixtures/optimize/toy_pkg"),
        "README: static matches in a small model package",
    ),
    Entry(
        "readme-rewrite",
        ("adopter", "rewrite", "tests/fixtures/optimize/toy_pkg"),
        "README: the rewrite of that package, as a diff (nothing written)",
        fence="diff",
    ),
    Entry(
        "readme-scan-reach",
        ("adopter", "scan", "tests/fixtures/reach/tv_resnet.py", "tests/corpus/styles/lookalikes_acts.py"),
        "README: a torchvision-style ResNet (helper convs, norm_layer, Sequential downsample) and look-alikes",
    ),
    Entry(
        "readme-rewrite-reach",
        ("adopter", "rewrite", "tests/fixtures/reach/tv_resnet.py"),
        "README: the rewrite of that ResNet, as a diff (nothing written)",
        fence="diff",
    ),
    Entry(
        "readme-python-api",
        ("python", "readme_snippets.py"),
        "README: what the README's Python blocks print (tests/cli/test_readme_snippets.py compares it too)",
        shown="the README's Python blocks run as one script (`python readme_snippets.py`)",
        in_temp_dir=True, fence="text", script=readme_python_blocks, env={"PYTHONPATH": str(ROOT)},
    ),
    Entry(
        "gate-tiny-bert",
        ("adopter", "verify", "--model", "tiny-bert", "--baseline", "benchmarks/baselines/tiny-bert.json",
         "--max-regression", "5%"),
        "docs/ci-gate.md: this project's own gate (`make gate`) and how to read its output",
        in_temp_dir=True, copy_in=("benchmarks/baselines/tiny-bert.json",), expected_status=(0, 1),
        figures=_wall,
    ),
    *(
        Entry(
            f"tiny-bert-threads-{threads}",
            ("adopter", "verify", "--model", "tiny-bert", "--threads", str(threads), "--blocks", "20",
             "--json", "verify.json"),
            f"docs/ci-gate.md: tiny-bert step times and speed-ratio interval with {threads} thread(s)",
            in_temp_dir=True, keep=("verify.json",), figures=_verify_figures("verify.json"),
        )
        for threads in (1, 2)
    ),
    Entry(
        "readme-verify-bert",
        ("adopter", "verify", "--model", "bert-base-uncased", "--json", "bert.json", "--plot", "bert.png"),
        "README: the main job, bert-base-uncased optimized, proven equivalent and benchmarked",
        in_temp_dir=True, keep=("bert.json",), long=True, timeout_s=3600,
        figures=_verify_figures("bert.json"),
    ),
    Entry(
        "readme-verify-llama-tiny",
        ("adopter", "verify", "--model", "llama-tiny", "--json", "llama.json"),
        "README: the LLM rule pack on llama-tiny (batch 4, seq 512): rewrites, equivalence, speed and memory",
        in_temp_dir=True, keep=("llama.json",), timeout_s=1800, figures=_verify_figures("llama.json"),
    ),
    Entry(
        "stacking-llama-tiny",
        ("python", "benchmarks/bench_stacking.py", "--cases", "llama-tiny"),
        "README: llama-tiny training, eager / optimized / torch.compile / compile of optimized, and the per-kernel "
        "ablation (benchmarks/results/stacking_llama-tiny.json)",
        long=True, timeout_s=2400, figures=_stacking_figures("llama-tiny"),
    ),
    Entry(
        "stacking-resnet-50",
        ("python", "benchmarks/bench_stacking.py", "--cases", "resnet-50"),
        "README: ResNet-50 inference, the four variants at batch 1 and 8 (benchmarks/results/stacking_resnet-50.json)",
        long=True, timeout_s=2400, figures=_stacking_figures("resnet-50"),
    ),
    Entry(
        "verify-resnet-inference",
        ("adopter", "verify", "--model", "microsoft/resnet-50", "--mode", "inference", "--channels-last",
         "--json", "resnet.json"),
        "README: ResNet-50 CPU inference, eval under no_grad, batch 1 and 8, channels_last inputs",
        in_temp_dir=True, keep=("resnet.json",), timeout_s=1800, figures=_inference_figures("resnet.json"),
    ),
    Entry(
        "verify-resnet-inference-nchw",
        ("adopter", "verify", "--model", "microsoft/resnet-50", "--mode", "inference", "--no-ablation",
         "--json", "resnet.json"),
        "README: the same with contiguous (NCHW) inputs",
        in_temp_dir=True, keep=("resnet.json",), timeout_s=1800, figures=_inference_figures("resnet.json"),
    ),
    Entry(
        "verify-load-llama-tiny",
        ("python", "benchmarks/bench_verify_load.py", "llama-tiny"),
        "README: the load test: verify llama-tiny quiet, then while 4 busy processes saturate both cores "
        "(benchmarks/results/verify_load_llama-tiny.json)",
        long=True, timeout_s=1800, figures=_load_figures("llama-tiny"),
    ),
    Entry(
        "lm-head-memory",
        ("python", "benchmarks/bench_lm_head_memory.py", "--rounds", "3"),
        "README: nanoGPT-style model at GPT-2's vocabulary (50,304), batch 4 x 512 on CPU: rules applied, "
        "equivalence, training-step peak memory (benchmarks/results/lm_head_memory.json)",
        long=True, timeout_s=1800, figures=_wall,
    ),
    Entry(
        "tests-fast",
        ("python", "-m", "pytest", "-q", "-m", "not slow", "-n", "auto", "-p", "no:cacheprovider"),
        "README: the fast test subset's size and wall time",
        expected_status=(0, 1), timeout_s=1800, figures=_pytest_figures,
    ),
    Entry(
        "tests-full",
        ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=1"),
        "README: the whole test suite's size and wall time, and its slowest test",
        expected_status=(0, 1), long=True, timeout_s=3600, figures=_pytest_figures,
    ),
]


BY_NAME = {entry.name: entry for entry in ENTRIES}


# ---------------------------------------------------------------------------------------------
# Running.


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_entry(entry: Entry) -> dict:
    changed = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()]
    record = {
        "format": FORMAT,
        "name": entry.name,
        "what": entry.what,
        "command": entry.command,
        "shown": entry.shown or f"`{entry.command}`",
        "cwd": "a fresh temporary directory" if entry.in_temp_dir else "the repository root",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": _git("rev-parse", "HEAD").strip(),
        "uncommitted_code_changes": [path for path in changed if not path.startswith(DOC_PATHS)],
        "uncommitted_doc_changes": [path for path in changed if path.startswith(DOC_PATHS)],
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_1min_before": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory(prefix=f"render_docs_{entry.name}_") as temp:
        cwd = Path(temp) if entry.in_temp_dir else ROOT
        for name in entry.copy_in:
            (cwd / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, cwd / name)
        if entry.script is not None:
            record["script"] = entry.script()
            (cwd / entry.argv[1]).write_text(record["script"])
        argv = [sys.executable if entry.argv[0] == "python" else entry.argv[0], *entry.argv[1:]]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **entry.env)  # unbuffered: the true order of stdout/stderr
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=entry.timeout_s, check=False)
        record["wall_s"] = round(time.perf_counter() - start, 2)
        record["load_average_1min_after"] = round(os.getloadavg()[0], 2)
        record["exit_status"] = proc.returncode
        record["output"] = proc.stdout
        if proc.returncode not in entry.expected_status:
            raise RunFailed(f"{entry.name}: exit status {proc.returncode}, expected {entry.expected_status}; "
                            f"output ends:\n{proc.stdout[-3000:]}")
        run = RunOutput(proc.stdout, record["wall_s"], record["load_average_1min_before"], cwd)
        record["figures"] = entry.figures(run) if entry.figures else {}
        record["kept_files"] = {}
        for name in entry.keep:
            kept = RESULTS / f"{entry.name}.{name}"
            shutil.copyfile(cwd / name, kept)
            record["kept_files"][name] = relative(kept)
    return record


class RunFailed(Exception):
    pass


def save(record: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(record["name"])
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Rendering: a pure function of the document text and the records.


def load_record(name: str) -> dict:
    path = result_path(name)
    if not path.exists():
        raise RenderError(f"no results file {relative(path)} (run: python benchmarks/render_docs.py --only {name})")
    return json.loads(path.read_text())


class RenderError(Exception):
    pass


def footer(record: dict) -> str:
    date = record["date"].replace("T", " ")[:16] + " UTC"
    changes = record["uncommitted_code_changes"]
    commit = record["git_commit"][:7] + (f" plus uncommitted changes to {len(changes)} file(s)" if changes else "")
    transformers = f", transformers {record['transformers']}" if record.get("transformers") else ""
    machine = f"Python {record['python']}, torch {record['torch']}{transformers}, {record['cpu_count']} CPUs"
    return (f"(output of {record['shown']}, run {date} at {commit}; {machine}; exit status {record['exit_status']}, "
            f"{record['wall_s']:.0f} s; results file {relative(result_path(record['name']))})")


def render_block(record: dict, fence_info: str) -> str:
    lines = [line.rstrip() for line in record["output"].rstrip().splitlines()]
    fence = "```"
    while any(line.lstrip().startswith(fence) for line in lines):
        fence += "`"
    body = "\n".join(lines)
    return f"\n{fence}{fence_info}\n{body}\n{fence}\n\n{footer(record)}\n"


def render_figure(record: dict, figure: str) -> str:
    try:
        return record["figures"][figure]
    except KeyError:
        raise RenderError(f"{record['name']}: no figure {figure!r} in {relative(result_path(record['name']))} "
                          f"(it has {sorted(record['figures'])})") from None


def render(text: str, records: Callable[[str], dict] = load_record, missing_ok: bool = False) -> str:
    """``text`` with every marker's body replaced by what the records say (a marker without a
    record is an error, or left as it is with ``missing_ok``)."""

    def replace(match: re.Match) -> str:
        name, figure = match["name"], match["figure"]
        try:
            record = records(name)
        except RenderError:
            if missing_ok:
                return match.group(0)
            raise
        if figure:
            body = render_figure(record, figure)
        else:
            entry = BY_NAME.get(name)
            body = render_block(record, entry.fence if entry else "")
        whole, start = match.group(0), match.start()
        return whole[: match.start("body") - start] + body + whole[match.end("body") - start:]

    return MARKER.sub(replace, text)


def markers(text: str) -> list[tuple[str, str | None]]:
    return [(m["name"], m["figure"]) for m in MARKER.finditer(text)]


def render_documents(write: bool, missing_ok: bool = False) -> list[Path]:
    """Re-render every document; returns the ones whose text changed (written when ``write``)."""
    changed = []
    for path in documents():
        text = path.read_text()
        rendered = render(text, missing_ok=missing_ok)
        if rendered != text:
            changed.append(path)
            if write:
                path.write_text(rendered)
    return changed


# ---------------------------------------------------------------------------------------------


def list_entries() -> None:
    used = {}
    for path in documents():
        for name, figure in markers(path.read_text()):
            used.setdefault(name, set()).add(relative(path) + ("" if figure is None else f" (#{figure})"))
    for entry in ENTRIES:
        path = result_path(entry.name)
        last = json.loads(path.read_text())["date"] if path.exists() else "never run"
        print(f"{entry.name}{'  [long]' if entry.long else ''}\n  {entry.command}\n  {entry.what}\n"
              f"  last run: {last}; used in: {', '.join(sorted(used.get(entry.name, ()))) or 'nothing'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]",
                        help="run only these entries (repeatable), then re-render")
    parser.add_argument("--skip-long", action="store_true", help="skip the multi-minute entries")
    parser.add_argument("--render-only", action="store_true", help="re-render from the stored records, run nothing")
    parser.add_argument("--check", action="store_true", help="run nothing; exit 1 when a document is not rendered")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    args = parser.parse_args(argv)

    if args.list:
        list_entries()
        return 0
    if args.check:
        stale = render_documents(write=False)
        for path in stale:
            print(f"not rendered from its results files: {relative(path)}", file=sys.stderr)
        return 1 if stale else 0

    failed = []
    if not args.render_only:
        names = [name for value in args.only for name in value.split(",") if name]
        unknown = [name for name in names if name not in BY_NAME]
        if unknown:
            parser.error(f"unknown entries {unknown}; known: {', '.join(BY_NAME)}")
        selected = [BY_NAME[name] for name in names] if names else [
            entry for entry in ENTRIES if not (args.skip_long and entry.long)]
        for entry in selected:
            print(f"running {entry.name}: {entry.command}", file=sys.stderr, flush=True)
            try:
                record = run_entry(entry)
            except (RunFailed, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as error:
                print(f"  FAILED, not recorded: {error}", file=sys.stderr)
                failed.append(entry.name)
                continue
            print(f"  exit {record['exit_status']}, {record['wall_s']:.0f} s -> {relative(save(record))}",
                  file=sys.stderr)
            # at once, so that a later entry (the test suite checks the documents) sees them rendered
            render_documents(write=True, missing_ok=True)
    try:
        for path in render_documents(write=True):
            print(f"rendered {relative(path)}", file=sys.stderr)
    except RenderError as error:
        print(f"render_docs: {error}", file=sys.stderr)
        return 2
    if failed:
        print(f"not recorded (previous results kept): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
