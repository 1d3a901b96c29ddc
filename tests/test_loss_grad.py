"""An in-graph cross-entropy's dL/dz derived from the forward (passes/loss_grad.py, runtime/loss_grad.py).

For a rule that reads dL/dz (CAPSkip, SB, UB, ...), a recognised cross-entropy's dL/dz is computed from the
logits, the labels and the reduction's constants on every row; the rule chooses from it, and the loss's own
backward (the prefix) then runs on the kept rows only.  Checked here: the derived dL/dz equals the prefix's in
float64 for each supported variant; the rows chosen are today's (prefix on every row first); the gradients are
the float64 dense reference's for those rows; the prefix ran on the kept rows (``record.loss_rows``); and a
loss the matcher does not recognise keeps the old path and says why.
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
from capskip_fx.passes import pipeline
from capskip_fx.passes.loss_grad import NotDerivable
from capskip_fx.runtime import backward as runtime_backward
from capskip_fx.runtime.executors import LossBackward

from conftest import max_rel_err
from helpers.examples import derandomize, examples
from helpers.models import grads

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model


@dataclass(frozen=True)
class CE:
    """One in-model cross-entropy over a tiny causal LM's (N, T, V) logits."""

    shift: bool = False  # Hugging Face's ForCausalLMLoss: labels padded with ignore_index, shifted by one
    upcast: bool = False  # logits.double() before the loss (Hugging Face's logits.float() for low precision)
    smoothing: float = 0.0
    weighted: bool = False  # class weights (a buffer)
    reduction: str = "mean"  # "mean", "sum", or "items": summed, divided by a scalar input (num_items_in_batch)
    temperature: float = 1.0
    squared: bool = False  # summed squares of the tokens' cross-entropies: row-wise, not a cross-entropy

    def __call__(self, z, y, weight, items):
        if self.squared:
            per = F.cross_entropy(z.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none")
            return (per ** 2).sum()
        z = z / self.temperature if self.temperature != 1.0 else z
        if self.upcast:
            z = z.double()
        if self.shift:
            y = F.pad(y, (0, 1), value=-100)[..., 1:].contiguous()
        loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), weight=weight, ignore_index=-100,
                               label_smoothing=self.smoothing, reduction="mean" if self.reduction == "mean" else "sum")
        return loss / items if self.reduction == "items" else loss


class TinyLM(nn.Module):
    """Embedding -> tanh Linear -> Linear over the vocabulary, the loss inside (labels=)."""

    def __init__(self, loss: CE, vocab: int = 7, d: int = 6):
        super().__init__()
        self.loss = loss
        self.emb, self.body, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)
        self.register_buffer("class_weight", torch.rand(vocab, generator=torch.Generator().manual_seed(1)) + 0.5
                             if loss.weighted else None)

    def forward(self, ids, labels, items=None):
        z = self.head(torch.tanh(self.body(self.emb(ids))))
        return self.loss(z, labels, self.class_weight, items), z


def _batch(n: int, t: int, vocab: int, seed: int, ignored=((1, 2), (3, None))):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    labels = torch.randint(0, vocab, (n, t), generator=g)
    for row, start in ignored:  # padding, and a sequence with no counted token
        if row < n:
            labels[row, (start or 0):] = -100
    return ids, labels


def _items(loss: CE, labels):
    return torch.tensor(float((labels != -100).sum()) + 3.0, dtype=torch.float64) if loss.reduction == "items" else None


class _Spy:
    """The prefix's dL/dz where it ran on every row, and the derived dL/dz, as the runtime computed them."""

    def __init__(self, monkeypatch):
        self.prefix, self.derived = [], []
        all_rows, derived = LossBackward.all_rows, runtime_backward.derived_grad

        def spy_all_rows(loss_backward, full):
            out = all_rows(loss_backward, full)
            self.prefix.append(out[len(loss_backward.prefix.keep)].detach().clone())  # its first output: dL/dz
            return out

        def spy_derived(recipe, z, inputs):
            g, targets = derived(recipe, z, inputs)
            self.derived.append((g.clone(), targets.clone()))
            return g, targets

        monkeypatch.setattr(LossBackward, "all_rows", spy_all_rows)
        monkeypatch.setattr(runtime_backward, "derived_grad", spy_derived)


def _step(loss: CE, rule="capskip", n=8, t=5, vocab=7, seed=0, dtype=torch.float64, **opts):
    torch._dynamo.reset()  # one forward code for every loss: sizes seen before would make T dynamic too
    torch.manual_seed(seed)
    model = TinyLM(loss, vocab).to(dtype)
    ref = copy.deepcopy(model).double()
    if not opts:
        opts = {"budget": 0.5} if rule == "capskip" else {"keep": 0.5}
    opts.setdefault("loss_grad", "derived")  # the opt-in these tests are about (the default: test_the_default_...)
    cm = capskip_fx.compile(model, rule=rule, backend="aot_eager", **opts)
    ids, labels = _batch(n, t, vocab, seed)
    items = _items(loss, labels)
    cm(ids, labels, items)[0].backward()
    head = next(r for r in cm.backend.records if r.head)
    return model, ref, cm, capskip_fx.stats(cm), head, (ids, labels, items)


