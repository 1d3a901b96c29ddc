"""An in-graph loss's backward (the prefix up to dL/dz) on the kept rows only (passes/prefix_rows.py).

For a rule that reads no dL/dz (forced, random at a fixed fraction), the runtime chooses the rows first and
runs the loss's backward on them, when the prefix is proven row-wise; otherwise the prefix runs on every row.
Either way the parameter gradients are the dense-masked ones: the float64 gradient of the loss through the
logits, with the logits' gradient scaled by the rule's weights.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import capskip_fx
from capskip_fx.rules import Forced, Rule
from capskip_fx.rules.base import HeadView
from capskip_fx.rules.registry import RULES

from conftest import max_rel_err
from helpers.examples import derandomize, examples
from helpers.models import grads

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model


@dataclass(frozen=True)
class Loss:
    """One in-model loss over logits ``z`` (N, C) or, ``tokens``, (N, T, C)."""

    tokens: bool = False
    reduction: str = "mean"
    smoothing: float = 0.0
    temperature: float = 1.0
    # divide a summed loss by the batch size: at the kept rows the backward would divide by their count, so
    # the batch size used as a value keeps the loss's backward on every row (placement's "uses the batch size")
    per_batch: bool = False
    mixing: str = ""  # "mean": z - z.mean(0); "roll": z.roll(1, 0): the loss's backward mixes rows
    squared: bool = False  # the summed squares of the tokens' cross-entropies: row-wise, not a cross-entropy

    def __call__(self, z, y):
        if self.squared:
            per = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="none")
            return (per ** 2).sum()
        if self.mixing == "mean":
            z = z - z.mean(0, keepdim=True)
        elif self.mixing == "roll":
            z = z + 0.5 * z.roll(1, 0)
        z = z / self.temperature
        loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100,
                               reduction="sum" if self.per_batch else self.reduction, label_smoothing=self.smoothing)
        return loss / y.shape[0] if self.per_batch else loss


class InModelLoss(nn.Module):
    def __init__(self, loss: Loss, d: int = 6, hidden: int = 8, classes: int = 5):
        super().__init__()
        self.loss = loss
        self.fc, self.head = nn.Linear(d, hidden), nn.Linear(hidden, classes)

    def forward(self, x, labels):
        z = self.head(torch.tanh(self.fc(x)))
        return self.loss(z, labels), z


def _batch(n: int, loss: Loss, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = 4 if loss.tokens else None
    x = torch.randn(n, *([t] if t else []), 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (n, *([t] if t else [])), generator=g)
    y.view(-1)[::3] = -100  # ignored labels: the mean divides by the others
    return x, y


def _reference(model, x, y, w) -> dict:
    """Float64 eager: the loss's gradient into the logits, each row scaled by its weight, back-propagated."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss, z = ref(x, y)
    (gz,) = torch.autograd.grad(loss, z, retain_graph=True)
    z.backward(gz * w.view(-1, *[1] * (z.dim() - 1)))
    return grads(ref)


def _step(loss: Loss, keep, n: int = 8, backend: str = "aot_eager", seed: int = 0, **opts):
    torch._dynamo.reset()  # one forward code for every loss: sizes seen before would make T dynamic too
    torch.manual_seed(seed)
    model = InModelLoss(loss).double()
    cm = capskip_fx.compile(model, rule=Forced(keep=keep), backend=backend, **opts)
    x, y = _batch(n, loss, seed)
    out, _ = cm(x, y)
    out.backward()
    st = capskip_fx.stats(cm)
    head = next(r for r in cm.backend.records if r.head)
    return model, cm, st, head, x, y


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("tokens", [False, True])
def test_the_loss_backward_runs_on_the_kept_rows(backend, tokens):
    loss = Loss(tokens=tokens)
    model, cm, st, head, x, y = _step(loss, lambda n: torch.tensor([1, 4, 6]), backend=backend)
    assert (st.kept, st.rows) == (3, 3), f"{backend}: 3 kept rows should run the backward, got {st}"
    assert head.in_graph_loss, f"{backend}: the loss should be found inside the graph: {capskip_fx.report(cm)}"
    assert head.prefix_rows == 1, f"{backend}: the loss's backward should have run on the kept rows once: {head.prefix_rows}"
    assert capskip_fx.report(cm)[0]["loss_backward"].startswith("row-wise"), (
        f"{backend}: the report should say the loss's backward is row-wise: {capskip_fx.report(cm)[0]}")
    assert head.verified, f"{backend}: the first gathered step should be checked against the dense-masked one"
    err = max_rel_err(grads(model), _reference(model, x, y, st.weight.double()))
    assert err < 1e-10, f"{backend}: gradients off the float64 reference by {err}"


