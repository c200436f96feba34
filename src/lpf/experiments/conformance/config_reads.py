"""Which config fields the reference's modeling code reads, read statically from its source.

Contract: `config_reads(source: str) -> dict[str, FieldReads]` parses a transformers
`modeling_<model_type>.py` (as text, with `ast`; nothing is imported or run) and returns, per config
field it reads (`config.F`, `self.config.F`, `getattr(config, "F", ...)`, and `self.X` where the file
assigned `self.X = config.F`): `literals`, the constants the field is compared with (`== "rope"`,
`in ("a", "b")`: an enum's choice set as the code itself spells it), and `enablers`, the conditions
every one of its reads sits under (`{"mamba_rms_norm": True}` when the field is only read inside
`if config.mamba_rms_norm:` or `... if config.mamba_rms_norm else ...`): a field that only matters
when another flag is on. A field read anywhere unconditionally has no enablers. `modeling_source(model_type)`
is the installed transformers' file text, or None.

Why static and not tracing the reads while the tiny model runs: a trace sees only the branch the default
config takes, and a field read only under a flag the default leaves off (FalconH1's
`mamba_norm_before_gate`, read only when `mamba_rms_norm` is on) is exactly the one a default hides.
The source shows every branch and the condition it sits under. Its blind spot: reads through other
aliases (a local variable, a helper in another module) are not followed; the drop rule (a variant that
leaves the reference's logits unchanged is dropped) catches a toggle that does nothing, not one missed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FieldReads:
    literals: list = field(default_factory=list)  # constants compared with the field, in source order
    enablers: dict | None = None  # {field: value} every read sits under; None until a read is seen
    lines: list[int] = field(default_factory=list)  # where it is read (1-based, the modeling file)


def modeling_source(model_type: str) -> tuple[str, Path] | None:
    import transformers

    path = Path(transformers.__file__).parent / "models" / model_type / f"modeling_{model_type}.py"
    return (path.read_text(), path) if path.is_file() else None


def _config_field(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The config field this expression reads, if it is one."""
    if isinstance(node, ast.Attribute):
        base = node.value
        if isinstance(base, ast.Name) and base.id == "config":
            return node.attr
        if isinstance(base, ast.Attribute) and base.attr == "config":
            return node.attr
        if isinstance(base, ast.Name) and base.id == "self" and node.attr in aliases:
            return aliases[node.attr]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == "config"
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    """`self.X = config.F` anywhere in the file: X reads F (names the file reuses for other things
    would be wrong here; modeling files keep these one-to-one)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            f = _config_field(node.value, {})
            if f and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.setdefault(t.attr, f)
    return out


def _conditions(test: ast.AST, aliases: dict[str, str]) -> dict:
    """{field: value} a test requires to be true (`config.A`, `not config.A`, `config.A == c`,
    `config.A in (c, ...)`, `and` of those); tests on anything else require nothing we can name."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        out: dict = {}
        for v in test.values:
            out.update(_conditions(v, aliases))
        return out
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        f = _config_field(test.operand, aliases)
        return {f: False} if f else {}
    f = _config_field(test, aliases)
    if f:
        return {f: True}
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        f, right = _config_field(test.left, aliases), test.comparators[0]
        if f and isinstance(test.ops[0], ast.Eq) and isinstance(right, ast.Constant):
            return {f: right.value}
        if f and isinstance(test.ops[0], ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            consts = [e.value for e in right.elts if isinstance(e, ast.Constant)]
            return {f: consts[0]} if consts else {}
    return {}


def _negated(cond: dict) -> dict:
    """The else branch of a single boolean test; anything else names no condition."""
    if len(cond) == 1:
        ((f, v),) = cond.items()
        if isinstance(v, bool):
            return {f: not v}
    return {}


def _literals(node: ast.Compare, aliases: dict[str, str]) -> tuple[str | None, list]:
    sides = [node.left, *node.comparators]
    f = next((_config_field(s, aliases) for s in sides if _config_field(s, aliases)), None)
    if f is None:
        return None, []
    consts = []
    for s in sides:
        if isinstance(s, ast.Constant) and s.value is not None:
            consts.append(s.value)
        elif isinstance(s, (ast.Tuple, ast.List, ast.Set)):
            consts += [e.value for e in s.elts if isinstance(e, ast.Constant) and e.value is not None]
    return f, consts


class _Reads(ast.NodeVisitor):
    def __init__(self, aliases: dict[str, str]):
        self.aliases = aliases
        self.out: dict[str, FieldReads] = {}
        self.stack: list[dict] = []

    def _read(self, f: str, line: int) -> None:
        r = self.out.setdefault(f, FieldReads())
        here: dict = {}
        for cond in self.stack:
            here.update({k: v for k, v in cond.items() if k != f})
        r.enablers = dict(here) if r.enablers is None else {k: v for k, v in r.enablers.items() if here.get(k) == v}
        r.lines.append(line)

    def _branch(self, test, body, orelse) -> None:
        self.visit(test)
        cond = _conditions(test, self.aliases)
        self.stack.append(cond)
        for n in body if isinstance(body, list) else [body]:
            self.visit(n)
        self.stack[-1] = _negated(cond)
        for n in orelse if isinstance(orelse, list) else [orelse]:
            self.visit(n)
        self.stack.pop()

    def visit_If(self, node: ast.If) -> None:
        self._branch(node.test, node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._branch(node.test, node.body, node.orelse)

    def visit_Compare(self, node: ast.Compare) -> None:
        f, consts = _literals(node, self.aliases)
        if f:
            lits = self.out.setdefault(f, FieldReads()).literals
            lits += [c for c in consts if c not in lits]
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        f = _config_field(node, self.aliases) if isinstance(node.ctx, ast.Load) else None
        if f:
            self._read(f, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = _config_field(node, self.aliases)
        if f:
            self._read(f, node.lineno)
        self.generic_visit(node)


def config_reads(source: str) -> dict[str, FieldReads]:
    tree = ast.parse(source)
    v = _Reads(_aliases(tree))
    v.visit(tree)
    return {f: r for f, r in v.out.items() if r.enablers is not None}
