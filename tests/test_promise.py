"""The promise at run time: each backward uses its own forward's selection, stats per step, and the
ordinary patterns that used to break it (issue 10), each a named regression test.
(The randomised version of the same promise: test_promise_fuzz.py.)"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.records import RefusalKind, counters
from capskip_fx.rules import Forced, Rule, Selection

from conftest import max_rel_err
from helpers.models import MLP, grads

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model


def _net(**opts):
    torch.manual_seed(0)
    model = MLP(d=6, hidden=8, classes=3).double()
    return model, capskip_fx.compile(model, backend="aot_eager", **opts)


def _x(n, seed):
    return torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


_grads = grads


def _ref(model, batches):
    """Eager float64 gradient of sum_f sum_i w_fi l_fi / N_f for [(x, y, w), ...]."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    sum((F.cross_entropy(ref(x), y, reduction="none") * w).sum() / x.shape[0] for x, y, w in batches).backward()
    return _grads(ref)


class ByLabel(Rule):
    """Keeps the rows whose label (from capskip_targets) is odd; records the labels it saw."""

    name = "by_label"

    def __init__(self):
        self.seen = []

    def select(self, view):
        self.seen.append(view.targets.clone())
        return Selection(weight=(view.targets % 2 == 1).to(view.delta.dtype))


