"""The rewrite keeps the user's line length (issue 34): rewrite/line_length.py."""
from __future__ import annotations

import ast

from adopter.rewrite import rewrite_file
from adopter.rewrite.line_length import line_limit, wrap_long_lines

ORIGINAL = "def f(self, x):\n    y = self.a(x)\n    return y\n"


def test_the_limit_is_the_projects_else_what_the_file_keeps_to(tmp_path):
    (tmp_path / ".git").mkdir()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(ORIGINAL)
    assert line_limit(pkg / "m.py", ORIGINAL) == 88  # nothing configured: at least 88
    assert line_limit(None, "x = 1\n" + "y = '" + "a" * 150 + "'\n") == 156  # (never tighter than it is written)
    long_file = "\n".join(f"x{i:03d} = '{'a' * 100}'" for i in range(200))
    assert line_limit(None, long_file) == 109
    (tmp_path / "setup.cfg").write_text("[flake8]\nmax-line-length = 100\n")
    from adopter.rewrite import line_length

    line_length._configured_limit.cache_clear()
    assert line_limit(pkg / "m.py", ORIGINAL) == 100
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\nline-length = 119\n")
    line_length._configured_limit.cache_clear()
    assert line_limit(pkg / "m.py", ORIGINAL) == 119


def test_added_calls_are_wrapped_black_style_and_notes_move_above():
    rewritten = (
        "def f(self, x):\n"
        "    y = kernel(self.first_module, self.second_module, x, residual=x)\n"
        "    z = other(self.first_module, self.second_module, x)  # adopter: a note that runs long\n"
        "    return kernel_two(self.first_module, self.second_module, self.third_module, x, scale=2)\n"
    )
    out = wrap_long_lines(ORIGINAL, rewritten, 60)
    assert out.split("\n") == [
        "def f(self, x):",
        "    y = kernel(",
        "        self.first_module, self.second_module, x, residual=x",
        "    )",
        "    # adopter: a note that runs long",
        "    z = other(self.first_module, self.second_module, x)",
        "    return kernel_two(",
        "        self.first_module,",
        "        self.second_module,",
        "        self.third_module,",
        "        x,",
        "        scale=2,",
        "    )",
        "",
    ]
    ast.parse(out)


def test_lines_the_user_wrote_and_other_shapes_stay_as_written():
    long_user_line = "    y = self.a(x, " + ", ".join(f"arg{i}" for i in range(20)) + ")\n"
    original = "def f(self, x):\n" + long_user_line + "    return y\n"
    rewritten = original.replace("return y", "return (kernel(self.a, self.b, x, y, y, y, y, y, y, y, y) + 1)")
    assert wrap_long_lines(original, rewritten, 40) == rewritten  # (not one call: left alone)
    commented = original.replace("return y", "return kernel(\n        x,  # why\n        y, y, y, y, y, y, y, y, y, y, y)")
    assert wrap_long_lines(original, commented, 40) == commented  # (comments among the arguments)


def test_a_file_rewrite_keeps_the_configured_length(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / "pyproject.toml").write_text("[tool.black]\nline-length = 70\n")
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Out(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.dense = nn.Linear(4, 4)\n"
        "        self.dropout_layer = nn.Dropout(0.1)\n        self.layer_norm_module = nn.LayerNorm(4)\n\n"
        "    def forward(self, hidden_states, input_tensor):\n        hidden_states = self.dense(hidden_states)\n"
        "        hidden_states = self.dropout_layer(hidden_states)\n"
        "        hidden_states = self.layer_norm_module(hidden_states + input_tensor)\n"
        "        return hidden_states\n"
    )
    result = rewrite_file(path, write=True, torchscript="never")
    assert result.status == "changed", result.reason
    text = path.read_text()
    assert "dropout_add_layer_norm(\n" in text and max(len(line) for line in text.splitlines()) <= 70
    assert rewrite_file(path, torchscript="never").status == "unchanged"  # (idempotent)
