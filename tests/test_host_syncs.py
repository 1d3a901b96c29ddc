"""Host reads per steady-state step (issue 14): on a GPU every read of a tensor's value stalls the
queue.  CAPSkip reads once (its k, with the fallback checks folded in); rules whose kept count the host
already knows (random/forced/sb with a fixed count) read nothing.  Counted on CPU with a dispatch mode
(``_local_scalar_dense`` is what item()/int()/bool()/float() reach; nonzero-like ops sync on a GPU)
plus ``Tensor.tolist``, which does not dispatch: capskip_fx.debug.count_host_reads."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import capskip_fx
from capskip_fx.debug import count_host_reads

from conftest import max_rel_err

from helpers.models import MLP, grads
from helpers.torch_features import needs_batch_marking

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model

N, C, D = 16, 5, 6


def Net():
    return MLP(d=D, hidden=8, classes=C)


_grads = grads


def _ref(model, x, y, w):
    """Eager float64 gradient of sum_i w_i l_i / N."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(x.shape[0]).backward()
    return _grads(ref)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, dtype=torch.float64, generator=g), torch.randint(0, C, (N,), generator=g)


def test_counter_sees_reads():
    """The counter is what the other tests rely on: it must catch each kind of read."""
    t = torch.ones(3)
    with count_host_reads() as ops:
        t.sum().item()
        int(t[0])
        bool(t[0] > 0)
        t.tolist()
        t.nonzero()
        t[t > 0]
    assert len(ops) == 6, ops
    with count_host_reads() as ops:
        (t * 2).sum()
        torch.argsort(t, stable=True)
    assert ops == [], f"plain arithmetic and a stable argsort keep values on the device; the counter saw reads {ops}"


RULES = [  # (rule options, reads per steady-state step)
    (dict(rule="capskip", budget=0.5), 1),
    (dict(rule="random", keep=0.5), 0),
    (dict(rule="forced", keep=0.5), 0),
    (dict(rule="sb", keep=0.5, start=0, end=1, interrupt=0), 0),
]


@pytest.mark.parametrize("gather", ["eager", "graph"])
@pytest.mark.parametrize("opts,reads", RULES, ids=[o["rule"] for o, _ in RULES])
def test_reads_per_step_and_exact(opts, reads, gather):
    torch.manual_seed(0)
    model = Net().double()
    cm = capskip_fx.compile(model, backend="aot_eager", gather=gather, **opts)
    for step in range(4):  # steps 0-1: compile, verify
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(cm(x), y)  # outside the mode: Dynamo does not trace under one
        with count_host_reads() as ops:
            loss.backward()
        if step >= 2:
            assert len(ops) == reads, (step, ops)
            st = capskip_fx.stats(cm)
            assert st.fallback is None, st
            assert 0 < st.kept < N, st
            assert st.rows < N, st
            assert max_rel_err(_grads(model), _ref(model, x, y, st.weight)) < 1e-10, (
                "a steady-state selected step's gradient differs from the float64 reference weighted by its selection")
    assert [r.gather for r in cm.backend.records if r.plan is not None] == [gather], (
        f"exactly one graph plans a selected backward, gathering as asked ({gather!r}); got "
        f"{[r.as_dict() for r in cm.backend.records]}")


