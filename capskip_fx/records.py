"""What the backend remembers about each Dynamo graph, and the one place a refusal is recorded.

Like Lightning Thunder's backend: every graph handed to us gets a :class:`GraphRecord`.  A pass that
will not rewrite a graph raises :class:`Refused` carrying a typed :class:`Refusal` (its
:class:`RefusalKind`, the detail shown in reports, the op and the model's source line when known).
Why a graph runs dense is recorded once (the first refusal wins) by :func:`refuse`, which also bumps
``torch._dynamo.utils.counters["capskip"]["refused: <kind>"]`` so tests and users can see what fired.

A record has two halves: :class:`CompileRecord` (frozen; what the pass pipeline decided for the graph,
built from its results in ``passes/pipeline.py``) and the fields the runtime updates per step (rows
seen, verification).  A refusal met at run time (verify) is kept apart from the compile one.
"""
from __future__ import annotations

import enum
import operator
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional


class BackwardMode(str, enum.Enum):
    """How a graph's backward runs.  A ``str`` Enum: reports and tests compare it to plain strings."""

    # the backward compiles at its first run: none ran (Dynamo discarded the graph for a retrace, or nothing
    # back-propagated through it yet)
    NOT_COMPILED = "no backward ran"
    INFERENCE = "none (inference graph)"
    SELECTED = "selected rows"  # gathers the kept rows
    DENSE_MASKED = "dense-masked"  # all N rows, skipped rows weighted 0: exact, no speed-up
    DENSE = "dense"  # no selection node: the plain backward

    def __str__(self) -> str:
        return self.value


class RefusalKind(str, enum.Enum):
    """Why a graph (or a step of it) does not run selected rows.  The value is the counter key's tail
    (``counters["capskip"]["refused: <value>"]``): keep values stable, add new kinds at the end."""

    UNDECLARED_FUNCTION = "undeclared autograd.Function"  # functions.py: capskip_fx.rowwise(cls) declares one
    NO_HEAD = "no head"  # no logits output and no batch-shaped tangent to mask
    STATIC_BATCH = "static batch"  # the logits' batch dim is not symbolic
    CROSS_EXAMPLE = "cross-example"  # the forward mixes rows (placement/)
    BATCH_LAYOUT = "batch layout"  # a value's rows can't be gathered (token-major, unknown, odd sizes)
    ROW_INDEX_VALUE = "row index as a value"  # arange(N) used as a value reaches the backward
    IN_GRAPH_LOSS = "in-graph loss"  # the loss region reads more than the logits, or no dL/dz
    UNPROVEN = "unproven saved value"  # a gathered backward input the layout proof does not cover
    SELECTION = "selection node"  # the backward's selection node is not as the joint pass left it
    SPECIALISED = "specialised"  # compiling the backward fixed the batch (or a stride) symbol
    VERIFY = "verify"  # run time: the gathered backward differed from the dense-masked one
    IN_GRAPH_GATHER = "in-graph gather"  # a loss backward's fused gather refused: its rows gathered eagerly
    VCAS = "vcas"  # VCAS's segmenting refused: the exact backward runs (not dense)
    # run-time causes of a step's fallback (stats().fallback.kind; summary() counts steps by kind)
    NON_FINITE = "non-finite"  # non-finite logits, dL/dz or head input
    UNUSED_LOGITS = "unused logits"  # dL/dz of the logits output is zero on every row
    NOT_SOFTMAX = "not a softmax loss"  # dL/dz reveals no labels (MSE on the logits, ...)
    EAGER_LOGITS = "eager logits"  # the returned logits come from eager code, no compiled graph's output
    NO_GRAPH = "no graph"  # Dynamo handed capskip no graph (recompile_limit, untraced RNNs)
    OTHER = "other"
    BACKWARD = "backward not row-wise"  # passes/validate.py: the backward that runs is not proven row-wise
    RANDOM_BACKWARD = "random in the backward"  # the backward draws or replays random numbers
    LOGITS_NOT_KEPT = "logits not kept"  # the rule reads token logits its graph (built for another) did not keep
    AFTER_HEAD = "after the head"  # the returned logits' graph, after the head's, passes gradient the rows don't weight
    OUTSIDE_GRAPH = "output outside the graph"  # an output is a parameter or its view, returned from outside the graph
    BEFORE_HEAD = "output before the head"  # an output holding the rows comes from a graph before the head's
    HOOK = "backward hook"  # a hook on the logits' gradient (tensor or module backward hook) runs before the weights


