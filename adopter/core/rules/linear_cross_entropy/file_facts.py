"""What the written-out form reads from a whole file, computed once per parsed tree and each part
only when first asked for (most files never reach the embedding part): its functions, the names
through which its code can reach torch's cross entropy, the sizes its embeddings are built with and
the weights it ties.
"""

from __future__ import annotations

import ast

from adopter.core.rules.linear_cross_entropy.names import argument, callee_name, names_read, single_assign
from adopter.core.syntax import per_node, statements, walk


def might_be_cross_entropy(source: str) -> bool:
    """Cheap text test before parsing: the file names a cross entropy. Every name through which
    its code can reach one (:attr:`FileFacts.ce_names`) starts from these two, written in the file
    (an import alias, an assignment or a helper naming one); Python reads identifiers after NFKC
    normalisation, so a file that is not ASCII is looked at whatever it spells."""
    return "cross_entropy" in source or "CrossEntropyLoss" in source or not source.isascii()


def size_key(expr: ast.expr | None, scope: ast.AST | None) -> object:
    """What a size argument names, comparable across constructions: an int literal's value, else the
    last name of the expression (``config.padded_vocab_size`` -> ``padded_vocab_size``), a local
    name of the constructing function resolved through its one assignment first."""
    for _ in range(3):
        if isinstance(expr, ast.Name) and scope is not None:
            bound = single_assign(scope, expr.id)
            if bound is None:
                break
            expr = bound.value
        else:
            break
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Name):
        return expr.id
    return None



class FileFacts:
    """What the written-out form reads from a whole file (:func:`file_facts`: once per parsed tree),
    each part only when first asked for."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self._functions: list | None = None
        self._embedding: tuple | None = None
        self._ce_names: set[str] | None = None
        self.no_cross_entropy: dict[int, bool] = {}  # id(function of the tree) -> calls_no_cross_entropy

    @property
    def functions(self) -> list:
        """(lineno, end_lineno, function) of every function."""
        if self._functions is None:
            self._functions = [(f.lineno, f.end_lineno, f) for f in statements(self.tree)
                               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return self._functions

    def _embedding_facts(self) -> tuple:
        if self._embedding is None:
            scope_of_call: dict[int, ast.AST] = {}
            for _, _, f in self.functions:
                for c in walk(f):
                    if isinstance(c, ast.Call):
                        scope_of_call[id(c)] = f  # the innermost function wins: walked after its parent
            embedded, tied = set(), set()
            for node in walk(self.tree):
                if isinstance(node, ast.Call) and callee_name(node).endswith("Embedding"):
                    key = size_key(argument(node, 0, "num_embeddings"), scope_of_call.get(id(node)))
                    if key is not None:  # (relative-position tables sized by arithmetic: not a vocabulary)
                        embedded.add(key)
                elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "weight"
                                                          for t in node.targets):
                    tied |= {n.attr for n in walk(node) if isinstance(n, ast.Attribute)}
            self._embedding = (scope_of_call, embedded, tied)
        return self._embedding

    @property
    def ce_names(self) -> set[str]:
        """Every name through which code of this file can reach torch's cross entropy: its own
        names, import aliases of them, names assigned a value that mentions one (``self.loss_fct
        = CrossEntropyLoss()``, ``LOSS = ...``, ``loss_fn = F.cross_entropy``) and module-level
        functions that call one — a fixpoint, so helpers of helpers count. A function calling
        none of them reaches no cross entropy: the cheap test before the exact one."""
        if self._ce_names is None:
            names = {"cross_entropy", "CrossEntropyLoss"}
            bindings: list[tuple[set[str], set[str]]] = []  # (names bound, names read by the value)
            for node in statements(self.tree):  # (imports and assignments are statements)
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for alias in node.names:
                        if alias.asname and alias.name.rsplit(".", 1)[-1] in names:
                            names.add(alias.asname)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    bound = {name for target in targets for name in names_read(target)}
                    bindings.append((bound, names_read(node.value)))
            for node in self.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    bindings.append(({node.name}, names_read(node)))
            changed = True
            while changed:
                changed = False
                for bound, read in bindings:
                    if read & names and not bound <= names:
                        names |= bound
                        changed = True
            self._ce_names = names
        return self._ce_names

    @property
    def scope_of_call(self) -> dict[int, ast.AST]:
        """id(call) -> the function it is in."""
        return self._embedding_facts()[0]

    @property
    def embedded(self) -> set:
        """The size keys embeddings are built with."""
        return self._embedding_facts()[1]

    @property
    def tied(self) -> set[str]:
        """Attribute names in ``<...>.weight = <...>`` assignments."""
        return self._embedding_facts()[2]


def calls_no_cross_entropy(tree: ast.Module, fn: ast.AST) -> bool:
    """No call of ``fn`` names anything that can reach torch's cross entropy (``FileFacts.ce_names``);
    once per function."""
    facts = file_facts(tree)
    known = facts.no_cross_entropy.get(id(fn))
    if known is None:
        names = facts.ce_names
        # (a function mentioning none of the names anywhere calls none: one pass, no walk kept)
        known = not (names_read(fn) & names) or not any(
            isinstance(n, ast.Call) and names_read(n.func) & names for n in walk(fn))
        facts.no_cross_entropy[id(fn)] = known  # (the facts keep the tree, so fn's id stays its own)
    return known


@per_node(32)
def file_facts(tree: ast.Module) -> FileFacts:
    """The :class:`FileFacts` of ``tree``, one per tree."""
    return FileFacts(tree)



def function_at(tree: ast.Module, span) -> ast.AST | None:
    """The innermost function of ``tree`` holding ``span``."""
    best = None
    for lineno, end_lineno, node in file_facts(tree).functions:
        if lineno <= span.line <= end_lineno and (best is None or lineno > best.lineno):
            best = node
    return best