class _Chain(torch.nn.Module):
    """Row-wise blocks feeding each other and the head directly: what regional compile chains."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(D, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)])
        self.head = torch.nn.Linear(8, C)

    def forward(self, x):
        h = self.embed(x).relu()
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@needs_batch_marking
@pytest.mark.parametrize("gather", ["eager", "graph"])
def test_regional_compile_reads_nothing_per_block(gather):
    """Each block graph's incoming gradient is the next graph's returned one: it runs on those rows
    without reading the device (a fixed-count rule: no read at all), exact."""
    torch.manual_seed(0)
    model = _Chain().double()
    capskip_fx.compile_regions(model, blocks=model.blocks, head=model.head, rule="random", keep=0.5,
                               backend="aot_eager", gather=gather)
    for step in range(4):  # steps 0-1: compile, verify
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        with count_host_reads() as ops:
            loss.backward()
        st = capskip_fx.stats(model)
        assert (st.mode, st.kept, st.rows) == ("selected", N // 2, N // 2), st
        assert max_rel_err(_grads(model), _ref(model, x, y, st.weight)) < 1e-10, "gradient differs from the reference"
        if step >= 2:
            assert ops == [], f"step {step}: a regionally compiled step read the device: {ops}"
    rep = capskip_fx.report(model)
    assert [r["rows_reused"] for r in rep if r["role"] == "body"] == [4, 4, 4], f"a block read its own rows: {rep}"
    assert all(r["gather"] == gather and r["graph_gathers"] == 4 * (gather == "graph") for r in rep if r["role"] != "-"), (
        f"every region should gather as asked ({gather!r}), the twin on each of the 4 steps: {rep}")


class ReadingForced(capskip_fx.rules.Forced):
    """A fixed-count rule that reads the device once: the counter must see reads made in the backward."""

    def select(self, view):
        view.delta.abs().sum().item()
        return super().select(view)


def test_counter_sees_a_read_in_the_backward():
    torch.manual_seed(0)
    model = Net().double()
    cm = capskip_fx.compile(model, rule=ReadingForced(keep=0.5), backend="aot_eager")
    for step in range(3):
        x, y = _batch(step)
        loss = F.cross_entropy(cm(x), y)
        with count_host_reads() as ops:
            loss.backward()
    assert ops == ["aten._local_scalar_dense.default"], (
        f"the rule's item() in the backward must be counted as one host read; counted {ops}")


def _state(cm):
    return cm.backend.state


def _snapshot(cm):
    st = _state(cm)
    return st.rule.state_dict(), st._generator.get_state()


def _same(a, b):
    (ra, ga), (rb, gb) = a, b
    assert torch.equal(ga, gb), (
        "the runtime generator's state changed across a step that fell back or raised; it must be put back")
    assert ra.keys() == rb.keys(), (
        f"the rule's state_dict keys changed across the step; before {list(ra)}, after {list(rb)}")
    for k in ra:
        if isinstance(ra[k], torch.Tensor):
            assert torch.equal(ra[k].nan_to_num(-7.0), rb[k].nan_to_num(-7.0)), k
        elif isinstance(ra[k], dict) and "state" in ra[k]:
            assert torch.equal(ra[k]["state"], rb[k]["state"]), k
        else:
            assert ra[k] == rb[k], k


BAD_STEPS = {  # loss from (logits, y), and the reason the step falls back
    "nan": (lambda z, y: F.cross_entropy(z * float("nan"), y), "non-finite"),
    "zero": (lambda z, y: 0.0 * F.cross_entropy(z, y), "zero on every row"),
    "mse": (lambda z, y: F.mse_loss(z, F.one_hot(y, C).double()), "capskip_targets="),
}


@pytest.mark.parametrize("bad", sorted(BAD_STEPS))
@pytest.mark.parametrize("opts", [dict(rule="sb", beta=1.0, history=64), dict(rule="kabena", tau=0.5),
                                  dict(rule="ub", b=6, tau_th=0)], ids=["sb", "kabena", "ub"])
def test_fallback_step_reads_once_runs_dense_and_leaves_the_rule_state(opts, bad):
    """The rule runs before the single read; a step that falls back puts its state back (and the
    runtime generator it draws from)."""
    torch.manual_seed(0)
    model = Net().double()
    cm = capskip_fx.compile(model, backend="aot_eager", **opts)
    for step in range(3):
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
    before = _snapshot(cm)
    loss_fn, reason = BAD_STEPS[bad]
    x, y = _batch(9)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(cm(x), y)
    with pytest.warns(UserWarning, match="dense backward"), count_host_reads() as ops:
        loss.backward()
    assert len(ops) == 1, ops
    st = capskip_fx.stats(cm)
    assert reason in st.fallback, (
        f"the dense fallback must give the bad step's reason {reason!r}; stats say {st.fallback!r}")
    assert st.kept == N, f"a step that falls back keeps every row; stats say kept {st.kept} of {N}"
    assert bool((st.weight == 1).all()), f"a dense fallback must weight every row 1; weights {st.weight.tolist()}"
    _same(_snapshot(cm), before)
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_fn(ref(x), y).backward()
    for k, g in _grads(model).items():
        r = ref.get_parameter(k).grad
        if bad == "nan":
            assert torch.equal(torch.isnan(g), torch.isnan(r)), (
                f"the dense fallback's {k} gradient must be NaN exactly where the eager model's is")
        else:
            assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), (
                f"the dense fallback's {k} gradient must equal the eager model's full-batch gradient")


def test_bad_labels_raise_before_the_state_changes():
    torch.manual_seed(0)
    model = Net().double()
    cm = capskip_fx.compile(model, rule="sb", beta=1.0, history=64, backend="aot_eager")
    x, y = _batch(0)
    F.cross_entropy(cm(x, capskip_targets=y), y).backward()
    before = _snapshot(cm)
    t = y.clone()
    t[2] = C + 3  # the rule must not index the logits with it either (it runs before the read)
    with pytest.raises(ValueError, match=rf"capskip_targets must be class labels in \[-1, {C}\) .*got values in "
                                         rf"\[\d+, {C + 3}\]"):
        F.cross_entropy(cm(x, capskip_targets=t), y).backward()
    _same(_snapshot(cm), before)


def test_fixed_count_nan_step_reads_nothing_and_its_gradient_is_non_finite():
    """No read, so no dense fallback: the kept rows weigh NaN (the gradient is non-finite, as a dense
    step's: GradScaler skips it); stats().fallback reads the checks when asked."""
    torch.manual_seed(0)
    model = Net().double()
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend="aot_eager")
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(cm(x), y).backward()
    x, y = _batch(9)
    x[3] = float("nan")  # one row: a random half usually skips it
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(cm(x), y)
    with count_host_reads() as ops:
        loss.backward()
    assert ops == [], f"a fixed-count rule's NaN step must read nothing from the device; counted {ops}"
    assert all(not torch.isfinite(g).all() for g in _grads(model).values()), (
        "the NaN step's kept rows weigh NaN: every parameter's gradient must be non-finite, so GradScaler skips it")
    st = capskip_fx.stats(cm)
    assert st.kept == N // 2, (
        f"the NaN step still runs the fixed count (no read, so no dense fallback); kept {st.kept} of {N}")
    assert st.rows < N, f"the NaN step must really run the backward on fewer rows; rows {st.rows} of {N}"
    with pytest.warns(UserWarning, match="non-finite"), count_host_reads() as ops:
        assert "non-finite" in st.fallback, (
            f"stats().fallback must report the non-finite step when asked; got {st.fallback!r}")
    assert ops == ["tolist"], f"asking stats().fallback must read the checks once with tolist(); counted {ops}"
    F.cross_entropy(cm(_batch(10)[0]), _batch(10)[1]).backward()  # the next finite step is clean
    assert capskip_fx.stats(cm).fallback is None, (
        f"the next finite step must not inherit the NaN step's reason; fallback {capskip_fx.stats(cm).fallback!r}")


