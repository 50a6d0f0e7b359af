"""What ``__init__`` builds before it binds it: local lists and ``OrderedDict``s of layers grown
entry by entry (:class:`_ListVar` of :class:`_Entry`, each way of an ``if`` the source does not
decide kept apart), ``nn.Sequential`` constructions resolved where they are built
(:class:`SeqBuildRecord`, also of an ``nn.Sequential`` subclass filling itself), and the children
of ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` bindings. A mixin of
:class:`adopter.core.extract.init_bindings._InitExtractor`, whose state it reads."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.extract.symbols import _dotted
from adopter.core.extract.values import UNKNOWN_TYPE
from adopter.core.syntax import walk

_CONTAINERS = ("torch.nn.ModuleList", "torch.nn.Sequential", "torch.nn.ModuleDict")
_SEQUENTIAL = "torch.nn.Sequential"
_MODULE_DICT = "torch.nn.ModuleDict"


@dataclass
class _Entry:
    """One element of a list being built (``layers.append(norm_layer(c))``) or of a Sequential:
    its candidate values, the expression that builds it, and whether it stands for any number
    of elements (a comprehension, ``*unknown``), after which positions are unknown."""

    values: list
    expr: ast.AST | None
    many: bool = False
    # the child's name: an ``("fc", nn.Linear(...))`` pair of a list that makes an OrderedDict,
    # a key of an OrderedDict filled item by item (``layers["fc"] = nn.Linear(...)``)
    name: str | None = None

    def copy(self) -> "_Entry":
        return _Entry(list(self.values), self.expr, self.many, self.name)


class _ListVar(list):
    """A local list (or ``OrderedDict``) of layers being built, entry by entry (:class:`_Entry`).

    When an ``if`` the source does not decide grows it differently on its branches, ``ways``
    holds what it is on each: ``[(condition, entries)]`` (the list itself keeps every entry of
    every branch, in order, for the bindings of the layers it holds). Entries added afterwards
    go to every way."""

    def __init__(self, entries=(), keyed: bool = False):
        super().__init__(entries)
        self.keyed = keyed  # an OrderedDict: entries carry their names
        self.ways: list[tuple[str, list]] | None = None

    def extend(self, items) -> None:
        items = list(items)
        super().extend(items)
        for _cond, entries in self.ways or ():
            entries.extend(items)

    def append(self, item) -> None:
        self.extend([item])

    def set_item(self, name: str, entry: _Entry) -> None:
        """``od[name] = value``: a new key goes last, an existing one keeps its place."""
        for entries in [self] + [e for _c, e in self.ways or ()]:
            at = next((i for i, e in enumerate(entries) if e.name == name), None)
            if at is None:
                list.append(entries, entry)
            else:
                entries[at] = entry

    def snapshot(self) -> "_ListVar":
        out = _ListVar(self, self.keyed)
        if self.ways is not None:
            out.ways = [(c, list(e)) for c, e in self.ways]
        return out

    def same_as(self, other: "_ListVar") -> bool:
        return self.ways is None and other.ways is None and len(self) == len(other) and all(
            a is b for a, b in zip(self, other))

    def by_way(self, condition: str) -> list[tuple[str, list]]:
        if self.ways is None:
            return [(condition, list(self))]
        return [(f"{condition} and {c}", list(e)) for c, e in self.ways]


# Ways a list may be built (if/else branches) followed before its contents are merged into one.
_MAX_WAYS = 4


@dataclass
class SeqBuildRecord:
    """An ``nn.Sequential(...)`` construction seen while resolving values (see
    :class:`~adopter.core.structures.SequentialBuild`): its entries as resolved where it is built."""

    class_name: str | None
    function: str
    call: ast.Call
    stmt: ast.AST | None
    alternatives: list  # [[(child name or None, _Entry)], ...]: one per distinct way it was built
    # per alternative: the branch conditions it is built under ("" for every way through)
    conditions: list = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.conditions is None:
            self.conditions = [""] * len(self.alternatives)


def _calls_super_forward(fn: ast.FunctionDef) -> bool:
    """``forward`` runs the Sequential's own (``super().forward(x)``), adding around it."""
    for node in walk(fn):
        if (
            type(node) is ast.Call and type(node.func) is ast.Attribute and node.func.attr == "forward"
            and type(node.func.value) is ast.Call and _dotted(node.func.value.func) == "super"
        ):
            return True
    return False


