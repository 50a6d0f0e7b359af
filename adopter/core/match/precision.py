"""Precision classes every rule shares (issue 11): a match the pattern fits whose kernel is not
provably applicable is reported ``refused`` or ``conditional`` with a code
(:data:`~adopter.core.match.context.PRECISION_CODES`), never as a plain match.

* ``torchscript`` — a matched node lies in code ``torch.jit.script`` compiles (a decorated
  function or method, ``@torch.jit.script_method``, a class passed to or decorated with
  ``torch.jit.script``): a call of a Python kernel cannot run there.
* ``branch-straddle`` — the matched statements lie in different blocks (under different ``if``
  branches, split by a loop) and the rewrite's hoisting (paper Fig. 4: statements before an
  ``if`` copied into every branch, statements after it to the end of every branch) cannot bring
  them into one block. :func:`hoist_failure` replays that hoisting on the function's ``ast``
  (``adopter/rewrite/apply.py`` does it on the fissix tree, with the same refusals).
* ``needs-config`` / ``not-a-layernorm`` — the same statements run on another control-flow path
  with another type for a matched module (bound on some branches only, ``nn.GELU() if c else
  nn.ReLU()``, a dict lookup ``NORM2FN[config.x](...)``): the match holds only for some
  configurations (:func:`type_dependence`). A norm is refused (``not-a-layernorm``); any other
  layer makes the match conditional, with the condition read from the binding's source.

Only the source text is read (``ast``), never imported or run.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache

from adopter.core.match.context import Refusal
from adopter.core.match.source import function_ast, parse_file, source_lines
from adopter.core.structures import FileStructures, InitBinding, Match
from adopter.core.syntax import dotted_name, per_file, statements, walk

# ---------------------------------------------------------------- torchscript

_SCRIPT = ("torch.jit.script", "torch.jit.script_method")
# what a file that scripts anything must contain (``torch.jit.script``, ``jit.script``,
# ``script_method``, or ``script`` imported from ``torch.jit``)
_SCRIPT_TEXT = re.compile(r"jit\.script\b|script_method|from\s+torch\.jit\s+import|import\s+torch\.jit\s+as")


def _dotted(e: ast.expr) -> str | None:
    return dotted_name(e.func if isinstance(e, ast.Call) else e)


def _qualified(e: ast.expr, imports: dict[str, str]) -> str | None:
    name = _dotted(e)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    full = imports.get(head, head)
    return f"{full}.{rest}" if rest else full


@per_file
@lru_cache(maxsize=64)
def _scripted(source: str, imports: tuple) -> dict[str, str]:
    """Qualified names of the classes and functions of ``source`` that ``torch.jit.script``
    compiles -> how (``@torch.jit.script``, ``torch.jit.script(Cls(...)) at line N``)."""
    if not _SCRIPT_TEXT.search(source):
        return {}
    tree = parse_file(source)
    if tree is None:
        return {}
    imp = dict(imports)
    out: dict[str, str] = {}

    def visit(body, prefix: str):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{node.name}"
                for d in node.decorator_list:
                    if _qualified(d, imp) in _SCRIPT:
                        out.setdefault(qual, f"@{_dotted(d)}")
                visit(node.body, qual + ".")

    visit(tree.body, "")
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    for node in walk(tree):
        if isinstance(node, ast.Call) and node.args and _qualified(node.func, imp) == "torch.jit.script":
            arg = node.args[0]
            target = arg.func if isinstance(arg, ast.Call) else arg
            if isinstance(target, ast.Name) and target.id in classes:
                out.setdefault(target.id, f"{_dotted(node.func)}({ast.unparse(arg)}) at line {node.lineno}")
    return out


def torchscript_refusal(match: Match, entry: str, structures: FileStructures, source: str | None) -> Refusal | None:
    """``torchscript`` when ``entry`` (the qualified function the match was found through) or
    a function holding a matched node is compiled by ``torch.jit.script``."""
    if not source:
        return None
    scripted = _scripted(source, tuple(sorted(structures.imports.items())))
    if not scripted:
        return None
    names = [entry] + [mn.node.span.function for mn in match.nodes if mn.node.span is not None and mn.node.span.function]
    for qual in dict.fromkeys(names):
        parts = qual.split(".")
        for k in range(len(parts), 0, -1):
            how = scripted.get(".".join(parts[:k]))
            if how is not None:
                return Refusal("torchscript", f"{qual} is compiled by TorchScript ({how}): a Python kernel call "
                                              "cannot run there")
    return None


# ---------------------------------------------------------------- branch straddle (hoisting replay)


@dataclass(eq=False)
class _Block:
    items: list = field(default_factory=list)
    owner: _Item | None = None  # the compound statement holding this suite (None: function body)


@dataclass(eq=False)
class _Item:
    stmt: ast.stmt | None  # None for a hoisted copy
    parent: _Block | None = None
    kind: str = "simple"  # "simple" | "if" | "other"
    suites: list = field(default_factory=list)
    tests: list = field(default_factory=list)  # if/elif tests
    stores: frozenset = frozenset()
    multiline_string: bool = False
    header: str = ""
    has_else: bool = False


def _assign_names(stmt: ast.stmt) -> frozenset:
    targets = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AugAssign):
        targets = [stmt.target]
    names = set()
    for t in targets:
        for n in walk(t):
            if isinstance(n, ast.Name):
                names.add(n.id)
            elif isinstance(n, ast.Attribute):
                names.add(n.attr)
    return frozenset(names)


def _has_multiline_string(stmt: ast.stmt) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and (n.end_lineno or n.lineno) > n.lineno
               for n in walk(stmt))


class _Model:
    """The blocks of one function, as the rewrite's hoisting sees them (``elif`` chains are
    one ``if`` with several suites)."""

    def __init__(self, fn: ast.AST, lines: tuple[str, ...]):
        self.lines = lines
        self.by_stmt: dict[int, _Item] = {}
        self.root = self._block(fn.body, None)

    def _block(self, body: list, owner: _Item | None) -> _Block:
        block = _Block(owner=owner)
        for st in body:
            item = self._item(st)
            item.parent = block
            block.items.append(item)
        return block

    def _is_elif(self, node: ast.stmt) -> bool:
        line = self.lines[node.lineno - 1] if 0 < node.lineno <= len(self.lines) else ""
        return line.lstrip().startswith("elif")

    def _item(self, st: ast.stmt) -> _Item:
        if isinstance(st, ast.If):
            item = _Item(st, kind="if", header=f"if {ast.unparse(st.test)}")
            node = st
            while True:
                item.tests.append(node.test)
                item.suites.append(self._block(node.body, item))
                if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and self._is_elif(node.orelse[0]):
                    node = node.orelse[0]
                    continue
                if node.orelse:
                    item.suites.append(self._block(node.orelse, item))
                    item.has_else = True
                break
        elif isinstance(st, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
                             getattr(ast, "TryStar", ast.Try), ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             getattr(ast, "Match", ast.Try))):
            first = self.lines[st.lineno - 1].strip() if 0 < st.lineno <= len(self.lines) else type(st).__name__
            item = _Item(st, kind="other", header=first.rstrip(":"))
            bodies = [getattr(st, a, []) for a in ("body", "orelse", "finalbody")]
            bodies += [h.body for h in getattr(st, "handlers", [])]
            bodies += [c.body for c in getattr(st, "cases", [])]
            item.suites = [self._block(b, item) for b in bodies if b]
        else:
            item = _Item(st)
        self.by_stmt[id(st)] = item
        return item


class _Fail(Exception):
    pass


def _ancestor_in(item: _Item, block: _Block) -> _Item | None:
    current = item
    while current is not None and current.parent is not block:
        owner = current.parent.owner if current.parent is not None else None
        current = owner
    return current


def _settle(it: _Item) -> _Item:
    """Fill in what moving a simple statement needs to know (computed only for moved ones)."""
    if it.stmt is not None and it.kind == "simple" and not it.stores and not it.multiline_string:
        it.stores, it.multiline_string = _assign_names(it.stmt), _has_multiline_string(it.stmt)
    return it


def _check_movable(moving: list[_Item]) -> None:
    for it in moving:
        if it.kind != "simple":
            raise _Fail("hoisting would copy a compound statement")
        if _settle(it).multiline_string:
            raise _Fail("hoisting would re-indent a multi-line string")


def _copy(it: _Item) -> _Item:
    _settle(it)
    return _Item(None, kind="simple", stores=it.stores, multiline_string=it.multiline_string)


def _copy_into_branches(anc: _Item, moving: list[_Item], where: str, matched_suite: _Block, stmts: list) -> list:
    if not anc.has_else:
        anc.suites.append(_Block(owner=anc))
        anc.has_else = True
    tracked = None
    for suite in anc.suites:
        copies = [_copy(m) for m in moving]
        for c in copies:
            c.parent = suite
        suite.items[0:0] = copies if where == "start" else []
        if where == "end":
            suite.items.extend(copies)
        if suite is matched_suite:
            tracked = copies
    for m in moving:
        m.parent.items.remove(m)
    index = {id(m): k for k, m in enumerate(moving)}
    return [tracked[index[id(s)]] if id(s) in index else s for s in stmts]


def _hoist(stmts: list[_Item]) -> None:
    """Raises :class:`_Fail` where ``adopter.rewrite.apply.hoist`` raises ``Skip``."""
    for _ in range(16):
        blocks = [s.parent for s in stmts]
        if all(b is blocks[0] for b in blocks):
            return
        i = next(j for j in range(1, len(stmts)) if blocks[j] is not blocks[j - 1])
        prev_block = blocks[i - 1]
        anc = _ancestor_in(stmts[i], prev_block)
        if anc is not None:
            if anc.kind != "if":
                raise _Fail(f"a `{anc.header}` lies between them (only an `if` can be hoisted over)")
            try:
                start, end = prev_block.items.index(stmts[0]), prev_block.items.index(anc)
            except ValueError:
                raise _Fail("matched statements lie in different branches") from None
            moving = prev_block.items[start:end]
            _check_movable(moving)
            stored = frozenset().union(*(_settle(m).stores for m in moving)) if moving else frozenset()
            names = set()
            for t in anc.tests:
                if any(isinstance(n, ast.Call) for n in walk(t)):
                    raise _Fail(f"the condition of `{anc.header}` calls a function; statements cannot move past it")
                names |= {n.id for n in walk(t) if isinstance(n, ast.Name)}
                names |= {n.attr for n in walk(t) if isinstance(n, ast.Attribute)}
            if names & stored:
                raise _Fail(f"the condition of `{anc.header}` reads a value the moved statements assign")
            suite = next(s for s in anc.suites if _ancestor_in(stmts[i], s) is not None)
            stmts = _copy_into_branches(anc, moving, "start", suite, stmts)
            continue
        owner = prev_block.owner
        if owner is not None and owner.kind == "if" and stmts[i].parent is owner.parent:
            outer = owner.parent.items
            moving = outer[outer.index(owner) + 1: outer.index(stmts[i]) + 1]
            _check_movable(moving)
            stmts = _copy_into_branches(owner, moving, "end", prev_block, stmts)
            continue
        raise _Fail("they lie in different branches")
    raise _Fail("hoisting did not converge")


def _where(model: _Model, item: _Item) -> str:
    headers = []
    block = item.parent
    while block is not None and block.owner is not None:
        owner = block.owner
        k = next((i for i, s in enumerate(owner.suites) if s is block), 0)
        branch = "" if k == 0 or owner.kind != "if" else (
            " (else branch)" if owner.has_else and k == len(owner.suites) - 1 else " (elif branch)")
        headers.append(f"`{owner.header}`{branch}")
        block = owner.parent
    return " > ".join(reversed(headers)) if headers else "the function body"


_BLOCK_IDS: dict = {}


def _block_ids(fn: ast.AST) -> dict[int, int]:
    """Statement start line -> an id of the statement list holding it (cached per function node)."""
    cached = _BLOCK_IDS.get(id(fn))
    if cached is not None and cached[0] is fn:
        return cached[1]
    out: dict[int, int] = {}
    counter = [0]

    def visit(body: list) -> None:
        counter[0] += 1
        here = counter[0]
        for st in body:
            out.setdefault(st.lineno, here)
            for attr in ("body", "orelse", "finalbody"):
                sub = getattr(st, attr, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    visit(sub)
            for h in getattr(st, "handlers", []):
                visit(h.body)
            for c in getattr(st, "cases", []):
                visit(c.body)

    visit(getattr(fn, "body", []))
    if len(_BLOCK_IDS) > 256:
        _BLOCK_IDS.clear()
    _BLOCK_IDS[id(fn)] = (fn, out)
    return out


def hoist_failure(source: str, function: str, stmt_lines: list[int]) -> str | None:
    """Why the statements starting at ``stmt_lines`` (execution order) of ``function`` cannot be
    brought into one block by the rewrite's hoisting; None when they share a block or can be."""
    fn = function_ast(source, function, stmt_lines[0])
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    blocks = _block_ids(fn)
    if len({blocks.get(line, -1) for line in stmt_lines}) == 1:
        return None  # one block (or a line not found: nothing to say)
    model = _Model(fn, source_lines(source))
    by_line: dict[int, _Item] = {}
    for item in model.by_stmt.values():
        if item.stmt is not None:
            by_line.setdefault(item.stmt.lineno, item)
    items = []
    for line in dict.fromkeys(stmt_lines):
        item = by_line.get(line)
        if item is None or item.kind != "simple":
            return None  # a call in a compound statement's header: not a case of hoisting
        items.append(item)
    if len(items) < 2 or all(it.parent is items[0].parent for it in items):
        return None
    where = "; ".join(f"line {it.stmt.lineno} in {_where(model, it)}" for it in items)
    try:
        _hoist(items)
    except _Fail as exc:
        return f"the matched statements lie in different blocks ({where}) and cannot be hoisted into one: {exc}"
    return None


