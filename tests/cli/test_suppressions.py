"""What a project decides to leave alone (issue 35, item 3), as a linter's user writes it:
``# adopter: ignore[...]`` comments, a ``[tool.adopter]`` table in ``pyproject.toml`` and a baseline
file. ``adopter rewrite`` (diff, --check, --write) skips those sites; ``adopter scan`` shows them
as suppressed (text, JSON, SARIF ``suppressions``); bad settings are one line and exit 2."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from adopter.cli import main

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "fixtures" / "sarif" / "sarif-schema-2.1.0.json"

HEAD = "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n    def forward(self, x):\n"


def model(body: str) -> str:
    return HEAD + textwrap.indent(textwrap.dedent(body), " " * 8)


@pytest.fixture()
def project(tmp_path, monkeypatch):
    (tmp_path / ".git").mkdir()  # (the project's root: no configuration above it is read)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def check(*paths, extra=()) -> int:
    return main(["rewrite", "--check", "--jobs", "1", *extra, *map(str, paths)])


@pytest.mark.parametrize("body", [
    "return torch.softmax(x, dim=-1)  # adopter: ignore[softmax]\n",
    "return torch.softmax(x, dim=-1)  # ADOPTER: Ignore[SoftMax] -- measured slower here\n",
    "return torch.softmax(x, dim=-1)  # adopter: ignore\n",
    "return torch.softmax(x, dim=-1)  # noqa: E501  # adopter: ignore[Add_ReLU, softmax]\n",
    "return torch.softmax(\n    x,\n    dim=-1,\n)  # adopter: ignore[softmax] -- on the call's last line\n",
])
def test_a_suppression_comment_on_the_site_leaves_it_alone(project, body, capsys):
    path = project / "m.py"
    path.write_text(model(body))
    assert check(path) == 0
    assert "1 suppressed" in capsys.readouterr().err
    assert main(["rewrite", "--write", "--jobs", "1", str(path)]) == 0
    assert path.read_text() == model(body)


@pytest.mark.parametrize("body", [
    "return torch.softmax(x, dim=-1)  # adopter: ignore[Add_ReLU]\n",  # another rule
    "return torch.softmax(x, dim=-1)  # adopter: ignored\n",  # not the directive
    "y = '# adopter: ignore'; return torch.softmax(x, dim=-1)\n",  # in a string
    "# adopter: ignore[softmax]\nreturn torch.softmax(x, dim=-1)\n",  # on the line above: not the site's
])
def test_what_is_not_a_suppression_of_the_site(project, body):
    path = project / "m.py"
    path.write_text(model(body))
    assert check(path) == 1


def test_ignore_file_and_its_rules(project):
    path = project / "m.py"
    path.write_text("# adopter: ignore-file[softmax] -- generated code\n" + model("return torch.softmax(x, dim=-1)\n"))
    assert check(path) == 0
    path.write_text("# adopter: ignore-file[Add_ReLU]\n" + model("return torch.softmax(x, dim=-1)\n"))
    assert check(path) == 1
    path.write_text("x = 1  # adopter: ignore-file\n" + model("return torch.softmax(x, dim=-1)\n"))
    assert check(path) == 1  # (only on a line of its own, as ruff's file-level directive)


def test_an_unknown_rule_name_is_a_one_line_warning_not_an_error(project, capsys):
    path = project / "m.py"
    path.write_text(model("return torch.softmax(x, dim=-1)  # adopter: ignore[sofmax, softmax]\n"))
    assert check(path) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == [f"{path}:7: warning: unknown rule 'sofmax' in an `# adopter: ignore[...]` comment "
                        "(adopter rules lists them); it suppresses nothing"]
    assert main(["scan", str(path)]) == 0
    assert "unknown rule 'sofmax'" in capsys.readouterr().err


def test_only_the_suppressed_site_is_left_alone_in_diff_and_write(project, capsys):
    path = project / "m.py"
    path.write_text(model("a = torch.softmax(x, dim=-1)  # adopter: ignore[softmax]\nreturn torch.softmax(a, dim=-1)\n"))
    assert main(["rewrite", "--jobs", "1", str(path)]) == 0
    diff = capsys.readouterr().out
    assert "-        return torch.softmax(a, dim=-1)" in diff and "-        a = torch.softmax" not in diff
    assert main(["rewrite", "--jobs", "1", "-v", str(path)]) == 0
    assert "skipped: suppressed by `# adopter: ignore[softmax]` (line 7)" in capsys.readouterr().err


# ---------------------------------------------------------------- scan


def test_scan_shows_suppressed_matches_in_text_json_and_sarif(project, capsys):
    path = project / "m.py"
    path.write_text(model("a = torch.softmax(x, dim=-1)  # adopter: ignore[softmax] -- slower\n"
                          "return torch.softmax(a, dim=-1)\n"))
    assert main(["scan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "static [suppressed by `# adopter: ignore[softmax]` (line 7)]" in out and "1 suppressed" in out
    assert main(["scan", "--format", "json", str(path)]) == 0
    matches = json.loads(capsys.readouterr().out)["matches"]
    assert [m.get("suppressed", "") for m in matches] == ["suppressed by `# adopter: ignore[softmax]` (line 7)", ""]
    assert main(["scan", "--format", "sarif", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    results = doc["runs"][0]["results"]
    assert [r.get("suppressions") for r in results] == [
        [{"kind": "inSource", "justification": "suppressed by `# adopter: ignore[softmax]` "
                                                                   "(line 7)"}], None]
    jsonschema = pytest.importorskip("jsonschema")
    assert not list(jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(doc))


# ---------------------------------------------------------------- [tool.adopter]


def _pyproject(project: Path, table: str) -> None:
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n\n[tool.adopter]\n" + textwrap.dedent(table))


def test_select_ignore_and_per_file_ignores(project, capsys):
    (project / "tests").mkdir()
    for name in ("m.py", "tests/test_m.py"):
        (project / name).write_text(model("return torch.softmax(x, dim=-1)\n"))
    _pyproject(project, 'per-file-ignores = {"tests/*" = ["softmax"]}\n')
    assert check(project / "tests" / "test_m.py") == 0
    assert check(project / "m.py") == 1
    _pyproject(project, 'ignore = ["SOFTMAX"]\n')
    assert check(project) == 0
    _pyproject(project, 'select = ["Add_ReLU"]\n')
    assert check(project) == 0
    assert check(project, extra=["--rules", "softmax"]) == 1  # the command line wins
    _pyproject(project, 'per-file-ignores = {"test_*.py" = ["*"]}\n')  # a name alone; every rule
    assert check(project / "tests" / "test_m.py") == 0


def test_exclude_max_file_size_and_torchscript_from_the_table(project, capsys):
    (project / "build").mkdir()
    (project / "build" / "gen.py").write_text(model("return torch.softmax(x, dim=-1)\n"))
    _pyproject(project, 'exclude = ["build/*"]\n')
    assert check(project) == 0
    assert "1 file(s) excluded by [tool.adopter]" in capsys.readouterr().err
    _pyproject(project, 'max-file-size = "1K"\n')
    big = project / "big.py"
    big.write_text(model("return torch.softmax(x, dim=-1)\n") + "# padding\n" * 200)
    capsys.readouterr()
    assert check(big) == 2
    assert "big.py: failed:" in capsys.readouterr().err
    assert check(big, extra=["--max-file-size", "0"]) == 1  # the command line wins
    (project / "build" / "gen.py").unlink()
    big.unlink()
    path = project / "m.py"
    path.write_text(model("return torch.softmax(x, dim=-1)\n"))
    _pyproject(project, 'torchscript = "always"\n')
    assert main(["rewrite", "--jobs", "1", str(path)]) == 0
    assert "torch.jit.is_scripting()" in capsys.readouterr().out
    assert main(["rewrite", "--jobs", "1", "--torchscript", "never", str(path)]) == 0
    assert "torch.jit.is_scripting()" not in capsys.readouterr().out


@pytest.mark.parametrize("table, message", [
    ("selct = ['softmax']\n", "unknown key(s) in [tool.adopter]: selct"),
    ("select = 'softmax'\n", "select must be a list of strings"),
    ("ignore = ['nope']\n", "ignore: unknown rule 'nope'"),
    ("per-file-ignores = {'a.py' = ['nope']}\n", "per-file-ignores 'a.py': unknown rule 'nope'"),
    ("per-file-ignores = ['a.py']\n", "per-file-ignores must be a table"),
    ("torchscript = 'sometimes'\n", "torchscript must be one of auto, always, never"),
    ("max-file-size = 'huge'\n", "--max-file-size: not a size"),
    ("select = [\n", "not valid TOML"),
    ("baseline = 'missing.json'\n", "missing.json: no such file"),
])
def test_a_bad_table_is_one_line_and_exit_2(project, table, message, capsys):
    path = project / "m.py"
    path.write_text(model("return torch.softmax(x, dim=-1)\n"))
    _pyproject(project, table)
    for command in (["rewrite", "--check"], ["scan"]):
        if command == ["scan"] and "baseline" in table:
            continue  # (scan does not read the baseline)
        assert main([*command, str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_config_names_the_file_to_read(project, tmp_path_factory, capsys):
    path = project / "m.py"
    path.write_text(model("return torch.softmax(x, dim=-1)\n"))
    other = tmp_path_factory.mktemp("elsewhere") / "settings.toml"
    other.write_text("[tool.adopter]\nignore = ['softmax']\n")
    assert check(path) == 1
    assert check(path, extra=["--config", str(other)]) == 0
    assert check(path, extra=["--config", str(other) + ".missing"]) == 2


# ---------------------------------------------------------------- baseline


LEGACY = model("a = torch.softmax(x, dim=-1)\nb = torch.softmax(x, dim=-1)\nreturn torch.softmax(a + b, dim=-1)\n")


def test_a_baseline_accepts_the_recorded_sites_and_survives_unrelated_edits(project, capsys):
    path = project / "legacy.py"
    path.write_text(LEGACY)
    assert check(path) == 1
    capsys.readouterr()
    assert main(["rewrite", "--save-baseline", "adopter-baseline.json", "--jobs", "1", str(path)]) == 0
    assert path.read_text() == LEGACY  # records, changes nothing
    saved = json.loads((project / "adopter-baseline.json").read_text())
    assert sorted((s["file"], s["rule"], s["scope"], s["count"]) for s in saved["sites"]) == [
        ("legacy.py", "softmax", "M.forward", 1), ("legacy.py", "softmax", "M.forward", 2)]
    assert check(path, extra=["--baseline", "adopter-baseline.json"]) == 0
    # lines moved, the calls reformatted, a comment added: still the same sites
    edited = ("import os\n\n" + LEGACY).replace("a = torch.softmax(x, dim=-1)",
                                               "a = torch.softmax(\n            x, dim=-1  # rows\n        )")
    path.write_text(edited)
    assert check(path, extra=["--baseline", "adopter-baseline.json"]) == 0
    # one more equal site than recorded: that one is new
    path.write_text(edited.replace("return torch.softmax(a + b", "c = torch.softmax(x, dim=-1)\n"
                                   "        return torch.softmax(a + b + c"))
    assert check(path, extra=["--baseline", "adopter-baseline.json"]) == 1
    # a site fixed: its entry is stale, harmless, and said
    path.write_text(LEGACY.replace("return torch.softmax(a + b, dim=-1)", "return a + b"))
    capsys.readouterr()
    assert check(path, extra=["--baseline", "adopter-baseline.json"]) == 0
    assert "1 baseline entry of the files checked match no site any more" in capsys.readouterr().err


def test_the_baseline_of_the_table_and_a_bad_baseline(project, capsys):
    path = project / "legacy.py"
    path.write_text(LEGACY)
    assert main(["rewrite", "--save-baseline", "base.json", "--jobs", "1", str(path)]) == 0
    _pyproject(project, 'baseline = "base.json"\n')
    assert check(path) == 0
    (project / "bad.json").write_text("{not json")
    capsys.readouterr()
    assert check(path, extra=["--baseline", "bad.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "baseline bad.json: not valid JSON" in err[0]
    (project / "bad.json").write_text('{"version": 1, "sites": [{"file": "legacy.py"}]}')
    assert check(path, extra=["--baseline", "bad.json"]) == 2
    assert main(["rewrite", "--write", "--save-baseline", "x.json", str(path)]) == 2