def test_fixed_count_uninformative_step_keeps_its_rows_exactly_and_says_so():
    """sb keep= on MSE without labels: the fixed count runs (no read to go dense), exact for its rows;
    the reason is in stats().fallback."""
    torch.manual_seed(0)
    model = Net().double()
    cm = capskip_fx.compile(model, rule="sb", keep=0.5, start=0, end=1, interrupt=0, backend="aot_eager")
    for step in range(3):
        x, y = _batch(step)
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(cm(x), F.one_hot(y, C).double())
        with count_host_reads() as ops:
            loss.backward()
    assert ops == [], (
        f"sb with a fixed keep count must read nothing from the device, even on MSE without labels; counted {ops}")
    st = capskip_fx.stats(cm)
    assert st.kept == N // 2, f"the uninformative step still runs sb's fixed count; kept {st.kept} of {N}"
    assert "capskip_targets=" in st.fallback, (
        f"the reason must ask for capskip_targets= (MSE gives no labels to score rows); got {st.fallback!r}")
    assert "kept its rows" in st.fallback, (
        f"the reason must say the step kept its rows (not dense); got {st.fallback!r}")
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    (F.mse_loss(ref(x), F.one_hot(y, C).double(), reduction="none").mean(1) * st.weight).sum().div(N).backward()
    assert max_rel_err(_grads(model), _grads(ref)) < 1e-10, (
        "the kept rows' gradient must equal the float64 MSE reference weighted by the step's selection;"
        f" rel. error {max_rel_err(_grads(model), _grads(ref))!r}")


VCAS_CASES = [  # (rule options, sampler, reads per sampled step)
    (dict(rule="vcas"), "systematic", 0),
    (dict(rule="capskip", budget=0.5), "systematic", 1),
    (dict(rule="forced", keep=0.5), "systematic", 0),
]


@pytest.mark.parametrize("opts,sampler,reads", VCAS_CASES, ids=[f"{o['rule']}-{s}" for o, s, _ in VCAS_CASES])
@pytest.mark.heavy
def test_vcas_sampled_step_reads(opts, sampler, reads):
    """VCAS adds no host read to a sampled step with the fixed-size sampler (its sizes are the budgets,
    of the rule's kept count); the reference's Bernoulli draws read once per resampling cut and sampled
    matmul (counted below as the contrast).  SampleA and SampleW really sample: fewer rows below the cuts."""
    from conftest import make_deit

    torch.manual_seed(0)
    model = make_deit(1).double()
    vc = capskip_fx.VCAS(freq=10 ** 9, sampler=sampler)
    cm = capskip_fx.compile(model, backend="aot_eager", vcas=vc, **opts)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g)
    runs = {}
    for step in range(4):  # step 0: the probe (compiles); 1: verify (capskip); 2-3: steady state
        loss = F.cross_entropy(cm(x), y)
        if step == 1:
            (runner,) = cm.backend.state.runners
            runner.ctrl.rho = [1.0] + [0.5] * (len(runner.ctrl.rho) - 1)
            runner.ctrl.nu = [0.5] * len(runner.ctrl.nu)
        for smp in ([sampler, "bernoulli"] if step == 3 else [sampler]):
            if step >= 1:
                runner.cfg = dataclasses.replace(vc, sampler=smp)
            model.zero_grad(set_to_none=True)
            with count_host_reads() as ops:
                loss.backward(retain_graph=True)
            runs[(step, smp)] = (list(ops), capskip_fx.stats(cm).vcas)
    for step in (2, 3):
        ops, st = runs[(step, sampler)]
        assert len(ops) == reads, (step, ops)
        assert not st["probe"], st
        assert st["segment_rows"][-1] < st["segment_rows"][0], st
        assert any(k < t for k, t in st["wgrad_rows"]), st
    ops, _ = runs[(3, "bernoulli")]
    assert len(ops) > reads + 1, ops  # one per resampling cut and per sampled matmul