def straddle_refusal(match: Match, source: str | None) -> Refusal | None:
    """``branch-straddle`` when the match's statements (all in one function) lie in blocks the
    rewrite cannot join."""
    if not source:
        return None
    spans = [mn.node.span for mn in match.nodes if mn.node.span is not None]
    functions = {(sp.function, sp.inlined_at) for sp in spans}
    if len(functions) != 1 or not spans[0].function:
        return None
    lines = sorted({sp.stmt_line or sp.line for sp in spans})
    if len(lines) < 2:
        return None
    why = hoist_failure(source, spans[0].function, lines)
    return Refusal("branch-straddle", why) if why else None


# ---------------------------------------------------------------- type depends on configuration


def _short(type_name: str) -> str:
    head, _, last = type_name.rpartition(".")
    return f"nn.{last}" if head in ("torch.nn", "torch.nn.modules") else last


def binding_condition(source: str | None, ib: InitBinding) -> str:
    """The condition under which ``ib`` binds its attribute, from the source: the test of the
    ``x if c else y`` or of the enclosing ``if`` (``not (...)`` on the other branch); else
    ``bound by <the bound expression>`` (a dict lookup, a factory call)."""
    if not source or ib.span is None or not ib.span.function:
        return ""
    fn = function_ast(source, ib.span.function, ib.span.line)
    if fn is None:
        return ""
    line = ib.span.stmt_line or ib.span.line

    def within(body) -> bool:
        return bool(body) and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno)

    def find(body, conds):
        for st in body:
            if not st.lineno <= line <= (st.end_lineno or st.lineno):
                continue
            if isinstance(st, ast.If):
                test = ast.unparse(st.test)
                if within(st.body):
                    return find(st.body, conds + [test])
                if within(st.orelse):
                    return find(st.orelse, conds + [f"not ({test})"])
                return None, conds
            subs = [getattr(st, a, None) for a in ("body", "orelse", "finalbody")]
            subs += [h.body for h in getattr(st, "handlers", [])]
            subs = [b for b in subs if isinstance(b, list) and b and isinstance(b[0], ast.stmt)]
            if subs:
                return next((find(b, conds) for b in subs if within(b)), (None, conds))
            return st, conds
        return None, conds

    stmt, conds = find(getattr(fn, "body", []), [])
    value = getattr(stmt, "value", None)
    if isinstance(value, ast.IfExp):
        test = ast.unparse(value.test)
        b = value.body
        in_body = (b.lineno, b.col_offset) <= (ib.span.line, ib.span.col) <= (b.end_lineno, b.end_col_offset)
        conds = conds + [test if in_body else f"not ({test})"]
    if conds:
        return " and ".join(conds)
    return f"bound by {ast.unparse(value)}" if value is not None else ""


