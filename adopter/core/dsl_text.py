"""Text form of the DSL (paper Fig. 2 plus the extensions in :mod:`adopter.core.dsl`).

Patterns
--------
A pattern is a sequence of nodes separated by ``;`` (newlines are plain
whitespace)::

    torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out

node
    ``*``                                   wildcard: any one node
    ``TYPE[@MODULE](ARGS) [-> VAR]``        DL layer (``TYPE`` may be ``a|b|c`` alternatives)
    ``VALUE OP VALUE -> VAR``               binary tensor op, ``OP`` one of ``+ - * / // % ** @``
    ``OP VALUE -> VAR``                     unary tensor op, ``OP`` one of ``- ~``
ARGS
    comma-separated ``VALUE`` or ``keyword=VALUE``
VALUE
    variable: ``$name`` (abstract), ``name`` / ``self.dense`` (dotted), optionally
    with an SSA version ``hidden_states#2``; or constant: a number (``-1``, ``1e-5``),
    a string (``'gelu'``), ``None``/``True``/``False``, or any expression in back-quotes
    (```config.hidden_size * 3```) — the printer back-quotes every constant that would
    otherwise read as a variable, so printing then parsing gives the same objects.
``->`` may be written ``→`` and ``=>`` may be written ``⇒``.
``#`` followed by digits right after a name is a version; any other ``#`` starts a
comment that runs to the end of the line.

Rule files
----------
A rule file is a sequence of rule blocks. A block starts with ``rule NAME`` at the
start of a line and holds an optional ``init:`` section and a ``forward:`` section,
each ``SOURCE => TARGET`` (two patterns), or just ``SOURCE`` for a rule whose codemod is
written in Python (the codemod alone says what the source becomes, so nothing can drift)::

    rule My_Dropout_Add_LayerNorm
    init:
        torch.nn.Dropout($p) -> $drop; torch.nn.LayerNorm($shape, eps=$eps) -> $ln
        => adopter.kernels.FusedDropoutAddLayerNorm($shape, $p, eps=$eps) -> $ln
    forward:
        torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out
        => adopter.kernels.FusedDropoutAddLayerNorm@$ln($x, $res) -> $out

Several blocks may carry the same name: they are *variants* of one rule (the
registry groups them). Errors raise :class:`DSLSyntaxError` with 1-based line and
column of the offending token in the text given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from adopter.core.dsl import Arg, Const, Layer, Node, Pattern, RulePart, RuleText, TensorOp, Value, Var, Wildcard

__all__ = [
    "DSLSyntaxError",
    "format_node",
    "format_pattern",
    "format_rule",
    "format_rules",
    "format_value",
    "parse_pattern",
    "parse_rule",
    "parse_rules",
]

BINARY_OPS = ("**", "//", "+", "-", "*", "/", "%", "@")
UNARY_OPS = ("-", "~")
KEYWORD_CONSTS = ("None", "True", "False")


class DSLSyntaxError(ValueError):
    """A DSL text error at ``line``:``col`` (both 1-based)."""

    def __init__(self, message: str, line: int, col: int, source_name: str = "<dsl>"):
        self.msg = message
        self.line = line
        self.col = col
        self.source_name = source_name
        super().__init__(f"{source_name}:{line}:{col}: {message}")


# ---------------------------------------------------------------- tokens


@dataclass(frozen=True)
class _Tok:
    kind: str  # NAME AVAR NUM STR BQ OP PUNCT VERSION EOF
    text: str
    line: int
    col: int  # 1-based


_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_NUM = re.compile(r"(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[jJ]?")
_STR = re.compile(r"""(?:[rbuRBU]{0,2})(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")
_PUNCTS = ("=>", "⇒", "->", "→", "**", "//", "(", ")", ",", ";", "=", "|", "@", "*", "+", "-", "/", "%", "~", ".")


def _tokenize(text: str, line0: int = 1, col0: int = 1, source_name: str = "<dsl>") -> list[_Tok]:
    """Tokens of ``text``; positions are shifted so that ``text[0]`` is at ``line0``:``col0``."""
    toks: list[_Tok] = []
    i, line, col = 0, line0, col0
    n = len(text)

    def err(msg: str) -> DSLSyntaxError:
        return DSLSyntaxError(msg, line, col, source_name)

    while i < n:
        ch = text[i]
        if ch == "\n":
            i += 1
            line += 1
            col = 1
            continue
        if ch in " \t\r":
            i += 1
            col += 1
            continue
        if ch == "#":
            prev_adjacent = toks and toks[-1].kind == "NAME" and i > 0 and not text[i - 1].isspace()
            m = re.match(r"#(\d+)", text[i:])
            if prev_adjacent and m:
                toks.append(_Tok("VERSION", m.group(1), line, col))
                i += m.end()
                col += m.end()
                continue
            while i < n and text[i] != "\n":  # comment
                i += 1
            continue
        if ch == "$":
            m = _NAME.match(text, i + 1)
            if not m:
                raise err("expected a name after '$'")
            toks.append(_Tok("AVAR", "$" + m.group(0), line, col))
            col += m.end() - i
            i = m.end()
            continue
        if ch == "`":
            j = text.find("`", i + 1)
            if j < 0 or "\n" in text[i:j]:
                raise err("unterminated back-quoted constant")
            toks.append(_Tok("BQ", text[i + 1 : j], line, col))
            col += j + 1 - i
            i = j + 1
            continue
        m = _STR.match(text, i)
        if m and (ch in "'\"" or (m.group(0)[0] in "rbuRBU" and ("'" in m.group(0)[:3] or '"' in m.group(0)[:3]))):
            toks.append(_Tok("STR", m.group(0), line, col))
            col += m.end() - i
            i = m.end()
            continue
        if ch in "'\"":
            raise err("unterminated string")
        if ch.isdigit() or (ch == "." and i + 1 < n and text[i + 1].isdigit()):
            m = _NUM.match(text, i)
            toks.append(_Tok("NUM", m.group(0), line, col))
            col += m.end() - i
            i = m.end()
            continue
        m = _NAME.match(text, i)
        if m:
            toks.append(_Tok("NAME", m.group(0), line, col))
            col += m.end() - i
            i = m.end()
            continue
        for p in _PUNCTS:
            if text.startswith(p, i):
                canon = {"→": "->", "⇒": "=>"}.get(p, p)
                toks.append(_Tok("PUNCT", canon, line, col))
                i += len(p)
                col += len(p)
                break
        else:
            raise err(f"unexpected character {ch!r}")
    toks.append(_Tok("EOF", "", line, col))
    return toks


# ---------------------------------------------------------------- parser


class _Parser:
    def __init__(self, toks: list[_Tok], source_name: str):
        self.toks = toks
        self.i = 0
        self.source_name = source_name

    # helpers
    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def peek(self, k: int = 1) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def error(self, msg: str, tok: _Tok | None = None) -> DSLSyntaxError:
        tok = tok or self.tok
        found = "end of input" if tok.kind == "EOF" else repr(tok.text)
        return DSLSyntaxError(f"{msg} (found {found})", tok.line, tok.col, self.source_name)

    def is_punct(self, text: str, k: int = 0) -> bool:
        t = self.peek(k) if k else self.tok
        return t.kind == "PUNCT" and t.text == text

    def expect_punct(self, text: str) -> _Tok:
        if not self.is_punct(text):
            raise self.error(f"expected '{text}'")
        t = self.tok
        self.i += 1
        return t

    # grammar
    def pattern(self, stop: tuple[str, ...] = ()) -> Pattern:
        nodes = [self.node()]
        while self.is_punct(";"):
            self.i += 1
            if self.tok.kind == "EOF" or any(self.is_punct(s) for s in stop):
                break  # trailing ';'
            nodes.append(self.node())
        return Pattern(tuple(nodes))

    def dotted(self) -> tuple[str, _Tok]:
        if self.tok.kind != "NAME":
            raise self.error("expected a name")
        first = self.tok
        parts = [first.text]
        self.i += 1
        while self.is_punct(".") and self.peek().kind == "NAME":
            self.i += 1
            parts.append(self.tok.text)
            self.i += 1
        return ".".join(parts), first

    def var(self) -> Var:
        if self.tok.kind == "AVAR":
            name = self.tok.text
            self.i += 1
            return Var(name)
        name, _ = self.dotted()
        version = 0
        if self.tok.kind == "VERSION":
            version = int(self.tok.text)
            self.i += 1
        return Var(name, version)

    def value(self) -> Value:
        t = self.tok
        if t.kind == "AVAR":
            return self.var()
        if t.kind == "NUM":
            self.i += 1
            return Const(t.text)
        if t.kind == "STR":
            self.i += 1
            return Const(t.text)
        if t.kind == "BQ":
            self.i += 1
            if not t.text.strip():
                raise DSLSyntaxError("empty back-quoted constant", t.line, t.col, self.source_name)
            return Const(t.text)
        if t.kind == "PUNCT" and t.text == "-" and self.peek().kind == "NUM":
            self.i += 2
            return Const("-" + self.toks[self.i - 1].text)
        if t.kind == "NAME":
            if t.text in KEYWORD_CONSTS and not self.is_punct(".", 1):
                self.i += 1
                return Const(t.text)
            return self.var()
        raise self.error("expected a variable or a constant")

    def args(self) -> tuple[Arg, ...]:
        self.expect_punct("(")
        out: list[Arg] = []
        if self.is_punct(")"):
            self.i += 1
            return ()
        while True:
            if self.tok.kind == "NAME" and self.is_punct("=", 1):
                kw = self.tok.text
                self.i += 2
                out.append(Arg(self.value(), kw))
            else:
                if out and out[-1].keyword is not None:
                    raise self.error("positional argument after keyword argument")
                out.append(Arg(self.value()))
            if self.is_punct(","):
                self.i += 1
                if self.is_punct(")"):
                    break
                continue
            break
        self.expect_punct(")")
        return tuple(out)

    def output(self, required: bool) -> Var | None:
        if self.is_punct("->"):
            self.i += 1
            if self.tok.kind not in ("AVAR", "NAME"):
                raise self.error("expected an output variable after '->'")
            return self.var()
        if required:
            raise self.error("expected '->' and an output variable")
        return None

    def node(self) -> Node:
        t = self.tok
        if self.is_punct("*"):
            self.i += 1
            return Wildcard()
        if t.kind == "PUNCT" and t.text in UNARY_OPS and not (t.text == "-" and self.peek().kind == "NUM"):
            self.i += 1
            operand = self.value()
            return TensorOp(t.text, (Arg(operand),), self.output(required=True))
        if t.kind == "NAME" and t.text not in KEYWORD_CONSTS:
            save = self.i
            layer = self._try_layer()
            if layer is not None:
                return layer
            self.i = save
        # binary tensor op, or unary minus applied to a number
        left = self.value()
        op_tok = self.tok
        if op_tok.kind != "PUNCT" or op_tok.text not in BINARY_OPS:
            if t.kind == "PUNCT" and t.text == "-":
                # "-1 -> $x" would be a unary op on a constant; accept it as such
                return TensorOp("-", (Arg(Const(left.text[1:])),), self.output(required=True))  # type: ignore[union-attr]
            raise self.error("expected a layer call '(' or a tensor operator")
        self.i += 1
        right = self.value()
        return TensorOp(op_tok.text, (Arg(left), Arg(right)), self.output(required=True))

    def _try_layer(self) -> Layer | None:
        """``TYPE[|TYPE...][@MODULE](ARGS) [-> VAR]``; None (no tokens consumed) if not a layer."""
        types = []
        name, _ = self.dotted()
        types.append(name)
        while self.is_punct("|"):
            self.i += 1
            name, _ = self.dotted()
            types.append(name)
        module = None
        if self.is_punct("@"):
            save = self.i
            self.i += 1
            if self.tok.kind in ("AVAR", "NAME"):
                module = self.var()
                if not self.is_punct("("):
                    if len(types) > 1:
                        raise self.error("expected '(' after the layer's module")
                    self.i = save
                    return None  # 'a @ b -> c': a matmul tensor op
            else:
                if len(types) > 1:
                    raise self.error("expected a module variable after '@'")
                self.i = save
                return None
        if not self.is_punct("("):
            if len(types) > 1 or module is not None:
                raise self.error("expected '(' to start the argument list")
            return None
        args = self.args()
        return Layer("|".join(types), args, self.output(required=False), module)


def parse_pattern(text: str, *, line: int = 1, col: int = 1, source_name: str = "<dsl>") -> Pattern:
    """Parse a pattern / model structure (``node; node; ...``)."""
    toks = _tokenize(text, line, col, source_name)
    p = _Parser(toks, source_name)
    if p.tok.kind == "EOF":
        raise p.error("empty pattern")
    pattern = p.pattern()
    if p.tok.kind != "EOF":
        raise p.error("expected ';' between nodes")
    return pattern


def _parse_part(text: str, line: int, col: int, source_name: str) -> RulePart:
    toks = _tokenize(text, line, col, source_name)
    p = _Parser(toks, source_name)
    if p.tok.kind == "EOF":
        raise p.error("empty section: expected 'SOURCE [=> TARGET]'")
    source = p.pattern(stop=("=>",))
    if p.tok.kind == "EOF":
        return RulePart(source, None)  # no target: the rule's codemod says what it becomes
    if not p.is_punct("=>"):
        raise p.error("expected ';' between nodes or '=>' before the target pattern")
    p.i += 1
    if p.tok.kind == "EOF":
        raise p.error("expected the target pattern after '=>'")
    target = p.pattern()
    if p.tok.kind != "EOF":
        raise p.error("expected ';' between nodes")
    return RulePart(source, target)


_RULE_HEADER = re.compile(r"^rule[ \t]+(\S+)[ \t]*(?:#.*)?$")
_SECTION = re.compile(r"^[ \t]*(init|forward)[ \t]*:")
_RULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9.\-]*$")