class _InitContainers:
    """Lists, Sequentials and container contents of :class:`~adopter.core.extract.init_bindings._InitExtractor`."""

    def is_sequential_subclass(self) -> bool:
        """This class is an ``nn.Sequential`` subclass running its children in order (no
        ``forward`` of its own here or in a same-file base)."""
        if self.cls is None or self.fn.name != "__init__" or self.sweep:
            return False
        for c in self.cls.mro():
            fwd = c.methods.get("forward")
            if fwd is not None and not _calls_super_forward(fwd):
                return False  # its own forward decides what runs
        return any(b == _SEQUENTIAL for c in self.cls.mro() for b in c.bases)

    def own_children(self, call: ast.Call) -> bool:
        """``super().__init__(*layers)`` / ``self.add_module("conv", m)`` of an nn.Sequential
        subclass: its own children, in order (a Sequential built by the class itself)."""
        f = call.func
        if type(f) is not ast.Attribute:
            return False
        if f.attr == "__init__" and type(f.value) is ast.Call and _dotted(f.value.func) == "super":
            if self.foreign_base_init(call):
                return True
            if not self.is_sequential_subclass():
                return False
            self.note_sequential(call)
            if not call.args:
                self.growing[self.self_name] = id(call)  # children follow through add_module
            return True
        target = _dotted(f.value)
        if f.attr == "add_module" and target in self.growing and len(call.args) > 1:
            rec = self.fc.seq_builds.get(self.growing[target])
            if rec is not None:
                name = call.args[0].value if type(call.args[0]) is ast.Constant else None
                entry = self.entry(call.args[1])
                known = rec.alternatives[0]
                unknown = name is None or entry.many or any(n is None for n, _e in known)
                known.append((None if unknown else str(name), entry))
        return False  # the binding of the element is recorded as before

    def note_sequential(self, call: ast.Call) -> None:
        """Record ``nn.Sequential(...)`` built here with its entries resolved in this scope
        (inline, ``*layers`` of a list built before, an ``OrderedDict``)."""
        ways = self.sequential_ways(call)
        if ways is None:
            return
        for condition, entries in ways:
            self.note_way(call, [(n, e.copy()) for n, e in entries], condition)

    def note_way(self, call: ast.Call, entries: list, condition: str) -> None:
        rec = self.fc.seq_builds.get(id(call))
        if rec is None:
            cls_name = self.qual.split(".")[0] if "." in self.qual else None
            self.fc.seq_builds[id(call)] = SeqBuildRecord(cls_name, self.qual, call, self.stmt, [entries], [condition])
            return
        # built again (a factory called from several places, with other arguments): each entry
        # may be any of the values seen; another number of entries is another alternative. The
        # ways of a list grown on the branches of an ``if`` stay apart (each pair of neighbours
        # is one of a way), unless there are too many.
        if condition and len(rec.alternatives) < _MAX_WAYS and condition not in rec.conditions:
            rec.alternatives.append(entries)
            rec.conditions.append(condition)
            return
        for i, known in enumerate(rec.alternatives):
            if len(known) == len(entries) and (rec.conditions[i] == condition or len(rec.alternatives) >= 4):
                for (_n, old), (_m, new) in zip(known, entries):
                    for v in new.values:
                        if all(v[0] != o[0] for o in old.values):
                            old.values.append(v)
                return
        if len(rec.alternatives) < 4:
            rec.alternatives.append(entries)
            rec.conditions.append(condition)

    def sequential_ways(self, call: ast.Call) -> list | None:
        """``[(condition, [(child name or None, _Entry)])]`` of ``nn.Sequential(...)``: one way when
        its entries do not depend on a branch, one per branch way of the list it is built from
        (``*layers``, ``OrderedDict(layers)``) otherwise; None when not a plain construction."""
        grown = self.branch_list(call)
        if grown is None or grown.ways is None:
            entries = self.sequential_entries(call)
            return None if entries is None else [("", entries)]
        out = []
        saved = grown.ways
        try:
            for condition, entries in saved:
                grown.ways = None
                # the list as built on this way (the Sequential reads it, nothing else)
                self.lists_override = (grown, entries)
                made = self.sequential_entries(call)
                if made is None:
                    return None
                out.append((condition, made))
        finally:
            grown.ways = saved
            self.lists_override = None
        return out

    def branch_list(self, call: ast.Call) -> "_ListVar | None":
        """The local list a Sequential is built from (``*layers``, ``OrderedDict(layers)``, an
        ``OrderedDict`` filled item by item), when there is exactly one."""
        names = []
        for a in call.args:
            a = a.value if type(a) is ast.Starred else a
            if type(a) is ast.Call and (_dotted(a.func) or "").endswith("OrderedDict") and a.args:
                a = a.args[0]
            if type(a) is ast.Name and a.id in self.lists:
                names.append(a.id)
        return self.lists[names[0]] if len(names) == 1 else None

    def list_of(self, name: str) -> list:
        """The entries of local list ``name`` (as built on the way being recorded, if any)."""
        override = getattr(self, "lists_override", None)
        lst = self.lists[name]
        if override is not None and override[0] is lst:
            return override[1]
        return lst

    def sequential_entries(self, call: ast.Call) -> list | None:
        """[(child name or None, _Entry)] of ``nn.Sequential(...)``; None when not a plain construction."""
        args = call.args
        if call.keywords:
            return None
        if len(args) == 1 and type(args[0]) is ast.Name and args[0].id in self.lists and self.lists[args[0].id].keyed:
            # ``layers = OrderedDict(); layers["fc"] = nn.Linear(...); nn.Sequential(layers)``
            return self.named_entries(self.list_of(args[0].id))
        if len(args) == 1 and type(args[0]) is ast.Call and (_dotted(args[0].func) or "").endswith("OrderedDict"):
            od = args[0]
            items: list = []
            if len(od.args) == 1 and not od.keywords and type(od.args[0]) is ast.Name and od.args[0].id in self.lists:
                # ``OrderedDict(layers)`` of a list of ``(name, layer)`` pairs built before
                return self.named_entries(self.list_of(od.args[0].id))
            if od.args and type(od.args[0]) in (ast.List, ast.Tuple):
                for el in od.args[0].elts:
                    if type(el) is ast.Tuple and len(el.elts) == 2 and type(el.elts[0]) is ast.Constant:
                        items.append((str(el.elts[0].value), el.elts[1]))
                    else:
                        items.append((None, el))
            elif od.args and type(od.args[0]) is ast.Dict:
                d = od.args[0]
                items = [(str(k.value) if type(k) is ast.Constant else None, v) for k, v in zip(d.keys, d.values)]
            items += [(k.arg, k.value) for k in od.keywords if k.arg is not None]
            return [(name, _Entry(self.values(e), e)) for name, e in items]
        entries: list = []
        unknown_position = False
        for a in args:
            if type(a) is ast.Starred:
                v = a.value
                listed = self.list_entries(v)
                if listed is not None:
                    for el in listed:
                        entries.append((None if unknown_position or el.many else str(len(entries)), el))
                        unknown_position = unknown_position or el.many
                else:
                    entries.append((None, _Entry([], a, many=True)))
                    unknown_position = True
                continue
            entries.append((None if unknown_position else str(len(entries)), _Entry(self.values(a), a)))
        return entries

    @staticmethod
    def named_entries(entries: list) -> list:
        """[(child name or None, _Entry)] of the pairs of an ``OrderedDict``: names known up to the
        first entry that stands for any number of them."""
        out, unknown = [], False
        for e in entries:
            unknown = unknown or e.many or e.name is None
            out.append((None if unknown else e.name, e))
        return out

    def list_entries(self, v: ast.AST) -> list | None:
        """Entries of a list expression: a list built before, ``[a, b]``, ``[a] + layers``."""
        t = type(v)
        if t is ast.Name and v.id in self.lists:
            return self.list_of(v.id)
        if t in (ast.List, ast.Tuple):
            return [self.entry(e) for e in v.elts]
        if t is ast.BinOp and type(v.op) is ast.Add:
            left, right = self.list_entries(v.left), self.list_entries(v.right)
            if left is not None and right is not None:
                return left + right
        if t is ast.IfExp:
            # ``([nn.ReLU()] if relu else [])``: some entries, how many is not known here
            values = [x for branch in (v.body, v.orelse) for e in (self.list_entries(branch) or []) for x in e.values]
            return [_Entry(values, v, many=True)]
        return None

    def entry(self, e: ast.AST) -> _Entry:
        if type(e) is ast.Starred:
            return _Entry([], e, many=True)
        if type(e) is ast.Tuple and len(e.elts) == 2 and type(e.elts[0]) is ast.Constant \
                and isinstance(e.elts[0].value, str):
            # ``("fc", nn.Linear(...))``: a named child of the OrderedDict the list becomes
            return _Entry(self.values(e.elts[1]), e.elts[1], many=self.loop_depth > 0, name=e.elts[0].value)
        return _Entry(self.values(e), e, many=self.loop_depth > 0)

    def dict_items(self, a: ast.AST) -> list[tuple[str | None, list]]:
        """``(key or None, values)`` of the children of the mapping a ModuleDict is built from."""
        ta = type(a)
        if ta is ast.Dict:
            return [(k.value if type(k) is ast.Constant and isinstance(k.value, str) and k.value.isidentifier()
                     else None, self.values(v)) for k, v in zip(a.keys, a.values)]
        if ta is ast.Call and (_dotted(a.func) or "") in ("dict", "OrderedDict", "collections.OrderedDict"):
            out: list = []
            if a.args:
                inner = a.args[0]
                if type(inner) in (ast.List, ast.Tuple):
                    for el in inner.elts:
                        e = self.entry(el)
                        out.append((e.name if e.name and e.name.isidentifier() else None, e.values))
                else:
                    out += self.dict_items(inner)
            out += [(k.arg, self.values(k.value)) for k in a.keywords if k.arg is not None]
            return out
        if ta is ast.Name and a.id in self.lists:
            return [(e.name if e.name and e.name.isidentifier() and not e.many else None, e.values)
                    for e in self.lists[a.id]]
        return []

    def contents(self, attr: str, prefix: str, ty: str, call: ast.Call, conditional: bool, elsewhere: bool = False):
        """Bindings for the layers inside ``nn.ModuleList/Sequential/ModuleDict(...)``; ``elsewhere``:
        built in another file (a factory read there), its elements placed at ``call``."""
        items: list[tuple[str, list]] = []  # (container name, element values)
        build = self.fc.seq_builds.get(id(call)) if ty == _SEQUENTIAL else None
        if build is None and ty == _SEQUENTIAL and id(call) in self.fc.read_seq_builds:
            build, elsewhere = self.fc.read_seq_builds[id(call)], True
        if build is not None:
            # the entries as resolved where the Sequential is built (maybe in a factory); each
            # way when a list grown under ``if``/``else`` built it (else the last one seen)
            branched = any(build.conditions)
            seen_names: dict[str, int] = {}
            for alternative in build.alternatives if branched else build.alternatives[-1:]:
                variant: list | None = []
                for name, entry in alternative:
                    vals = [v for v in entry.values if v[3] is not None]
                    container = f"{prefix}[{name}]" if name is not None else f"{prefix}[*]"
                    if container in seen_names and name is not None:
                        known = items[seen_names[container]][1]
                        known += [v for v in vals if all(v[0] != k[0] for k in known)]
                    else:
                        seen_names[container] = len(items)
                        items.append((container, list(vals)))
                    if name is None or not name.isdigit():
                        variant = None
                    elif variant is not None:
                        # ``self.seq(x)`` in forward is expanded into one node per element (one
                        # variant per Sequential when a container holds several differently built
                        # ones); an entry we cannot type stays unknown, the others still count
                        types = {v[0] for v in vals}
                        variant.append((f"{prefix}[{name}]", vals[0][0] if len(types) == 1 else UNKNOWN_TYPE))
                if variant:
                    self.cls.seq_variants.setdefault(prefix, []).append(tuple(variant))
        elif ty == _MODULE_DICT and call.args:
            # ``nn.ModuleDict({"fc": ...})``, ``nn.ModuleDict(dict(fc=...))``, of an OrderedDict
            # filled before: each child under its key (``self.mlp.fc``/``self.mlp["fc"]`` in forward)
            for key, vals in self.dict_items(call.args[0]):
                items.append((f"{prefix}[{key}]" if key is not None else f"{prefix}[*]", vals))
        elif ty != _SEQUENTIAL:
            for a in call.args:
                a = a.value if type(a) is ast.Starred else a
                ta = type(a)
                if ta in (ast.List, ast.Tuple):
                    items += [(f"{prefix}[*]", self.values(e)) for e in a.elts]
                elif ta in (ast.ListComp, ast.GeneratorExp):
                    items.append((f"{prefix}[*]", self.values(a.elt)))
                elif ta is ast.Dict:
                    items += [(f"{prefix}[*]", self.values(e)) for e in a.values]
                elif ta is ast.Name and a.id in self.lists:
                    items += [(f"{prefix}[*]", e.values) for e in self.lists[a.id]]
        for name, vals in items:
            if elsewhere:
                # (an element built there stands at the call here; a container keeps its own call,
                # under which its contents are found)
                vals = [v if v[0] in _CONTAINERS else (v[0], v[1], v[2], call) for v in vals]
            self.record(attr, vals, conditional, container_of=name, elsewhere=elsewhere)

    def ordered_dict(self, value) -> list | None:
        """Entries of a new ``OrderedDict()``/``OrderedDict([("fc", layer), ...])``/``dict()``/``{...}``
        assigned to a local (filled item by item afterwards), or None for another value."""
        if type(value) is ast.Dict:
            if not all(type(k) is ast.Constant and isinstance(k.value, str) for k in value.keys):
                return None
            out = []
            for k, v in zip(value.keys, value.values):
                e = self.entry(v)
                e.name = k.value
                out.append(e)
            return out
        if type(value) is not ast.Call or value.keywords:
            return None
        d = _dotted(value.func) or ""
        if not (d.endswith("OrderedDict") or d == "dict"):
            return None
        if not value.args:
            return []
        if len(value.args) == 1 and type(value.args[0]) in (ast.List, ast.Tuple):
            entries = [self.entry(e) for e in value.args[0].elts]
            return entries if all(e.name is not None for e in entries) else None
        return None
