"""`--torchscript auto|always|never` (issue 34): where a rewrite keeps the user's statements beside
the rewritten ones for TorchScript. auto: only in packages that use TorchScript, only in functions
it could compile."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from adopter.rewrite import rewrite_file
from adopter.rewrite.scripting import SCRIPTING_TEST, uses_torchscript, wants_guard

MODEL = "import torch\nfrom torch import nn\n\n\n" + (Path(__file__).parents[1] / "fixtures" / "rewrite" / "mlp_classes.py").read_text().split("\n\n\n", 1)[1]



def _package(tmp_path, scripts: bool):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mlp.py").write_text(MODEL)
    (pkg / "export.py").write_text("import torch\n\n\ndef scripted(m):\n    return torch.jit.script(m)\n" if scripts
                                   else "import torch\n\n\ndef traced(m, x):\n    return torch.jit.trace(m, x)\n")
    return pkg / "sub" / "mlp.py"


def _guards(diff: str) -> int:
    return diff.count(f"+        if {SCRIPTING_TEST}:")


@pytest.mark.parametrize("scripts", [False, True])
def test_auto_guards_only_in_packages_that_script_and_only_scriptable_functions(tmp_path, scripts):
    path = _package(tmp_path, scripts)
    assert uses_torchscript(path) is scripts  # (jit.trace is no scripting: kernels see it and step aside)
    auto = rewrite_file(path)
    assert auto.status == "changed" and len([o for o in auto.outcomes if o.applied]) == 2
    # in a scripting package: MLP.forward is guarded, MLPKw.forward (**kwargs: never scripted) is not
    assert _guards(auto.diff) == (1 if scripts else 0)
    always = rewrite_file(path, torchscript="always")
    assert _guards(always.diff) == 2
    never = rewrite_file(path, torchscript="never")
    assert _guards(never.diff) == 0 and never.diff.count("+        h = linear_gelu(self.fc, self.act, x)") == 2


def test_a_file_outside_a_package_answers_for_itself(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    assert not uses_torchscript(path, MODEL)
    assert uses_torchscript(path, MODEL + "\nscripted = torch.jit.script(MLP())\n")
    assert wants_guard("always", path, MODEL) and not wants_guard("never", path, "torch.jit.script")
    with pytest.raises(ValueError, match="torchscript must be one of"):
        wants_guard("sometimes", path, MODEL)


def test_the_cli_takes_the_choice_and_refuses_others(tmp_path):
    path = _package(tmp_path, scripts=False)
    run = [sys.executable, "-m", "adopter", "rewrite", str(path), "--jobs", "1"]
    done = subprocess.run(run + ["--torchscript", "always"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count(f"+        if {SCRIPTING_TEST}:") == 2, done.stderr
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and SCRIPTING_TEST not in done.stdout
    done = subprocess.run(run + ["--torchscript", "maybe"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'maybe'" in done.stderr and "Traceback" not in done.stderr


def test_optimize_refuses_an_unknown_choice():
    import torch

    import adopter

    with pytest.raises(adopter.OptimizeError, match="torchscript must be one of"):
        adopter.optimize(torch.nn.Linear, torchscript="maybe")


def test_a_package_where_few_files_name_torchscript_does_not_count_as_scripting(tmp_path):
    # transformers: 5 of 2,860 files keep an @torch.jit.ignore; its models are not scripted
    pkg = tmp_path / "big"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for i in range(40):
        (pkg / f"m{i}.py").write_text("import torch\n")
    (pkg / "helper.py").write_text("import torch\n\n\n@torch.jit.ignore\ndef f(x):\n    return x\n")
    (pkg / "model.py").write_text(MODEL)
    assert not uses_torchscript(pkg / "model.py", MODEL)
    assert uses_torchscript(pkg / "helper.py", (pkg / "helper.py").read_text())  # (names it itself)
    for i in range(2, 4):
        (pkg / f"m{i}.py").write_text("import torch\nscripted = torch.jit.is_scripting()\n")
    from adopter.rewrite import scripting

    scripting._package_uses_torchscript.cache_clear()
    assert uses_torchscript(pkg / "model.py", MODEL)  # 3 of 43 files: 7% >= SCRIPTING_SHARE
