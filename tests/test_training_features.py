"""Works where real training runs: autocast, accumulation, retain/create_graph, inference graphs,
checkpoint/resume, varying batch sizes, graph breaks.

Gradients are compared with a dense eager reference of ``sum_i w_i l_i / N`` (float64 unless the
feature itself is about precision), ``w = capskip_fx.stats(cm).weight``.
"""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.rules import CAPSkip, Forced, Rule, Selection

from conftest import make_deit, max_rel_err, reference_grads
from helpers import models

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model

N = 8


def MLP(d=12, hidden=16, classes=5, p_drop=0.0):
    return models.MLP(d, hidden, classes, p_drop)


class KeepRule(Rule):
    """Keeps fixed rows and records the dtypes the rule saw."""

    name = "keep_spy"
    needs_labels = False

    def __init__(self, rows):
        self.rows = rows
        self.seen = []

    def select(self, view):
        self.seen.append((view.delta.dtype, view.h.dtype, view.z.dtype))
        w = view.delta.new_zeros(view.n)
        w[self.rows] = 1
        return Selection(weight=w)


_grads = models.grads


def _half_own_labels(model, x, seed=0):
    """Every other row labelled with the model's own prediction: CAPSkip has candidates and must keep."""
    with torch.no_grad():
        pred = model(x).argmax(1)
    y = torch.randint(0, 5, (x.shape[0],), generator=torch.Generator().manual_seed(seed))
    y[::2] = pred[::2]
    return y


