"""A capture indexed for confirmation: graph nodes with their source positions, and data flow
through the ops that only move data."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from .capture import Capture
from .source_map import NodeSource, map_nodes

# ------------------------------------------------------------------ op vocabulary

# Graph ops that only move/reshape data: data flow passes through them.
TRANSPARENT_OPS = {
    "view", "reshape", "_unsafe_view", "transpose", "permute", "contiguous", "to", "_to_copy",
    "clone", "expand", "unsqueeze", "squeeze", "flatten", "getitem", "alias", "type_as", "detach",
    "t", "float", "half", "bfloat16", "type", "lift_fresh_copy", "_assert_tensor_metadata",
    "dropout_identity",
}

# ------------------------------------------------------------------ graph access


@dataclass
class TraceIndex:
    """A capture plus per-node sources and lookups used by confirmation."""

    capture: Capture
    sources: list[NodeSource]
    by_name: dict[str, NodeSource]
    nodes: dict[str, torch.fx.Node]
    by_file: dict[str, list[NodeSource]]
    by_line: dict[tuple[str, int], list[NodeSource]]  # (file, line) of any frame -> nodes

    @classmethod
    def build(cls, capture: Capture) -> TraceIndex:
        sources = map_nodes(capture.graph_module)
        nodes = {n.name: n for n in capture.graph_module.graph.nodes}
        by_file: dict[str, list[NodeSource]] = defaultdict(list)
        by_line: dict[tuple[str, int], list[NodeSource]] = defaultdict(list)
        for s in sources:
            for f in {fr.file for fr in s.frames}:
                by_file[f].append(s)
            for key in {(fr.file, fr.line) for fr in s.frames}:
                by_line[key].append(s)
        return cls(capture, sources, {s.node_name: s for s in sources}, nodes, by_file, by_line)

    def at_lines(self, file: str, lines: range) -> list[NodeSource]:
        """Nodes with a frame at one of ``lines`` of ``file``, in graph order."""
        found = {}
        for line in lines:
            for s in self.by_line.get((file, line), ()):
                found[s.node_name] = s
        return sorted(found.values(), key=lambda s: s.index)

    def users(self, name: str) -> list[str]:
        return [u.name for u in self.nodes[name].users]

    def inputs(self, name: str) -> list[str]:
        return [a.name for a in self.nodes[name].all_input_nodes]

    def is_transparent(self, name: str) -> bool:
        src = self.by_name.get(name)
        if src is None:
            return False
        op = src.op_name
        if op in TRANSPARENT_OPS:
            return True
        # eval-mode dropout and identity-like modules pass data through in a symbolic trace
        return src.op == "call_module" and op in ("identity", "flatten")

    def flows(self, sources: set[str], targets: set[str]) -> bool:
        """Some target is reachable from some source through source/transparent nodes only."""
        seen = set()
        stack = list(sources)
        while stack:
            name = stack.pop()
            for user in self.users(name):
                if user in targets:
                    return True
                if user in seen:
                    continue
                seen.add(user)
                if user in sources or self.is_transparent(user):
                    stack.append(user)
        return False

    def roots(self, names: Iterable[str], exclude: set[str]) -> set[str]:
        """Data inputs of ``names`` from outside the group, followed back through transparent ops."""
        out = set()
        for name in names:
            for inp in self.inputs(name):
                if inp in exclude:
                    continue
                node = self.nodes[inp]
                if node.op in ("get_attr",) or (node.op == "placeholder" and _is_param(node)):
                    continue
                out |= self._root(inp)
        return out

    def _root(self, name: str) -> set[str]:
        while self.is_transparent(name):
            ins = [i for i in self.inputs(name) if self.nodes[i].op != "get_attr"]
            if len(ins) != 1:
                break
            name = ins[0]
        return {name}


def _is_param(node: torch.fx.Node) -> bool:
    # torch.export lifts parameters/buffers to placeholders named p_*/b_*/c_*
    return node.name.startswith(("p_", "b_", "c_"))


def realpath(p: str) -> str:
    return os.path.realpath(p) if p else p
