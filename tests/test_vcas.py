"""VCAS as a graph pass: segments, SampleA / SampleW inside the compiled backward, the controller.

The math (soft top-k, closed-form variance, controller rules) is in test_vcas_math.py.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx import VCAS

from conftest import make_deit, make_mlp

NO_PROBE = 10 ** 9  # freq: only step 0 probes


def _build(depth=2, dtype=torch.float64, backend="aot_eager", rule="vcas", **vcas):
    torch.manual_seed(0)
    model = make_deit(depth).to(dtype)
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule=rule, backend=backend, vcas=VCAS(**{"freq": NO_PROBE, **vcas}))
    return ref, cm


def _data(n=8, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (n,), generator=g)


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _ref_grads(ref, x, y):
    ref.zero_grad(set_to_none=True)
    F.cross_entropy(ref(x), y).backward()
    return _grads(ref)


def _runner(cm):
    (r,) = cm.backend.state.runners
    return r


def _rel(a, b):
    return max(float((p - q).norm() / (q.norm() + 1e-30)) for p, q in zip(a, b))


@pytest.fixture(scope="module")
def deit2():
    """aot_eager float64, two blocks; the first step (a probe) compiles it."""
    ref, cm = _build()
    x, y = _data()
    cm.model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    return ref, cm


def test_cuts_at_residual_forks_and_probe_step_is_exact(deit2):
    ref, cm = deit2
    r = _runner(cm)
    # a pre-norm block has two residual forks (attention, MLP): 2 blocks -> 4 cuts, 5 segments
    assert len(r.plan.boundaries) == 4 and len(r.plan.segments) == 5
    # qkv, proj, fc1, fc2 per block; the head and the patch embedding stay exact
    assert r.slots == 8
    rows = capskip_fx.report(cm)
    assert len(rows) == 1 and rows[0]["vcas"].startswith("5 segments, 8 sampled")
    assert r.ctrl.probes_done == 1  # step 0 was a probe: its gradient is the exact one (two halves)
    x, y = _data()
    assert _rel(_grads(cm.model), _ref_grads(ref, x, y)) < 1e-10


def test_segments_run_exact_when_nothing_is_sampled(deit2):
    ref, cm = deit2
    r = _runner(cm)
    rho, nu = list(r.ctrl.rho), list(r.ctrl.nu)
    try:
        r.ctrl.rho, r.ctrl.nu = [1.0] * len(rho), [1.0] * len(nu)
        x, y = _data(n=6, seed=3)  # another batch size: same compiled segments
        cm.model.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
        assert _rel(_grads(cm.model), _ref_grads(ref, x, y)) < 1e-10
        st = capskip_fx.stats(cm)
        assert st.vcas["segment_rows"] == [6] * 5 and not st.vcas["probe"]
        assert all(k == t for k, t in st.vcas["wgrad_rows"])
    finally:
        r.ctrl.rho, r.ctrl.nu = rho, nu


@pytest.mark.parametrize("sampler", ["systematic", "bernoulli"])
def test_sampled_backward_drops_rows_and_is_unbiased(deit2, sampler):
    """SampleA + SampleW on: fewer rows per segment and per weight-gradient matmul, and the Monte-Carlo
    mean of the sampled gradients converges to the exact gradient (retain_graph: same forward).
    The systematic sampler's sizes are the budgets exactly: int(rho * 8) rows, int(nu * T) token rows."""
    ref, cm = deit2
    r = _runner(cm)
    rho, nu, cfg = list(r.ctrl.rho), list(r.ctrl.nu), r.cfg
    try:
        r.cfg = dataclasses.replace(cfg, sampler=sampler)
        r.ctrl.rho = [0.75, 0.75, 0.5, 0.5]
        r.ctrl.nu = [0.5] * len(nu)
        x, y = _data(n=8, seed=4)
        exact = _ref_grads(ref, x, y)
        cm.model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(cm(x), y)
        draws, seg_rows, w_rows, mm_rows = 300, [], [], []
        acc = [torch.zeros_like(g) for g in exact]
        sq = [torch.zeros_like(g) for g in exact]
        for _ in range(draws):
            cm.model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            for a, s, p in zip(acc, sq, cm.model.parameters()):
                a += p.grad
                s += p.grad ** 2
            st = capskip_fx.stats(cm).vcas
            seg_rows.append(st["segment_rows"])
            # the executed graph: token-row matmuls below a resampling cut run on fewer than 8*65 rows
            mm_rows.extend(s[0][0] for op, s in cm.backend.records[0].matmul_shapes if op == "aten.mm.default")
            w_rows.append(st["wgrad_rows"])
        assert any(rows[-1] < 8 for rows in seg_rows)  # rows really dropped below the cuts
        assert all(rows[0] == 8 for rows in seg_rows)
        if sampler == "systematic":  # resampled where rho drops: cut 0 (0.75) and cut 2 (0.5)
            assert all(rows == [8, 6, 6, 4, 4] for rows in seg_rows)
            assert max(mm_rows) == 6 * 65 and 4 * 65 in mm_rows
            assert all(k == int(0.5 * t) for rows in w_rows for k, t in rows)
        else:  # Bernoulli: random counts (sometimes all 8 rows)
            assert 8 * 65 in mm_rows and any(8 < r < 8 * 65 for r in mm_rows)
        assert sum(k for rows in w_rows for k, _ in rows) < 0.8 * sum(t for rows in w_rows for _, t in rows)
        for a, s, e, (name, _) in zip(acc, sq, exact, cm.model.named_parameters()):
            mean = a / draws
            var = (s / draws - mean ** 2).clamp_min(0) * draws / (draws - 1)
            se = (var / draws).sqrt()
            # per-entry z-scores: a biased estimator shows up as a systematic shift over many entries
            z = ((mean - e) / (se + 1e-12 * e.abs().max() + 1e-300))
            assert z.abs().mean() < 1.5, name
            assert float((mean - e).norm()) <= 5 * float(se.norm()) + 1e-9 * float(e.norm()), name
    finally:
        r.ctrl.rho, r.ctrl.nu, r.cfg = rho, nu, cfg


