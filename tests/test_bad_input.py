"""Bad input, one test each: what capskip does when the model, loss, labels or options are not what it
expects.  Never a silently wrong selection: an error naming the option, or a dense step with the reason
in ``stats().fallback`` / ``report()`` (and one warning).

(BatchNorm in train mode, the static-budget/rule-name basics and a head-less model's reason are in
test_pass.py; here: the rest of the matrix.)
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.rules import CAPSkip, make_rule

from conftest import max_rel_err, reference_grads
from helpers.models import MLP, grads
from helpers.torch_features import needs_batch_marking

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model

N, C = 8, 5


def Net():
    return MLP(d=12, hidden=16, classes=C)


def _net(**opts):
    torch.manual_seed(0)
    model = Net().double()
    return model, capskip_fx.compile(model, backend="aot_eager", **opts)


def _x(n=N, seed=0):
    return torch.randn(n, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


_grads = grads


def _dense_grads(model, loss_fn):
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_fn(ref).backward()
    return _grads(ref)


def _recorded_warnings(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(m.message) for m in w if "capskip_fx" in str(m.message)]


# ---------------------------------------------------------------- options

@pytest.mark.parametrize("b", [-1e-9, 1.5, float("nan"), float("inf")])
def test_budget_outside_unit_interval_raises_at_compile_everywhere(b):
    with pytest.raises(ValueError, match=r"budget must be a number in \[0, 1\]"):
        capskip_fx.compile(Net(), budget=b)  # nothing ran yet: compile time
    with pytest.raises(ValueError, match=r"budget must be a number in \[0, 1\]"):
        capskip_fx.compile(Net(), rule="random", match="capskip", budget=b)  # the matched rule's budget
    with pytest.raises(ValueError, match=r"budget must be in \[0, 1\]"):
        CAPSkip(budget=b)
    opt = torch.compile(Net(), backend="capskip", options={"budget": b, "backend": "aot_eager"})
    with pytest.raises(Exception, match=r"budget must be a number in \[0, 1\]"):
        opt(torch.randn(4, 12))  # the string backend builds its rule when Dynamo hands it the graph


@pytest.mark.parametrize("option,bad", [("buckets", True), ("buckets", 0), ("buckets", 2.0), ("granule", True),
                                        ("granule", 0)])
def test_count_options_take_positive_ints_only(option, bad):
    """``buckets=True`` would read as one bucket (every step dense-masked, silently): refused, as 0 and 2.0."""
    with pytest.raises(ValueError, match=f"{option} must be a positive int"):
        capskip_fx.compile(Net(), **{option: bad})


def test_unknown_rule_name_lists_valid_names_everywhere():
    valid = "valid names: " + ", ".join(sorted(capskip_fx.RULES))
    with pytest.raises(ValueError, match=valid):
        capskip_fx.compile(Net(), rule="capskp")
    with pytest.raises(ValueError, match=valid):
        make_rule("SB")
    with pytest.raises(ValueError, match=valid):
        capskip_fx.compile(Net(), rule="random", match="capskp")
    _, cm = _net(rule="dense")
    with pytest.raises(ValueError, match=valid):
        cm.rule = "nope"  # swapping the rule later checks the name too


def test_model_on_meta_device_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cpu/cuda/xpu.*meta"):
        capskip_fx.compile(Net().to("meta"))


# ---------------------------------------------------------------- non-finite steps

def test_nan_logits_skip_selection_run_dense_warn_once_and_spare_the_rule_state():
    model, cm = _net(rule="sb", beta=1.0, history=64, prime_epochs=0)
    x, y = _x(), torch.randint(0, C, (N,))
    F.cross_entropy(cm(x), y).backward()  # a finite step: SB records 8 losses
    hist = cm.rule.history.clone()
    x_bad = _x(seed=1)
    x_bad[2] = float("nan")  # one bad row: NaN logits there, NaN loss, NaN dL/dz everywhere

    def two_bad_steps():
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(cm(x_bad), y).backward()

    msgs = _recorded_warnings(two_bad_steps)
    assert sum("non-finite" in m for m in msgs) == 1, (
        "a non-finite step should warn once per model, not on every bad step; "
        f'got {sum("non-finite" in m for m in msgs)!r} non-finite warnings over two bad steps')
    st = capskip_fx.stats(cm)
    assert "non-finite" in st.fallback, (
        f"a NaN step should run dense and say why in stats().fallback, got {st.fallback!r}")
    assert st.kept == N, f"a dense fallback step keeps every row, got kept={st.kept!r} of {N!r}"
    assert bool((st.weight == 1).all()), f"a dense fallback step weights every row 1, got {st.weight!r}"
    assert torch.allclose(cm.rule.history, hist, equal_nan=True), (
        "the NaN step must not reach SB's loss history (it would poison later selections)")
    dense = _dense_grads(model, lambda m: F.cross_entropy(m(x_bad), y))
    for k, g in _grads(model).items():  # exactly the dense step's (NaN) gradient, as eager gives
        assert torch.equal(torch.isnan(g), torch.isnan(dense[k])), (
            f"the fallback gradient of {k} should be NaN exactly where eager's dense gradient is")
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()  # the next finite step selects again
    st = capskip_fx.stats(cm)
    assert st.fallback is None, (
        f"the next finite step should select again, not stay dense, got fallback={st.fallback!r}")
    assert max_rel_err(_grads(model), reference_grads(model, x, y, st.weight)) < 1e-10, (
        "after the NaN step the selected gradient should again match the float64 weighted reference")


def test_inf_loss_scale_skips_selection():
    model, cm = _net(rule="capskip", budget=1.0)
    x = _x()
    with torch.no_grad():
        y = model(x).argmax(1)  # all correct at b = 1: a finite step would skip every row
    model.zero_grad(set_to_none=True)
    (F.cross_entropy(cm(x), y) * math.inf).backward()
    st = capskip_fx.stats(cm)
    assert "non-finite" in st.fallback, (
        f"an inf loss scale should make the step dense with a non-finite reason, got {st.fallback!r}")
    assert st.kept == N, (
        f"an inf-scaled step must not skip rows (every row is correct at b=1), got kept={st.kept!r} of {N!r}")


# ---------------------------------------------------------------- labels

@pytest.mark.parametrize("bad", [C, 17, -2])
def test_explicit_label_out_of_range_is_a_value_error_naming_the_option(bad):
    model, cm = _net(rule="capskip", budget=0.5)
    y = torch.randint(0, C, (N,))
    t = y.clone()
    t[3] = bad
    with pytest.raises(ValueError, match=rf"capskip_targets must be class labels in \[-1, {C}\)"):
        F.cross_entropy(cm(_x(), capskip_targets=t), y).backward()
    t[3] = -1  # -1 = unknown label: allowed, that row is kept
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(_x(), capskip_targets=t), y).backward()
    assert capskip_fx.stats(cm).weight[3] == 1, (
        f"a row with unknown label -1 must be kept, got weight {capskip_fx.stats(cm).weight[3]!r}")


@pytest.mark.parametrize("t", [torch.zeros(N), torch.zeros(N, 1, dtype=torch.long), [0] * N],
                         ids=["float", "2-D", "list"])
def test_explicit_labels_of_wrong_type_fail_at_the_forward(t):
    _, cm = _net(rule="capskip")
    with pytest.raises(ValueError, match="capskip_targets must be a 1-D integer tensor"):
        cm(_x(), capskip_targets=t)


def test_mse_on_logits_without_targets_runs_dense_and_names_the_option():
    """MSE's dL/dz rows don't sum to 0, so "the most negative entry" is no label: CAPSkip would
    decide on garbage.  Decision: warn once (naming capskip_targets=), run the step dense."""
    model, cm = _net(rule="capskip", budget=0.5)
    x, y = _x(), torch.randint(0, C, (N,))
    onehot = F.one_hot(y, C).double()

    def mse_step():
        model.zero_grad(set_to_none=True)
        F.mse_loss(cm(x), onehot).backward()

    msgs = _recorded_warnings(lambda: (mse_step(), mse_step()))
    assert sum("capskip_targets=" in m for m in msgs) == 1, (
        "MSE on logits without labels should warn once, naming capskip_targets=; "
        f'got {sum("capskip_targets=" in m for m in msgs)!r} such warnings over two steps')
    st = capskip_fx.stats(cm)
    assert "capskip_targets=" in st.fallback, (
        f"the dense step's reason should name the capskip_targets= option, got {st.fallback!r}")
    assert st.kept == N, f"without labels the MSE step must run dense (keep every row), got kept={st.kept!r} of {N!r}"
    dense = _dense_grads(model, lambda m: F.mse_loss(m(x), onehot))
    assert max_rel_err(_grads(model), dense) < 1e-10, (
        f"the unlabelled MSE step should give eager's dense gradient, rel err {max_rel_err(_grads(model), dense)!r}")
    # with the labels given, the selection runs and is exact for sum_i w_i mse_i / N
    with torch.no_grad():
        y = model(x).argmax(1)
    onehot = F.one_hot(y, C).double()
    model.zero_grad(set_to_none=True)
    F.mse_loss(cm(x, capskip_targets=y), onehot).backward()
    st = capskip_fx.stats(cm)
    assert st.fallback is None, (
        f"with capskip_targets= given, MSE should select rows, not fall back, got {st.fallback!r}")
    assert st.kept < N, f"with correct labels and budget 0.5 some rows should be skipped, got kept={st.kept!r} of {N!r}"
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    per_row = F.mse_loss(ref(x), onehot, reduction="none").mean(1)
    (per_row * st.weight).sum().div(N).backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        "the selected MSE gradient should equal sum_i w_i mse_i / N in float64, "
        f"rel err {max_rel_err(_grads(model), _grads(ref))!r}")


@pytest.mark.parametrize("loss", ["label_smoothing", "soft_targets", "class_weights"])
def test_softmax_losses_are_not_mistaken_for_mse(loss):
    model, cm = _net(rule="capskip", budget=0.5)
    x = _x()
    with torch.no_grad():
        y = model(x).argmax(1)
    z = cm(x)
    if loss == "label_smoothing":
        out = F.cross_entropy(z, y, label_smoothing=0.1)
    elif loss == "soft_targets":
        out = F.cross_entropy(z, 0.8 * F.one_hot(y, C).double() + 0.04)
    else:
        out = F.cross_entropy(z, y, weight=torch.linspace(0.5, 2, C, dtype=torch.float64))
    assert not _recorded_warnings(out.backward), f"a softmax loss ({loss}) must not be taken for MSE and warned about"
    st = capskip_fx.stats(cm)
    assert st.fallback is None, f"a softmax loss ({loss}) should select rows, not fall back, got {st.fallback!r}"
    assert st.kept < N, f"with correct labels some rows should be skipped under {loss}, got kept={st.kept!r} of {N!r}"


# ---------------------------------------------------------------- batches

@needs_batch_marking
@pytest.mark.parametrize("how", ["marked", "dynamic", "first", "in_place", "in_place_unmarked"])
def test_batch_of_one_under_the_string_backend_is_dense_by_design_without_a_warning(how):
    """A ragged last batch of 1 under ``backend="capskip"``: Dynamo specialises a graph for it, whose dense step
    is by design (a note, no fallback, no warning), not a "no classifier head" or "static batch" refusal; one
    step, counted once, whether the batches were marked, compiled with ``dynamic=True`` (no marks: not taken
    for a static first batch), the batch of 1 comes first, or the model was compiled in place (its head graph
    specialised to one row: a head found, not a missing one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 5))
    opts = {"rule": "forced", "keep": 0.5, "backend": "aot_eager"}
    if how.startswith("in_place"):
        model.compile(backend="capskip", options=opts)
        cm = model
    else:
        cm = torch.compile(model, backend="capskip", options=opts, dynamic=True if how == "dynamic" else None)
    if how not in ("dynamic", "in_place_unmarked"):
        capskip_fx.mark_compiled_batches(cm)
    sizes = (1, N, N) if how == "first" else (N, N, 1, N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, n in enumerate(sizes):
            F.cross_entropy(cm(torch.randn(n, 20)), torch.randint(0, 5, (n,))).backward()
            st = capskip_fx.stats(cm)
            if n == 1:
                assert st.mode == "dense" and st.fallback is None and "size 1" in (st.note or ""), st
            else:
                assert st.mode == "selected", st
    said = [str(w.message) for w in caught if "capskip_fx" in str(w.message)]
    assert not said, f"a batch of 1 is by design: no warning, got {said}"
    run = capskip_fx.summary(cm)
    assert run.steps == len(sizes) and not run.fallbacks and sum(run.dense_by_design.values()) == 1, run


class _AuxOfOneFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        z = self.head(F.gelu(self.a(x)))
        return z.pow(2).mean().reshape(1), z  # an auxiliary loss of shape (1,) before the logits


def test_an_output_of_one_row_before_the_logits_is_not_a_batch_of_one():
    """A head graph whose first output has dim 0 of 1 (an auxiliary loss of shape (1,)) over a batch of 8:
    the batch is the logits' (logits_index=1), so the head selects; not refused as a batch of size 1."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_AuxOfOneFirst(), rule="forced", keep=0.5, backend="aot_eager", logits_index=1)
    for step in range(2):
        aux, z = cm(torch.randn(8, 6))
        (F.cross_entropy(z, torch.randint(0, 3, (8,))) + 0.01 * aux.sum()).backward()
        st = capskip_fx.stats(cm)
        assert st.mode == "selected" and st.kept == 4 and st.note is None, f"step {step}: {st}"


def test_batch_of_one_is_dense_with_reason_and_no_recompile():
    model, cm = _net(rule="capskip", budget=1.0)
    x8 = _x()
    with torch.no_grad():
        y8 = model(x8).argmax(1)
    F.cross_entropy(cm(x8), y8).backward()
    assert capskip_fx.stats(cm).kept < N, (
        f"the full all-correct batch at b=1 should skip rows, got kept={capskip_fx.stats(cm).kept!r} of {N!r}")
    x1, y1 = _x(1, seed=3), torch.tensor([2])
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x1), y1).backward()
    st = capskip_fx.stats(cm)
    assert st.n == 1, f"stats should describe the one-row batch, got n={st.n!r}"
    assert st.kept == 1, f"a batch of one runs dense, keeping its row, got kept={st.kept!r}"
    assert st.mode == "dense" and st.fallback is None, (
        f"a batch of one runs dense by design, not as a fallback: mode={st.mode!r}, fallback={st.fallback!r}")
    assert "size 1" in st.note, f"the step's note should say the batch has size 1, got {st.note!r}"
    run = str(capskip_fx.summary(cm))
    assert "fell back" not in run and "1 step ran dense by design (no fallback): batch of size 1" in run, run
    assert max_rel_err(_grads(model), _dense_grads(model, lambda m: F.cross_entropy(m(x1), y1))) < 1e-12, (
        "the batch-of-one step should give eager's dense gradient")
    assert len(cm.backend.records) == 1, (
        f"a batch of one must not compile a static-batch graph, got {len(cm.backend.records)!r} records")
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x8), y8).backward()  # and the next full batch selects as before
    assert capskip_fx.stats(cm).fallback is None, (
        f"the next full batch should select again, got fallback={capskip_fx.stats(cm).fallback!r}")
    assert capskip_fx.stats(cm).kept < N, (
        f"the next full batch should skip rows as before, got kept={capskip_fx.stats(cm).kept!r} of {N!r}")


@pytest.mark.parametrize("case", ["all_wrong", "all_right_b1", "all_right_b03"])
def test_all_wrong_and_all_right(case):
    model, cm = _net(rule="capskip", budget=0.3 if case == "all_right_b03" else 1.0)
    x = _x()
    with torch.no_grad():
        pred = model(x).argmax(1)
    y = (pred + 1) % C if case == "all_wrong" else pred
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    grads = _grads(model)
    assert st.fallback is None, (
        f"an all-wrong or all-right batch is no reason to fall back ({case}), got {st.fallback!r}")
    if case == "all_wrong":
        assert st.kept == N, f"misclassified rows are never skipped, got kept={st.kept!r} of {N!r}"
    elif case == "all_right_b1":
        assert st.kept == 0, f"at b=1 with every row correct the bound allows skipping all, got kept={st.kept!r}"
        assert all(g.abs().max() == 0 for g in grads.values()), (
            "skipping every row should leave all gradients zero")  # S_N = G: skip all
    else:
        assert 0 < st.kept < N, (
            f"at b=0.3 an all-right batch keeps some rows but not all, got kept={st.kept!r} of {N!r}")
        assert st.bound <= 0.3, f"the certified bound must respect the budget 0.3, got {st.bound!r}"
    assert max_rel_err(grads, reference_grads(model, x, y, st.weight)) < 1e-10, (
        f"the selected gradient ({case}) should match the float64 weighted reference")


# ---------------------------------------------------------------- model shapes

class ConvHead(nn.Module):
    """Logits from a full-size convolution: no Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Conv2d(6, C, 6)

    def forward(self, x):
        return self.head(self.conv(x).relu()).flatten(1)


def test_no_linear_head_runs_dense_with_reason_and_exact_gradients():
    torch.manual_seed(0)
    model = ConvHead().double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.25, backend="aot_eager")
    x, y = torch.randn(N, 3, 6, 6, dtype=torch.float64), torch.randint(0, C, (N,))
    msgs = _recorded_warnings(lambda: F.cross_entropy(cm(x), y).backward())
    assert any("no classifier head" in m for m in msgs), (
        f"a head-less model should warn that it has no classifier head, got warnings {msgs!r}")
    st = capskip_fx.stats(cm)
    assert "no classifier head" in st.fallback, (
        f"the dense step's reason should say there is no classifier head, got {st.fallback!r}")
    assert st.kept == N, f"a head-less model runs dense (keeps every row), got kept={st.kept!r} of {N!r}"
    rec = cm.backend.records[0]  # the reason: refused graph's, or a head-less "body" graph's no_head
    assert "no classifier head" in (rec.reason or getattr(rec, "no_head", None) or ""), (
        "the graph record should carry the no-classifier-head reason, "
        f'got {rec.reason or getattr(rec, "no_head", None) or ""!r}')
    assert max_rel_err(_grads(model), _dense_grads(model, lambda m: F.cross_entropy(m(x), y))) < 1e-10, (
        "the head-less model's dense step should give eager's gradient")
    table = str(capskip_fx.report(cm)).splitlines()[1].split()
    assert table[2] == "dense" and "never" not in table, (
        f"with no head anywhere report() should say the graph runs dense, with nothing to verify: {table}")