def test_a_rule_reading_dl_dz_runs_an_underived_loss_backward_on_every_row():
    """A loss whose dL/dz the library does not derive (not a cross-entropy; tests/test_loss_grad.py has those
    it derives): a rule that reads dL/dz runs the loss's backward on every row first."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    loss = Loss(squared=True)
    model = InModelLoss(loss).double()
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend="aot_eager")
    x, y = _batch(8, loss, 0)
    cm(x, y)[0].backward()
    head = next(r for r in cm.backend.records if r.head)
    assert head.prefix_rows == 0, f"capskip reads dL/dz: the loss's backward must run on every row first: {head.prefix_rows}"
    assert head.loss_rows == 8, f"the loss's backward should have run on all 8 rows: {head.loss_rows}"
    how = capskip_fx.report(cm)[0]["loss_backward"]
    assert how.startswith("row-wise: kept rows when the rule reads no dL/dz") and "dL/dz not derived: " in how, how
    err = max_rel_err(grads(model), _reference(model, x, y, capskip_fx.stats(cm).weight.double()))
    assert err < 1e-10, f"capskip with an in-graph loss: gradients off the float64 reference by {err}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_rule_set_after_compiling_runs_the_loss_backward_on_the_kept_rows(backend):
    """Compiled under CAPSkip with a loss whose dL/dz is not derived (the prefix's fused gather is not built),
    then a forced rule: its kept rows are gathered eagerly for the loss's backward, exactly."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    loss = Loss(tokens=True, squared=True)
    model = InModelLoss(loss).double()
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend=backend)
    x, y = _batch(8, loss, 0)
    cm(x, y)[0].backward()
    cm.rule = Forced(keep=lambda n: torch.tensor([0, 5]))
    model.zero_grad(set_to_none=True)
    cm(x, y)[0].backward()
    head = next(r for r in cm.backend.records if r.head)
    st = capskip_fx.stats(cm)
    assert (st.kept, head.prefix_rows) == (2, 1), f"{backend}: the forced step's loss backward on its 2 rows: {st}, {head.prefix_rows}"
    err = max_rel_err(grads(model), _reference(model, x, y, st.weight.double()))
    assert err < 1e-10, f"{backend}: a rule set after compiling: gradients off the float64 reference by {err}"


@pytest.mark.parametrize("mixing", ["mean", "roll", "per_batch"])
def test_a_loss_backward_that_mixes_rows_runs_on_every_row(mixing):
    loss = Loss(per_batch=True) if mixing == "per_batch" else Loss(mixing=mixing)
    model, cm, st, head, x, y = _step(loss, 0.5)
    assert st.rows == 4, f"the rest of the backward should still run on the 4 kept rows: {st}"
    assert head.prefix_rows == 0, f"{mixing}: a loss backward that mixes rows must not run on the kept rows only"
    how = capskip_fx.report(cm)[0]["loss_backward"]
    assert how.startswith("all rows: the in-graph loss's backward is not row-wise"), f"{mixing}: the reason: {how!r}"
    err = max_rel_err(grads(model), _reference(model, x, y, st.weight.double()))
    assert err < 1e-10, f"{mixing}: gradients off the float64 reference by {err}"


@pytest.mark.heavy
@settings(max_examples=examples(30), deadline=None, derandomize=derandomize(),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(loss=st.builds(Loss, tokens=st.booleans(), reduction=st.sampled_from(["mean", "sum"]),
                      smoothing=st.sampled_from([0.0, 0.1]), temperature=st.sampled_from([1.0, 2.0]),
                      per_batch=st.booleans(), mixing=st.sampled_from(["", "", "mean", "roll"])),
       keep=st.lists(st.booleans(), min_size=8, max_size=8), seed=st.integers(0, 3))
def test_property_the_loss_backward_on_kept_rows_is_exact(loss, keep, seed):
    """Any in-model loss, any kept set: exact; on the kept rows exactly when the loss's backward is row-wise
    and does not read the batch size as a value."""
    idx = torch.tensor([i for i, k in enumerate(keep) if k] or [0])
    model, cm, st, head, x, y = _step(loss, lambda n: idx, seed=seed)
    err = max_rel_err(grads(model), _reference(model, x, y, st.weight.double()))
    assert err < 1e-10, f"{loss}, kept {idx.tolist()}: gradients off the float64 reference by {err}"
    gathered = st.rows < 8  # idx of 8 rows (or above gather_below) runs every row, prefix included
    assert head.prefix_rows == (1 if gathered and not loss.mixing and not loss.per_batch else 0), (
        f"{loss}, kept {idx.tolist()} (rows {st.rows}): the loss's backward ran on the kept rows "
        f"{head.prefix_rows} times; report {capskip_fx.report(cm)[0]['loss_backward']!r}")


NO_GRADIENT = sorted(n for n, make in RULES.items() if isinstance(make(), Rule) and not make().reads_gradient)


def test_the_rules_that_read_no_gradient():
    assert NO_GRADIENT == ["dense", "forced", "random"], f"registered rules declaring reads_gradient=False: {NO_GRADIENT}"


@pytest.mark.parametrize("name", NO_GRADIENT)
def test_a_rule_that_reads_no_gradient_never_touches_it(name):
    """``reads_gradient = False`` is a promise the runtime acts on (it passes ``delta=None``): hold every
    registered rule that makes it to it."""
    rule = RULES[name]()
    g = torch.Generator().manual_seed(0)
    for z in (torch.randn(8, 5, generator=g), torch.randn(8, 4, 5, generator=g)):
        sel = rule.select(HeadView(delta=None, h=torch.randn(*z.shape[:-1], 3, generator=g), z=z))
        assert sel.weight.shape == (8,), f"{name}: a weight per row, got {tuple(sel.weight.shape)}"
