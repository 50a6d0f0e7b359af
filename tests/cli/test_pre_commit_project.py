"""The pre-commit hook as a project uses it (issue 35, item 3): the hook's entry, exactly as
``.pre-commit-hooks.yaml`` defines it, run from the project's root on the files pre-commit would
pass, in a project with a ``[tool.adopter]`` table, a baseline file and suppression comments.
pre-commit itself is not needed: it runs ``<entry> <files>`` and reads the exit status."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def hook_entry() -> list[str]:
    """The entry of the adopter-rewrite-check hook (its args appended), read from the file."""
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    block = text[text.index("- id: adopter-rewrite-check"):]
    entry = re.search(r"^\s+entry:\s*(.+)$", block, flags=re.M).group(1)
    args = re.search(r"^\s+args:\s*\[(.*)\]$", block, flags=re.M)
    return shlex.split(entry) + (shlex.split(args.group(1).replace(",", " ")) if args else [])


def run_hook(project: Path, *files: str) -> subprocess.CompletedProcess:
    entry = hook_entry()
    assert entry[0] == "adopter"  # the console script: `python -m adopter` here
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath)
    return subprocess.run([sys.executable, "-m", "adopter", *entry[1:], *files], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


SOFTMAX = "import torch\nfrom torch import nn\n\n\nclass {name}(nn.Module):\n    def forward(self, x):\n{body}"


def source(name: str, body: str) -> str:
    return SOFTMAX.format(name=name, body=textwrap.indent(textwrap.dedent(body), " " * 8))


def test_the_hook_in_a_project_with_settings_a_baseline_and_suppressions(tmp_path):
    project = tmp_path
    (project / ".git").mkdir()
    settings = textwrap.dedent("""\
        [project]
        name = "shop"

        [tool.adopter]
        ignore = ["fused_QKV"]
        per-file-ignores = {"tests/*" = ["softmax"]}
        exclude = ["generated/*"]
        """)
    (project / "pyproject.toml").write_text(settings)
    (project / "models").mkdir()
    (project / "tests").mkdir()
    (project / "generated").mkdir()
    legacy = project / "models" / "legacy.py"
    legacy.write_text(source("Legacy", "return torch.softmax(x, dim=-1)\n"))
    (project / "models" / "quiet.py").write_text(source(
        "Quiet", "return torch.softmax(x, dim=-1)  # adopter: ignore[softmax] -- measured slower on our GPUs\n"))
    (project / "tests" / "test_probs.py").write_text(source("Probe", "return torch.softmax(x, dim=-1)\n"))
    (project / "generated" / "gen.py").write_text(source("Gen", "return torch.softmax(x, dim=-1)\n"))
    (project / "models" / "clean.py").write_text("def f(x):\n    return x + 1\n")
    staged = ["models/legacy.py", "models/quiet.py", "tests/test_probs.py", "generated/gen.py", "models/clean.py"]

    # adopting the check: the legacy site is the one that would fail it
    first = run_hook(project, *staged)
    assert first.returncode == 1, first.stderr
    assert first.stdout == "would rewrite models/legacy.py\n"
    recorded = subprocess.run(
        [sys.executable, "-m", "adopter", "rewrite", "--save-baseline", "adopter-baseline.json", *staged],
        cwd=project, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
        capture_output=True, text=True, timeout=300, check=False)
    assert recorded.returncode == 0, recorded.stderr
    assert "recorded 1 site(s) in adopter-baseline.json" in recorded.stderr
    (project / "pyproject.toml").write_text(settings + 'baseline = "adopter-baseline.json"\n')

    ok = run_hook(project, *staged)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout == ""
    # an edit elsewhere in the baselined file keeps it accepted
    legacy.write_text("# shop's legacy model\n" + legacy.read_text().replace("x, dim=-1", "x,  dim = -1"))
    assert run_hook(project, "models/legacy.py").returncode == 0

    # a new site in a staged file fails the commit, naming the file
    fresh = project / "models" / "fresh.py"
    fresh.write_text(source("Fresh", "return torch.softmax(x * 2, dim=-1)\n"))
    failed = run_hook(project, "models/legacy.py", "models/fresh.py")
    assert failed.returncode == 1
    assert failed.stdout == "would rewrite models/fresh.py\n"
    assert fresh.read_text() == source("Fresh", "return torch.softmax(x * 2, dim=-1)\n")  # --check writes nothing
    # ... until the developer suppresses it, saying why
    fresh.write_text(source("Fresh", "return torch.softmax(x * 2, dim=-1)  # adopter: ignore[softmax] -- tiny\n"))
    assert run_hook(project, "models/fresh.py").returncode == 0

    # a broken table stops the hook with one line, exit 2
    (project / "pyproject.toml").write_text("[tool.adopter]\nignore = 'softmax'\n")
    broken = run_hook(project, "models/fresh.py")
    assert broken.returncode == 2
    assert broken.stderr.strip().count("\n") == 0 and "ignore must be a list of strings" in broken.stderr
    assert "Traceback" not in broken.stderr