class Outputs(nn.Module):
    """Logits plus a per-example auxiliary output, as a tuple or a dict (aux first)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(12, 16)
        self.head = nn.Linear(16, C)
        self.aux = nn.Linear(16, 1)
        self.emb = nn.Linear(16, 3)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        z, a = self.head(h), self.aux(h).squeeze(1).pow(2)
        if self.kind == "tuple":
            return z, a
        if self.kind == "dict":
            return {"aux": a, "logits": z}
        return {"emb": self.emb(h), "logits": z, "aux": a}  # another 2-D Linear output first


def _logits_aux(out):
    return (out[0], out[1]) if isinstance(out, tuple) else (out["logits"], out["aux"])


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_tuple_and_dict_outputs_pick_logits_and_keep_skipped_rows_aux_out(kind):
    torch.manual_seed(0)
    model = Outputs(kind).double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([0, 5, 6]), backend="aot_eager")
    x, y = _x(), torch.randint(0, C, (N,))
    z, a = _logits_aux(cm(x))
    (F.cross_entropy(z, y) + a.mean()).backward()
    st = capskip_fx.stats(cm)
    assert st.kept == 3, f"the forced rule keeps rows 0, 5, 6, got kept={st.kept!r}"
    assert st.fallback is None, f"a {kind} output with logits should not fall back, got {st.fallback!r}"
    rec = cm.backend.records[0]
    assert rec.backward == "selected rows", f"the backward should run on the selected rows only, got {rec.backward!r}"
    assert rec.masked_tangents == 2, (
        f"both per-example outputs (logits and aux) should have skipped rows masked, got {rec.masked_tangents!r}")
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    zr, ar = _logits_aux(ref(x))
    ((F.cross_entropy(zr, y, reduction="none") + ar) * st.weight).sum().div(N).backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        "skipped rows' aux output must not leak into the gradient, "
        f"rel err {max_rel_err(_grads(model), _grads(ref))!r}")


def test_unused_2d_output_picked_as_logits_is_caught_and_logits_index_fixes_it():
    torch.manual_seed(0)
    model = Outputs("emb").double()
    cm = capskip_fx.compile(model, rule="capskip", budget=1.0, backend="aot_eager")
    x = _x()
    with torch.no_grad():
        y = model(x)["logits"].argmax(1)
    out = cm(x)
    msgs = _recorded_warnings(lambda: F.cross_entropy(out["logits"], y).backward())
    assert any("logits_index=" in m for m in msgs), (
        "an unused 2-D output picked as logits should be caught (not: every row is free, skip them all) "
        f"with a warning naming logits_index=, got {msgs!r}")
    st = capskip_fx.stats(cm)
    assert "logits_index=" in st.fallback, f"the dense step's reason should name logits_index=, got {st.fallback!r}"
    assert st.kept == N, (
        f"a wrongly picked logits output must run dense, not skip every row, got kept={st.kept!r} of {N!r}")
    assert max_rel_err(_grads(model), _dense_grads(model, lambda m: F.cross_entropy(m(x)["logits"], y))) < 1e-10, (
        "the wrongly-picked-logits step should give eager's dense gradient")
    torch.manual_seed(0)
    model = Outputs("emb").double()
    cm = capskip_fx.compile(model, rule="capskip", budget=1.0, backend="aot_eager", logits_index=1)
    F.cross_entropy(cm(x)["logits"], y).backward()
    assert capskip_fx.stats(cm).fallback is None, (
        f"with logits_index=1 the step should select, got fallback={capskip_fx.stats(cm).fallback!r}")
    assert capskip_fx.stats(cm).kept == 0, (
        f"with the right logits, all-correct rows at b=1 are all skipped, got kept={capskip_fx.stats(cm).kept!r}")


class ScalarAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.head = nn.Linear(16, C)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        return self.head(h), h.pow(2).mean()  # a batch-level auxiliary loss: couples the examples


def test_batch_level_aux_output_is_refused_as_coupling():
    torch.manual_seed(0)
    model = ScalarAux().double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([0, 3]), backend="aot_eager",
                            verify=False)
    x, y = _x(), torch.randint(0, C, (N,))

    def loss(out):
        return F.cross_entropy(out[0], y) + out[1]

    loss(cm(x)).backward()
    assert cm.backend.records[0].coupled, (
        "a batch-level aux loss couples the examples and should be recorded as coupled, "
        f"got {cm.backend.records[0].coupled!r}")
    assert "cross-example" in capskip_fx.stats(cm).fallback, (
        f"the dense reason should name the cross-example coupling, got {capskip_fx.stats(cm).fallback!r}")
    assert max_rel_err(_grads(model), _dense_grads(model, lambda m: loss(m(x)))) < 1e-10, (
        "the coupled model's dense step should give eager's gradient")


class NormNet(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8) if norm == "group" else nn.LayerNorm([8, 6, 6])
        self.head = nn.Linear(8, C)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).relu().mean((2, 3)))


@pytest.mark.parametrize("norm", ["group", "layer"])
def test_group_and_layer_norm_are_per_example_not_refused(norm):
    torch.manual_seed(0)
    model = NormNet(norm).double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([1, 2, 7]), backend="aot_eager")
    x, y = torch.randn(N, 3, 6, 6, dtype=torch.float64), torch.randint(0, C, (N,))
    assert not _recorded_warnings(lambda: F.cross_entropy(cm(x), y).backward()), (
        f"{norm} norm is per-example and should run without any capskip warning")
    rec = cm.backend.records[0]
    assert not rec.coupled, f"{norm} norm must not be taken for a cross-example coupling"
    assert rec.backward == "selected rows", f"the backward should run on the selected rows only, got {rec.backward!r}"
    assert rec.row_counts == {3}, (
        f"the selected backward should see exactly the 3 forced rows, got row counts {rec.row_counts!r}")
    st = capskip_fx.stats(cm)
    assert st.fallback is None, f"{norm} norm is no reason to fall back, got {st.fallback!r}"
    assert max_rel_err(_grads(model), reference_grads(model, x, y, st.weight)) < 1e-10, (
        f"the {norm}-norm selected gradient should match the float64 weighted reference")


class Lonely(nn.Module):
    """Its own forward code object: the recompile_limit test must not poison Net.forward's cache."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(12, C)

    def forward(self, x):
        return self.head(x.tanh())