@pytest.mark.parametrize("order", ["forward order", "reverse order"])
def test_two_forwards_one_backward_capskip_b1(order):
    """b=1: x1 all misclassified (kept), x2 all right (skipped).  Used to give CE1's gradient as zero."""
    model, cm = _net(rule="capskip", budget=1.0)
    x1, x2 = _x(8, 1), _x(8, 2)
    with torch.no_grad():
        y1 = (model(x1).argmax(1) + 1) % 3
        y2 = model(x2).argmax(1)
    pairs = [(x1, y1), (x2, y2)] if order == "forward order" else [(x2, y2), (x1, y1)]
    sum(F.cross_entropy(cm(x), y) for x, y in pairs).backward()
    ones, zeros = torch.ones(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    assert max_rel_err(_grads(model), _ref(model, [(x1, y1, ones), (x2, y2, zeros)])) < 1e-10, (
        f"{order}: x1 (all misclassified) must get its full gradient and x2 (all right) none; rel. error "
        f"{max_rel_err(_grads(model), _ref(model, [(x1, y1, ones), (x2, y2, zeros)]))!r}")
    st = capskip_fx.stats(cm)
    assert (st.n, st.kept) == (16, 8), f"two forwards of 8 rows, x1's 8 kept: (n, kept) should be (16, 8), got {(st.n, st.kept)!r}"
    assert len(st.forwards) == 2, f"the step's stats should list each of the two forwards, got {len(st.forwards)!r}"
    assert st.fallback is None, f"both forwards ran selected: no dense fallback expected, got {st.fallback!r}"
    assert sorted(f.kept for f in st.forwards) == [0, 8], (
        f"each forward keeps its own rows (x2's 0, x1's 8), got {sorted(f.kept for f in st.forwards)!r}")
    assert "forwards" in st.as_dict(), "the stats' dict form should carry the per-forward breakdown"


def test_each_forward_keeps_its_own_labels_in_any_backward_order():
    """capskip_targets are bound to the forward that got them: three forwards, backwards newest first,
    one retained and back-propagated again, a metrics forward never back-propagated in between."""
    rule = ByLabel()
    model, cm = _net(rule=rule)
    xs = [_x(n, s) for n, s in ((8, 1), (6, 2), (8, 3))]
    ys = [torch.arange(n) % 3 for n in (8, 6, 8)]
    outs = [cm(x, capskip_targets=y) for x, y in zip(xs, ys)]
    cm(_x(8, 9), capskip_targets=torch.full((8,), 7) % 3)  # metrics forward under grad: never backwarded
    losses = [F.cross_entropy(o, y) for o, y in zip(outs, ys)]
    losses[2].backward(retain_graph=True)
    losses[0].backward()
    losses[1].backward()
    w = [(y % 2 == 1).double() for y in ys]
    assert max_rel_err(_grads(model), _ref(model, list(zip(xs, ys, w)))) < 1e-10, (
        f"each forward must be weighted by its own labels whatever the backward order; rel. error "
        f"{max_rel_err(_grads(model), _ref(model, list(zip(xs, ys, w))))!r}")
    assert [t.tolist() for t in rule.seen] == [ys[2].tolist(), ys[0].tolist(), ys[1].tolist()], (
        f"the rule should see each forward's own labels in backward order (3rd, 1st, 2nd), never the metrics "
        f"forward's: saw {[t.tolist() for t in rule.seen]!r}, expected {[ys[2].tolist(), ys[0].tolist(), ys[1].tolist()]!r}")


def test_same_compiled_graph_twice_in_one_step_both_exact():
    keep = iter([torch.tensor([0, 3]), torch.tensor([1, 2, 5])])
    model, cm = _net(rule=Forced(keep=lambda n: next(keep)))
    x1, x2 = _x(6, 1), _x(6, 2)
    y1, y2 = torch.arange(6) % 3, (torch.arange(6) + 1) % 3
    (F.cross_entropy(cm(x1), y1) + F.cross_entropy(cm(x2), y2)).backward()
    st = capskip_fx.stats(cm)
    # the second forward's head backward runs first: it got the first keep set
    w2, w1 = (f.weight for f in st.forwards)
    assert w2.nonzero().flatten().tolist() == [0, 3], f"the second forward's backward runs first and gets the first keep set [0, 3], kept {w2.nonzero().flatten().tolist()}"
    assert w1.nonzero().flatten().tolist() == [1, 2, 5], f"the first forward gets the second keep set [1, 2, 5], kept {w1.nonzero().flatten().tolist()}"
    assert max_rel_err(_grads(model), _ref(model, [(x1, y1, w1), (x2, y2, w2)])) < 1e-10, (
        f"two uses of one graph in a step must each get their own rows' gradient; rel. error "
        f"{max_rel_err(_grads(model), _ref(model, [(x1, y1, w1), (x2, y2, w2)]))!r}")
    assert cm.backend.records[0].backward == "selected rows", (
        f"reusing the graph twice in a step should not make it dense: backward {cm.backend.records[0].backward!r}")
    assert cm.backend.records[0].reason is None, (
        f"the graph should have no dense reason, got {cm.backend.records[0].reason!r}")


def test_two_compiled_models_interleaved():
    (m1, c1), (m2, c2) = _net(rule="forced", keep=0.5), _net(rule="forced", keep=0.25)
    x, y = _x(8, 1), torch.arange(8) % 3
    o1, o2 = c1(x), c2(x)
    (F.cross_entropy(o2, y) + F.cross_entropy(o1, y)).backward()
    w1, w2 = capskip_fx.stats(c1).weight, capskip_fx.stats(c2).weight
    assert int(w1.sum()) == 4, f"model 1 (keep=0.5 of 8) should keep its own 4 rows, not model 2's: kept {int(w1.sum())!r}"
    assert int(w2.sum()) == 2, f"model 2 (keep=0.25 of 8) should keep its own 2 rows, not model 1's: kept {int(w2.sum())!r}"
    assert max_rel_err(_grads(m1), _ref(m1, [(x, y, w1)])) < 1e-10, (
        f"interleaved with model 2, model 1's gradients must match its own rows; rel. error {max_rel_err(_grads(m1), _ref(m1, [(x, y, w1)]))!r}")
    assert max_rel_err(_grads(m2), _ref(m2, [(x, y, w2)])) < 1e-10, (
        f"interleaved with model 1, model 2's gradients must match its own rows; rel. error {max_rel_err(_grads(m2), _ref(m2, [(x, y, w2)]))!r}")


class Rolled(nn.Module):
    """Rows mixed by torch.roll between two graphs: the body graph must not drop rows by the head's mask."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        h = torch.roll(h, 1, 0)  # eager, between the graphs
        torch._dynamo.graph_break()
        return self.head(self.b(h).relu())


def test_rows_mixed_between_graph_breaks_stay_exact():
    torch.manual_seed(0)
    model = Rolled().double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([1, 4]), backend="aot_eager")
    x, y = _x(8, 1), torch.arange(8) % 3
    F.cross_entropy(cm(x), y).backward()
    w = capskip_fx.stats(cm).weight
    assert max_rel_err(_grads(model), _ref(model, [(x, y, w)])) < 1e-10, (
        f"rows rolled between graph breaks must keep their gradient in the body graph; rel. error "
        f"{max_rel_err(_grads(model), _ref(model, [(x, y, w)]))!r}")
    body = next(r for r in cm.backend.records if r.body)
    assert body.row_counts == {2}, f"the body graph should gather the 2 rows that carry gradient after the roll, ran at {body.row_counts!r}"  # the rolled rows 2 and 5 carry the gradient: gathered, not masked away


@pytest.mark.parametrize("every", [None, 2])
def test_verify_waits_for_informative_steps_and_rechecks_every_k(every, monkeypatch):
    """Steps keeping 0 or all rows tell nothing (0 == 0): verify must not be used up by them.
    With verify_every=K it re-checks every K-th informative gathered step."""
    from capskip_fx.runtime import backward

    checked = []  # the informative step each verify ran at
    real = backward.plan_step

    def spy(record, rows, config, informative_steps, fused_loss):
        step = real(record, rows, config, informative_steps, fused_loss)
        if step.verify:
            checked.append(informative_steps + 1)
        return step

    monkeypatch.setattr(backward, "plan_step", spy)
    plan = [[], list(range(8)), [], [0, 2], [1], [3, 4], [5], [6, 7]]  # k = 0, N, 0, then informative
    it = iter(plan)
    model, cm = _net(rule=Forced(keep=lambda n: torch.tensor(next(it), dtype=torch.long)), verify_every=every,
                     gather_below=1.0)
    for step in range(len(plan)):
        x, y = _x(8, step), torch.arange(8) % 3
        model.zero_grad()
        F.cross_entropy(cm(x), y).backward()
        assert max_rel_err(_grads(model), _ref(model, [(x, y, capskip_fx.stats(cm).weight)])) < 1e-10, (
            f"step {step} (keep {plan[step]}): gradients differ from the reference; rel. error "
            f"{max_rel_err(_grads(model), _ref(model, [(x, y, capskip_fx.stats(cm).weight)]))!r}")
    assert checked == ([1] if every is None else [1, 2, 4]), (
        f"verify should skip the steps keeping 0 or all rows and check informative step 1 "
        f"{'once' if every is None else 'and every 2nd after (1, 2, 4)'}; checked at {checked!r}")
    rec = cm.backend.records[0]
    assert rec.verified, f"the gathered backward should be recorded as verified against the dense one, got {rec.verified!r}"
    assert rec.checks == len(checked), f"the record should count every verify run: {rec.checks!r} recorded, {len(checked)!r} ran"
    assert capskip_fx.report(cm)[0]["verified"], (
        f"report() should show the graph as verified, got {capskip_fx.report(cm)[0]['verified']!r}")


def test_compiled_autograd_is_refused_with_a_clear_message():
    import torch._dynamo.compiled_autograd as ca

    model, cm = _net(rule="forced", keep=0.5)
    x, y = _x(6, 1), torch.arange(6) % 3
    with pytest.raises(RuntimeError, match="does not support compiled autograd"):
        with ca._enable(lambda gm: gm):
            F.cross_entropy(cm(x), y).backward()


def test_on_coupling_error_raises_value_error_naming_the_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    cm = capskip_fx.compile(model, on_coupling="error", backend="aot_eager")
    with pytest.raises(ValueError, match=r"on_coupling='error'.*var_mean"):
        cm(_x(6, 1))
    cm_dense = capskip_fx.compile(copy.deepcopy(model), backend="aot_eager")  # the default falls back
    with pytest.warns(UserWarning, match="cross-example"):
        F.cross_entropy(cm_dense(_x(6, 1)), torch.arange(6) % 3).backward()


class WithSideInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x, pos, mask=None):  # x (N, T, 4), pos (T, 4), mask (N, T)
        h = self.fc(x + pos).relu()
        if mask is not None:
            h = h * mask[..., None]
        return self.head(h.mean(1))


@pytest.mark.parametrize("n", [6, 3])  # 3 == T: the positional tensor's dim 0 equals the batch
def test_non_batch_positional_and_batch_keyword_inputs(n):
    torch.manual_seed(0)
    model = WithSideInputs().double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([0, 2]), backend="aot_eager")
    g = torch.Generator().manual_seed(n)
    x, pos = torch.randn(n, 3, 4, dtype=torch.float64, generator=g), torch.randn(3, 4, dtype=torch.float64, generator=g)
    mask = (torch.rand(n, 3, generator=g) > 0.3).double()
    y = torch.arange(n) % 3
    F.cross_entropy(cm(x, pos, mask=mask), y).backward()
    w = capskip_fx.stats(cm).weight
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (F.cross_entropy(ref(x, pos, mask=mask), y, reduction="none") * w).sum().div(n).backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        f"batch {n}: a non-batch positional input and a batch keyword mask must give exact gradients; rel. error "
        f"{max_rel_err(_grads(model), _grads(ref))!r}")


class PaddedTokens(nn.Module):
    """HF's padding mask (masking_utils): ``mask[arange(N)[:, None], arange(T)[None, :]]``, saved by attention."""

    def __init__(self, shift=0):
        super().__init__()
        self.shift = shift
        self.qkv, self.head = nn.Linear(4, 12), nn.Linear(4, 3)

    def forward(self, x, mask):
        n, t = x.shape[:2]
        rows = (torch.arange(n)[:, None] + self.shift) % n if self.shift else torch.arange(n)[:, None]
        m = mask.bool()[rows, torch.arange(t)[None, :]]  # (N, T)
        q, k, v = self.qkv(x).chunk(3, -1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None, :].expand(n, t, t))
        return self.head(a.mean(1))