def _step(cm, model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    w = capskip_fx.stats(cm).weight
    return _grads(model), (torch.ones(x.shape[0]) if w is None else w.clone())  # None: a dense step


# ---------------------------------------------------------------- autocast

def _autocast_reference(model, x, y, w):
    """The same dense-masked loss, eager, under the same autocast."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = F.cross_entropy(ref(x), y, reduction="none")
    (losses * w.float()).sum().div(x.shape[0]).backward()
    return {k: p.grad.double() for k, p in ref.named_parameters()}


# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3).  Against the autocast eager reference
# both sides round the same bf16 products; the gathered backward only sums the kept rows in another
# order: 1e-4 (observed 1e-5 on DeiT, 0 on the Inductor MLP).  The compiled DeiT graph itself rounds
# some inputs otherwise than eager autocast by up to ~1 bf16 ulp, with every row run too: the CAPSkip
# step's input is one (observed 6e-4): 5e-3.  Against float64 the bf16 forward itself is off by O(1e-2)
# relative: 5e-2 (observed ~8e-3).
BF16_VS_AUTOCAST, BF16_COMPILED_VS_EAGER, BF16_VS_F64 = 1e-4, 5e-3, 5e-2


@pytest.mark.heavy
def test_autocast_bf16_selection_in_float32_and_gradients():
    torch.manual_seed(0)
    model = make_deit()
    rule = KeepRule(torch.tensor([0, 3, 5]))
    # verify off: the tolerance below, not verify's own 1e-3, decides whether the gathered backward is exact
    cm = capskip_fx.compile(model, rule=rule, backend="aot_eager", verify=False)
    x = torch.randn(N, 3, 32, 32)
    y = torch.randint(0, 10, (N,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cm(x)
        loss = F.cross_entropy(out, y)
    assert out.dtype == torch.bfloat16, (
        f"under bf16 autocast the logits should be bfloat16, got {out.dtype}")  # the head really ran in bf16
    loss.backward()
    assert rule.seen == [(torch.float32,) * 3], (
        "the rule should run once and see delta, h and z upcast to float32 under bf16 autocast, "
        f"saw dtypes {rule.seen}")  # the rule sees float32 (upcast in RuntimeState.select)
    st = capskip_fx.stats(cm)
    assert st.kept == 3, f"the rule kept rows 0, 3 and 5, yet stats say kept {st.kept}"
    assert st.fallback is None, (
        f"a bf16 autocast step should run the rule's selection, yet it fell back: {st.fallback!r}")
    assert cm.backend.records[0].backward == "selected rows", (
        "under autocast the head graph's backward should run on the selected rows, "
        f"report says {cm.backend.records[0].backward!r}")
    assert cm.backend.records[0].row_counts == {3}, (
        "the gathered backward should run on exactly the 3 kept rows, "
        f"gathered row counts seen: {cm.backend.records[0].row_counts}")
    grads = _grads(model)
    assert max_rel_err(grads, _autocast_reference(model, x, y, st.weight)) < BF16_VS_AUTOCAST, (
        "bf16 selected-row gradients differ from the eager autocast reference of the same weighted loss by more "
        "than summing the kept rows in another order explains: max rel err "
        f"{max_rel_err(grads, _autocast_reference(model, x, y, st.weight)):.2e} > {BF16_VS_AUTOCAST}")
    assert max_rel_err(grads, reference_grads(model, x, y, st.weight)) < BF16_VS_F64, (
        "bf16 selected-row gradients are further from the float64 reference than the bf16 forward explains: "
        f"max rel err {max_rel_err(grads, reference_grads(model, x, y, st.weight)):.2e} > {BF16_VS_F64}")

    # CAPSkip itself under autocast: float32 Gram, bound within budget, same exactness
    cm.rule = CAPSkip(budget=0.5)
    x2 = torch.randn(N, 3, 32, 32)
    y2 = _half_own_labels(model, x2)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(cm(x2), y2).backward()
    st = capskip_fx.stats(cm)
    assert st.fallback is None, (
        f"CAPSkip under bf16 autocast (float32 Gram) should select rows, yet it fell back: {st.fallback!r}")
    assert st.bound <= 0.5, (
        f"CAPSkip's bound ||S_k|| / ||G|| must stay within the budget 0.5 under autocast, got {st.bound}")
    assert max_rel_err(_grads(model), _autocast_reference(model, x2, y2, st.weight)) < BF16_COMPILED_VS_EAGER, (
        "CAPSkip's bf16 gradients differ from the eager autocast reference of its weighted loss: max rel err "
        f"{max_rel_err(_grads(model), _autocast_reference(model, x2, y2, st.weight)):.2e} > {BF16_COMPILED_VS_EAGER}")


@pytest.mark.inductor
def test_inductor_autocast_and_varying_batch_one_compile():
    """The Inductor path: bf16 autocast, batch sizes 8, 5, 8, 3 -> one graph, one backward variant."""
    torch.manual_seed(0)
    model = MLP(d=24, hidden=32, classes=6)
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend="inductor", verify=False)
    for step, n in enumerate([8, 5, 8, 3]):
        x = torch.randn(n, 24)
        y = _half_own_labels(model, x, seed=step).clamp_max(5)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        assert st.n == n, f"stats should describe this step's batch of {n} rows, got n={st.n}"
        assert st.fallback is None, (
            f"the Inductor path under bf16 autocast should select rows at batch size {n}, yet it fell back: "
            f"{st.fallback!r}")
        assert max_rel_err(_grads(model), _autocast_reference(model, x, y, st.weight)) < BF16_VS_AUTOCAST, (
            f"Inductor bf16 gradients at batch size {n} differ from the eager autocast reference: max rel err "
            f"{max_rel_err(_grads(model), _autocast_reference(model, x, y, st.weight)):.2e} > {BF16_VS_AUTOCAST}")
    assert len(cm.backend.records) == 1, (
        f"batch sizes 8, 5, 8, 3 should share one dynamic graph, yet {len(cm.backend.records)} graphs were compiled")
    assert capskip_fx.stats(cm).variants == 1, (
        "batch sizes 8, 5, 8, 3 should share one compiled backward variant, "
        f"got {capskip_fx.stats(cm).variants}")
    assert cm.backend.records[0].backward == "selected rows", (
        "the Inductor head graph's backward should run on the selected rows, "
        f"report says {cm.backend.records[0].backward!r}")


# ---------------------------------------------------------------- accumulation

def test_gradient_accumulation_each_micro_batch_selects_its_rows():
    torch.manual_seed(0)
    model = MLP().double()
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend="aot_eager")
    micro = []
    for s, n in enumerate([8, 8, 6]):
        x = torch.randn(n, 12, dtype=torch.float64)
        micro.append((x, _half_own_labels(model, x, seed=s)))
    m = len(micro)
    model.zero_grad(set_to_none=True)
    weights, steps = [], []
    for x, y in micro:
        (F.cross_entropy(cm(x), y) / m).backward()  # grads accumulate in .grad
        weights.append(capskip_fx.stats(cm).weight.clone())
        steps.append(capskip_fx.stats(cm).step)
    assert steps == [0, 1, 2], (
        f"each micro-batch should run the rule once, got steps {steps}")  # one selection per micro-batch
    assert any((w == 0).any() for w in weights), (
        f"CAPSkip at budget 0.5 should skip a row in some micro-batch, weights: {weights}")  # something was skipped
    assert not torch.equal(weights[0], weights[1]), (
        "each micro-batch should select on its own rows, yet the first two got the same weights "
        f"{weights[0]}")  # each micro-batch decided on its own rows
    total = {}
    for (x, y), w in zip(micro, weights):
        for k, r in reference_grads(model, x, y, w).items():
            total[k] = total.get(k, 0) + r / m
    assert max_rel_err(_grads(model), total) < 1e-10, (
        f"gradients accumulated over {m} micro-batches differ from the sum of their float64 references (each "
        f"with its own rows): max rel err {max_rel_err(_grads(model), total):.2e}")


# ---------------------------------------------------------------- retain_graph / create_graph

def _compiled_mlp(**opts):
    torch.manual_seed(0)
    model = MLP().double()
    return model, capskip_fx.compile(model, backend="aot_eager", **opts)


def _batch(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, dtype=torch.float64, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_retain_graph_second_backward():
    """Plain torch.compile refuses retain_graph (AOTAutograd donates saved buffers to the backward);
    capskip's backwards don't take donated buffers (their inputs are gathered copies), so it works."""
    model, cm = _compiled_mlp(rule="capskip", budget=0.5)
    x = _batch()[0]
    y = _half_own_labels(model, x)
    plain = torch.compile(copy.deepcopy(model), backend="aot_eager")
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(RuntimeError, match="donated_buffer=False"):
        F.cross_entropy(plain(x), y).backward(retain_graph=True)
    loss = F.cross_entropy(cm(x), y)
    loss.backward(retain_graph=True)
    first, w1, s1 = _grads(model), capskip_fx.stats(cm).weight.clone(), capskip_fx.stats(cm).step
    loss.backward()  # the rule runs again on the same (h, z, dL/dz): same rows
    w2, s2 = capskip_fx.stats(cm).weight, capskip_fx.stats(cm).step
    assert (w1 == 0).any(), f"CAPSkip at budget 0.5 should skip a row on the first backward, weights {w1}"
    assert torch.equal(w1, w2), (
        "the retained second backward sees the same (h, z, dL/dz), so the rule should keep the same rows: "
        f"{w1} then {w2}")
    assert s2 == s1 + 1, f"the second backward should run the rule once more (step {s1 + 1}), stats say step {s2}"
    ref = reference_grads(model, x, y, w1)
    assert max_rel_err(first, ref) < 1e-10, (
        "the first backward's gradients differ from the float64 reference for its rows: max rel err "
        f"{max_rel_err(first, ref):.2e}")
    assert max_rel_err(_grads(model), {k: 2 * r for k, r in ref.items()}) < 1e-10, (
        "two backwards through the retained graph should accumulate twice the reference gradients: max rel err "
        f"{max_rel_err(_grads(model), {k: 2 * r for k, r in ref.items()}):.2e}")


def test_create_graph_first_order_exact_double_backward_clear_error():
    """Double backward is not supported by torch.compile's AOTAutograd (capskip or not): the first-order
    grads (create_graph=True) are the selected ones; differentiating them raises torch's clear error."""
    model, cm = _compiled_mlp(rule="forced", keep=lambda n: torch.tensor([1, 2, 6]))
    x, y = _batch(1)
    grads = torch.autograd.grad(F.cross_entropy(cm(x), y), list(model.parameters()), create_graph=True)
    named = dict(zip([k for k, _ in model.named_parameters()], grads))
    assert max_rel_err(named, reference_grads(model, x, y, capskip_fx.stats(cm).weight)) < 1e-10, (
        "first-order gradients taken with create_graph=True differ from the float64 reference for the forced rows: "
        f"max rel err {max_rel_err(named, reference_grads(model, x, y, capskip_fx.stats(cm).weight)):.2e}")
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        sum(g.pow(2).sum() for g in grads).backward()


# ---------------------------------------------------------------- inference graphs

def test_no_grad_and_eval_forwards_equal_eager():
    torch.manual_seed(0)
    model = MLP(p_drop=0.5).double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x, y = _batch(2)
    cm.eval()
    assert not model.training, "cm.eval() should put the wrapped model in eval mode"
    with torch.no_grad():
        assert torch.allclose(cm(x), model(x), rtol=0, atol=1e-13), (
            "the compiled model's no_grad eval forward (dropout off) should equal the eager model's")
    out = cm(x)  # eval mode, grad enabled: a training-capable graph without dropout
    assert torch.allclose(out, model(x), rtol=0, atol=1e-13), (
        "an eval-mode forward with grad enabled (a training-capable graph without dropout) should equal the "
        f"eager one, max abs diff {(out - model(x)).abs().max().item():.2e}")
    assert out.requires_grad, "an eval-mode forward with grad enabled should return logits that require grad"
    cm.train()
    model.drop.p = 0.0  # dropout off so the train-mode graph can be compared too
    with torch.no_grad():
        assert torch.allclose(cm(x), model(x), rtol=0, atol=1e-13), (
            "after cm.train() with dropout at 0, the compiled no_grad forward should equal the eager model's")
    grads, w = _step(cm, model, x, y)  # training after inference still selects, exactly
    assert capskip_fx.stats(cm).kept == N // 2, (
        f"a training step after inference forwards should still run the forced rule, keeping {N // 2} of {N} "
        f"rows; kept {capskip_fx.stats(cm).kept}")
    assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10, (
        "a training step after inference forwards should still give the exact gradient of its rows: max rel err "
        f"{max_rel_err(grads, reference_grads(model, x, y, w)):.2e}")


