"""Map every captured graph node back to the model source that produced it.

Both capture methods leave two things in ``node.meta``: ``stack_trace`` (the Python frames that
were active when the node was created) and ``nn_module_stack`` (the module instances being called,
outermost first). From them we get, per node: the file/line/function/class of the *model code*
(innermost frame outside torch and outside library layers such as ``transformers.activations``,
so an ``aten.linear`` maps to the ``self.dense(x)`` line, not into ``torch/nn/modules/linear.py``),
and the module path and class of the instance that was running.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass, field

import torch
import torch.fx

_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Files that implement layers, not model structure: frames there are skipped when
    attributing a node to model code (the call site in the model file is what matters)."""
    dirs = [_TORCH_DIR]
    try:
        import transformers

        base = os.path.dirname(os.path.realpath(transformers.__file__)) + os.sep
        dirs += [
            base + "activations.py",
            base + "pytorch_utils.py",
            base + "integrations" + os.sep,
            base + "masking_utils.py",
            base + "utils" + os.sep,
            base + "modeling_layers.py",
        ]
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return tuple(dirs)


def is_library_file(path: str) -> bool:
    return path.startswith(_library_dirs())


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


@dataclass(frozen=True)
class NodeSource:
    """Where one graph node comes from.

    ``file``/``line``/``function``/``class_name``: innermost model-code frame (``function`` is
    qualified, ``BertSelfOutput.forward``; ``class_name`` is None for a module-level function).
    ``module_path``/``module_class``: the innermost module instance running when the node was
    created (``encoder.layer.0.output.dropout``, ``torch.nn.modules.dropout.Dropout``).
    ``frames`` all frames outermost first, ``module_stack`` all ``(path, class)`` outermost first.
    ``index`` is the node's position in the graph (execution order).
    """

    node_name: str
    op: str
    target: str
    file: str | None
    line: int | None
    function: str | None
    class_name: str | None
    module_path: str | None
    module_class: str | None
    index: int = 0
    op_name: str = ""  # normalized op: "linear", "add", "dropout", module class for call_module
    frames: tuple[Frame, ...] = field(default=(), repr=False)
    module_stack: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def frame_in(self, file: str, lines: range | None = None) -> Frame | None:
        """Innermost frame in ``file`` (within ``lines`` when given)."""
        for frame in reversed(self.frames):
            if frame.file == file and (lines is None or frame.line in lines):
                return frame
        return None

    def innermost_frame_in(self, file: str) -> Frame | None:
        for frame in reversed(self.frames):
            if frame.file == file:
                return frame
        return None

    def within(self, module_path: str) -> bool:
        """True when the node ran inside the module instance at ``module_path`` (or a child)."""
        if module_path == "":
            return True
        return any(p == module_path or p.startswith(module_path + ".") for p, _ in self.module_stack)


def parse_stack_trace(text: str | None) -> tuple[Frame, ...]:
    if not text:
        return ()
    frames = []
    for raw in text.splitlines():
        m = _FRAME_RE.match(raw)
        if m:
            frames.append(Frame(os.path.realpath(m["file"]), int(m["line"]), m["func"]))
    return tuple(frames)


# ------------------------------------------------------------------ enclosing class/function per line


@dataclass(frozen=True)
class _Scope:
    start: int
    end: int
    qualname: str
    class_name: str | None


