"""Adopter in the user's environment (issue 22): a light base install beside the user's torch,
extras with one-line errors, an unwritable home, and a runtime-only environment that trains a
rewritten model with torch and the base package alone."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"transformers", "pytest", "pytest-benchmark", "matplotlib", "triton", "xformers", "ruff", "mypy",
         "onnx", "onnxscript", "onnxruntime", "accelerate", "peft", "jsonschema"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _base_requirements_of_setup_cfg() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [r for r in cfg["options"]["install_requires"].splitlines() if r.strip() and not r.strip().startswith("#")]


def _check_base(requirements: list[str]) -> None:
    names = {_name(r) for r in requirements}
    assert not names & HEAVY, f"test/plot/model-zoo/dev packages in the base requirements: {names & HEAVY}"
    assert names <= {"torch", "bowler", "fissix"}, names
    torch = [r for r in requirements if _name(r) == "torch"]
    assert torch and "==" not in torch[0] and ">=" in torch[0], f"torch must be a range, not a pin: {torch}"


def test_base_requirements_are_light_and_never_pin_torch():
    _check_base(_base_requirements_of_setup_cfg())


def test_installed_metadata_agrees():
    requires = metadata.requires("adopter") or []
    _check_base([r for r in requires if "extra ==" not in r])
    extras = set(metadata.metadata("adopter").get_all("Provides-Extra") or [])
    assert {"hf", "verify", "gpu", "dev"} <= extras


def test_torch_floor_is_the_one_stated():
    import adopter.kernels as kernels

    floor = ".".join(map(str, kernels.TORCH_FLOOR))
    assert f"torch>={floor}" in _base_requirements_of_setup_cfg()


def _run(code: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_unwritable_home_neither_breaks_import_nor_rewrite(tmp_path):
    model = tmp_path / "m.py"
    model.write_text(textwrap.dedent("""\
        from torch import nn


        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.act = nn.GELU()

            def forward(self, x):
                return self.act(self.fc(x))
    """))
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = "/dev/null"
    code = ("import sys; from adopter.cli import main; from adopter import optimize; "
            f"sys.exit(main(['rewrite', '--diff', {str(model)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "linear_gelu(self.fc, self.act, x)" in done.stdout
    assert "Traceback" not in done.stderr


def test_a_missing_extra_is_one_line_naming_the_install(tmp_path):
    # transformers made unimportable: a shipped HF model id needs the hf extra
    (tmp_path / "m.py").write_text("x = 1\n")
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from adopter.cli import main\n"
            f"sys.exit(main(['scan', '--model', 'tiny-bert', {str(tmp_path / 'm.py')!r}]))")
    done = _run(code)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'adopter[hf]'" in lines[0], done.stderr


# ---------------------------------------------------------------- runtime-only environment

RUNTIME_CHECK = '''
import importlib.util, sys, torch
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
original, rewritten, optimized = (load(sys.argv[i], n) for i, n in ((1, "orig"), (2, "rw"), (3, "opt")))
assert "transformers" not in sys.modules and "pytest" not in sys.modules
for name, make in (("ConvNet", lambda: torch.randn(2, 3, 12, 12)), ("BertLayer", lambda: torch.randn(2, 5, 32)),
                   ("LlamaBlock", lambda: torch.randn(2, 5, 32))):
    torch.manual_seed(0)
    reference = getattr(original, name)()
    for module in (rewritten, optimized):
        candidate = getattr(module, name, None)
        if candidate is None:
            continue
        model = candidate()
        model.load_state_dict(reference.state_dict())
        x = make()
        for m in (reference, model):
            m.train()
            m.zero_grad()
            torch.manual_seed(1)
            m(x).pow(2).mean().backward()
        for (n, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=f"{name}.{n}")
        torch.optim.SGD(model.parameters(), lr=0.1).step()
used = sorted(k for k in sys.modules if k.startswith("adopter"))
assert "adopter.kernels" in used and not any(k.startswith(("adopter.core", "adopter.rewrite", "adopter.tracing")) for k in used), used
print("trained", torch.__version__)
'''


@pytest.mark.slow
def test_runtime_only_environment_trains_rewritten_and_optimized_models(tmp_path):
    """A fresh venv with torch (already there, as a user's would be) and the base package only:
    installing adopter leaves torch alone, and a rewritten file and an optimize()d class's source
    import and train with nothing else of the tool."""
    import inspect

    import torch
    from adopter.rewrite import rewrite_source

    from adopter import optimize
    from adopter.core.rules import all_rules
    from adopter.core.scan import scan_source

    zoo = ROOT / "tests" / "fixtures" / "modes" / "zoo.py"
    text = zoo.read_text()
    (tmp_path / "original.py").write_text(text)
    rewritten = rewrite_source(text, scan_source(text, "zoo.py", all_rules()), filename="zoo.py").new_text
    (tmp_path / "rewritten.py").write_text(rewritten)
    sys.path.insert(0, str(zoo.parent))
    try:
        import zoo as zoo_module

        optimized = optimize(zoo_module.LlamaBlock, example_inputs=(torch.randn(2, 5, 32),))
    finally:
        sys.path.remove(str(zoo.parent))
    (tmp_path / "optimized.py").write_text(inspect.getsource(sys.modules[optimized.__module__]))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_version = torch.__version__.split("+")[0]
    subprocess.run(pip + [f"torch=={torch_version}"], check=True, timeout=900, capture_output=True)
    def torch_install() -> list[str]:
        shown = subprocess.run([python, "-m", "pip", "show", "-f", "torch"], capture_output=True, text=True).stdout
        return [line for line in shown.splitlines() if not line.startswith("Required-by")]

    before = torch_install()
    done = subprocess.run(pip + [str(ROOT)], timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch_install() == before  # the user's torch is untouched (version, location, files)
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    assert not {_name(line) for line in listed.splitlines()} & HEAVY, listed
    check = subprocess.run(
        [python, "-c", RUNTIME_CHECK, *(str(tmp_path / f) for f in ("original.py", "rewritten.py", "optimized.py"))],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert check.returncode == 0 and "trained" in check.stdout, check.stderr[-3000:]