def test_inference_graph_leaves_no_refusal_behind():
    model, cm = _compiled_mlp(rule="forced", keep=0.5)
    x, y = _batch(3)
    _step(cm, model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "dense backward" warning for a graph that has no backward
        with torch.no_grad():
            cm(x)
    _step(cm, model, x, y)
    assert capskip_fx.stats(cm).fallback is None, (
        "a no_grad forward between training steps should leave no fallback on the next step, got "
        f"{capskip_fx.stats(cm).fallback!r}")
    assert all(r["reason"] is None for r in capskip_fx.report(cm)), (
        "a no_grad graph has no backward and should leave no refusal reason in the report: "
        f"{[r['reason'] for r in capskip_fx.report(cm)]}")


# ---------------------------------------------------------------- checkpoint / resume

def _sb_run(model, batches, cm=None, opt=None, seed=5):
    cm = cm or capskip_fx.compile(model, rule="sb", beta=1.0, history=32, prime_epochs=0, backend="aot_eager", seed=seed)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    weights = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
        opt.step()
        weights.append(capskip_fx.stats(cm).weight.clone())
    return cm, opt, weights


def test_checkpoint_resume_is_bit_identical_for_sb():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(N, 12, generator=g), torch.randint(0, 5, (N,), generator=g)) for _ in range(7)]
    S = 3

    def fresh(seed):
        torch.manual_seed(seed)
        return MLP()

    straight = fresh(0)
    _, _, w_straight = _sb_run(straight, batches)

    first = fresh(0)
    cm, opt, w_first = _sb_run(first, batches[:S])
    buf = io.BytesIO()
    torch.save({"model": cm.state_dict(), "opt": opt.state_dict()}, buf)
    assert "history" in cm.state_dict()["_capskip"]["rule"], (
        "the checkpoint should hold Selective-Backprop's loss history (the rule's state), rule keys: "
        f"{sorted(cm.state_dict()['_capskip']['rule'])}")  # the rule's state is in the checkpoint

    resumed = fresh(123)  # a new process: other init, other seed, state from disk
    cm2 = capskip_fx.compile(resumed, rule="sb", beta=1.0, history=32, prime_epochs=0, backend="aot_eager", seed=99)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.05)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    cm2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    _, _, w_resumed = _sb_run(resumed, batches[S:], cm2, opt2)

    for a, b in zip(w_straight, w_first + w_resumed):
        assert torch.equal(a, b), (
            f"after resuming from the checkpoint a step kept other rows than the uninterrupted run: {b} vs {a}")
    assert any(0 < int((w != 0).sum()) < N for w in w_resumed), (
        "Selective-Backprop should really skip rows after resuming (some step keeps some but not all rows), "
        f"kept per step: {[int((w != 0).sum()) for w in w_resumed]}")  # SB really skipped rows after resuming
    for (k, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), k