def test_no_graph_from_dynamo_is_reported_not_silent(monkeypatch):
    """Dynamo's recompile_limit reached by earlier compiles of the same forward code: the model runs
    eagerly and capskip gets no graph.  The step is dense; stats say why (not stale numbers).
    (capskip_fx.compile isolates each model's recompiles where torch can; without that, e.g. torch < 2.14.)"""
    import capskip_fx.api as api

    monkeypatch.setattr(api, "_ISOLATED", {})
    x, y = _x(), torch.randint(0, C, (N,))
    with torch._dynamo.config.patch(recompile_limit=1):
        capskip_fx.compile(Lonely().double(), rule="forced", keep=0.5, backend="aot_eager")(x)  # the one entry
        torch.manual_seed(0)
        model = Lonely().double()
        cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
        msgs = _recorded_warnings(lambda: F.cross_entropy(cm(x), y).backward())
    assert any("produced no graph" in m for m in msgs), (
        f"a model Dynamo gave no graph for should warn, not run silently, got {msgs!r}")
    st = capskip_fx.stats(cm)
    assert st.n == N, f"stats should describe this step, not stale numbers, got n={st.n!r} of {N!r}"
    assert st.kept == N, f"with no graph the step is dense (keeps every row), got kept={st.kept!r} of {N!r}"
    assert "recompile_limit" in st.fallback, (
        f"the dense reason should name Dynamo's recompile_limit, got {st.fallback!r}")
    assert max_rel_err(_grads(model), _dense_grads(model, lambda m: F.cross_entropy(m(x), y))) < 1e-12, (
        "the graph-less step should give eager's dense gradient")


