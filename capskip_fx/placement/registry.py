"""One rule per op: ``@rule(TABLE, ...)`` registers a transfer function ``(walk, node) -> Result`` for every op
of the tables (tables.py); ``rule_of(node)`` finds it (an op torch tags pointwise falls back to the rule
registered for that tag).  A rule is pure: it reads its node and its inputs' layouts through the walk, and
returns the output's layout or raises ``Refuse`` for row mixing.  ``op_table_markdown()`` prints the registry
as docs/design.md's table.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import fx

from .tables import packet_of

__all__ = ["RULES", "fitting", "makes_row_index", "op_table_markdown", "rule", "rule_of"]

RULES: dict[str, Callable] = {}  # qualified op name -> its rule
_TAGGED: dict[Any, Callable] = {}  # torch.Tag -> the rule of the ops it tags that no table names
_FITTING: set = set()  # the rules whose values may fit any layout (constant or i.i.d. rows in, such rows out)
_ROW_INDEX: set = set()  # the rules that may make a row index (arange(N))


def rule(*tables: Any, tags: tuple = (), fitting: bool = False, row_index: bool = False) -> Callable:
    """Register the decorated function as the rule of every op in ``tables`` (sets or dicts of qualified op
    names) and of the ops torch tags with one of ``tags`` that no table names.  One rule per op: a second
    registration of an op is a bug in the tables.  ``fitting``: its values keep rows that fit any layout when
    its inputs' do; ``row_index``: its values may be a row index."""
    def register(fn: Callable) -> Callable:
        for table in tables:
            for p in table:
                if RULES.setdefault(p, fn) is not fn:
                    raise AssertionError(f"{p} has two layout rules: {RULES[p].__name__} and {fn.__name__}")
        for tag in tags:
            if _TAGGED.setdefault(tag, fn) is not fn:
                raise AssertionError(f"{tag} has two layout rules: {_TAGGED[tag].__name__} and {fn.__name__}")
        if fitting:
            _FITTING.add(fn)
        if row_index:
            _ROW_INDEX.add(fn)
        return fn
    return register


def rule_of(n: fx.Node) -> Optional[Callable]:
    """The rule of ``n``'s op (None: no rule, the walk's generic one applies)."""
    if n.op != "call_function":
        return None
    r = RULES.get(packet_of(n))
    if r is not None:
        return r
    return next((fn for tag, fn in _TAGGED.items() if tag in getattr(n.target, "tags", ())), None)


def fitting(fn: Optional[Callable]) -> bool:
    return fn in _FITTING


def makes_row_index(fn: Optional[Callable]) -> bool:
    return fn in _ROW_INDEX


def op_table_markdown() -> str:
    """The ops the analysis knows, by rule, as the markdown table docs/design.md shows (generated from the
    registry: ``python -c "from capskip_fx.placement import op_table_markdown; print(op_table_markdown())"``)."""
    by_rule: dict[Callable, list[str]] = {}
    for p, fn in RULES.items():
        by_rule.setdefault(fn, []).append(p)
    lines = ["| rule | ops |", "| --- | --- |"]
    for fn, ps in by_rule.items():
        ops = ", ".join(f"`{p}`" for p in sorted(ps))
        lines.append(f"| `{fn.__name__.lstrip('_')}` | {ops} |")
    lines.append("| `pointwise` | every op torch tags `pointwise` (`torch.Tag.pointwise`) |")
    return "\n".join(lines) + "\n"
