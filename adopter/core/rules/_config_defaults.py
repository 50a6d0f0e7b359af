"""Default values of configuration attributes, read statically from the sibling
``configuration_<model>.py`` of a scanned ``modeling_<model>.py`` (parsed with ``ast``,
never imported). Used to tell which activation ``ACT2FN[config.hidden_act]`` names by
default."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

from adopter.core.match.source import class_init_ast, function_ast, parse_file
from adopter.core.source_file import SourceReadError, read_source
from adopter.core.syntax import statements, walk


@lru_cache(maxsize=256)
def _defaults_of_file(path: str) -> dict[str, dict[str, frozenset]]:
    """class name -> attribute -> set of literal default values, for every class in the file."""
    try:
        tree = ast.parse(read_source(path).text)
    except (SourceReadError, SyntaxError, ValueError):
        return {}
    per_class: dict[str, dict[str, frozenset]] = {}
    found: dict[str, set] = {}

    def note(name: str, value_node: ast.AST | None):
        if value_node is None:
            return
        try:
            value = ast.literal_eval(value_node)
        except Exception:
            # activation_fn_key(default="silu") and similar wrappers
            if isinstance(value_node, ast.Call):
                for kw in value_node.keywords:
                    if kw.arg == "default":
                        note(name, kw.value)
                        return
            value = None
        found.setdefault(name, set()).add(value if isinstance(value, (str, int, float, bool)) else None)

    for cls in statements(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        found = {}
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                note(stmt.target.id, stmt.value)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        note(t.id, stmt.value)
            elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                args = stmt.args
                pos = args.posonlyargs + args.args
                for a, d in zip(pos[len(pos) - len(args.defaults):], args.defaults):
                    note(a.arg, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults):
                    note(a.arg, d)
        per_class[cls.name] = {k: frozenset(v) for k, v in found.items()}
    return per_class


@lru_cache(maxsize=1024)
def _is_file(path: str) -> bool:
    return Path(path).is_file()


@lru_cache(maxsize=256)
def _configuration_files(directory: str) -> list[Path]:
    return sorted(Path(directory).glob("configuration_*.py"))


def config_defaults(modeling_file: str, attr: str, config_class: str | None = None) -> frozenset | None:
    """Default values of ``attr`` in the configuration file(s) next to ``modeling_file``
    (None inside the set when one is not a literal): of ``config_class`` when it is given and
    defined there, else of every config class defining ``attr``. None when unknown."""
    p = Path(modeling_file)
    if not p.name.startswith("modeling_"):
        return None
    candidates = [p.with_name("configuration_" + p.name[len("modeling_"):])]
    candidates += _configuration_files(str(p.parent))
    merged: set = set()
    for c in candidates:
        if not _is_file(str(c)):
            continue
        classes = _defaults_of_file(str(c))
        if config_class and config_class in classes:
            d = classes[config_class].get(attr)
            return d
        for attrs in classes.values():
            if attr in attrs:
                merged |= attrs[attr]
        if merged:
            return frozenset(merged)
    return None


def config_annotation(source: str | None, class_name: str) -> str | None:
    """The annotated type name of the ``config`` parameter of ``class_name.__init__``."""
    if source is None:
        return None
    init = class_init_ast(source, class_name)
    if not isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for a in init.args.args + init.args.kwonlyargs:
        if a.arg == "config" and a.annotation is not None:
            ann = a.annotation
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                return ann.value.split(".")[-1]
            if isinstance(ann, ast.Name):
                return ann.id
            if isinstance(ann, ast.Attribute):
                return ann.attr
    return None


def local_origin(source: str, function: str, name: str, before_line: int):
    """Where the local ``name`` used at ``before_line`` in ``function`` comes from:
    ``("default", value)`` for a parameter with a literal default that is not reassigned,
    ``("getattr", (attr, fallback))`` for ``name = getattr(config, "attr", fallback)``,
    ``("config", (attr, None))`` for ``name = config.attr``; None when unknown."""
    fn = function_ast(source, function, before_line)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    assigns = [
        n for n in walk(fn)
        if isinstance(n, ast.Assign) and n.lineno < before_line
        and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    if assigns:
        if len(assigns) > 1:
            return None
        value = assigns[0].value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr" \
                and len(value.args) >= 2 and isinstance(value.args[1], ast.Constant) and isinstance(value.args[1].value, str):
            if "config" not in ast.unparse(value.args[0]):
                return None  # getattr of something else than the configuration
            if len(value.args) > 2:
                try:
                    fallback = ast.literal_eval(value.args[2])
                except Exception:
                    return None
                return ("getattr", (value.args[1].value, fallback))
            return ("config", (value.args[1].value, None))
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and "config" in value.value.id:
            return ("config", (value.attr, None))
        return None
    args = fn.args
    pos = args.posonlyargs + args.args
    pairs = list(zip(pos[len(pos) - len(args.defaults):], args.defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
    for a, d in pairs:
        if a.arg == name and d is not None:
            try:
                return ("default", ast.literal_eval(d))
            except Exception:
                return None
    return None


def param_passed(source: str, class_name: str, param: str) -> bool:
    """Whether some call ``ClassName(...)`` in the file passes ``param`` (by keyword, by
    ``**kwargs``, or positionally far enough to reach it), so its default may not hold."""
    if not re.search(r"(?<![\w.])" + re.escape(class_name) + r"\(", source):
        return False  # never instantiated in this file
    tree = parse_file(source)
    if tree is None:
        return True
    cls = next((n for n in statements(tree) if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) if cls else None
    if init is None:
        return True
    names = [a.arg for a in init.args.posonlyargs + init.args.args][1:]  # without self
    index = names.index(param) if param in names else None
    for node in walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if called != class_name:
            continue
        if any(kw.arg == param or kw.arg is None for kw in node.keywords):
            return True
        if any(isinstance(a, ast.Starred) for a in node.args):
            return True
        if index is not None and len(node.args) > index:
            return True
    return False


_BASE_CONFIGS = ("PreTrainedConfig", "PretrainedConfig")


@lru_cache(maxsize=4)
def _base_config_text(path: str) -> str | None:
    try:
        return read_source(path).text
    except SourceReadError:
        return None


@lru_cache(maxsize=256)
def _config_classes_of_file(path: str) -> dict[str, tuple[tuple[str, ...], frozenset]]:
    """class name -> (base names, every name the class body mentions outside its docstring:
    identifiers, attributes, string constants such as ``attribute_map`` keys)."""
    try:
        tree = ast.parse(read_source(path).text)
    except (SourceReadError, SyntaxError, ValueError):
        return {}
    out = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        bases = tuple(b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "?"
                      for b in cls.bases)
        body = cls.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring describes, it does not define
        names: set[str] = set()
        for stmt in body:
            for n in walk(stmt):
                if isinstance(n, ast.Name):
                    names.add(n.id)
                elif isinstance(n, ast.Attribute):
                    names.add(n.attr)
                elif isinstance(n, ast.arg):
                    names.add(n.arg)
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                    names.add(n.value)
        out[cls.name] = (bases, frozenset(names))
    return out


def config_defines(modeling_file: str, attr: str, config_class: str | None = None) -> bool | None:
    """Whether the configuration of ``modeling_file`` can hold ``attr`` by default.

    False only when it certainly does not: ``config_class`` (or, when it is not given, every
    class of the sibling ``configuration_<model>.py``) is found, derives — through classes of
    that file — only from transformers' ``PreTrainedConfig``, and neither it, its in-file bases
    nor ``configuration_utils.py`` ever mention the name (so ``getattr(config, attr, default)``
    gives ``default``). True when some class mentions it; None when unknown."""
    p = Path(modeling_file)
    if not p.name.startswith("modeling_"):
        return None
    own = p.with_name("configuration_" + p.name[len("modeling_"):])
    if not _is_file(str(own)):
        return None
    classes = _config_classes_of_file(str(own))
    if config_class is not None:
        if config_class not in classes:
            return None
        roots = [config_class]
    else:
        roots = [name for name, (bases, _n) in classes.items() if any(b.endswith("Config") for b in bases)]
        if not roots:
            return None
    base_text = None
    todo, seen = list(roots), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in _BASE_CONFIGS:
            if base_text is None:
                base_text = _base_config_text(str(p.parent.parent.parent / "configuration_utils.py"))
                if base_text is None:
                    return None
            if re.search(r"\b" + re.escape(attr) + r"\b", base_text):
                return None  # the base class may provide it (or mentions it somehow): unknown
            continue
        if name not in classes:
            return None  # a base defined elsewhere: unknown
        bases, names = classes[name]
        if attr in names:
            return True
        todo.extend(bases)
    return False


_CONFIG_OWNER = re.compile(r"^(?:config|cfg|.*_config)$")


def evaluate_config_condition(modeling_file: str, text: str, config_class: str | None = None) -> bool | None:
    """The truth of a condition on configuration attributes (``config.num_groups == 1``,
    ``hasattr(config, "x") and config.x``, ``not (self.config.flag)``) under the literal defaults
    of the sibling ``configuration_*.py``; None when some part is not settled by them."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    unknown = object()

    def attr_of(e: ast.expr) -> str | None:
        if isinstance(e, ast.Attribute):
            owner = e.value.attr if isinstance(e.value, ast.Attribute) else getattr(e.value, "id", "")
            if _CONFIG_OWNER.match(owner or ""):
                return e.attr
        return None

    def value(e: ast.expr):
        if isinstance(e, ast.Constant):
            return e.value
        attr = attr_of(e)
        if attr is not None:
            defaults = config_defaults(modeling_file, attr, config_class)
            if defaults and len(defaults) == 1 and None not in defaults:
                return next(iter(defaults))
            return unknown
        if (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "hasattr" and len(e.args) == 2
                and isinstance(e.args[1], ast.Constant) and isinstance(e.args[1].value, str)
                and _CONFIG_OWNER.match(ast.unparse(e.args[0]).rsplit(".", 1)[-1])):
            defined = config_defines(modeling_file, e.args[1].value, config_class)
            return unknown if defined is None else defined
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = value(e.operand)
            return unknown if v is unknown else not v
        if isinstance(e, ast.BoolOp):
            vals = [value(x) for x in e.values]
            decided = [bool(v) for v in vals if v is not unknown]
            if isinstance(e.op, ast.And):
                return False if False in decided else (True if len(decided) == len(vals) else unknown)
            return True if True in decided else (False if len(decided) == len(vals) else unknown)
        if isinstance(e, ast.Compare) and len(e.ops) == 1:
            a, b = value(e.left), value(e.comparators[0])
            if a is unknown or b is unknown:
                return unknown
            ops = {ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b, ast.Is: lambda: a is b,
                   ast.IsNot: lambda: a is not b, ast.Lt: lambda: a < b, ast.Gt: lambda: a > b,
                   ast.LtE: lambda: a <= b, ast.GtE: lambda: a >= b}
            op = ops.get(type(e.ops[0]))
            if op is None:
                return unknown
            try:
                return bool(op())
            except TypeError:
                return unknown
        return unknown

    out = value(tree)
    return None if out is unknown else bool(out)