#: a graph specialised to a batch of 1 (a ragged last batch, string backend): its dense step is by design
ONE_ROW_NOTE = ("a batch of size 1: Dynamo specialises its batch dim (a graph of its own for this size), whose "
                "backward could not drop rows anyway: dense backward, by design")

#: The one vocabulary for why a step was not ``selected``: compile-time refusals and run-time causes.
FallbackKind = RefusalKind

# refusal details seen (counted) -> kind: a step's reason built from a graph's refusal gets its kind back
_DETAIL_KINDS: dict[str, RefusalKind] = {}
# run-time reasons by their opening words (runtime/checks.py, runtime/forwards.py, api.py, backward.py)
_REASON_KINDS = (
    ("non-finite", RefusalKind.NON_FINITE),
    ("dL/dz of the logits output is zero", RefusalKind.UNUSED_LOGITS),
    ("dL/dz is not the gradient of a softmax loss", RefusalKind.NOT_SOFTMAX),
    ("verify:", RefusalKind.VERIFY),
    ("the returned logits are not the output of a compiled graph", RefusalKind.EAGER_LOGITS),
    ("the returned logits, or an output computed from them", RefusalKind.AFTER_HEAD),
    ("an output of the forward is a parameter", RefusalKind.OUTSIDE_GRAPH),
    ("an output of the forward holds the batch's rows but comes from a graph before", RefusalKind.BEFORE_HEAD),
    ("a backward hook runs on the returned logits' gradient", RefusalKind.HOOK),
    ("torch.compile produced no graph", RefusalKind.NO_GRAPH),
    ("Dynamo does not trace", RefusalKind.NO_GRAPH),
    ("no graph of this backward ran the rule", RefusalKind.NO_HEAD),
    ("no classifier head", RefusalKind.NO_HEAD),
)


def fallback_kind(reason: Optional[str]) -> Optional[RefusalKind]:
    """The kind of a step's fallback reason (None for None): a typed reason's own, a refusal's detail's,
    else by its opening words; ``OTHER`` when none matches."""
    if reason is None:
        return None
    kind = getattr(reason, "kind", None)
    if kind is not None:
        return kind
    for text, k in _REASON_KINDS:
        if reason.startswith(text):
            return k
    for detail, k in _DETAIL_KINDS.items():
        if detail and detail in reason:
            return k
    if ": no rule runs" in reason:  # a body graph's "<why it has no head>: no rule runs, dense backward"
        return RefusalKind.NO_HEAD
    return RefusalKind.OTHER


class Fallback(str):
    """A step's fallback: the reason text (a ``str``, as before) with its ``kind``."""

    kind: RefusalKind

    def __new__(cls, detail: str, kind: Optional[RefusalKind] = None) -> "Fallback":
        self = super().__new__(cls, detail)
        self.kind = RefusalKind(kind) if kind is not None else fallback_kind(str(detail))
        return self

    @property
    def detail(self) -> str:
        return str.__str__(self)


@dataclass(frozen=True)
class Refusal:
    """A typed refusal: ``kind`` for code and counters, ``detail`` (the reason text reports show), and
    where a pass met it at a graph node: ``op`` (the aten op), ``source_line`` (the model's line, from
    Dynamo's stack trace) and ``module`` (the innermost module's path and class, which names the spot
    when the op is inside a library module such as BatchNorm)."""

    kind: RefusalKind
    detail: str
    op: Optional[str] = None
    source_line: Optional[str] = None
    module: Optional[str] = None
    location: Optional[tuple] = None  # (file path, line) of source_line: where the warning points

    def __str__(self) -> str:
        return self.detail

    @property
    def where(self) -> Optional[str]:
        """``op aten.x in path (Class) at file.py:12: code``, or None where no node was known."""
        parts = [f"op {self.op}" if self.op else "", f"in {self.module}" if self.module else "",
                 f"at {self.source_line}" if self.source_line else ""]
        return " ".join(p for p in parts if p) or None