@pytest.mark.parametrize("shift", [0, 1])
def test_padding_mask_indexed_by_the_row_index(shift):
    """shift 0: row b reads its own mask row (selected rows, exact); shift 1: row b reads row b + 1's
    (not a row index: dense with the reason, exact)."""
    torch.manual_seed(0)
    model = PaddedTokens(shift).double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([1, 4]), backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, 4, dtype=torch.float64, generator=g)
    mask = (torch.arange(5) < 5 - torch.arange(6)[:, None] % 3).long()
    y = torch.arange(6) % 3
    if shift:
        with pytest.warns(UserWarning, match="dense backward"):
            F.cross_entropy(cm(x, mask), y).backward()
    else:
        F.cross_entropy(cm(x, mask), y).backward()
    st = capskip_fx.stats(cm)
    ref = copy.deepcopy(model)
    ref.zero_grad()
    w = st.weight if st.weight is not None else torch.ones(6, dtype=torch.float64)
    (F.cross_entropy(ref(x, mask), y, reduction="none") * w).sum().div(6).backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        f"shift {shift}: the padding mask indexed by rows must give exact gradients, selected or dense; rel. error "
        f"{max_rel_err(_grads(model), _grads(ref))!r}")
    if shift:
        assert st.kept == 6, f"a shifted row index mixes rows: the dense step keeps all 6 rows, kept {st.kept!r}"
        assert "remainder" in st.fallback, f"the dense fallback should say why (a remainder of the graph is refused), got {st.fallback!r}"
    else:
        assert (st.kept, st.rows, st.fallback) == (2, 2, None), (
            f"arange(N) is a row index: the 2 kept rows should run selected with no fallback; (kept, rows, fallback) "
            f"= {(st.kept, st.rows, st.fallback)!r}")