def parse_rules(text: str, *, source_name: str = "<dsl>") -> list[RuleText]:
    """Parse a rule file: a sequence of ``rule NAME`` blocks (see the module docstring)."""
    lines = text.split("\n")
    rules: list[RuleText] = []
    current: dict | None = None
    section: tuple[str, int, int, list[str]] | None = None  # name, start line, start col, text lines

    def close_section():
        nonlocal section
        if section is None:
            return
        name, sline, scol, body = section
        body_text = "\n".join(body)
        if current[name] is not None:
            raise DSLSyntaxError(f"duplicate '{name}:' section in rule {current['name']}", sline, 1, source_name)
        current[name] = _parse_part(body_text, sline, scol, source_name)
        section = None

    def close_rule():
        close_section()
        if current is None:
            return
        if current["forward"] is None:
            raise DSLSyntaxError(
                f"rule {current['name']} has no 'forward:' section", current["line"], 1, source_name
            )
        rules.append(RuleText(current["name"], current["init"], current["forward"]))

    for lineno, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        if raw.startswith("rule") and (len(raw) == 4 or raw[4] in " \t"):
            close_rule()
            m = _RULE_HEADER.match(raw.rstrip())
            if not m or not _RULE_NAME.match(m.group(1)):
                raise DSLSyntaxError("expected 'rule NAME'", lineno, 1, source_name)
            current = {"name": m.group(1), "init": None, "forward": None, "line": lineno}
            continue
        m = _SECTION.match(raw)
        if m:
            if current is None:
                raise DSLSyntaxError(f"'{m.group(1)}:' outside a rule block", lineno, m.start(1) + 1, source_name)
            close_section()
            section = (m.group(1), lineno, m.end() + 1, [raw[m.end() :]])
            continue
        if section is not None:
            section[3].append(raw)
            continue
        if stripped and not stripped.startswith("#"):
            col = len(raw) - len(raw.lstrip()) + 1
            where = "expected 'rule NAME'" if current is None else "expected 'init:' or 'forward:'"
            raise DSLSyntaxError(where, lineno, col, source_name)
    close_rule()
    return rules