@functools.lru_cache(maxsize=256)
def _scopes(file: str) -> tuple[_Scope, ...]:
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=file)
    except (OSError, SyntaxError, ValueError):
        return ()
    scopes: list[_Scope] = []

    def visit(node, prefix: str, cls: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                scopes.append(_Scope(start, child.end_lineno or child.lineno, prefix + child.name, cls))
                visit(child, f"{prefix}{child.name}.", cls)

    visit(tree, "", None)
    return tuple(scopes)


@functools.lru_cache(maxsize=256)
def _conditions(file: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, "if <test>" | "else of if <test>")`` for every branch body."""
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=file)
    except (OSError, SyntaxError, ValueError):
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            for body, label in ((node.body, f"if {test}"), (node.orelse, f"else of if {test}")):
                if body:
                    out.append((body[0].lineno, body[-1].end_lineno or body[-1].lineno, label))
    return tuple(out)


def enclosing_condition(file: str, line: int) -> str | None:
    """The innermost ``if`` branch holding ``line`` (``"if self.use_batch_norm"``), if any."""
    best = None
    for start, end, label in _conditions(file):
        if start <= line <= end and (best is None or start >= best[0]):
            best = (start, end, label)
    return best[2] if best else None


def enclosing_scope(file: str, line: int) -> tuple[str | None, str | None]:
    """``(qualified function, class)`` enclosing ``line`` of ``file`` (innermost function)."""
    best = None
    for scope in _scopes(file):
        if scope.start <= line <= scope.end and (best is None or scope.start >= best.start):
            best = scope
    if best is None:
        return None, None
    return best.qualname, best.class_name


# ------------------------------------------------------------------ per node


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.linear.default"
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


def _op_name(node: torch.fx.Node, module_class: str | None) -> str:
    """Normalized op: ``aten.native_dropout.default`` -> ``native_dropout``; ``operator.add`` ->
    ``add``; ``Tensor.view`` -> ``view``; a call_module node -> its class name lowercased."""
    if node.op == "call_module":
        return (module_class or "").rsplit(".", 1)[-1].lower()
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", "") or ""
    return name


def _class_str(cls) -> str:
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}"


# ``node.meta`` key of the module instances whose methods were running (frame by frame, outermost
# first) when the node was created; recorded by the capture (``capture._module_frames_recorded``).
MODULE_FRAMES = "adopter_module_frames"


def _module_stack(node: torch.fx.Node) -> tuple[tuple[str, str], ...]:
    """The module instances a node ran in, outermost first: those entered through ``__call__``
    (the tracers' ``nn_module_stack``) merged with those whose method ran on the stack
    (``MODULE_FRAMES``): a submodule's ``forward`` called directly (``self.ffn.forward(x)``,
    ``nn.Module.forward(self.ffn, x)``) never passes ``__call__``, so the tracers file its nodes
    under the caller's module; the frames still show whose method made them."""
    stack = node.meta.get("nn_module_stack") or {}
    called = []
    for value in stack.values():
        try:
            path, cls = value
        except (TypeError, ValueError):
            continue
        called.append((str(path).split("@")[0], _class_str(cls)))
    framed = list(node.meta.get(MODULE_FRAMES) or ())
    if not framed:
        return tuple(called)
    called_paths = {p for p, _ in called}
    if "" not in called_paths:  # the root's own frames: the tracer's stack leaves it out
        framed = [entry for entry in framed if entry[0] != ""]
    framed_at = {p: i for i, (p, _) in enumerate(framed)}
    # a symbolic trace's leaf call_module node is the call itself: no frame of it ran
    leaf = called.pop() if node.op == "call_module" and called and called[-1][0] not in framed_at else None
    out: list[tuple[str, str]] = []
    taken = 0
    for entry in called:
        at = framed_at.get(entry[0])
        if at is None:
            out.append(entry)  # entered by __call__ but no method frame recognised: keep its place
        elif at >= taken:
            out += framed[taken:at + 1]
            taken = at + 1
    out += framed[taken:]
    if leaf is not None:
        out.append(leaf)
    seen: set[str] = set()
    return tuple(e for e in out if not (e[0] in seen or seen.add(e[0])))


def node_source(node: torch.fx.Node, index: int = 0) -> NodeSource:
    frames = parse_stack_trace(node.meta.get("stack_trace"))
    module_stack = _module_stack(node)
    module_path, module_class = module_stack[-1] if module_stack else (None, None)
    code_frame = next((f for f in reversed(frames) if not is_library_file(f.file)), None)
    file = line = function = class_name = None
    if code_frame is not None:
        file, line = code_frame.file, code_frame.line
        function, class_name = enclosing_scope(file, line)
        function = function or code_frame.function
    return NodeSource(
        node_name=node.name,
        op=node.op,
        target=_target_name(node),
        file=file,
        line=line,
        function=function,
        class_name=class_name,
        module_path=module_path,
        module_class=module_class,
        index=index,
        op_name=_op_name(node, module_class),
        frames=frames,
        module_stack=module_stack,
    )


def map_nodes(graph_module: torch.fx.GraphModule) -> list[NodeSource]:
    """A :class:`NodeSource` for every computing node (call_function/call_method/call_module),
    in graph (execution) order."""
    sources = []
    for index, node in enumerate(graph_module.graph.nodes):
        if node.op in ("call_function", "call_method", "call_module"):
            sources.append(node_source(node, index))
    return sources
