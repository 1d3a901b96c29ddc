"""The step's plan: what one call of a selected-row backward does, decided from host values only.

Two pure functions, each reading a graph's record (``records.GraphRecord``), the config and plain numbers;
neither mutates anything nor calls a graph, so every branch is testable without compiling
(tests/test_plan.py):

  rows_before_loss(record, plan, reads_gradient)   before the rule runs: may an in-graph loss's backward
                                                    wait for the rows (and then run on the kept rows only)?
  plan_step(record, rows, config, ...)             after it: the :class:`StepPlan`

The runtime (runtime/backward.py) builds :class:`Rows` from the selection, asks for the plan and hands it
to an executor (runtime/executors.py); the plan's ``mode`` and ``reason`` are what the graph's record
counts (``GraphRecord.ran``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..records import ALL_ROWS_NOTE, EVERY_ROW_KEPT, BackwardMode

SELECTED, DENSE_MASKED, DENSE = "selected", "dense-masked", "dense"  # records.STEP_MODES
ALL, KEPT = "all", "kept"  # where an in-graph loss's backward runs
FUSED, EAGER = "fused", "eager"  # how its kept rows are gathered


@dataclass(frozen=True)
class Rows:
    """The selection as the plan reads it: host numbers only."""

    n: int  # rows in the batch
    kept: int  # rows that carry weight
    dense: bool = False  # no rule applied this step (a fallback: every weight 1)
    reason: Optional[str] = None  # that step's fallback
    published: Optional[int] = None  # a body graph's rows from the gathered backward that fed it: their count
    loss_waits: bool = False  # the rows were chosen before an in-graph loss's backward ran


@dataclass(frozen=True)
class StepPlan:
    """What one backward call runs."""

    mode: str  # SELECTED: ``rows`` gathered rows; DENSE_MASKED or DENSE: all n rows with the step's weights
    rows: int  # rows the compiled backward runs on (kept rows padded to the bucket, or n)
    reason: Optional[str] = None  # why all rows ran (the record's step reason); None when selected
    note: Optional[str] = None  # a kept share above gather_below, or every row kept: stats().note (no fallback)
    fallback: Optional[str] = None  # a graph that runs dense-masked: its reason, the step's fallback
    reuse: bool = False  # run on the published kept-row index as it is (no sort, no read)
    loss: Optional[str] = None  # an in-graph loss's backward still to run: on ALL rows or the KEPT rows
    loss_gather: Optional[str] = None  # its kept rows gathered by its FUSED twin or EAGER
    verify: bool = False  # also run the dense-masked backward and compare
    informative: bool = False  # counts toward ``verify_every`` (verify on, some rows kept, some dropped)


def rows_before_loss(record: Any, plan: Any, reads_gradient: bool) -> bool:
    """Whether the rule may choose before an in-graph loss's backward runs: that backward proven row-wise
    (passes/prefix_rows.py), a graph that gathers and whose rule reads h and z, a rule that reads no dL/dz or
    a loss whose dL/dz is derived from the forward (a recognised cross-entropy, passes/loss_grad.py), and h
    and z among the graph's own inputs (not the loss's outputs).  ``plan``: the graph's BackwardPlan."""
    pre = plan.prefix
    return (pre is not None and pre.specs is not None and record.backward == BackwardMode.SELECTED and plan.head
            and (not reads_gradient or getattr(pre, "grad", None) is not None)
            and max(plan.select_args[:2]) < len(pre.keep))


def plan_step(record: Any, rows: Rows, config: Any, informative_steps: int = 0, fused_loss: bool = False) -> StepPlan:
    """The plan of one backward call of the graph ``record`` describes.  ``config``: its CapskipConfig
    (bucket, gather_below, verify, verify_every); ``informative_steps``: the informative gathered steps it
    ran so far; ``fused_loss``: its loss's backward has a twin that gathers its own kept rows."""
    n, k = rows.n, rows.kept
    kb = config.bucket(k, n)
    masked = record.backward != BackwardMode.SELECTED  # refused at compile time, or by verify since
    if kb > config.gather_below * n or masked:
        note = None
        if rows.dense:  # no rule applied: the step's reason
            mode, reason = DENSE, rows.reason
        elif masked:
            mode, reason = DENSE_MASKED, record.reason
        elif k >= n:  # a note, no fallback: the rule's gradient is the dense one
            mode, reason = DENSE_MASKED, EVERY_ROW_KEPT
            note = reason
        else:  # a mode label, no fallback: gathering would cost more than it saves
            mode, reason = DENSE_MASKED, ALL_ROWS_NOTE.format(gather_below=config.gather_below)
            note = reason
        return StepPlan(mode, n, reason, note, fallback=record.reason if masked else None,
                        loss=ALL if rows.loss_waits else None)
    informative = config.verify and 0 < k < n  # steps keeping none or all rows tell nothing (0 == 0)
    return StepPlan(SELECTED, kb, reuse=rows.published == kb,
                    loss=KEPT if rows.loss_waits else None,
                    loss_gather=(FUSED if fused_loss else EAGER) if rows.loss_waits else None,
                    verify=informative and _verify_due(record, config.verify_every, informative_steps + 1),
                    informative=informative)


def _verify_due(record: Any, every: Optional[int], step: int) -> bool:
    """The first informative step; the next one too when the first kept the first k rows (where a value
    recomputed from the row index coincides with the dense one; no read to look for a step that does not:
    rules that always keep a prefix are served); then every ``every``-th informative step if set."""
    if not record.verified or (not record.verified_unordered and record.checks < 2):
        return True
    return every is not None and step % every == 0
