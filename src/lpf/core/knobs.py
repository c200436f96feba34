"""Engine knobs, declared once where they are declared: on an engine's `Options` fields.

An engine's knobs are the fields of its pydantic `Options` class (lpf.adapters.base.Options). What a
knob *means* to the rest of lpf is said on the field, not in name lists elsewhere:

    cache_mb: float = knob(64.0, gt=0, help="Cache size in MiB.", roles=("cache_size",), shrink_order=10,
                           flag=True)

`knob(default, *, help, roles=(), shrink_order=None, flag=False, repeatable=False, metavar=None,
**constraints)` returns a pydantic `Field` (the constraints are pydantic's: ge, gt, le, ...) whose
`description` is the help and whose `json_schema_extra["lpf"]` holds the rest:
- `roles`: what the knob does, from `ROLES` (unknown roles are refused at class definition);
  experiments ask for a role instead of naming knobs (`knob_with_role(cls, "concurrency")`).
- `shrink_order`: `lpf shrink` moves the knobs that have one toward the default, lowest first.
- `flag`: the command line gets a named option for it (`--cache-mb`, `--enable-chunked-prefill/
  --no-...` for a boolean, repeatable and joined with "," when `repeatable`); every knob, flagged or
  not, is also settable as `-E NAME=VALUE`. One flag serves every engine that has a field of that
  name; its help is that of the first engine (in `lpf.adapters.REGISTRY` order) that flags it (the
  command line adds each engine's `choices` when they differ).
A plain field, `Field(1, ge=1, description="...")` or a bare annotation, is a knob too: no roles,
no shrink order, no flag (its description is its help). So adding a knob is adding one field.

The questions: `knobs(cls)` (every knob, declaration order), `knob_info(cls, name)`,
`knobs_with_role(cls, role)` / `knob_with_role(cls, role)`, `shrink_knobs(cls)` (shrink's order),
`flag_knobs(classes)` (the union of flagged knobs, first declaration wins), `choices(annotation)`.
Pure: no I/O, no lpf imports.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from pydantic import Field

ROLES = {
    "cache_size": "sizes the engine's cache: smaller, and state slots and KV blocks recycle sooner",
    "state_slots": "caps the Mamba state slots alone: fewer, and a slot is reused after fewer requests",
    "concurrency": "the most sequences the engine batches in one step (`lpf repeat` varies it)",
    "step_budget": "the token budget of one engine step",
    "context_length": "the longest prompt + output a request may have (conformance keeps it short)",
    "prefix_cache": "turns prefix caching on (conformance turns it off unless a cell turns it on)",
    "speculative": "turns speculative decoding on (drafts verified in one pass; off by default)",
}
_KEY = "lpf"


def knob(
    default: Any = ...,
    *,
    help: str,
    roles: Iterable[str] = (),
    shrink_order: int | None = None,
    flag: bool = False,
    repeatable: bool = False,
    metavar: str | None = None,
    **constraints,
) -> Any:
    """A pydantic Field for an Options class, carrying lpf's knob metadata (see the module doc)."""
    roles = tuple(roles)
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"unknown knob role {unknown[0]!r}; roles: {', '.join(ROLES)}")
    if repeatable and not flag:
        raise ValueError("repeatable is about the command-line flag: it needs flag=True")
    meta = {
        "roles": list(roles),
        "shrink_order": shrink_order,
        "flag": flag,
        "repeatable": repeatable,
        "metavar": metavar,
    }
    return Field(default, description=help, json_schema_extra={_KEY: meta}, **constraints)


@dataclass(frozen=True)
class Knob:
    name: str  # the field's name (the engine's own name for it: max_num_seqs)
    help: str
    default: Any
    kind: str  # bool | int | float | str: what a command-line value is converted to
    roles: tuple[str, ...] = ()
    shrink_order: int | None = None
    flag: bool = False
    repeatable: bool = False  # the flag may be given several times; the values are joined with ","
    metavar: str | None = None

    @property
    def flag_name(self) -> str:
        """The named command-line option (`--cache-mb`); meaningful when `flag`."""
        return "--" + self.name.replace("_", "-")


def _kind(annotation) -> str:
    """bool | int | float | str for an annotation such as `int | None` or `Literal["a", "b"]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "str"
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    for t in (bool, int, float, str):  # bool first: a bool is an int to Python
        if annotation is t:
            return t.__name__
    return "str"


def choices(annotation) -> tuple[str, ...]:
    """A Literal's choices (also inside `X | None`), as text; () when the field takes any value."""
    if typing.get_origin(annotation) is Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return choices(args[0])
    return ()


def _info(name: str, field) -> Knob:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    meta = extra.get(_KEY) or {}
    return Knob(
        name=name,
        help=field.description or "",
        default=field.default,
        kind=_kind(field.annotation),
        roles=tuple(meta.get("roles") or ()),
        shrink_order=meta.get("shrink_order"),
        flag=bool(meta.get("flag")),
        repeatable=bool(meta.get("repeatable")),
        metavar=meta.get("metavar"),
    )


def knobs(options_cls) -> list[Knob]:
    """Every knob of an Options class, in declaration order."""
    return [_info(name, f) for name, f in options_cls.model_fields.items()]


def knob_info(options_cls, name: str) -> Knob | None:
    field = options_cls.model_fields.get(name)
    return None if field is None else _info(name, field)


def knobs_with_role(options_cls, role: str) -> list[str]:
    if role not in ROLES:
        raise ValueError(f"unknown knob role {role!r}; roles: {', '.join(ROLES)}")
    return [k.name for k in knobs(options_cls) if role in k.roles]


def knob_with_role(options_cls, role: str) -> str | None:
    """The engine's knob with this role (the first declared), or None when it has none."""
    found = knobs_with_role(options_cls, role)
    return found[0] if found else None


def shrink_knobs(options_cls) -> list[str]:
    """The knobs `lpf shrink` moves toward the defaults, in its order (lowest shrink_order first)."""
    ordered = [k for k in knobs(options_cls) if k.shrink_order is not None]
    return [k.name for k in sorted(ordered, key=lambda k: k.shrink_order)]


def flag_knobs(options_classes: Iterable) -> list[Knob]:
    """The flagged knobs of these Options classes: one per name, the first class's declaration wins."""
    seen: dict[str, Knob] = {}
    for cls in options_classes:
        for k in knobs(cls):
            if k.flag and k.name not in seen:
                seen[k.name] = k
    return list(seen.values())