def test_probe_updates_controller_and_state_dict_round_trips(deit2):
    ref, cm = deit2
    r = _runner(cm)
    sd = cm.state_dict()
    assert sd["_capskip"]["runners"][0]["s"] == r.ctrl.s
    # a fresh model loads the controller before its backward is compiled (pending), then uses it;
    # checkpoints written before the runners key kept it under "vcas"
    ref2, cm2 = _build()
    saved = dict(sd["_capskip"].pop("runners")[0], s=0.5, rho=[0.9, 0.8, 0.7, 0.6], nu=[0.3] * 8, step=7)
    sd["_capskip"]["vcas"] = [saved]
    cm2.load_state_dict(sd)
    x, y = _data()
    F.cross_entropy(cm2(x), y).backward()
    r2 = _runner(cm2)
    assert r2.ctrl.s == 0.5 and r2.ctrl.step == 8 and r2.ctrl.rho == [0.9, 0.8, 0.7, 0.6]
    assert capskip_fx.stats(cm2).vcas["nu"] == [0.3] * 8


def test_controller_direction_on_a_real_probe():
    """Tiny tau: measured variance is over budget -> s and nu go up (from below 1); huge tau: down."""
    for tau, up in ((1e-12, True), (1e6, False)):
        _, cm = _build(depth=1, freq=1, tau_act=tau, tau_w=tau)
        x, y = _data(n=8)
        F.cross_entropy(cm(x), y).backward()  # step 0: probe at s = rho = nu = 1
        r = _runner(cm)
        r.ctrl.s, r.ctrl.nu = 0.5, [0.5] * r.slots
        r.ctrl.rho = [0.6] * len(r.ctrl.rho)
        F.cross_entropy(cm(x), y).backward()  # step 1: probe with sampling active
        assert r.ctrl.probes_done == 2
        if up:
            assert r.ctrl.s == pytest.approx(0.51) and all(v > 0.5 for v in r.ctrl.nu)
            assert r.ctrl.last["act_ratio"] > 0
        else:
            assert r.ctrl.s == pytest.approx(0.49) and all(v < 0.5 for v in r.ctrl.nu)


def test_capskip_then_vcas_inside_the_kept_rows():
    ref, cm = _build(depth=1, rule="capskip", freq=NO_PROBE)
    cm.rule = capskip_fx.rules.Forced(keep=0.625)
    x, y = _data(n=8)
    F.cross_entropy(cm(x), y).backward()  # step 0: exact (probe) over the 5 kept rows
    w = capskip_fx.stats(cm).weight
    assert int((w != 0).sum()) == 5
    grads = _grads(cm.model)
    ref.zero_grad(set_to_none=True)
    (F.cross_entropy(ref(x), y, reduction="none") * w).mean().backward()
    assert _rel(grads, _grads(ref)) < 1e-10
    r = _runner(cm)
    r.ctrl.rho = [0.5] * len(r.ctrl.rho)
    cm.model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert st.rows == 5 and st.vcas["segment_rows"][0] == 5 and st.vcas["segment_rows"][-1] <= 5


def test_no_residual_block_falls_back_exact_with_reason():
    torch.manual_seed(0)
    model = make_mlp().double()
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule="vcas", backend="aot_eager")
    x, y = torch.randn(6, 12, dtype=torch.float64), torch.randint(0, 5, (6,))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        F.cross_entropy(cm(x), y).backward()
    assert any("no residual fork" in str(m.message) for m in w)
    assert "no residual fork" in capskip_fx.report(cm)[0]["vcas"]
    assert _rel(_grads(model), _ref_grads(ref, x, y)) < 1e-10


