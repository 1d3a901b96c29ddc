"""What the backend remembers about each Dynamo graph, and the one place a refusal is recorded.

Like Lightning Thunder's backend: every graph handed to us gets a :class:`GraphRecord`; why a graph
runs dense is recorded once (the first reason wins) with :func:`refuse`, which also bumps
``torch._dynamo.utils.counters["capskip"]`` so tests and users can see what fired.  A pass that will not
rewrite a graph raises :class:`Refused` with that reason.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class BackwardMode(str, enum.Enum):
    """How a graph's backward runs.  A ``str`` Enum: reports and tests compare it to plain strings."""

    NOT_COMPILED = "not compiled yet"
    INFERENCE = "none (inference graph)"
    SELECTED = "selected rows"  # gathers the kept rows
    DENSE_MASKED = "dense-masked"  # all N rows, skipped rows weighted 0: exact, no speed-up
    DENSE = "dense"  # no selection node: the plain backward

    def __str__(self) -> str:
        return self.value


class Refused(Exception):
    """A graph a pass will not rewrite; the message is the reason recorded in the report."""


def counters() -> Any:
    from torch._dynamo.utils import counters as c

    return c["capskip"]


@dataclass
class GraphRecord:
    """What happened to one Dynamo graph."""

    index: int
    nodes: int
    selected: bool = False  # the joint pass inserted the selection node (head graph)
    body: bool = False  # no head: uses its forward's head selection (capskip::shared)
    no_head: Optional[str] = None
    coupled: bool = False
    masked_tangents: int = 0
    in_graph_loss: bool = False  # the loss is computed in the graph: rows selected on dL/dz in the backward
    backward: BackwardMode = BackwardMode.NOT_COMPILED
    reason: Optional[str] = None  # why this graph runs dense, if it does
    plan: Any = None  # passes.selected_rows.BackwardPlan
    layouts: dict = field(default_factory=dict, repr=False)  # forward value name -> layout.Layout (joint pass)
    row_counts: set = field(default_factory=set)  # distinct gathered row counts seen
    matmul_shapes: list = field(default_factory=list)  # aot_eager: (op, operand shapes) of the last backward's matmuls
    gather: str = "eager"  # where the row gather runs: "graph" (ops of the compiled backward) or "eager"
    gather_refused: Optional[str] = None  # gather="graph" asked, eager used: why
    vcas: Optional[str] = None  # VCAS: segments and sampled matmuls, or why it did not apply
    segmented: bool = False  # the backward runs as VCAS segments (aot_eager: matmul shapes accumulate per pass)
    verified: bool = False  # an informative gathered step matched the dense-masked backward
    verified_unordered: bool = False  # ... on a step whose kept rows were not the first k
    checks: int = 0  # verify comparisons run
    error: Optional[str] = None  # on_coupling="error": raised at this graph's first forward
    cached: bool = False  # served by AOTAutogradCache: the wrappers were rebuilt from their stored description

    def refuse(self, reason: str, mode: Optional[BackwardMode] = None) -> None:
        refuse(self, reason, mode)

    def as_dict(self) -> dict:
        return {"graph": self.index, "nodes": self.nodes, "role": "head" if self.selected else "body" if self.body else "-",
                "backward": str(self.backward),
                "reason": self.reason, "gathered_inputs": self.plan.gathered_inputs if self.plan else 0,
                "row_counts": sorted(self.row_counts), "verified": self.verified, "vcas": self.vcas,
                "gather": self.gather if self.gather_refused is None else f"eager ({self.gather_refused})"}


def refuse(record: Optional[GraphRecord], reason: str, mode: Optional[BackwardMode] = None) -> None:
    """Record why a graph (or one step of it) does not run selected rows; count it once per graph."""
    if record is not None:
        if record.reason is None:
            record.reason = reason
            counters()["refused: " + reason.split(":")[0][:60]] += 1
        if mode is not None:
            record.backward = mode
    else:
        counters()["refused: " + reason.split(":")[0][:60]] += 1


class Report(list):
    """``capskip_fx.report(model)``: one dict per graph (a list, as before; ``.rows`` for code) that prints
    as a table."""

    COLUMNS = ("graph", "role", "backward", "gathered_inputs", "row_counts", "verified", "reason")

    @property
    def rows(self) -> list[dict]:
        return list(self)

    def __str__(self) -> str:
        cells = [[str(c) for c in self.COLUMNS]] + [[_cell(r.get(c)) for c in self.COLUMNS] for r in self]
        width = [max(len(row[i]) for row in cells) for i in range(len(self.COLUMNS) - 1)]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, width)) + "  " + row[-1] for row in cells]
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(map(str, v)) if len(v) <= 6 else f"{','.join(map(str, v[:6]))},... ({len(v)})"
    return str(v)
