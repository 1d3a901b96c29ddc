"""The step clock: which step the running backward belongs to.

A step is one autograd backward (graph task), with the backwards nested in it (a reentrant checkpoint's):
every compiled graph that runs in it, and every forward it back-propagates, adds to the same :class:`~capskip_fx.runtime.stats.StepStats` (``last``).  A new
graph task starts a new step and hands the finished one to the run log.  A step can also be recorded
before any graph of its backward ran (a forward hook saw eager logits; a body graph ran first): its
graphs then claim it instead of starting another.
"""
from __future__ import annotations

import sys
import threading

import torch
from torch.autograd import graph as _autograd_graph

from .stats import RunLog, RunSummary, StepStats

# the Python function every backward / autograd.grad goes through (a moved one: no nesting detected)
_ENGINE_RUN = getattr(getattr(_autograd_graph, "_engine_run_backward", None), "__code__", None)
_CLAIM = object()  # StepClock._task: a step recorded at its forward, claimed by the next backward


class _Root:
    """The outermost backward seen: its graph task, the thread it ran on and how many backward calls were
    on that thread's Python stack then.  A reentrant backward (``checkpoint(use_reentrant=True)``) runs
    inside one of its nodes, on the same thread, one call deeper: it is part of the same training step."""

    task: int = -1
    thread: int = 0
    depth: int = 0
    nested: int = -1  # the last nested task id seen, mapped to ``task`` without walking the stack again


_ROOT = _Root()


def _backward_depth() -> int:
    """Autograd engine calls (backward, autograd.grad) on this thread's Python stack."""
    depth, frame = 0, sys._getframe(2)
    while frame is not None:
        depth += frame.f_code is _ENGINE_RUN
        frame = frame.f_back
    return depth


def _raw_task() -> int:
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)()


def graph_task() -> int:
    """The running training step's autograd graph task id: a nested (reentrant) backward's is its
    outermost backward's; -1 outside a backward (or on a torch without the hook)."""
    task = _raw_task()
    root = _ROOT
    if task == -1 or task == root.task:
        return task
    if task == root.nested:
        return root.task
    thread, depth = threading.get_ident(), _backward_depth()
    if root.task != -1 and thread == root.thread and depth > root.depth:
        root.nested = task  # called from inside the outer backward: the same step
        return root.task
    # a new outermost backward (one that raised leaves a stale root behind: same depth, so replaced here)
    root.task, root.thread, root.depth, root.nested = task, thread, depth, -1
    return task


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
            # forwards that ran no rule (a batch of 1, a forward made dense at its backward) stay in the step
            dense = [f for f in self.last.forwards if f.dense]
            self.last = StepStats(step=self.last.step, variants=variants)
            for f in dense:
                self.last.add(f)
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

