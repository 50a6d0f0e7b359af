"""The user's own model class on the command line (issue 22, item 4): ``--model
package.module:Name`` (+ ``--model-args FILE.json``, or a factory) for ``scan``, ``verify`` and a
trace-confirmed ``rewrite --model ... --write`` that writes what ``optimize()`` proved; bad input is
one line and exit 2; ``optimize()`` of classes defined in a script or a notebook cell.

The CLI runs as a user runs it: ``python -m adopter`` in a project directory (``tmp_path``) holding
a small model package whose only match is conditional (its activation is chosen by a constructor
argument, so the source alone cannot settle it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

NET = '''\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, smooth=False):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.act = nn.GELU() if smooth else nn.ReLU()

    def forward(self, x):
        return self.act(self.dense(x))


class Net(nn.Module):
    def __init__(self, width=16, smooth=False, classes=4):
        super().__init__()
        self.block = Block(width, smooth)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.block(x))


def make_model(smooth=True):
    return Net(16, smooth=smooth), {"x": torch.randn(2, 16)}
'''

SMOOTH = {"kwargs": {"smooth": True}, "inputs": {"x": {"shape": [2, 16], "dtype": "float32"}}}


@pytest.fixture()
def project(tmp_path):
    pkg = tmp_path / "mymodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(NET)
    (tmp_path / "smooth.json").write_text(json.dumps(SMOOTH))
    (tmp_path / "relu.json").write_text(json.dumps({**SMOOTH, "kwargs": {"smooth": False}}))
    return tmp_path


def adopter(*argv, cwd, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "adopter", *map(str, argv)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _statuses(stdout: str) -> list[str]:
    return [m["status"] for m in json.loads(stdout)["matches"] if m["rule"] == "biased_GeLU"]


@pytest.mark.slow
def test_scan_model_settles_the_conditional_match(project):
    static = adopter("scan", "mymodels", "--format", "json", cwd=project)
    assert static.returncode == 0, static.stderr
    assert _statuses(static.stdout) == ["conditional"]
    confirmed = adopter("scan", "mymodels", "--format", "json", "--model", "mymodels.net:Net",
                        "--model-args", "smooth.json", cwd=project)
    assert confirmed.returncode == 0, confirmed.stderr
    assert _statuses(confirmed.stdout) == ["confirmed"]
    rejected = adopter("scan", "mymodels", "--format", "json", "--model", "mymodels.net:Net",
                       "--model-args", "relu.json", cwd=project)
    assert rejected.returncode == 0, rejected.stderr
    assert _statuses(rejected.stdout) == ["rejected"]
    # a factory: the model and its example inputs come from the user's function
    factory = adopter("scan", "mymodels", "--format", "json", "--model", "mymodels.net:make_model", cwd=project)
    assert factory.returncode == 0, factory.stderr
    assert _statuses(factory.stdout) == ["confirmed"]


def test_static_rewrite_points_at_the_real_way_to_apply_a_conditional_match(project):
    r = adopter("rewrite", "mymodels", "-v", cwd=project)
    assert r.returncode == 0, r.stderr
    assert "adopter optimize" not in r.stderr
    assert "adopter rewrite --model package.module:Class" in r.stderr


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_rewrite_model_writes_what_optimize_proved_and_trains_the_same(project):
    original_text = (project / "mymodels" / "net.py").read_text()
    shown = adopter("rewrite", "--model", "mymodels.net:Net", "--model-args", "smooth.json", cwd=project)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("--- a/mymodels/net.py\n+++ b/mymodels/net.py\n")  # relative to the cwd
    assert "linear_gelu(self.dense, self.act, x)" in shown.stdout
    assert (project / "mymodels" / "net.py").read_text() == original_text  # --diff writes nothing
    check = adopter("rewrite", "--model", "mymodels.net:Net", "--model-args", "smooth.json", "--check", cwd=project)
    assert check.returncode == 1 and check.stdout == "would rewrite mymodels/net.py\n", check.stderr

    written = adopter("rewrite", "--model", "mymodels.net:Net", "--model-args", "smooth.json", "--write", cwd=project)
    assert written.returncode == 0, written.stderr
    assert written.stdout == "rewrote mymodels/net.py\n"
    assert "applied biased_GeLU at mymodels/net.py:12 [confirmed]" in written.stderr
    assert "equivalent to the original" in written.stderr
    new_text = (project / "mymodels" / "net.py").read_text()
    # exactly the diff shown before writing
    from adopter.rewrite.source_io import unified_diff

    assert unified_diff(original_text, new_text, "mymodels/net.py") == shown.stdout
    # a second run finds nothing left to do, statically or from the trace
    again = adopter("rewrite", "--model", "mymodels.net:Net", "--model-args", "smooth.json", "--check", cwd=project)
    assert again.returncode == 0, again.stdout + again.stderr

    # the written file trains one step exactly as the original: same loss, gradients and update
    (project / "orig_net.py").write_text(original_text)
    orig = _load(project / "orig_net.py", "adopter_test_orig_net")
    new = _load(project / "mymodels" / "net.py", "adopter_test_rewritten_net")
    torch.manual_seed(0)
    a = orig.Net(smooth=True)
    b = new.Net(smooth=True)
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(8, 16)
    target = torch.randint(0, 4, (8,))
    from adopter.kernels import count_kernel_calls

    losses, grads = [], []
    with count_kernel_calls() as calls:
        for model in (a, b):
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), target)
            loss.backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
            opt.step()
            losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=1e-5, atol=1e-6)
    for (ka, pa), (kb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert ka == kb
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    # the rewritten model took the fused path (not the guard's fallback to the original computation)
    assert sum(c.count for c in calls.calls if c.kernel == "linear_gelu" and c.fused) == 1, calls.calls


def test_rewrite_model_json_and_paths_limit_what_is_written(project, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    r = adopter("rewrite", "--model", "mymodels.net:Net", "--model-args", "smooth.json", "--write",
                "--format", "json", "elsewhere", cwd=project)
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    assert payload["model"] == "mymodels.net:Net" and payload["class"] == "mymodels.net.Net"
    (entry,) = payload["files"]
    assert (entry["file"], entry["status"], entry["written"]) == ("mymodels/net.py", "skipped", False)
    assert entry["reason"] == "not under the paths given"
    assert payload["report"]["traced"] is True
    assert (project / "mymodels" / "net.py").read_text() == NET


def test_verify_model_with_a_factory(project):
    r = adopter("verify", "--model", "mymodels.net:make_model", "--blocks", "1", "--bench-seconds", "0.5",
                "--json", "out.json", "--quiet", cwd=project)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((project / "out.json").read_text())
    assert result["model"]["id"] == "mymodels.net:make_model"
    assert result["model"]["class"] == "mymodels.net.Net"
    assert [a["rule"] for a in result["rules_applied"]] == ["biased_GeLU"]
    assert result["equivalence"]["equivalent"] is True
    assert result["benchmark"]["batch_size"] == 2  # the factory's inputs, as given


BAD_INPUT = [
    (["scan", "mymodels", "--model", "nope.mod:Net"], "cannot import module 'nope.mod'"),
    (["scan", "mymodels", "--model", "mymodels.net:Nett"], "did you mean 'Net'?"),
    (["verify", "--model", "mymodels.net:Net", "--model-args", "bad.json"], "not valid JSON"),
    (["rewrite", "--model", "mymodels.net:Net", "--model-args", "missing.json"], "no such file"),
    (["rewrite", "--model", "mymodels.net:Net"], 'in --model-args {"inputs": {...}}'),
    (["rewrite", "--model", "broken:Net"], "importing broken failed at broken.py:1: RuntimeError: boom"),
    (["rewrite", "--model", "notmodel:x"], "not an nn.Module class or a factory"),
    (["rewrite", "--model", "tiny-bert"], "expected package.module:Name"),
    (["scan", "mymodels", "--model", "tiny-bert", "--model-args", "smooth.json"], "--model-args applies only"),
    (["scan", "mymodels", "--model", "mymodels.net:Net", "--model-args", "badkey.json"], "unknown key(s) 'kwarg'"),
    (["scan", "mymodels", "--model", "mymodels.net:Net", "--model-args", "baddtype.json"], "unknown dtype 'floaty'"),
]


def _bad_inputs(project: Path) -> None:
    (project / "bad.json").write_text("{bad")
    (project / "badkey.json").write_text('{"kwarg": {}}')
    (project / "baddtype.json").write_text('{"inputs": {"x": {"shape": [2, 16], "dtype": "floaty"}}}')
    (project / "broken.py").write_text('raise RuntimeError("boom at import")\n')
    (project / "notmodel.py").write_text("x = 1\n")


@pytest.fixture()
def in_project(project, monkeypatch):
    """The CLI in process, run from ``project``; the user's modules it imports are forgotten after."""
    _bad_inputs(project)
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield project
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("mymodels", "notmodel", "broken"):
            del sys.modules[name]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_model_input_is_one_line_and_exit_2(in_project, argv, message, capsys):
    from adopter.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"adopter {argv[0]}: error: ") and message in lines[0], lines[0]


