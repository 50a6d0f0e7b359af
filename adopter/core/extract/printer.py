"""Human-readable dump of extracted structures (debugging aid)."""

from __future__ import annotations

from adopter.core.dsl import Layer
from adopter.core.dsl_text import format_node as dsl_format_node
from adopter.core.structures import FileStructures


def _fallback_format_node(node) -> str:
    args = ", ".join(str(a) for a in node.args)
    out = f" -> {node.output}" if node.output is not None else ""
    if isinstance(node, Layer):
        mod = f"@{node.module}" if node.module is not None else ""
        return f"{node.type}{mod}({args}){out}"
    if len(node.args) == 2:
        return f"{node.args[0]} {node.op} {node.args[1]}{out}"
    return f"{node.op} {args}{out}"


def format_structure(fs: FileStructures, *, lines: bool = True) -> str:
    """Human-readable dump of everything extracted from one file (debugging aid)."""
    def format_node(node) -> str:
        try:
            return dsl_format_node(node)
        except ValueError:  # names the DSL text cannot spell (``self.layers[*]``)
            return _fallback_format_node(node)
    out = [f"# {fs.file}"]
    for c in fs.classes:
        out.append(f"class {c.name}({', '.join(c.bases)}){' [module]' if c.is_module else ''}")
        for b in c.init_bindings:
            flags = []
            if b.conditional:
                flags.append("conditional")
            if b.container:
                flags.append(f"container={b.container}")
            if b.activation:
                flags.append(f"activation={b.activation}")
            where = f"  # L{b.span.line}" if lines and b.span else ""
            out.append(f"  init {b.attr}: {format_node(b.layer)}{' [' + ', '.join(flags) + ']' if flags else ''}{where}")
    for f in fs.functions:
        qual = f"{f.class_name}.{f.function}" if f.class_name else f.function
        out.append(f"def {qual}: {len(f.paths)} path(s){' [capped]' if f.capped else ''}")
        for i, p in enumerate(f.paths):
            out.append(f"  path {i}:")
            for n in p.nodes:
                where = f"  # {n.span.function} L{n.span.line}:{n.span.col}" if lines and n.span else ""
                out.append(f"    {format_node(n)}{where}")
    return "\n".join(out)
