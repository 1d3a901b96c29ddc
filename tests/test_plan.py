"""The step-level decision (runtime/plan.py) on hand-made records and selections: every branch of
``plan_step`` and ``rows_before_loss``, with nothing compiled and no tensor."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from capskip_fx.config import CapskipConfig
from capskip_fx.passes.selected_rows import BackwardPlan, Prefix
from capskip_fx.records import ALL_ROWS_NOTE, EVERY_ROW_KEPT, BackwardMode, CompileRecord, GraphRecord, Refusal, RefusalKind
from capskip_fx.runtime.plan import (ALL, DENSE, DENSE_MASKED, EAGER, FUSED, KEPT, SELECTED, Rows,
                                     StepPlan, plan_step, rows_before_loss)

WHY = "a saved value the layout proof does not cover"


@pytest.fixture(autouse=True)
def _nothing_compiles(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the plan must be decided without compiling")

    monkeypatch.setattr(torch, "compile", refuse)


def _record(backward=BackwardMode.SELECTED, refusal=None, **runtime) -> GraphRecord:
    rec = GraphRecord(index=0, nodes=1, compiled=CompileRecord(backward=backward, refusal=refusal))
    for k, v in runtime.items():
        setattr(rec, k, v)
    return rec


def _plan(rec, rows, informative_steps=0, fused_loss=False, **config) -> StepPlan:
    before = dataclasses.asdict(rec.compiled), dict(vars(rec))
    step = plan_step(rec, rows, CapskipConfig(**config), informative_steps, fused_loss)
    assert (dataclasses.asdict(rec.compiled), dict(vars(rec))) == before, "plan_step changed the record"
    return step


def test_some_rows_kept_are_gathered_and_verified_on_the_first_informative_step():
    step = _plan(_record(), Rows(n=8, kept=3))
    assert step == StepPlan(SELECTED, 3, verify=True, informative=True), step


def test_kept_rows_are_padded_to_the_bucket():
    step = _plan(_record(), Rows(n=16, kept=5), granule=4)
    assert (step.mode, step.rows) == (SELECTED, 8), step


def test_a_kept_share_above_gather_below_runs_all_rows_by_design():
    step = _plan(_record(), Rows(n=10, kept=6), gather_below=0.5)
    note = ALL_ROWS_NOTE.format(gather_below=0.5)
    assert step == StepPlan(DENSE_MASKED, 10, reason=note, note=note), step
    assert step.fallback is None, "a kept share above gather_below is a label, not a fallback"
    at_limit = _plan(_record(), Rows(n=10, kept=5), gather_below=0.5)
    assert (at_limit.mode, at_limit.rows) == (SELECTED, 5), f"kb <= gather_below * n still gathers: {at_limit}"


def test_every_row_kept_runs_dense_masked():
    step = _plan(_record(), Rows(n=8, kept=8))
    assert step == StepPlan(DENSE_MASKED, 8, reason=EVERY_ROW_KEPT, note=EVERY_ROW_KEPT), step
    assert step.fallback is None, "keeping every row is a note, not a fallback"


def test_no_row_kept_runs_min_rows_zero_weight_rows_unverified():
    step = _plan(_record(), Rows(n=8, kept=0))
    assert step == StepPlan(SELECTED, 2), f"k = 0 runs min_rows rows, not informative: {step}"
    assert _plan(_record(), Rows(n=8, kept=0), min_rows=1).rows == 1


def test_a_step_no_rule_applied_to_is_dense_with_its_reason():
    """A non-finite step (or any fallback) keeps every row with weight 1: mode dense, the step's reason."""
    why = "non-finite logits or gradient"
    step = _plan(_record(), Rows(n=8, kept=8, dense=True, reason=why))
    assert step == StepPlan(DENSE, 8, reason=why), step
    # gather_below=1: every row gathered (the identity order): the step still runs selected, as the rows say
    assert _plan(_record(), Rows(n=8, kept=8, dense=True, reason=why), gather_below=1.0).mode == SELECTED


def test_a_graph_that_runs_dense_masked_gives_its_reason_and_its_fallback():
    refused = _record(BackwardMode.DENSE_MASKED, Refusal(RefusalKind.UNPROVEN, WHY))
    step = _plan(refused, Rows(n=8, kept=2))
    assert step == StepPlan(DENSE_MASKED, 8, reason=WHY, fallback=WHY), step
    dense_step = _plan(refused, Rows(n=8, kept=8, dense=True, reason="non-finite"))
    assert (dense_step.mode, dense_step.reason, dense_step.fallback) == (DENSE, "non-finite", WHY), dense_step