def test_bad_model_input_from_the_shell_has_no_traceback(project):
    _bad_inputs(project)
    for argv, message in (BAD_INPUT[0], BAD_INPUT[2], BAD_INPUT[5]):
        r = adopter(*argv, cwd=project)
        assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
        assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------- --write guards (in process)


class _FakeReport:
    def __init__(self, path: str, old: str, new: str):
        self.sources = {path: (old, new)}
        self.applied, self.skipped, self.traced = [], [], True
        self.equivalence = self.flipped_equivalence = None


def _fake_optimize(monkeypatch, report):
    from adopter.tracing.user_model import UserModel

    import adopter.commands._model as model_cmd
    import adopter.commands._rewrite_model as rewrite_model

    monkeypatch.setattr(model_cmd, "resolve_user_model",
                        lambda args, needed=False: UserModel("mymodels.net:Net", torch.nn.Module))
    monkeypatch.setattr(rewrite_model, "_optimize", lambda args, user: (type("C", (), {"adopter_report": report}), []))


def test_write_refuses_a_file_changed_since_optimize_read_it(project, monkeypatch, capsys):
    from adopter.cli import main

    path = project / "mymodels" / "net.py"
    _fake_optimize(monkeypatch, _FakeReport(str(path), NET.replace("width=16", "width=8"), NET + "# new\n"))
    monkeypatch.chdir(project)
    assert main(["rewrite", "--model", "mymodels.net:Net", "--write"]) == 2
    assert "changed since optimize() read it; not written" in capsys.readouterr().err
    assert path.read_text() == NET