def test_counters_record_rewrites_and_refusals():
    counters().clear()
    model, cm = _net(rule="forced", keep=0.5)
    F.cross_entropy(cm(_x(6, 1)), torch.arange(6) % 3).backward()
    assert counters()["graphs"] == 1, f"one compiled MLP should count one graph, got {counters()['graphs']!r}"
    assert counters()["rewritten"] == 1, f"the MLP's graph should count as rewritten (selection inserted), got {counters()['rewritten']!r}"
    assert counters()["variants"] == 1, f"one step should compile one backward variant, got {counters()['variants']!r}"
    torch.manual_seed(0)
    bn = capskip_fx.compile(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double(),
                            backend="aot_eager")
    with pytest.warns(UserWarning):
        F.cross_entropy(bn(_x(6, 1)), torch.arange(6) % 3).backward()
    refused = {k: v for k, v in counters().items() if k.startswith("refused: ")}
    assert refused == {f"refused: {RefusalKind.CROSS_EXAMPLE.value}": 1}, f"BatchNorm in train mode should count one cross-example refusal and no other, got {refused}"
    rec = bn.backend.records[0]
    assert rec.refusal.kind is RefusalKind.CROSS_EXAMPLE, f"the refusal should be typed CROSS_EXAMPLE, got {rec.refusal!r}"
    assert rec.coupled, f"a cross-example refusal should mark the record as coupled; refusal {rec.refusal!r}"
    assert rec.reason == rec.refusal.detail, f"the record's reason should be the refusal's detail, got {rec.reason!r}"
    assert rec.reason.startswith("cross-example op"), f"the reason should say row mixing first, got {rec.reason!r}"