def test_refused_segmenting_leaves_the_exact_backward(monkeypatch):
    """A refusal after the SampleW rewrite must not leak it: the unrewritten graph compiles, exact."""
    import capskip_fx.vcas.build as build
    from capskip_fx.records import Refused

    def refuse(*a, **k):
        raise Refused("test refusal")

    monkeypatch.setattr(build, "split_backward", refuse)
    ref, cm = _build(depth=1)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F.cross_entropy(cm(x), y).backward()
    assert "test refusal" in capskip_fx.report(cm)[0]["vcas"] and not cm.backend.state.runners
    assert _rel(_grads(cm.model), _ref_grads(ref, x, y)) < 1e-10


def test_vcas_option_errors():
    with pytest.raises(ValueError, match="eager"):
        capskip_fx.compile(make_mlp(), rule="vcas", backend="eager")
    with pytest.raises(TypeError, match="VCAS"):
        capskip_fx.compile(make_mlp(), vcas="yes")
    with pytest.raises(ValueError, match="tau_act"):
        capskip_fx.compile(make_mlp(), vcas={"tau_act": 0})
    cm = capskip_fx.compile(make_mlp(), rule="vcas", vcas={"freq": 5})
    assert cm.config.vcas == VCAS(freq=5) and cm.rule.name == "dense"


def test_inductor_segments_exact_then_sampled_without_recompiles():
    torch.manual_seed(0)
    ref, cm = _build(depth=1, dtype=torch.float32, backend="inductor")
    for n, seed in ((8, 1), (6, 2)):
        x, y = _data(n=n, dtype=torch.float32, seed=seed)
        cm.model.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
        r = _runner(cm)
        if n == 8:  # probe step: exact
            assert _rel(_grads(cm.model), _ref_grads(ref, x, y)) < 1e-4
            r.ctrl.rho, r.ctrl.nu = [0.5] * len(r.ctrl.rho), [0.4] * r.slots
    st = capskip_fx.stats(cm)
    assert st.vcas["segment_rows"][0] == 6 and st.vcas["segment_rows"][-1] < 6 or \
        any(k < t for k, t in st.vcas["wgrad_rows"])
    compiled_before = len(r.compiled)
    for seed in range(3, 6):  # other row counts, other nu/rho: the same compiled segments
        r.ctrl.nu = [0.3 + 0.1 * (seed - 3)] * r.slots
        x, y = _data(n=8, dtype=torch.float32, seed=seed)
        F.cross_entropy(cm(x), y).backward()
    assert len(capskip_fx.report(cm)) == 1 and len(r.compiled) == compiled_before
    assert capskip_fx.stats(cm).variants == 1


class _ResMLP(nn.Module):
    """Pre-norm residual MLP blocks over tokens: one residual fork per block."""

    def __init__(self, depth, dim, classes=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x.mean(1))


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(depth=st.integers(2, 3), tokens=st.integers(1, 4), dim=st.sampled_from([4, 8]), n=st.integers(4, 9),
       every=st.integers(1, 2))
def test_segmenting_any_residual_stack_is_exact(depth, tokens, dim, n, every):
    """One cut per block (every k-th; the input needs no gradient, so the lowest block's cut is its
    output's join; one block alone shows no residual: see the MLP test), two sampled matmuls per
    block, and the probe step's
    gradient (exact halves through the segments) equals the float64 eager gradient."""
    torch.manual_seed(depth * 100 + n)
    # one fresh model per example, same forward code: no automatic-dynamic token dim from the last one
    with torch._dynamo.config.patch(recompile_limit=64, automatic_dynamic_shapes=False):
        _check_residual_stack(depth, tokens, dim, n, every)


def _check_residual_stack(depth, tokens, dim, n, every):
    model = _ResMLP(depth, dim).double()
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule="vcas", backend="aot_eager", vcas=VCAS(freq=NO_PROBE, every=every))
    x, y = torch.randn(n, tokens, dim, dtype=torch.float64), torch.randint(0, 4, (n,))
    F.cross_entropy(cm(x), y).backward()
    r = _runner(cm)
    assert len(r.plan.boundaries) == len(range(0, depth, every))
    assert r.slots == 2 * depth
    assert r.ctrl.probes_done == 1
    assert _rel(_grads(model), _ref_grads(ref, x, y)) < 1e-10
    # and with nothing to sample (rho = nu = 1), a plain step is the exact gradient too
    r.ctrl.rho, r.ctrl.nu = [1.0] * len(r.ctrl.rho), [1.0] * r.slots
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    assert _rel(_grads(model), _ref_grads(ref, x, y)) < 1e-10