def test_write_keeps_newlines_and_leaves_read_only_files_alone(project, monkeypatch, capsys):
    from adopter.cli import main

    path = project / "mymodels" / "net.py"
    path.write_bytes(NET.replace("\n", "\r\n").encode())
    _fake_optimize(monkeypatch, _FakeReport(str(path), NET, NET + "# new\n"))
    monkeypatch.chdir(project)
    path.chmod(0o444)
    try:
        assert main(["rewrite", "--model", "mymodels.net:Net", "--write"]) == 2
        assert "is read-only" in capsys.readouterr().err
        assert path.read_bytes() == NET.replace("\n", "\r\n").encode()
        assert main(["rewrite", "--model", "mymodels.net:Net", "--write", "--force"]) == 0
    finally:
        path.chmod(0o644)
    assert path.read_bytes() == (NET + "# new\n").replace("\n", "\r\n").encode()  # CRLF kept, atomic replace
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".adopter-")]


def test_write_leaves_files_outside_the_working_directory_alone(project, tmp_path_factory, monkeypatch, capsys):
    """A class drawing on an installed package: only files under the working directory (or the
    PATHs given) are written."""
    from adopter.cli import main

    elsewhere = tmp_path_factory.mktemp("site-packages") / "lib.py"
    elsewhere.write_text(NET)
    _fake_optimize(monkeypatch, _FakeReport(str(elsewhere), NET, NET + "# new\n"))
    monkeypatch.chdir(project)
    assert main(["rewrite", "--model", "mymodels.net:Net", "--write"]) == 0
    assert "skipped: outside the working directory" in capsys.readouterr().err
    assert elsewhere.read_text() == NET
    assert main(["rewrite", "--model", "mymodels.net:Net", "--write", str(elsewhere.parent)]) == 0
    assert elsewhere.read_text() == NET + "# new\n"


# ---------------------------------------------------------------- optimize() of __main__ classes

MAIN_BODY = NET.split("\n\ndef make_model")[0] + '''

from adopter import optimize

print("top level ran")
Optimized = optimize(Net, init_kwargs={"smooth": True}, example_inputs={"x": torch.randn(2, 16)})
report = Optimized.adopter_report
print("applied", [(a.rule, a.status) for a in report.applied])
model = Optimized(smooth=True)
print("module", type(model).__module__.startswith("__main____adopter_"), type(model.block).__name__)
print("sources", len(report.sources))
'''


def _python(code_or_script, cwd, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args, code_or_script], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_optimize_a_class_of_the_running_script(tmp_path):
    (tmp_path / "train.py").write_text(MAIN_BODY)
    r = _python("train.py", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("top level ran") == 1  # the rewritten script's definitions only ran again
    assert "applied [('biased_GeLU', 'confirmed')]" in r.stdout
    assert "module True Block" in r.stdout and "sources 1" in r.stdout


def test_optimize_a_class_of_a_notebook_cell(tmp_path):
    """IPython keeps each cell's text in linecache under the cell's file name; ``python -c`` has
    no ``__main__.__file__``, as a notebook kernel has none for its cells."""
    (tmp_path / "cell.py").write_text(MAIN_BODY)
    code = textwrap.dedent('''
        import linecache, __main__
        cell = open("cell.py").read()
        name = "<ipython-input-3-0123456789ab>"
        linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
        exec(compile(cell, name, "exec"), __main__.__dict__)
    ''')
    r = _python(code, tmp_path, "-c")
    assert r.returncode == 0, r.stderr
    assert "applied [('biased_GeLU', 'confirmed')]" in r.stdout


def test_optimize_a_main_class_without_source_is_one_clear_error(tmp_path):
    code = textwrap.dedent('''
        import torch
        from adopter import optimize
        from adopter.errors import OptimizeError
        Made = type("Made", (torch.nn.Module,), {"__module__": "__main__"})
        try:
            optimize(Made, example_inputs={})
        except OptimizeError as exc:
            print("OptimizeError:", exc)
    ''')
    r = _python(code, tmp_path, "-c")
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.strip().splitlines()
    assert line.startswith("OptimizeError: Made is defined in __main__ and its source cannot be found")