def _how(cm) -> str:
    """report()'s ``loss_backward`` of the head graph."""
    return next(r for r in capskip_fx.report(cm) if r["role"] == "head")["loss_backward"]


def _reference(ref, inputs, w) -> dict:
    """Float64 eager: the loss's gradient into the logits, each sequence scaled by its weight, back-propagated."""
    ref.zero_grad(set_to_none=True)
    loss, z = ref(*inputs)
    (gz,) = torch.autograd.grad(loss, z, retain_graph=True)
    z.backward(gz * w.view(-1, 1, 1))
    return grads(ref)


VARIANTS = {
    "mean, ignore_index": CE(),
    "label smoothing": CE(smoothing=0.2),
    "class weights": CE(weighted=True),
    "class weights and smoothing": CE(weighted=True, smoothing=0.1),
    "sum": CE(reduction="sum"),
    "sum / num_items": CE(reduction="items"),
    "causal shift (Hugging Face)": CE(shift=True),
    "causal shift / num_items": CE(shift=True, reduction="items"),
    "temperature": CE(temperature=2.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_derived_dl_dz_is_the_prefix_s(name, monkeypatch):
    """float64: the dL/dz the rule reads equals the one the loss's own backward computes (on every row: the
    first step verifies, which runs the prefix on all rows as its reference)."""
    spy = _Spy(monkeypatch)
    loss = VARIANTS[name]
    model, ref, cm, st_, head, inputs = _step(loss)
    how = _how(cm)
    assert "derived from the forward" in how, f"{name}: the loss should be recognised: {how}"
    assert len(spy.derived) == 1 and len(spy.prefix) == 1, (
        f"{name}: one derived dL/dz and one prefix on all rows (verify's reference): {len(spy.derived)}, {len(spy.prefix)}")
    (g, targets), prefix = spy.derived[0], spy.prefix[0].view(spy.derived[0][0].shape)
    assert g.dtype == torch.float64
    err = (g - prefix).abs().max().item()
    assert err <= 1e-13 * prefix.abs().max().item(), f"{name}: derived dL/dz off the prefix's by {err}"
    # the labels the loss reads: ignored tokens (and the position the shift drops) are -1
    _, labels, _ = inputs
    want = F.pad(labels, (0, 1), value=-100)[:, 1:] if loss.shift else labels
    assert torch.equal(targets, want.masked_fill(want == -100, -1)), f"{name}: targets {targets} vs labels {want}"
    assert head.loss_rows == st_.rows, f"{name}: the loss's backward should run on the {st_.rows} rows: {head.loss_rows}"
    err = max_rel_err(grads(model), _reference(ref, inputs, st_.weight.double()))
    assert err < 1e-10, f"{name}: gradients off the float64 reference by {err}"


def test_an_upcast_loss_derives_dl_dz_in_the_models_precision(monkeypatch):
    """A float32 model whose loss upcasts the logits (Hugging Face's ``logits.float()`` for bf16): the derived
    dL/dz (float32, the selection dtype) matches the float64 prefix's to float32 rounding."""
    spy = _Spy(monkeypatch)
    _, _, cm, _, _, _ = _step(CE(shift=True, upcast=True), dtype=torch.float32)
    (g, _), prefix = spy.derived[0], spy.prefix[0]
    assert g.dtype == torch.float32 and prefix.dtype == torch.float32, (g.dtype, prefix.dtype)
    err = (g - prefix.view(g.shape)).abs().max().item()
    assert err <= 1e-6 * prefix.abs().max().item(), f"upcast loss: derived dL/dz off the prefix's by {err}"
    assert "derived from the forward" in _how(cm)


@pytest.mark.heavy
@settings(max_examples=examples(6), deadline=None, derandomize=derandomize(),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(loss=st.builds(CE, shift=st.booleans(), smoothing=st.sampled_from([0.0, 0.15]), weighted=st.booleans(),
                      reduction=st.sampled_from(["mean", "sum", "items"])),
       n=st.integers(5, 9), t=st.integers(2, 4), vocab=st.integers(2, 6), seed=st.integers(0, 100))
def test_property_the_derived_dl_dz_is_the_prefix_s(loss, n, t, vocab, seed):
    """Any drawn variant, shape and labels (a batch size apart from the sequence length: Dynamo would give
    equal sizes one symbol)."""
    with pytest.MonkeyPatch.context() as mp:
        spy = _Spy(mp)
        model, ref, cm, st_, head, inputs = _step(loss, n=n, t=t, vocab=vocab, seed=seed)
    if not spy.derived:  # the loss's backward not proven row-wise at this shape (the partitioner recomputed a
        # batch reduction in it): the old path, whatever the rule, and the report says so
        assert _how(cm).startswith("all rows: ") and head.loss_rows == n, (loss, n, t, vocab, _how(cm))
    else:
        g, prefix = spy.derived[0][0], spy.prefix[0].view(spy.derived[0][0].shape)
        err = (g - prefix).abs().max().item()
        assert err <= 1e-13 * max(prefix.abs().max().item(), 1e-30), f"{loss} n={n} t={t} V={vocab}: off by {err}"
    err = max_rel_err(grads(model), _reference(ref, inputs, st_.weight.double()))
    assert err < 1e-10, f"{loss}: gradients off the float64 reference by {err}"


RULE_OPTS = {"capskip": {"budget": 0.5}, "sb": {"keep": 0.5, "prime_epochs": 0}, "ub": {"b": 0.5}}


def _no_derivation(graph, head, loss):
    raise NotDerivable("switched off by the test")


@pytest.mark.parametrize("rule", list(RULE_OPTS))
def test_rules_that_read_dl_dz_keep_todays_rows_and_back_only_the_kept_sequences(rule, monkeypatch):
    """The tiny causal LM (Hugging Face's shifted labels, loss in the model), verify off: the rule keeps the
    rows it kept when the loss's backward ran on every row first, the gradients are the float64 dense
    reference's for those rows, and the loss's backward ran on the kept sequences only."""
    loss, opts = CE(shift=True), dict(RULE_OPTS[rule], verify=False)
    model, ref, cm, new, head, inputs = _step(loss, rule=rule, n=16, t=6, **opts)
    assert new.mode == "selected" and 0 < new.kept < 16, f"{rule}: the step should select sequences: {new}"
    assert (head.derived_grads, head.prefix_rows, head.loss_rows) == (1, 1, new.rows), (
        f"{rule}: dL/dz derived {head.derived_grads}x, loss backward on kept rows {head.prefix_rows}x, last on "
        f"{head.loss_rows} rows (kept rows {new.rows})")
    err = max_rel_err(grads(model), _reference(ref, inputs, new.weight.double()))
    assert err < 1e-10, f"{rule}: gradients off the float64 reference by {err}"
    with monkeypatch.context() as mp:  # today's path: the loss's backward on every row, the rule on its dL/dz
        mp.setattr(pipeline, "match_cross_entropy", _no_derivation)
        *_, old, old_head, _ = _step(loss, rule=rule, n=16, t=6, **opts)
    assert (old_head.derived_grads, old_head.prefix_rows, old_head.loss_rows) == (0, 0, 16), (
        f"{rule} without derivation: the loss's backward should run on all 16 rows: {old_head.loss_rows}")
    assert torch.equal(old.weight, new.weight), f"{rule}: kept {new.weight} with derived dL/dz, {old.weight} before"


def test_an_unrecognised_loss_runs_its_backward_on_every_row_and_says_why():
    loss = CE(squared=True)
    model, ref, cm, st_, head, inputs = _step(loss)
    how = _how(cm)
    assert "dL/dz not derived: " in how and "not part of a cross-entropy" in how, how
    assert (head.derived_grads, head.prefix_rows, head.loss_rows) == (0, 0, 8), (
        f"the loss's backward should run on every row: {head.loss_rows}")
    assert st_.mode == "selected" and st_.rows < 8, f"the rest of the backward still runs on the kept rows: {st_}"
    err = max_rel_err(grads(model), _reference(ref, inputs, st_.weight.double()))
    assert err < 1e-10, f"unrecognised loss: gradients off the float64 reference by {err}"


@pytest.mark.parametrize("rule", ["capskip", "sb"])
def test_the_default_runs_the_loss_backward_on_every_row_for_a_rule_reading_dl_dz(rule):
    """``loss_grad="prefix"`` (the default, measured faster: docs/benchmarks.md): a rule that reads dL/dz reads
    the loss backward's own, run on every row; the same rows as the derived path, exact."""
    loss = CE(shift=True)
    opts = dict(RULE_OPTS[rule], verify=False, loss_grad="prefix")
    model, ref, cm, st_, head, inputs = _step(loss, rule=rule, n=16, t=6, **opts)
    how = _how(cm)
    assert "loss_grad='prefix'" in how, f"{rule}: report should say why dL/dz is not derived: {how}"
    assert (head.derived_grads, head.prefix_rows, head.loss_rows) == (0, 0, 16), (
        f"{rule}: the loss's backward should run on all 16 rows by default: {head.loss_rows}")
    *_, derived, _, _ = _step(loss, rule=rule, n=16, t=6, **dict(opts, loss_grad="derived"))
    assert torch.equal(st_.weight, derived.weight), f"{rule}: the default keeps {st_.weight}, derived {derived.weight}"
    assert st_.mode == "selected", st_
    err = max_rel_err(grads(model), _reference(ref, inputs, st_.weight.double()))
    assert err < 1e-10, f"{rule} (default loss_grad): gradients off the float64 reference by {err}"


def test_an_unknown_loss_grad_setting_is_refused_with_the_values():
    from capskip_fx.config import CapskipConfig

    with pytest.raises(ValueError, match="loss_grad must be 'prefix' or 'derived'"):
        CapskipConfig(loss_grad="fast")