def test_a_graph_verify_refused_runs_dense_masked_from_then_on():
    rec = _record()
    rec.refuse(Refusal(RefusalKind.VERIFY, "verify: differs"), BackwardMode.DENSE_MASKED)
    step = _plan(rec, Rows(n=8, kept=2))
    assert (step.mode, step.reason, step.verify) == (DENSE_MASKED, "verify: differs", False), step


@pytest.mark.parametrize("verified, unordered, checks, every, steps, due", [
    (False, False, 0, None, 0, True),    # the first informative step
    (True, False, 1, None, 1, True),     # the first kept a prefix of the rows: the next one too
    (True, False, 2, None, 2, False),    # two checks of prefix rows: enough
    (True, True, 1, None, 1, False),     # an unordered step verified: done
    (True, True, 1, 2, 1, True),         # verify_every=2: the 2nd informative step
    (True, True, 2, 2, 2, False),        # ... not the 3rd
    (True, True, 2, 2, 3, True),         # ... the 4th
])
def test_verify_schedule(verified, unordered, checks, every, steps, due):
    rec = _record(verified=verified, verified_unordered=unordered, checks=checks)
    step = _plan(rec, Rows(n=8, kept=3), informative_steps=steps, verify_every=every)
    assert (step.verify, step.informative) == (due, True), step


def test_verify_off_never_verifies_and_counts_nothing():
    step = _plan(_record(), Rows(n=8, kept=3), verify=False)
    assert (step.mode, step.verify, step.informative) == (SELECTED, False, False), step


@pytest.mark.parametrize("published, granule, reuse", [(3, 1, True), (3, 4, False), (None, 1, False)])
def test_published_rows_are_reused_only_at_the_bucket_size(published, granule, reuse):
    """A body graph fed by a gathered backward runs on its published index when that index already has
    the bucket's row count; otherwise the kept rows are sorted first again."""
    step = _plan(_record(), Rows(n=16, kept=3, published=published), granule=granule)
    assert (step.mode, step.reuse) == (SELECTED, reuse), step


@pytest.mark.parametrize("fused, how", [(True, FUSED), (False, EAGER)])
def test_a_waiting_loss_backward_runs_on_the_kept_rows(fused, how):
    step = _plan(_record(), Rows(n=8, kept=3, loss_waits=True), fused_loss=fused)
    assert (step.mode, step.loss, step.loss_gather) == (SELECTED, KEPT, how), step


def test_a_waiting_loss_backward_runs_on_all_rows_when_the_step_does():
    step = _plan(_record(), Rows(n=8, kept=8, loss_waits=True), fused_loss=True)
    assert (step.mode, step.loss, step.loss_gather) == (DENSE_MASKED, ALL, None), step
    assert _plan(_record(), Rows(n=8, kept=3)).loss is None, "no loss backward waiting: nothing to plan"


def _bplan(specs=(), select_args=(0, 1, 2), keep=(0, 1, 2)):
    prefix = Prefix(gm=None, examples=[], args=(2,), keep=keep, specs=list(specs) if specs is not None else None)
    return BackwardPlan(select_args=select_args, tangent_args=(), specs=[], out_specs=[], sym=None, prefix=prefix)


def test_rows_before_loss():
    rec = _record()
    assert rows_before_loss(rec, _bplan(), reads_gradient=False), "proven prefix, head, rule reads no dL/dz"
    assert not rows_before_loss(rec, _bplan(), reads_gradient=True), "the rule reads dL/dz: the loss runs first"
    assert not rows_before_loss(rec, _bplan(specs=None), reads_gradient=False), "a loss backward not row-wise"
    assert not rows_before_loss(rec, _bplan(select_args=(0,)), reads_gradient=False), "a body graph"
    assert not rows_before_loss(rec, _bplan(select_args=(0, 3, 4)), reads_gradient=False), (
        "z is one of the loss backward's outputs: the rule cannot read it first")
    assert not rows_before_loss(_record(BackwardMode.DENSE_MASKED, Refusal(RefusalKind.UNPROVEN, WHY)), _bplan(),
                                reads_gradient=False), "a graph that runs dense-masked runs the loss on all rows"
    assert not rows_before_loss(rec, dataclasses.replace(_bplan(), prefix=None), reads_gradient=False)