class Refused(Exception):
    """A graph a pass will not rewrite; ``refusal`` says why (its detail is the message).  ``node``: the
    graph node the pass refused at, whose op, source line and module the refusal then names."""

    def __init__(self, detail: str, kind: RefusalKind, op: Optional[str] = None, source_line: Optional[str] = None,
                 node: Any = None):
        super().__init__(detail)
        module = location = None
        if node is not None:
            op, source_line, module, location = node_origin(node)
        self.refusal = Refusal(RefusalKind(kind), detail, op, source_line, module, location)


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in ')


def node_origin(node: Any) -> tuple[Optional[str], Optional[str], Optional[str], Optional[tuple]]:
    """(op, source line, module, location) of an FX node, from its meta: the aten op's name; the innermost
    frame of Dynamo's ``stack_trace`` outside torch itself as ``file.py:line: code`` (inside BatchNorm the
    innermost frames are torch's own: the line that called the module is the user's) and as (path, line);
    the innermost entry of ``nn_module_stack`` as ``path (Class)``."""
    op = str(node.target) if getattr(node, "op", None) == "call_function" else None
    meta = getattr(node, "meta", {}) or {}
    frames, lines = [], (meta.get("stack_trace") or "").splitlines()
    for i, ln in enumerate(lines):
        m = _FRAME.match(ln)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            frames.append((m.group(1), m.group(2), code))
    import torch  # here: the records stay importable without torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    user = [f for f in frames if not os.path.abspath(f[0]).startswith(torch_dir)]
    source = location = None
    if user:
        path, line, code = user[-1]
        source = f"{os.path.basename(path)}:{line}" + (f": {code}" if code else "")
        location = (path, int(line))
    module = None
    stack = list((meta.get("nn_module_stack") or {}).values())
    if stack:
        path, cls = stack[-1]
        path = re.sub(r"^L\['[^']*'\]\.?", "", str(path))
        path = re.sub(r"^(__self__|_orig_mod)\.?", "", path) or "the model"
        module = f"{path} ({getattr(cls, '__name__', str(cls).rsplit('.', 1)[-1])})"
    return op, source, module, location


def counters() -> Any:
    from torch._dynamo.utils import counters as c

    return c["capskip"]


@dataclass(frozen=True)
class CompileRecord:
    """What the pass pipeline decided for one graph, at compile time (passes/pipeline.py's results).

    Frozen: the backend replaces it as each direction's result comes in, and AOTAutogradCache stores
    it with the compiled graph (aot_cache.py)."""

    head: bool = False  # the joint pass inserted capskip::select (the graph returns the logits)
    body: bool = False  # no head: uses its forward's head selection (capskip::shared)
    no_head: Optional[str] = None  # why a body graph has no head
    coupled: bool = False  # refused for row mixing (RefusalKind.CROSS_EXAMPLE)
    masked_tangents: int = 0
    in_graph_loss: bool = False  # the loss is computed in the graph: rows selected on dL/dz in the backward
    # False: token logits whose values the rule reads none of; the graph keeps a (N, T, 1) stand-in for them,
    # and returns them uncopied unless another op reads them (passes/insert_select.py; Rule.reads_logits)
    logits_kept: bool = True
    backward: BackwardMode = BackwardMode.NOT_COMPILED
    refusal: Optional[Refusal] = None  # why this graph runs dense, if it does (the first refusal)
    plan: Any = None  # passes.selected_rows.BackwardPlan
    vcas: Optional[str] = None  # VCAS: segments and sampled matmuls, or why it did not apply
    gather: str = "eager"  # where the kept rows are gathered: "graph" (gather="graph"), or "eager (why not)"
    segmented: bool = False  # the backward runs as VCAS segments (aot_eager: matmul shapes accumulate per pass)
    error: Optional[str] = None  # on_coupling="error": raised at this graph's first forward


