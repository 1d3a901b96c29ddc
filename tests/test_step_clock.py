"""The step clock (runtime/clock.py): one step per autograd backward, whatever its graphs record and in
which order; nothing lost or counted twice at step boundaries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capskip_fx.runtime import clock as clock_mod
from capskip_fx.runtime.clock import StepClock
from capskip_fx.runtime.stats import StepStats
from helpers.examples import examples

# one backward: a head selecting over its forwards' rows; a step recorded dense at the forward (eager
# logits), which the backward's graph claims; or a body graph first (a provisional dense step) then the head
BACKWARD = st.one_of(
    st.tuples(st.just("select"), st.lists(st.integers(1, 9), min_size=1, max_size=3)),
    st.tuples(st.just("dense_at_forward"), st.integers(1, 9)),
    st.tuples(st.just("body_then_head"), st.lists(st.integers(1, 9), min_size=1, max_size=3)),
)


def _run(clock: StepClock, task: list, kind: str, arg) -> int:
    """Play one backward on ``clock`` in graph task ``task[0]``; the rows it should end up counting."""
    if kind == "dense_at_forward":
        task[0] = -1  # the forward runs outside any backward
        clock.record_dense(arg, "eager logits", 0, at_forward=True)
        task[0] = task[1]
        assert clock.claim(), "the backward did not claim the step its forward recorded"
        return arg
    if kind == "body_then_head":
        assert not clock.claim(), "a body graph's backward before the head's has no forward record to claim"
        clock.record_dense(sum(arg), "body first", 0, provisional=True)
    for n in arg:
        clock.begin(0)
        clock.last.add(StepStats(n=n, kept=n, rows=n))
    return sum(arg)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(BACKWARD, min_size=1, max_size=8))
def test_one_step_per_backward_and_every_row_counted_once(backwards):
    clock, task = StepClock(), [-1, 0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(clock_mod, "graph_task", lambda: task[0])
        rows = 0
        for i, (kind, arg) in enumerate(backwards):
            task[1] = task[0] = i + 1  # autograd gives each backward a new graph task id
            rows += _run(clock, task, kind, arg)
            assert clock.last.step == i, f"backward {i} ({kind}) recorded as step {clock.last.step}"
            assert clock.peek() == i, f"peek() in backward {i} says {clock.peek()}"
        run = clock.summary()
    assert run.steps == len(backwards), f"{run.steps} steps for {len(backwards)} backwards: {backwards}"
    assert run.n == rows, f"{run.n} rows counted, {rows} forwarded: {backwards}"
    assert clock.step == len(backwards), f"the next step would be {clock.step}"
    dense = sum(kind == "dense_at_forward" for kind, _ in backwards)  # a head replaces a body's dense record
    assert run.modes["dense"] == dense, f"dense steps {run.modes}, expected {dense}: {backwards}"
    assert sum(run.fallbacks.values()) == dense, f"fallback reasons {run.fallbacks}, expected {dense}"


def test_outside_a_backward_every_begin_is_a_new_step(monkeypatch):
    """Without a graph task id (-1) nothing ties two calls to one backward: each starts a step."""
    monkeypatch.setattr(clock_mod, "graph_task", lambda: -1)
    clock = StepClock()
    assert [clock.begin(0) for _ in range(3)] == [0, 1, 2], "outside a backward each begin() should start a new step (0, 1, 2)"
    assert not clock.in_step(), "outside a backward no step should stay open"
    assert clock.peek() == 3, f"after 3 steps the next step should be 3, peek() says {clock.peek()}"
