"""Where the rewrite puts ``from adopter.kernels import ...`` (issue 34): where isort would, when the
module's imports are in isort's order, so the user's import linter finds nothing to change."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from adopter.rewrite import rewrite_file

BODY = "\n\n" + (Path(__file__).parents[1] / "fixtures" / "rewrite" / "mlp_classes.py").read_text().split("\n\n\n", 1)[1]



def _rewritten(tmp_path, head: str) -> str:
    path = tmp_path / "model.py"
    path.write_text(head + BODY)
    result = rewrite_file(path, write=True, torchscript="never")
    assert result.status == "changed", result.reason
    return path.read_text()


@pytest.mark.parametrize("head, expected", [
    # third-party section: after the plain imports, before `from torch ...`
    ('"""Doc."""\nimport math\n\nimport torch\nfrom torch import nn\n\nfrom .sibling import thing\n',
     '"""Doc."""\nimport math\n\nimport torch\nfrom adopter.kernels import linear_gelu\nfrom torch import nn\n\n'
     'from .sibling import thing\n'),
    # the first third-party import: it takes the section's blank line
    ("import math\n\nfrom torch import nn\n",
     "import math\n\nfrom adopter.kernels import linear_gelu\nfrom torch import nn\n"),
    # the last third-party import, before the local section
    ("import torch\nimport torch.nn as nn\n\nfrom .sibling import thing\n",
     "import torch\nimport torch.nn as nn\nfrom adopter.kernels import linear_gelu\n\nfrom .sibling import thing\n"),
    # imports not in isort's order: after the last one, as before
    ("from torch import nn\nimport math\n", "from torch import nn\nimport math\nfrom adopter.kernels import linear_gelu\n"),
])
def test_the_kernel_import_goes_where_isort_puts_it(tmp_path, head, expected):
    text = _rewritten(tmp_path, head)
    assert text.startswith(expected), text[:300]


def test_ruffs_import_rule_finds_nothing_in_a_sorted_file_after_the_rewrite(tmp_path):
    head = '"""Doc."""\nimport math\nimport os\n\nimport torch\nfrom torch import nn\n\nfrom .sibling import thing\n'
    _rewritten(tmp_path, head)
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "I", "model.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    if "No module named ruff" in done.stderr:
        pytest.skip("ruff not installed")
    assert done.returncode == 0, done.stdout + done.stderr
