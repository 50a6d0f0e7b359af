"""The README's Python snippets run as written (in order, one namespace, in a fresh
interpreter), and the report output the README shows is what they print, so neither can drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def _normalized(text: str) -> list[str]:
    """Lines with numbers that vary run to run (max |diff|) or with the installed transformers'
    patch release (line numbers in its ``modeling_*.py`` files) masked, trailing blanks dropped."""
    out = []
    for line in text.strip().splitlines():
        line = re.sub(r"max \|diff\| [0-9.e+-]+", "max |diff| N", line)
        line = re.sub(r"(modeling_\w+\.py):\d+(-\d+)?", r"\1:N", line)
        out.append(line.rstrip())
    return out


def test_readme_has_python_snippets_and_documents_the_conventions():
    assert len(_blocks("python")) >= 2
    assert 'pytest -q -m "not slow"' in README
    assert "Exit status" in README and "keep going" in README.lower()


@pytest.mark.slow
def test_readme_python_snippets_run_and_print_what_the_readme_shows(tmp_path):
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n\n".join(_blocks("python")))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    shown = _blocks("text")[0]
    assert _normalized(r.stdout) == _normalized(shown)
