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
# order, so a few roundings along the chain may differ by an ulp: 1e-2 (observed ~1e-5).  Against
# float64 the bf16 forward itself is off by O(1e-2) relative: 5e-2 (observed ~8e-3).
BF16_VS_AUTOCAST, BF16_VS_F64 = 1e-2, 5e-2


@pytest.mark.heavy
def test_autocast_bf16_selection_in_float32_and_gradients():
    torch.manual_seed(0)
    model = make_deit()
    rule = KeepRule(torch.tensor([0, 3, 5]))
    cm = capskip_fx.compile(model, rule=rule, backend="aot_eager")
    x = torch.randn(N, 3, 32, 32)
    y = torch.randint(0, 10, (N,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cm(x)
        loss = F.cross_entropy(out, y)
    assert out.dtype == torch.bfloat16, f"expected out.dtype == torch.bfloat16, got {out.dtype!r} vs {torch.bfloat16!r}"  # the head really ran in bf16
    loss.backward()
    assert rule.seen == [(torch.float32,) * 3], (
        f"expected rule.seen == [(torch.float32,) * 3], got {rule.seen!r} vs {[(torch.float32,) * 3]!r}")  # the rule sees float32 (upcast in RuntimeState.select)
    st = capskip_fx.stats(cm)
    assert st.kept == 3, f"expected st.kept == 3, got {st.kept!r}"
    assert st.fallback is None, f"expected st.fallback is None, got {st.fallback!r}"
    assert cm.backend.records[0].backward == "selected rows", (
        f'expected cm.backend.records[0].backward == "selected rows", got {cm.backend.records[0].backward!r}')
    assert cm.backend.records[0].row_counts == {3}, (
        f"expected cm.backend.records[0].row_counts == {{3}}, got {cm.backend.records[0].row_counts!r}")
    grads = _grads(model)
    assert max_rel_err(grads, _autocast_reference(model, x, y, st.weight)) < BF16_VS_AUTOCAST, (
        'expected max_rel_err(grads, _autocast_reference(model, x, y, st.weight)) < B...')
    assert max_rel_err(grads, reference_grads(model, x, y, st.weight)) < BF16_VS_F64, (
        'expected max_rel_err(grads, reference_grads(model, x, y, st.weight)) < BF16_...')

    # CAPSkip itself under autocast: float32 Gram, bound within budget, same exactness
    cm.rule = CAPSkip(budget=0.5)
    x2 = torch.randn(N, 3, 32, 32)
    y2 = _half_own_labels(model, x2)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(cm(x2), y2).backward()
    st = capskip_fx.stats(cm)
    assert st.fallback is None, f"expected st.fallback is None, got {st.fallback!r}"
    assert st.bound <= 0.5, f"expected st.bound <= 0.5, got {st.bound!r}"
    assert max_rel_err(_grads(model), _autocast_reference(model, x2, y2, st.weight)) < BF16_VS_AUTOCAST, (
        'expected max_rel_err(_grads(model), _autocast_reference(model, x2, y2, st.we...')


@pytest.mark.inductor
def test_inductor_autocast_and_varying_batch_one_compile():
    """The Inductor path: bf16 autocast, batch sizes 8, 5, 8, 3 -> one graph, one backward variant."""
    torch.manual_seed(0)
    model = MLP(d=24, hidden=32, classes=6)
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend="inductor")
    for step, n in enumerate([8, 5, 8, 3]):
        x = torch.randn(n, 24)
        y = _half_own_labels(model, x, seed=step).clamp_max(5)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        assert st.n == n, f"expected st.n == n, got {st.n!r} vs {n!r}"
        assert st.fallback is None, f"expected st.fallback is None, got {st.fallback!r}"
        assert max_rel_err(_grads(model), _autocast_reference(model, x, y, st.weight)) < BF16_VS_AUTOCAST, (
            'expected max_rel_err(_grads(model), _autocast_reference(model, x, y, st.weig...')
    assert len(cm.backend.records) == 1, f"expected len(cm.backend.records) == 1, got {len(cm.backend.records)!r}"
    assert capskip_fx.stats(cm).variants == 1, (
        f"expected capskip_fx.stats(cm).variants == 1, got {capskip_fx.stats(cm).variants!r}")
    assert cm.backend.records[0].backward == "selected rows", (
        f'expected cm.backend.records[0].backward == "selected rows", got {cm.backend.records[0].backward!r}')


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
    assert steps == [0, 1, 2], f"expected steps == [0, 1, 2], got {steps!r}"  # one selection per micro-batch
    assert any((w == 0).any() for w in weights), 'expected any((w == 0).any() for w in weights)'  # something was skipped
    assert not torch.equal(weights[0], weights[1]), 'expected not torch.equal(weights[0], weights[1])'  # each micro-batch decided on its own rows
    total = {}
    for (x, y), w in zip(micro, weights):
        for k, r in reference_grads(model, x, y, w).items():
            total[k] = total.get(k, 0) + r / m
    assert max_rel_err(_grads(model), total) < 1e-10, (
        f"expected max_rel_err(_grads(model), total) < 1e-10, got {max_rel_err(_grads(model), total)!r}")


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
    assert (w1 == 0).any(), 'expected (w1 == 0).any()'
    assert torch.equal(w1, w2), 'expected torch.equal(w1, w2)'
    assert s2 == s1 + 1, f"expected s2 == s1 + 1, got {s2!r} vs {s1 + 1!r}"
    ref = reference_grads(model, x, y, w1)
    assert max_rel_err(first, ref) < 1e-10, f"expected max_rel_err(first, ref) < 1e-10, got {max_rel_err(first, ref)!r}"
    assert max_rel_err(_grads(model), {k: 2 * r for k, r in ref.items()}) < 1e-10, (
        'expected max_rel_err(_grads(model), {k: 2 * r for k, r in ref.items()}) < 1e-10')


def test_create_graph_first_order_exact_double_backward_clear_error():
    """Double backward is not supported by torch.compile's AOTAutograd (capskip or not): the first-order
    grads (create_graph=True) are the selected ones; differentiating them raises torch's clear error."""
    model, cm = _compiled_mlp(rule="forced", keep=lambda n: torch.tensor([1, 2, 6]))
    x, y = _batch(1)
    grads = torch.autograd.grad(F.cross_entropy(cm(x), y), list(model.parameters()), create_graph=True)
    named = dict(zip([k for k, _ in model.named_parameters()], grads))
    assert max_rel_err(named, reference_grads(model, x, y, capskip_fx.stats(cm).weight)) < 1e-10, (
        'expected max_rel_err(named, reference_grads(model, x, y, capskip_fx.stats(cm...')
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        sum(g.pow(2).sum() for g in grads).backward()


# ---------------------------------------------------------------- inference graphs

def test_no_grad_and_eval_forwards_equal_eager():
    torch.manual_seed(0)
    model = MLP(p_drop=0.5).double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x, y = _batch(2)
    cm.eval()
    assert not model.training, 'expected not model.training'
    with torch.no_grad():
        assert torch.allclose(cm(x), model(x), rtol=0, atol=1e-13), (
            'expected torch.allclose(cm(x), model(x), rtol=0, atol=1e-13)')
    out = cm(x)  # eval mode, grad enabled: a training-capable graph without dropout
    assert torch.allclose(out, model(x), rtol=0, atol=1e-13), (
        'expected torch.allclose(out, model(x), rtol=0, atol=1e-13)')
    assert out.requires_grad, f"expected out.requires_grad to be true, got {out.requires_grad!r}"
    cm.train()
    model.drop.p = 0.0  # dropout off so the train-mode graph can be compared too
    with torch.no_grad():
        assert torch.allclose(cm(x), model(x), rtol=0, atol=1e-13), (
            'expected torch.allclose(cm(x), model(x), rtol=0, atol=1e-13)')
    grads, w = _step(cm, model, x, y)  # training after inference still selects, exactly
    assert capskip_fx.stats(cm).kept == N // 2, (
        f"expected capskip_fx.stats(cm).kept == N // 2, got {capskip_fx.stats(cm).kept!r} vs {N // 2!r}")
    assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10, (
        'expected max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10')


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
        f"expected capskip_fx.stats(cm).fallback is None, got {capskip_fx.stats(cm).fallback!r}")
    assert all(r["reason"] is None for r in capskip_fx.report(cm)), (
        'expected all(r["reason"] is None for r in capskip_fx.report(cm))')


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
    assert "history" in cm.state_dict()["_capskip"]["rule"], 'expected "history" in cm.state_dict()["_capskip"]["rule"]'  # the rule's state is in the checkpoint

    resumed = fresh(123)  # a new process: other init, other seed, state from disk
    cm2 = capskip_fx.compile(resumed, rule="sb", beta=1.0, history=32, prime_epochs=0, backend="aot_eager", seed=99)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.05)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    cm2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    _, _, w_resumed = _sb_run(resumed, batches[S:], cm2, opt2)

    for a, b in zip(w_straight, w_first + w_resumed):
        assert torch.equal(a, b), 'expected torch.equal(a, b)'
    assert any(0 < int((w != 0).sum()) < N for w in w_resumed), (
        'expected any(0 < int((w != 0).sum()) < N for w in w_resumed)')  # SB really skipped rows after resuming
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
        assert st.n == n, f"expected st.n == n, got {st.n!r} vs {n!r}"
        assert w.shape == (n,), f"expected w.shape == (n,), got {w.shape!r} vs {(n,)!r}"
        if n == 1:
            assert st.kept == 1, f"expected st.kept == 1, got {st.kept!r}"
            assert "size 1" in st.fallback, f'expected "size 1" in st.fallback, got st.fallback = {st.fallback!r}'
        else:
            assert st.kept == len(keep), f"expected st.kept == len(keep), got {st.kept!r} vs {len(keep)!r}"
            assert st.fallback is None, f"expected st.fallback is None, got {st.fallback!r}"
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10, (
            'expected max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10')
    assert len(cm.backend.records) == 1, f"expected len(cm.backend.records) == 1, got {len(cm.backend.records)!r}"
    assert capskip_fx.stats(cm).variants == 1, (
        f"expected capskip_fx.stats(cm).variants == 1, got {capskip_fx.stats(cm).variants!r}")
    assert 2 in cm.backend.records[0].row_counts, (
        f"expected 2 in cm.backend.records[0].row_counts, got cm.backend.records[0].row_counts = {cm.backend.records[0].row_counts!r}")  # 1 or 2 kept rows ran gathered on min_rows = 2


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
            f"expected capskip_fx.stats(cm).step == before + (step > 0), got {capskip_fx.stats(cm).step!r} vs {before + (step > 0)!r}")  # the rule ran once per step
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10, (
            'expected max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10')
    assert skipped > 0, f"expected skipped > 0, got {skipped!r}"
    recs = cm.backend.records
    assert len(recs) == 2, f"expected len(recs) == 2, got {len(recs)!r}"
    head = [r for r in recs if r.head]
    assert len(head) == 1, f"expected len(head) == 1, got {len(head)!r}"
    assert head[0].backward == "selected rows", (
        f'expected head[0].backward == "selected rows", got {head[0].backward!r}')
    assert head[0].row_counts, f"expected head[0].row_counts to be true, got {head[0].row_counts!r}"
    for r in recs:
        if r is not head[0]:  # above the break: the head's rows (body graph), or dense with a reason
            assert getattr(r, "body", False) or (r.backward.startswith("dense") and r.reason), (
                'expected getattr(r, "body", False) or (r.backward.startswith("dense") and r....')


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