def _settled(file: str, cond: str, ib: InitBinding | None, source: str | None) -> bool | None:
    # configuration defaults are read by the rules' helper (sibling configuration_*.py files)
    from adopter.core.rules._config_defaults import config_annotation, evaluate_config_condition

    owner = ib.span.function.rsplit(".", 1)[0] if ib is not None and ib.span is not None and "." in ib.span.function \
        else None
    config_class = config_annotation(source, owner) if owner else None
    return evaluate_config_condition(file, cond, config_class)


def _factory_choice(structures: FileStructures, source: str | None, ib: InitBinding) -> str | None:
    """``self.act = get_activation_fn(key)`` with an in-file function that picks its result by
    comparing its parameter with constants (``if activation == "gelu": return F.gelu``) and a key
    settled statically (a constant, a configuration attribute with one literal default, the
    default of a constructor parameter when the file builds the class and never passes it): the
    qualified name of what it returns for that key; None when any of that is unknown."""
    from adopter.core.rules._config_defaults import config_annotation, config_defaults, local_origin, param_passed

    if not source or ib.span is None or not ib.span.function:
        return None
    fn = function_ast(source, ib.span.function, ib.span.line)
    stmt = next((st for st in walk(fn) if isinstance(st, ast.Assign)
                 and st.lineno == (ib.span.stmt_line or ib.span.line)), None) if fn is not None else None
    call = getattr(stmt, "value", None)
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) + len(call.keywords) == 1):
        return None
    tree = parse_file(source)
    factory = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == call.func.id), None) \
        if tree is not None else None
    if factory is None or not factory.args.args:
        return None
    param = factory.args.args[0].arg
    arg = call.args[0] if call.args else call.keywords[0].value
    if call.keywords and call.keywords[0].arg != param:
        return None
    key = None
    owner = ib.span.function.rsplit(".", 1)[0] if "." in ib.span.function else ""
    if isinstance(arg, ast.Constant):
        key = arg.value
    elif isinstance(arg, ast.Attribute) and re.fullmatch(r"(?:self\.)?(?:config|cfg|\w*_config)", ast.unparse(arg.value)):
        defaults = config_defaults(structures.file, arg.attr, config_annotation(source, owner) if owner else None)
        key = next(iter(defaults)) if defaults and len(defaults) == 1 else None
    elif isinstance(arg, ast.Name):
        # A constructor parameter's default settles the key only when the file builds the class
        # and never passes it; a class built elsewhere is the caller's choice (a condition).
        origin = local_origin(source, ib.span.function, arg.id, ib.span.line)
        cls = owner.rsplit(".", 1)[-1]
        if origin is not None and origin[0] == "default" and cls and not param_passed(source, cls, arg.id) \
                and re.search(r"(?<!class )(?<![\w.])" + re.escape(cls) + r"\(", source):
            key = origin[1]
        elif origin is not None and origin[0] == "config":
            defaults = config_defaults(structures.file, origin[1][0], config_annotation(source, owner) if owner else None)
            key = next(iter(defaults)) if defaults and len(defaults) == 1 else None
    if not isinstance(key, str):
        return None
    body = factory.body
    while body:
        st = next((s for s in body if isinstance(s, ast.If)), None)
        if st is None:
            return None
        t = st.test
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
                and isinstance(t.left, ast.Name) and t.left.id == param and isinstance(t.comparators[0], ast.Constant)):
            return None
        if t.comparators[0].value == key:
            ret = st.body[0] if st.body else None
            if not isinstance(ret, ast.Return) or ret.value is None:
                return None
            value = ret.value.func if isinstance(ret.value, ast.Call) else ret.value
            return _qualified(value, structures.imports)
        body = st.orelse
    return None