class _TakeAlongDim(nn.Module):
    """torch.take_along_dim specialises the batch size while Dynamo traces it (docs/limits.md)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(12, 16), nn.Linear(16, C)

    def forward(self, x):
        h = self.body(x).relu()
        return self.head(h + torch.take_along_dim(h, torch.zeros(x.shape[0], 1, dtype=torch.long), dim=1))


def test_batch_fixed_inside_the_model_names_that_op_not_the_mark():
    """capskip_fx.compile marked the input's batch dynamic; an op of the model fixed it: the refusal says so and
    names the fix (not 'mark the input', which the user already did)."""
    torch.manual_seed(0)
    model = _TakeAlongDim().double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x, y = _x(), torch.randint(0, C, (N,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(cm(x), y).backward()
    msgs = [str(w.message) for w in caught if "static" in str(w.message)]
    assert len(msgs) == 1, f"one warning about the static batch expected, got {[str(w.message) for w in caught]}"
    assert "fixed the batch size" in msgs[0] and "take_along_dim" in msgs[0], msgs[0]
    assert "mark_dynamic" not in msgs[0], f"the input was marked: the fix is not to mark it: {msgs[0]}"
    assert capskip_fx.stats(cm).fallback.kind.value == "static batch", capskip_fx.stats(cm)
    assert max_rel_err(_grads(model), _dense_grads(model, lambda m: F.cross_entropy(m(x), y))) < 1e-12, (
        "the refused graph's dense backward should give eager's gradient")


class _BatchNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.head = nn.BatchNorm1d(12), nn.Linear(12, C)

    def forward(self, x):
        return self.head(self.bn(x))  # the line the refusal's warning points at


def test_compile_time_refusal_warns_at_the_models_line():
    """A refusal found in the graph names the model's line, and the warning points there (file and line), not
    at capskip's or Dynamo's frames."""
    import inspect

    cm = capskip_fx.compile(_BatchNormed().double(), rule="forced", keep=0.5, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(cm(_x()), torch.randint(0, C, (N,))).backward()
    ours = [w for w in caught if "cross-example" in str(w.message)]
    src, first = inspect.getsourcelines(_BatchNormed.forward)
    line = first + next(i for i, s in enumerate(src) if "the line the refusal" in s)
    assert len(ours) == 1 and (ours[0].filename, ours[0].lineno) == (__file__, line), (
        [(w.filename, w.lineno, str(w.message)[:80]) for w in caught])