@dataclass
class GraphRecord:
    """What happened to one Dynamo graph: ``compiled`` (frozen, compile time) and the fields the runtime
    updates per step.  The compile fields read through (``record.backward``, ``record.reason``, ...)."""

    index: int
    nodes: int
    compiled: CompileRecord = field(default_factory=CompileRecord)
    joint: Any = None  # passes.pipeline.JointResult: the joint pass's layout proof, for the backward pass
    cached: bool = False  # served by AOTAutogradCache: the wrappers were rebuilt from their stored description
    # -- run time
    demoted: Optional[str] = None  # a head graph whose output was not the returned logits: runs as a body graph
    run_refusal: Optional[Refusal] = None  # a refusal met at run time (verify)
    run_mode: Optional[BackwardMode] = None  # the backward since a run-time refusal (dense-masked)
    row_counts: set = field(default_factory=set)  # distinct gathered row counts seen
    matmul_shapes: list = field(default_factory=list)  # aot_eager: (op, operand shapes) of the last backward's matmuls
    verified: bool = False  # an informative gathered step matched the dense-masked backward
    verified_unordered: bool = False  # ... on a step whose kept rows were not the first k
    checks: int = 0  # verify comparisons run
    host_reads: int = 0  # body backwards that read their rows from the device (their own nonzero rows)
    rows_reused: int = 0  # body backwards that ran on the rows of the gathered backward that fed them (no read)
    prefix_rows: int = 0  # backwards whose in-graph loss's backward ran on the kept rows only (chosen first)
    graph_gathers: int = 0  # gathered backwards whose compiled graph gathered its kept rows itself (gather="graph")
    derived_grads: int = 0  # ... of those, the rule read a dL/dz derived from the forward (passes/loss_grad.py)
    loss_rows: Optional[int] = None  # the rows the in-graph loss's backward ran on in the latest backward
    modes: Counter = field(default_factory=Counter)  # step mode (selected, dense-masked, dense) -> backwards run
    last_mode: Optional[str] = None  # the mode of this graph's latest backward
    step_reason: Optional[str] = None  # why its latest backward that was not ``selected`` ran all rows

    def ran(self, mode: str, reason: Optional[str] = None) -> None:
        """One backward of this graph ran in ``mode`` (a step mode); ``reason``: why, when not selected."""
        self.modes[mode] += 1
        self.last_mode = mode
        if mode != "selected" and reason:
            self.step_reason = str(reason)

    def settle(self, **fields: Any) -> Optional[Refusal]:
        """Replace compile fields (a pipeline result).  A ``refusal`` is kept only if the graph had none
        (the first wins) and counted once; returns it then (the caller warns), else None."""
        refusal = fields.pop("refusal", None)
        new = refusal is not None and self.refusal is None
        if new:
            fields["refusal"] = refusal
            _count(refusal)
        self.compiled = replace(self.compiled, **fields)
        return refusal if new else None

    def refuse(self, refusal: Refusal, mode: Optional[BackwardMode] = None) -> bool:
        """A refusal met at run time; True if it is the graph's first (counted once)."""
        if mode is not None:
            self.run_mode = mode
        if self.refusal is not None:
            return False
        self.run_refusal = refusal
        _count(refusal)
        return True

    # -- one answer per question
    @property
    def refusal(self) -> Optional[Refusal]:
        return self.compiled.refusal or self.run_refusal

    @property
    def reason(self) -> Optional[str]:
        """Why this graph runs dense (or dense-masked), if it does."""
        return None if self.refusal is None else self.refusal.detail

    @property
    def backward(self) -> BackwardMode:
        return self.run_mode or self.compiled.backward

    @property
    def head(self) -> bool:
        """The graph runs the rule: it returns the logits (not demoted at run time)."""
        return self.compiled.head and self.demoted is None

    @property
    def body(self) -> bool:
        return self.compiled.body or self.demoted is not None

    @property
    def no_head(self) -> Optional[str]:
        return self.compiled.no_head or self.demoted

    def __setattr__(self, name: str, value: Any) -> None:
        if name in CompileRecord.__dataclass_fields__:  # compile fields change only through settle()
            raise AttributeError(f"GraphRecord.{name} is a compile field: settle({name}=...) replaces it")
        super().__setattr__(name, value)

    def as_dict(self) -> dict:
        c = self.compiled
        return {"graph": self.index, "nodes": self.nodes, "role": "head" if self.head else "body" if self.body else "-",
                "backward": str(self.backward),
                "reason": self.reason, "where": None if self.refusal is None else self.refusal.where,
                "gathered_inputs": c.plan.gathered_inputs if c.plan else 0,
                "row_counts": sorted(self.row_counts), "verified": self.verified, "vcas": c.vcas,
                "host_reads": self.host_reads, "rows_reused": self.rows_reused, "prefix_rows": self.prefix_rows,
                "derived_grads": self.derived_grads, "loss_rows": self.loss_rows, "logits_kept": c.logits_kept,
                "loss_backward": None if c.plan is None or c.plan.prefix is None else _loss_backward(c.plan.prefix),
                "gather": c.gather, "graph_gathers": self.graph_gathers,
                "steps": {m: self.modes[m] for m in STEP_MODES if self.modes[m]}, "last": self.last_mode,
                "step_reason": self.step_reason}