def _alternatives(structures: FileStructures, class_name: str | None, attr: str) -> list[InitBinding]:
    from adopter.core.match.init_match import class_and_bases

    cls = next((c for c in structures.classes if c.name == class_name), None)
    if cls is None:
        return []
    out = []
    for c in class_and_bases(structures, cls):
        here = [ib for ib in c.init_bindings if ib.attr == attr and ib.container is None]
        if here:
            out = here
            break
    return out


def type_dependence(
    structures: FileStructures, accepted: dict, found_on: dict, position_maps: dict, source: str | None
) -> list[tuple]:
    """Accepted matches whose statements run on another path of their function with another type
    for a matched module (the pattern does not match there): ``[(key, match)]`` with the match
    with a verdict: ``("needs-config", condition)`` (conditional, also when the configuration
    defaults bind the other type), a :class:`Refusal` (``not-a-layernorm``), or a plain reason (an
    in-file factory builds another layer for the key it is given). A condition the literal
    configuration defaults make true leaves the match as it is."""
    out = []
    for key, m in accepted.items():
        if m.status != "static" or m.sequential is not None:
            continue
        spans = [mn.node.span for mn in m.nodes]
        if any(sp is None for sp in spans):
            continue
        # module calls only (an operator may start at the same column as its first operand's call)
        modules = [getattr(mn.node, "module", None) is not None for mn in m.nodes]
        positions = [(sp.line, sp.col, sp.inlined_at) if mod else None for sp, mod in zip(spans, modules)]
        where = found_on.get(key, set())
        differing: dict[int, set] = {}
        for f_index in {f for f, _ in where}:
            fs = structures.functions[f_index]
            for p_index, path in enumerate(fs.paths):
                if (f_index, p_index) in where:
                    continue
                pmap = position_maps.get((f_index, p_index))
                if pmap is None:
                    pmap = position_maps[(f_index, p_index)] = {
                        (n.span.line, n.span.col, n.span.inlined_at): getattr(n, "type", None)
                        for n in path.nodes if n.span is not None and getattr(n, "module", None) is not None
                    }
                if not all(p is None or p in pmap for p in positions):
                    continue
                for i, (p, mn) in enumerate(zip(positions, m.nodes)):
                    other = pmap.get(p) if p is not None else None
                    if other is not None and other != getattr(mn.node, "type", None):
                        differing.setdefault(i, set()).add(other)
        if not differing:
            continue
        i = min(differing)
        node = m.nodes[i].node
        attr = node.module.name
        matched_type = node.type
        others = ", ".join(sorted(_short(t) for t in differing[i]))
        bindings = [ib for ib in _alternatives(structures, m.class_name, attr) if ib.layer.type == matched_type]
        cond = next((c for c in (binding_condition(source, ib) for ib in bindings) if c), "")
        bound = cond.startswith("bound by ")
        if bound and bindings:
            chosen = _factory_choice(structures, source, bindings[0])
            if chosen is not None and chosen == matched_type:
                continue  # the in-file factory returns the matched layer for the key it is given
            if chosen is not None and not matched_type.endswith("LayerNorm"):
                out.append((key, m, f"{attr} is {_short(chosen)} for the key it is built with ({cond})"))
                continue
        if cond and not bound:
            # the literal configuration defaults may settle the condition (as they settle an
            # activation key): true -> the plain match stands; false -> still a site, conditional
            # (a configuration that makes it true runs it; the trace settles which)
            settled = _settled(structures.file, cond, bindings[0] if bindings else None, source)
            if settled is True:
                continue
            if settled is False:
                out.append((key, m, ("needs-config", f"{attr} is {_short(matched_type)} only if {cond} "
                                                     f"(false under the configuration defaults: {others})")))
                continue
        if matched_type.endswith("LayerNorm"):
            how = f" ({cond})" if bound else f" (an nn.LayerNorm only if {cond})" if cond else ""
            out.append((key, m, Refusal("not-a-layernorm", f"{attr} may be {others}{how}: not provably an nn.LayerNorm")))
        else:
            condition = (f"{attr} is {_short(matched_type)} only if {cond}" if cond and not bound
                         else f"{attr} is {_short(matched_type)}, not {others}" + (f" ({cond})" if cond else ""))
            out.append((key, m, ("needs-config", condition)))
    return out