def parse_rule(text: str, *, source_name: str = "<dsl>") -> RuleText:
    """Parse text holding exactly one rule block."""
    rules = parse_rules(text, source_name=source_name)
    if len(rules) != 1:
        raise DSLSyntaxError(f"expected exactly one rule, found {len(rules)}", 1, 1, source_name)
    return rules[0]


# ---------------------------------------------------------------- printer

_SIMPLE_CONST = re.compile(
    r"""^(?:-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[jJ]?|None|True|False|"""
    r"""[rbuRBU]{0,2}(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))$"""
)
_PLAIN_VAR = re.compile(r"^\$?[A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)*$")


def format_value(value: Value) -> str:
    if isinstance(value, Var):
        if not _PLAIN_VAR.match(value.name):
            raise ValueError(f"variable name {value.name!r} cannot be written in the DSL")
        return str(value)
    if _SIMPLE_CONST.match(value.text):
        return value.text
    if "`" in value.text or "\n" in value.text:
        raise ValueError(f"constant {value.text!r} cannot be written in the DSL")
    return f"`{value.text}`"


def _format_arg(arg: Arg) -> str:
    v = format_value(arg.value)
    return f"{arg.keyword}={v}" if arg.keyword else v


def format_node(node: Node) -> str:
    if isinstance(node, Wildcard):
        return "*"
    if isinstance(node, Layer):
        head = node.type + (f"@{format_value(node.module)}" if node.module is not None else "")
        out = f" -> {format_value(node.output)}" if node.output is not None else ""
        return f"{head}({', '.join(_format_arg(a) for a in node.args)}){out}"
    if isinstance(node, TensorOp):
        out = format_value(node.output) if node.output is not None else "_"
        if len(node.args) == 1:
            return f"{node.op} {_format_arg(node.args[0])} -> {out}"
        return f"{_format_arg(node.args[0])} {node.op} {_format_arg(node.args[1])} -> {out}"
    raise TypeError(f"not a DSL node: {node!r}")


def format_pattern(pattern: Pattern | tuple | list, sep: str = "; ") -> str:
    nodes = pattern.nodes if isinstance(pattern, Pattern) else pattern
    return sep.join(format_node(n) for n in nodes)


def format_rule(rule: RuleText) -> str:
    out = [f"rule {rule.name}"]
    for name, part in (("init", rule.init), ("forward", rule.forward)):
        if part is None:
            continue
        out.append(f"{name}:")
        out.append("    " + format_pattern(part.source, sep=";\n    "))
        if part.target is not None:
            out.append("    => " + format_pattern(part.target, sep=";\n       "))
    return "\n".join(out) + "\n"


def format_rules(rules: list[RuleText]) -> str:
    return "\n".join(format_rule(r) for r in rules)