# ---------------------------------------------------------------- varying batch sizes

@pytest.mark.heavy
def test_varying_batch_sizes_no_recompile_storm():
    """Observed bound: 1 graph and 1 compiled backward variant for sizes 8, 8, 5, 8, 3, 1, 6
    (the batch of 1 runs the eager model instead of a static-batch recompile)."""
    torch.manual_seed(0)
    model = make_deit().double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    for step, n in enumerate([8, 8, 5, 8, 3, 1, 6]):
        keep = torch.randperm(n, generator=gen)[: max(1, n // 3)]
        cm.rule = Forced(keep=lambda _, keep=keep: keep)
        x = torch.randn(n, 3, 32, 32, dtype=torch.float64, generator=gen)
        y = torch.randint(0, 10, (n,), generator=gen)
        grads, w = _step(cm, model, x, y)
        st = capskip_fx.stats(cm)
        assert st.n == n, f"stats should describe this step's batch of {n} rows, got n={st.n}"
        assert w.shape == (n,), (
            f"the rule's weight should have one entry per row of the batch of {n}, got shape {tuple(w.shape)}")
        if n == 1:
            assert st.kept == 1, f"a batch of 1 runs the eager model and keeps its one row, stats say kept {st.kept}"
            assert st.fallback is None and "size 1" in st.note, (
                f"a batch of 1 runs dense by design with a note naming size 1, got note={st.note!r}, "
                f"fallback={st.fallback!r}")
        else:
            assert st.kept == len(keep), f"the forced rule kept {len(keep)} of {n} rows, stats say kept {st.kept}"
            assert st.fallback is None, (
                f"a batch of {n} should run the forced selection, yet it fell back: {st.fallback!r}")
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10, (
            f"gradients at batch size {n} differ from the float64 reference for the kept rows: max rel err "
            f"{max_rel_err(grads, reference_grads(model, x, y, w)):.2e}")
    assert len(cm.backend.records) == 1, (
        "batch sizes 8, 8, 5, 8, 3, 1, 6 should share one dynamic graph (no recompile storm), yet "
        f"{len(cm.backend.records)} graphs were compiled")
    assert capskip_fx.stats(cm).variants == 1, (
        "batch sizes 8, 8, 5, 8, 3, 1, 6 should share one compiled backward variant, "
        f"got {capskip_fx.stats(cm).variants}")
    assert 2 in cm.backend.records[0].row_counts, (
        "1 or 2 kept rows should run gathered on the minimum of 2 rows, gathered row counts seen: "
        f"{cm.backend.records[0].row_counts}")  # 1 or 2 kept rows ran gathered on min_rows = 2


# ---------------------------------------------------------------- graph breaks

class TokenBreak(nn.Module):
    """(N, T, D) tokens; the break sits between two token layers (the upper graph outputs 3-D)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        t = F.gelu(self.fc1(x))
        if self.how == "graph_break":
            torch._dynamo.graph_break()
        else:
            print("", end="")  # print() is a graph break too
        return self.head(F.gelu(self.fc2(t)).mean(1))


class FeatureBreak(nn.Module):
    """The break sits right after a Linear: the upper graph's output is (N, D) from addmm."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.fc1(x)
        torch._dynamo.graph_break()
        return self.head(F.gelu(h))


def _check_graph_break(model, make_x):
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend="aot_eager")
    skipped = 0
    for step in range(3):
        x = make_x(step)
        y = _half_own_labels(model, x, seed=step)
        before = capskip_fx.stats(cm).step
        grads, w = _step(cm, model, x, y)
        skipped += int((w == 0).sum())
        assert capskip_fx.stats(cm).step == before + (step > 0), (
            "the rule should run once per training step, not once per graph of the break: stats say step "
            f"{capskip_fx.stats(cm).step}, expected {before + (step > 0)}")  # the rule ran once per step
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10, (
            f"gradients across the graph break differ from the float64 reference at step {step}: max rel err "
            f"{max_rel_err(grads, reference_grads(model, x, y, w)):.2e}")
    assert skipped > 0, (
        "CAPSkip at budget 0.5 should skip some row over 3 steps across the graph break, it skipped none")
    recs = cm.backend.records
    assert len(recs) == 2, f"the graph break should split the model into 2 graphs, got {len(recs)}"
    head = [r for r in recs if r.head]
    assert len(head) == 1, f"exactly one graph (the one producing the logits) should be the head, got {len(head)}"
    assert head[0].backward == "selected rows", (
        f"the head graph's backward should run on the selected rows, report says {head[0].backward!r}")
    assert head[0].row_counts, (
        "the head graph's selected backward should record the row counts it gathered, none recorded")
    for r in recs:
        if r is not head[0]:  # above the break: the head's rows (body graph), or dense with a reason
            assert getattr(r, "body", False) or (r.backward.startswith("dense") and r.reason), (
                "the graph above the break should run on the head's rows (a body graph) or be dense with a reason, "
                f"got backward {r.backward!r}, reason {r.reason!r}")


@pytest.mark.parametrize("how", ["graph_break", "print"])
def test_graph_break_head_graph_selects_and_gradients_are_exact(how):
    torch.manual_seed(0)
    model = TokenBreak(how).double()
    _check_graph_break(model, lambda s: torch.randn(N, 5, 4, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(s)))


def test_graph_break_after_a_linear_is_not_a_second_head():
    torch.manual_seed(0)
    model = FeatureBreak().double()
    _check_graph_break(model, lambda s: torch.randn(N, 12, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(s)))