# ---------------------------------------------------------------- methods that would diverge


def _self_calls(fn: ast.AST) -> set[str]:
    """``a`` of every ``self.a(...)`` call in ``fn``."""
    out = set()
    for node in walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            out.add(node.func.attr)
    return out


@per_file
@lru_cache(maxsize=8)
def _class_methods(source: str) -> dict[str, dict[str, tuple[set[str], ast.AST]]]:
    """class name -> method name -> (the ``self.<attr>(...)`` calls of that method, its tree) (once
    per file: the tree extraction parsed). Shared: callers must not change it."""
    tree = parse_file(source)
    if tree is None:
        return {}
    out: dict[str, dict[str, tuple[set[str], ast.AST]]] = {}
    for node in statements(tree):
        if isinstance(node, ast.ClassDef):
            out[node.name] = {f.name: (_self_calls(f), f) for f in node.body
                              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name != "__init__"}
    return out


def _self_call_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
        return node.func.attr
    return None


def _computes_chain(method: ast.AST, first: str, last: str) -> bool:
    """Whether ``method`` calls ``self.<last>`` on a value that is ``self.<first>(...)``'s output,
    through names and ``+`` only (the value may also be read elsewhere: timm's taps). A name keeps
    its latest binding in the method's own statements; a binding under a branch or loop is added
    to the ones it may have (so what is unsure counts as reaching: the refusal stays)."""
    # env: name -> tuple of (value, the env its names read)
    def reaches(expr: ast.AST, env: dict, depth: int = 0) -> bool:
        if depth > 64:
            return True
        if _self_call_of(expr) == first:
            return True
        if isinstance(expr, ast.Name):
            return any(reaches(v, at, depth + 1) for v, at in env.get(expr.id, ()))
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return reaches(expr.left, env, depth + 1) or reaches(expr.right, env, depth + 1)
        return False

    def calls_last(node: ast.AST, env: dict) -> bool:
        return any(_self_call_of(c) == last and c.args and reaches(c.args[0], env) for c in ast.walk(node))

    def run(body: list, env: dict, nested: bool) -> bool:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if run(stmt.body, env, True):
                    return True
                continue
            blocks = [v for f, v in ast.iter_fields(stmt) if f in ("body", "orelse", "finalbody", "handlers")]
            head = [v for f, v in ast.iter_fields(stmt) if f not in ("body", "orelse", "finalbody", "handlers")]
            if any(calls_last(v, env) for h in head for v in (h if isinstance(h, list) else [h])
                   if isinstance(v, ast.AST)):
                return True
            if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
                value = stmt.value if not isinstance(stmt, ast.AugAssign) else ast.BinOp(stmt.target, stmt.op, stmt.value)
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                before = dict(env)
                for target in targets:
                    # an unpacked name's value is not followed (no chain through it: conservative
                    # only where it would reach, which a tuple's element cannot by `+` alone)
                    one = value if isinstance(target, ast.Name) else ast.Constant(None)
                    for name in (n for n in ast.walk(target) if isinstance(n, ast.Name)):
                        env[name.id] = (env.get(name.id, ()) if nested else ()) + ((one, before),)
            for block in blocks:
                for item in block if isinstance(block, list) else ():
                    inner = item.body if isinstance(item, ast.ExceptHandler) else [item]
                    if run(inner, env, True):
                        return True
        return False

    return run(getattr(method, "body", []), {}, False)


