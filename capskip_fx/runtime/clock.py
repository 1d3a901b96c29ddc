"""The step clock: which step the running backward belongs to.

A step is one autograd backward (graph task): every compiled graph that runs in it, and every forward
it back-propagates, adds to the same :class:`~capskip_fx.runtime.stats.StepStats` (``last``).  A new
graph task starts a new step and hands the finished one to the run log.  A step can also be recorded
before any graph of its backward ran (a forward hook saw eager logits; a body graph ran first): its
graphs then claim it instead of starting another.
"""
from __future__ import annotations

import torch

from .stats import RunLog, RunSummary, StepStats

_CLAIM = object()  # StepClock._task: a step recorded at its forward, claimed by the next backward


def graph_task() -> int:
    """The running autograd graph task's id; -1 outside a backward (or on a torch without the hook)."""
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)()


class StepClock:
    """Step and epoch numbers, the step in progress (``last``) and the completed ones (``log``)."""

    def __init__(self):
        self.step = 0  # the number the next new step gets
        self.epoch = 0
        self.last = StepStats()
        self.log = RunLog()
        self._task: object = None  # graph task of ``last``; _CLAIM: recorded at a forward, not yet claimed

    def in_step(self) -> bool:
        """Whether the running backward is the one ``last`` belongs to."""
        task = graph_task()
        return task != -1 and task == self._task

    def claim(self) -> bool:
        """:meth:`in_step`, after giving a step recorded at its forward to the running backward."""
        if self._task is _CLAIM:
            self._task = graph_task()
        return self.in_step()

    def begin(self, variants: int) -> int:
        """The step number of the running backward: a new step per autograd graph task."""
        task = graph_task()
        if task == -1 or task != self._task:
            self._task = task
            self.log.add(self.last)
            self.last = StepStats(step=self.step, variants=variants)
            self.step += 1
        elif self.last.provisional:  # a graph of this backward recorded it dense before the head ran
            self.last = StepStats(step=self.last.step, variants=variants)
        return self.last.step

    def peek(self) -> int:
        """The step number :meth:`begin` will give the running backward (nothing changes)."""
        return self.last.step if self.in_step() else self.step

    def record_dense(self, n: int, reason: str, variants: int, provisional: bool = False,
                     at_forward: bool = False) -> None:
        """A step where every row ran, and why.  ``provisional``: recorded by a graph of the running backward,
        which a head selection of the same backward replaces.  ``at_forward``: recorded by a forward hook;
        the next backward claims it."""
        self.log.add(self.last)
        self.last = StepStats(step=self.step, n=n, kept=n, rows=n, _fallback=reason, variants=variants,
                              dense=True, provisional=provisional)
        self._task = _CLAIM if at_forward else graph_task() if provisional else None
        self.step += 1

    def summary(self) -> RunSummary:
        """The run so far, the step in progress included."""
        now = RunSummary()
        now.add(self.last)
        return self.log.totals + now