class InModelLoss(nn.Module):
    """Hugging Face style: given labels, the model returns (loss, logits); the loss is computed inside."""

    def __init__(self, extra=None):
        super().__init__()
        self.fc, self.head, self.extra = nn.Linear(6, 8), nn.Linear(8, 3), extra

    def forward(self, x, labels=None):
        h = F.gelu(self.fc(x))
        z = self.head(h)
        if labels is None:
            return z
        loss = F.cross_entropy(z, labels, ignore_index=-100)
        if self.extra == "aux":
            loss = loss + h.pow(2).mean()  # another batch reduction: couples the rows
        elif self.extra == "reads_h":
            loss = loss + (z * h[:, :3]).sum(1).mean()  # the loss reads an activation besides the logits
        return loss, z


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_in_graph_loss_selects_on_the_gradient_into_the_logits(backend):
    torch.manual_seed(0)
    model = InModelLoss().double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([0, 3, 5]), backend=backend)
    for step in range(2):
        x, y = _x(8, step), torch.arange(8) % 3
        y[6] = -100  # an ignored row: the loss divides by the 7 valid ones
        model.zero_grad()
        loss, z = cm(x, y)
        loss.backward()
    st = capskip_fx.stats(cm)
    assert (st.kept, st.rows) == (3, 3), f"{backend}: with an in-graph loss the 3 kept rows should run the backward, (kept, rows) = {(st.kept, st.rows)!r}"
    assert cm.backend.records[0].in_graph_loss, (
        f"the graph should be recorded as selecting on the in-graph loss's gradient, got {cm.backend.records[0].in_graph_loss!r}")
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (F.cross_entropy(ref(x), y, reduction="none", ignore_index=-100) * st.weight).sum().div(7).backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        f"{backend}: the in-graph loss (an ignored row, mean over 7) must give the kept rows' exact gradient; rel. error "
        f"{max_rel_err(_grads(model), _grads(ref))!r}")
    assert capskip_fx.report(cm)[0]["backward"] == "selected rows", (
        f"{backend}: the in-graph loss graph should run a selected backward, got {capskip_fx.report(cm)[0]['backward']!r}")


@pytest.mark.parametrize("extra", ["aux", "reads_h"])
def test_in_graph_loss_that_reaches_other_activations_is_refused(extra):
    torch.manual_seed(0)
    model = InModelLoss(extra).double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x, y = _x(8, 1), torch.arange(8) % 3
    with pytest.warns(UserWarning, match="the in-graph loss reads"):
        loss, _ = cm(x, y)
        loss.backward()
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref(x, y)[0].backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        f"a refused in-graph loss ({extra}) must fall back to the exact dense gradient; rel. error "
        f"{max_rel_err(_grads(model), _grads(ref))!r}")


@pytest.mark.heavy
def test_many_models_sharing_one_forward_each_get_their_graph():
    """Ten nn.Sequential models (one forward code object) under recompile_limit=2: each compiled model has
    its own Dynamo entries, so none silently runs eager."""
    import capskip_fx.api as api

    if not api._ISOLATED:
        pytest.skip("this torch has no isolate_recompiles")
    with torch._dynamo.config.patch(recompile_limit=2):
        for i in range(10):
            torch.manual_seed(i)
            cm = capskip_fx.compile(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)).double(),
                                    rule="forced", keep=0.5, backend="aot_eager")
            F.cross_entropy(cm(_x(6, i)), torch.arange(6) % 3).backward()
            assert capskip_fx.report(cm)[0]["backward"] == "selected rows", (
                f"model {i} of 10 sharing one forward should get its own graph (selected, not eager), got "
                f"{capskip_fx.report(cm)[0]['backward']!r}")
            assert capskip_fx.stats(cm).kept == 3, (
                f"model {i}: keep=0.5 of 6 should keep 3 rows, kept {capskip_fx.stats(cm).kept!r}")