def _chain_ends(match: Match) -> tuple[str, str] | None:
    """``(first, last)`` attributes of a chain rule's match whose two ends are ``self.<attr>`` layers.
    Another method computes the *same* chain when its last layer reads the first one's output
    through names and adds; one that runs the same layers in another order or with other layers
    between (DETR's pre-norm and post-norm methods) computes something else, and a rewrite of one
    cannot make the two disagree."""
    if len(match.nodes) < 2:
        return None
    names = [getattr(getattr(mn.node, "module", None), "name", "") or "" for mn in (match.nodes[0], match.nodes[-1])]
    if not all(n.startswith("self.") and n.count(".") == 1 for n in names):
        return None
    return names[0][len("self."):], names[1][len("self."):]


def _own_method(match: Match) -> str:
    """The method of its class a match is in: ``forward`` for ``forward`` and for a function nested
    in it (``forward.stem``), whose calls :func:`_self_calls` counts as the method's own."""
    function = match.function
    if match.class_name and function.startswith(match.class_name + "."):
        function = function[len(match.class_name) + 1:]
    return function.split(".")[0]


def _module_attrs(match: Match) -> frozenset[str]:
    names = set()
    for mn in match.nodes:
        name = getattr(getattr(mn.node, "module", None), "name", "") or ""
        if name.startswith("self.") and name.count(".") == 1:
            names.add(name[len("self."):])
    return frozenset(names)