def _loss_backward(prefix: Any) -> str:
    """Where an in-graph loss's backward runs, in words (``report()``'s ``loss_backward``)."""
    if prefix.whole_rows:
        return "all rows: " + prefix.whole_rows
    if prefix.grad is not None:
        return (f"row-wise: kept rows (rules that read dL/dz get it derived from the forward: "
                f"{prefix.grad.describe()})")
    why = f"; dL/dz not derived: {prefix.grad_why}" if prefix.grad_why else ""
    return f"row-wise: kept rows when the rule reads no dL/dz (a rule that reads it runs it on all rows{why})"


# the other compile fields read through: record.plan, record.vcas, ... (read-only)
for _name in CompileRecord.__dataclass_fields__:
    if not hasattr(GraphRecord, _name):
        setattr(GraphRecord, _name, property(operator.attrgetter(f"compiled.{_name}")))
del _name


#: the modes a step (or one graph's backward in it) runs in, in reporting order
STEP_MODES = ("selected", "dense-masked", "dense")
ALL_ROWS_NOTE = ("kept share above gather_below={gather_below}: all rows ran, skipped rows weighted 0 (by design: "
                 "gathering would cost more than it saves)")
EVERY_ROW_KEPT = "every row kept: all rows ran (nothing to skip)"


def _count(refusal: Refusal) -> None:
    counters()["refused: " + refusal.kind.value] += 1
    if len(_DETAIL_KINDS) < 1000:  # details are per cause, not per step: bounded in practice
        _DETAIL_KINDS.setdefault(refusal.detail, refusal.kind)


class Report(list):
    """``capskip_fx.report(model)``: one dict per graph (a list, as before; ``.rows`` for code) that prints
    as a table."""

    COLUMNS = ("graph", "role", "backward", "steps", "last", "gathered_inputs", "row_counts", "verified", "reason")

    @property
    def rows(self) -> list[dict]:
        return list(self)

    LEGEND = (
        "role: head (runs the rule on its logits) | body (uses its forward's head selection) | - (neither)",
        "backward: what the graph's backward is built to run: selected rows (kept rows gathered) | dense-masked "
        "(all rows, skipped ones weighted 0: the rule's gradient, no speed-up) | dense (rule not applied) | "
        "no backward ran (a graph Dynamo discarded for a retrace, or none has reached it yet)",
        "steps: this graph's backwards by the mode they ran in; last: the latest one's mode",
        "gathered_inputs: saved tensors gathered per step; row_counts: gathered row counts seen",
        "verified: yes = a gathered step matched the dense-masked backward; never: no informative step (some "
        "rows kept, some dropped) has run yet; - = nothing to verify (not a gathered backward)",
        "reason: why the graph is refused, else why its latest step that was not selected ran all rows",
    )

    def __str__(self) -> str:
        cells = [[str(c) for c in self.COLUMNS]] + [[_display(r, c) for c in self.COLUMNS] for r in self]
        width = [max(len(row[i]) for row in cells) for i in range(len(self.COLUMNS) - 1)]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, width)) + "  " + row[-1] for row in cells]
        where = [f"graph {r['graph']} refused at: {r['where']}" for r in self if r.get("where")]
        return "\n".join([line.rstrip() for line in lines] + where + ["", *self.LEGEND])

    __repr__ = __str__


def _display(row: dict, column: str) -> str:
    if column == "verified":  # a bool for code; for readers, "never" is said in words, not as a failure
        if row.get("backward") != str(BackwardMode.SELECTED):
            return "-"
        return "yes" if row.get("verified") else "never (no informative step)"
    if column == "steps":
        return ", ".join(f"{m} {c}" for m, c in (row.get("steps") or {}).items()) or "-"
    if column == "reason":
        if row.get("backward") == str(BackwardMode.NOT_COMPILED) and not row.get("reason"):
            return "never back-propagated: Dynamo discarded this trace (a retrace replaced it), or no step reached it yet"
        return _cell(row.get("reason") or row.get("step_reason"))
    return _cell(row.get(column))


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(map(str, v)) if len(v) <= 6 else f"{','.join(map(str, v[:6]))},... ({len(v)})"
    return str(v)