def method_divergence(matches: list[Match], source: str | None, chain: bool = False) -> dict[int, Refusal]:
    """``method-divergence`` refusals (by index in ``matches``): a match over layers ``self.a``,
    ``self.b`` of a class whose other method calls both and holds no match of the same rule over
    them (timm's ``forward_intermediates`` reads the conv output before the BatchNorm that
    ``forward_features`` folds). Every method that runs a pair gets the rewrite, or none does."""
    if not source or not matches:
        return {}
    methods = None
    covered = {(m.rule, m.class_name, _own_method(m), _module_attrs(m)) for m in matches}
    out: dict[int, Refusal] = {}
    for index, m in enumerate(matches):
        attrs = _module_attrs(m)
        if not m.class_name or len(attrs) < 2 or m.sequential is not None:
            continue
        if methods is None:
            methods = _class_methods(source)
        own = _own_method(m)
        ends = _chain_ends(m) if chain else None
        for name, (calls, method) in methods.get(m.class_name, {}).items():
            if name != own and attrs <= calls and (m.rule, m.class_name, name, attrs) not in covered \
                    and (ends is None or _computes_chain(method, *ends)):
                layers = ", ".join(f"self.{a}" for a in sorted(attrs))
                out[index] = Refusal("method-divergence", f"{m.class_name}.{name} also runs {layers} and cannot "
                                     "take the same rewrite: fusing them here alone would make the two methods "
                                     "answer differently")
                break
    return out
