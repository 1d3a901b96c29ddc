"""Literature rules (random, sb, kabena, ub; stale_sb's own tests are in test_stale_sb.py).

Statistical checks use confidence intervals computed from the draws themselves (5 sigma), never a
hand-picked tolerance.  Per-example last-layer gradients are built explicitly, in float64, as
outer products ``delta_i (x) [h_i; 1]``.
"""
from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from capskip_fx.rules import (KABENA, RULES, HeadView, RandomSkip, SelectiveBackprop, StaleSB,
                              UpperBoundIS, make_rule)
from capskip_fx.rules.capskip import CAPSkip
from capskip_fx.rules.labels import per_example_ce
from helpers.examples import draws as mc_draws, examples

torch.set_num_threads(1)
Z = 5.0  # width of every confidence interval, in standard errors


def make_view(seed: int, n: int = 16, c: int = 5, d: int = 3, dtype=torch.float64, scale: float = 2.0,
              generator=None, epoch: int = 0, step: int = 0, explicit_targets: bool = True) -> HeadView:
    g = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(n, c, generator=g)).to(dtype)
    y = torch.randint(0, c, (n,), generator=g)
    h = torch.randn(n, d, generator=g).to(dtype)
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, c).to(dtype)) / n
    return HeadView(delta=delta, h=h, z=z, targets=y if explicit_targets else None,
                    index=torch.arange(n), step=step, epoch=epoch, generator=generator)


def permuted(view: HeadView, perm: torch.Tensor) -> HeadView:
    return HeadView(delta=view.delta[perm], h=view.h[perm], z=view.z[perm],
                    targets=None if view.targets is None else view.targets[perm],
                    index=None if view.index is None else view.index[perm],
                    step=view.step, epoch=view.epoch, generator=view.generator)


def per_example_grads(view: HeadView) -> torch.Tensor:
    """(N, C*(d+1)) float64: g_i = delta_i (x) [h_i; 1], flattened."""
    d = view.delta.double()
    xh = torch.cat([view.h.double(), torch.ones(view.n, 1, dtype=torch.float64)], 1)
    return torch.einsum("nc,nd->ncd", d, xh).reshape(view.n, -1)


def mc_weights(rule, view: HeadView, draws: int) -> torch.Tensor:
    """(draws, N) weights from repeated selections on the same batch (one generator, iid draws)."""
    return torch.stack([rule.select(view).weight.double() for _ in range(draws)])


def assert_unbiased(weights: torch.Tensor, grads: torch.Tensor) -> None:
    """Mean of sum_i w_i g_i within Z standard errors of sum_i g_i, per coordinate."""
    est = weights @ grads  # (draws, P)
    dense = grads.sum(0)
    se = est.std(0) / math.sqrt(est.shape[0])
    slack = 1e-12 * dense.abs().max()  # zero-variance coordinates must match up to rounding
    err = (est.mean(0) - dense).abs()
    assert (err <= Z * se + slack).all(), f"max err/se {(err / (se + slack)).max():.2f}"


# ---------------------------------------------------------------------------------------------
# registry


def test_registry_names_and_repr():
    for name, cls in [("random", RandomSkip), ("sb", SelectiveBackprop), ("stale_sb", StaleSB),
                      ("kabena", KABENA), ("ub", UpperBoundIS)]:
        assert RULES[name] is cls, f"the registry should map {name!r} to {cls.__name__}, maps it to {RULES[name]!r}"
        r = make_rule(name)
        assert isinstance(r, cls), f"make_rule({name!r}) should build a {cls.__name__}, built {type(r).__name__}"
        assert r.name == name, f"a {cls.__name__} should report the name it is registered under, {name!r}, not {r.name!r}"
        assert repr(r).startswith(cls.__name__ + "("), f"the repr should show the class and its options, got {r!r}"
    assert isinstance(make_rule("random", match="capskip").match, CAPSkip), (
        "match='capskip' by name should build the CAPSkip rule whose count the random rule matches")


@pytest.mark.parametrize("bad", [
    lambda: RandomSkip(keep=0.0), lambda: RandomSkip(keep=0.5, match=CAPSkip()),
    lambda: SelectiveBackprop(keep=1.5), lambda: SelectiveBackprop(beta=-1),
    lambda: KABENA(pi_min=0.0), lambda: KABENA(tau=-0.1),
    lambda: UpperBoundIS(b=0), lambda: UpperBoundIS(b=1.5), lambda: StaleSB(staleness=-1)])
def test_bad_options_raise(bad):
    with pytest.raises((ValueError, TypeError)):
        bad()


# ---------------------------------------------------------------------------------------------
# unbiasedness of the Horvitz-Thompson / importance-sampling rules


def test_kabena_unbiased_and_variance_matches_bound():
    view = make_view(3, n=16)
    rule = KABENA(tau=0.5, pi_min=0.2, seed=1)
    sel = rule.select(view)
    pi, k = sel.info["prob"].double(), int(sel.info["K"])
    assert k > 0, "the test needs rows that are actually sampled"
    assert (pi < 1).sum() > 0, "the test needs rows that are actually sampled"
    draws = mc_draws(3000)
    w = mc_weights(rule, view, draws)
    grads = per_example_grads(view)
    assert_unbiased(w, grads)
    # E ||G_hat - G||^2 is the added variance V(K) = var_ratio * ||G||^2 (independent Bernoullis)
    sq = ((w @ grads - grads.sum(0)) ** 2).sum(1)
    v = float(sel.info["var_ratio"]) * float(grads.sum(0).square().sum())
    assert abs(sq.mean() - v) <= Z * sq.std() / math.sqrt(draws), (
        f"KABENA's reported var_ratio should predict E||G_hat - G||^2 = {v!r} within the Monte Carlo error; "
        f"measured {sq.mean()!r}")
    assert float(sel.info["var_ratio"]) <= 0.5, (
        f"the added variance should stay within tau=0.5 of ||G||^2, var_ratio {float(sel.info['var_ratio'])!r}")


def test_ub_unbiased_with_multiplicities():
    view = make_view(5, n=16)
    rule = UpperBoundIS(b=5, tau_th=0.0, seed=2)  # tau_th <= 0: sampling from the first step
    draws = mc_draws(3000)
    sels = [rule.select(view) for _ in range(draws)]
    assert all(bool(s.info["on"]) for s in sels), "with tau_th <= 0 UB should sample from the first step, yet some steps ran dense"
    w = torch.stack([s.weight.double() for s in sels])
    assert_unbiased(w, per_example_grads(view))
    # weight = multiplicity / (b p_i); counts sum to b; some row was drawn twice somewhere
    counts = torch.stack([s.info["counts"].double() for s in sels])
    p = sels[0].info["prob"].double()
    assert torch.equal(counts.sum(1), torch.full((draws,), 5.0, dtype=torch.float64)), (
        f"each UB draw should sample exactly b=5 rows with replacement; totals seen {counts.sum(1).unique().tolist()}")
    torch.testing.assert_close(w, counts / (5 * p), rtol=1e-12, atol=0)
    assert (counts > 1).any(), "no row was ever drawn twice: UB samples with replacement, so multiplicities must occur"
    # score is ||softmax(z) - y||, normalised
    s = (view.z.softmax(1) - torch.nn.functional.one_hot(view.targets, 5)).norm(dim=1)
    torch.testing.assert_close(p, s / s.sum())


def test_ub_switch_on_follows_ema_of_tau():
    n, b = 12, 4
    # one hard row, the rest nearly perfect: tau = sqrt(N sum p^2) is large
    z = torch.zeros(n, 3, dtype=torch.float64)
    z[:, 0] = 12.0
    y = torch.zeros(n, dtype=torch.long)
    y[0] = 1
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, 3).double()) / n
    view = HeadView(delta=delta, h=torch.randn(n, 2, dtype=torch.float64), z=z, targets=y)
    rule = UpperBoundIS(b=b, off="dense")  # default threshold 2; off: all rows, weight 1 (not the reference's)
    p = delta.norm(dim=1) / delta.norm(dim=1).sum()
    tau = float((n * (p ** 2).sum()).sqrt())
    assert tau > 2.5, f"one hard row among easy ones should give a large tau (> 2.5) for the EMA to cross 2, got {tau!r}"
    ema = 0.0
    for t in range(30):
        sel = rule.select(view)
        assert bool(sel.info["on"]) == (ema > 2.0), (  # decided on the EMA before this step
            f"step {t}: UB should switch on exactly when the EMA of tau before the step ({ema:.3f}) exceeds 2")
        if not bool(sel.info["on"]):
            assert torch.equal(sel.weight, torch.ones(n, dtype=torch.float64)), (
                f"step {t}: UB switched off (off='dense') should keep every row at weight 1, got {sel.weight.tolist()}")
        ema = 0.9 * ema + 0.1 * tau
        assert abs(float(sel.info["tau_ema"]) - ema) < 1e-12, (
            f"step {t}: the reported tau EMA should be 0.9 * previous + 0.1 * tau = {ema!r}, got {float(sel.info['tau_ema'])!r}")
    assert bool(sel.info["on"]), "after 30 steps of a large tau the EMA should have switched UB on"
    # equal scores: tau = 1, never switches on
    flat = UpperBoundIS(b=b, off="dense")
    y2 = torch.ones(n, dtype=torch.long)
    z2 = torch.zeros(n, 3, dtype=torch.float64)
    d2 = (z2.softmax(1) - torch.nn.functional.one_hot(y2, 3).double()) / n
    v2 = HeadView(delta=d2, h=torch.randn(n, 2, dtype=torch.float64), z=z2, targets=y2)
    for _ in range(20):
        s2 = flat.select(v2)
        assert not bool(s2.info["on"]), "equal scores give tau = 1: UB must never switch on"
        assert torch.equal(s2.weight, torch.ones(n, dtype=torch.float64)), (
            f"UB switched off (off='dense') should keep every row at weight 1, got {s2.weight.tolist()}")


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 24), tau=st.floats(0.0, 2.0),
       pi_min=st.floats(0.05, 1.0))
def test_kabena_constraint_and_maximal_K(seed, n, tau, pi_min):
    """V(K) <= tau ||G||^2, and excluding one more row (K+1) would break it (explicit gradients)."""
    view = make_view(seed, n=n)
    sel = KABENA(tau=tau, pi_min=pi_min).select(view)
    grads = per_example_grads(view)
    gn2 = grads.square().sum(1)
    total = grads.sum(0).square().sum()
    loss = per_example_ce(view.z, view.targets)
    pi = sel.info["prob"].double()
    k = int(sel.info["K"])
    added = ((1 - pi) / pi * gn2).sum()
    assert added <= tau * total * (1 + 1e-9) + 1e-30, (
        f"KABENA's added variance V(K) = {added!r} should stay within tau ||G||^2 = {tau * total!r}")
    order = torch.argsort(loss, stable=True)
    if k < n:
        ref = loss[order[min(k + 1, n - 1)]]
        cand = order[: k + 1]
        pi2 = torch.ones(n, dtype=torch.float64)
        pi2[cand] = (loss[cand] / ref).clamp(pi_min, 1.0)
        assert ((1 - pi2) / pi2 * gn2).sum() > tau * total * (1 - 1e-9), (
            f"K={k} is not maximal: excluding one more row adds V = {((1 - pi2) / pi2 * gn2).sum()!r}, still within "
            f"tau ||G||^2 = {tau * total!r}")
    # the excluded candidates are the K lowest losses
    assert (pi[order[k:]] == 1).all(), f"only the K={k} lowest-loss rows may be sampled; rows above them have pi {pi[order[k:]].tolist()}"


def test_kabena_limits():
    view = make_view(11)
    dense = torch.ones(view.n, dtype=torch.float64)
    assert torch.equal(KABENA(pi_min=1.0, tau=10.0).select(view).weight, dense), (
        "pi_min=1 leaves no row to sample: KABENA should keep every row at weight 1, whatever tau")
    assert torch.equal(KABENA(tau=0.0).select(view).weight, dense), (
        "tau=0 allows no added variance: KABENA should keep every row at weight 1")  # generic rows: no free variance


# ---------------------------------------------------------------------------------------------
# Selective-Backprop


@pytest.mark.parametrize("beta", [1.0, 2.0, 3.0])
def test_sb_keep_fraction(beta):
    """iid losses: percentiles ~ uniform, kept fraction ~ 1/(beta+1) (binomial CI)."""
    R, n, warm, steps = 1024, 64, 16, 150
    rule = SelectiveBackprop(beta=beta, history=R, seed=7, prime_epochs=0)
    kept = 0
    for t in range(warm + steps):
        w = rule.select(make_view(1000 + t, n=n, c=10, dtype=torch.float32)).weight
        if t >= warm:  # history full: a row's count-below is uniform on {0..R-1}
            kept += int((w > 0).sum())
    expect = sum((j / R) ** beta for j in range(R)) / R
    assert abs(expect - 1 / (beta + 1)) < 1 / R, (
        f"the discrete keep fraction over a history of {R} should be 1/(beta+1) = {1 / (beta + 1)!r} up to 1/R, got {expect!r}")
    total = n * steps
    assert abs(kept / total - expect) <= Z * math.sqrt(expect * (1 - expect) / total), (
        f"beta={beta}: SB should keep {expect:.4f} of iid rows (binomial CI), kept {kept / total:.4f}")


def test_sb_percentile_counts_strictly_below_and_includes_batch():
    rule = SelectiveBackprop(beta=1.0, history=8, prime_epochs=0)
    n = 4
    losses = torch.tensor([0.5, 2.0, 1.0, 2.0], dtype=torch.float64)
    # logits with CE exactly `losses` for label 0 on 2 classes: l = log(1 + e^{a})
    a = torch.log(torch.expm1(losses))
    z = torch.stack([torch.zeros(n, dtype=torch.float64), a], 1)
    y = torch.zeros(n, dtype=torch.long)
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, 2).double()) / n
    sel = rule.select(HeadView(delta=delta, h=torch.zeros(n, 1, dtype=torch.float64), z=z, targets=y))
    torch.testing.assert_close(sel.info["prob"], torch.tensor([0, 2, 1, 2], dtype=torch.float64) / 4)


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), keep=st.floats(0.01, 1.0))
def test_sb_fixed_count_top_losses(seed, n, keep):
    view = make_view(seed, n=n)
    # deterministic top-k, no schedule, loss's 1/N, at least one row (the pre-Composer-default behaviour)
    old = dict(start=0.0, end=1.0, interrupt=0, normalize="batch", min_keep=1)
    w = SelectiveBackprop(keep=keep, sample=False, **old).select(view).weight
    k = max(1, math.floor(keep * n))
    assert int(w.sum()) == k, f"fixed-count SB (keep={keep}, n={n}) should keep floor(keep*n) >= 1 = {k} rows, kept {int(w.sum())!r}"
    loss = per_example_ce(view.z, view.targets)
    if k < n:
        assert loss[w > 0].min() >= loss[w == 0].max(), (
            f"deterministic SB should keep the highest losses: lowest kept {loss[w > 0].min()!r} < highest skipped "
            f"{loss[w == 0].max()!r}")
    ws = SelectiveBackprop(keep=keep, sample=True, seed=seed, **old).select(view).weight
    assert int(ws.sum()) == k, f"sampled fixed-count SB should keep exactly {k} rows too, kept {int(ws.sum())!r}"
    assert set(ws.unique().tolist()) <= {0.0, 1.0}, f"sampled SB (normalize='batch') should weight rows 0 or 1 only, got {ws.unique().tolist()}"


def test_sb_composer_sampling_prefers_high_loss():
    view = make_view(21, n=10)
    rule = SelectiveBackprop(keep=0.3, sample=True, seed=0, start=0.0, end=1.0, interrupt=0)
    freq = torch.stack([rule.select(view).weight for _ in range(400)]).mean(0)
    order = torch.argsort(per_example_ce(view.z, view.targets))
    assert freq[order[-1]] > freq[order[0]], (
        f"Composer's sampling should keep the highest-loss row more often ({freq[order[-1]]!r}) than the lowest "
        f"({freq[order[0]]!r})")


def test_sb_composer_window_without_duration_warns_once_and_stays_open():
    """Composer's [start, end) window needs the run's length; without it the window counts as open, and the
    user is told once how to place or silence it."""
    view = make_view(22, n=10)
    rule = SelectiveBackprop(keep=0.3, sample=False, seed=0, interrupt=0)  # Composer's start=0.5, end=0.9
    with pytest.warns(UserWarning, match=r"capskip_fx: sb keep=.*total_steps= or total_epochs="):
        w = rule.select(view).weight
    assert int((w > 0).sum()) == 3, f"an open window should keep floor(0.3 * 10) = 3 rows, kept {int((w > 0).sum())}"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rule.select(view)  # once per rule
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SelectiveBackprop(keep=0.3, sample=False, start=0.0, end=1.0, interrupt=0).select(view)


def test_generator_state_that_cannot_be_restored_warns_and_reseeds(monkeypatch):
    """A generator state saved on a device this process cannot create (a CUDA checkpoint loaded on a CPU-only
    machine) is reported and replaced by the rule's seed: the rule then draws as a fresh one."""
    view = make_view(23, n=12)
    fresh = RandomSkip(keep=0.5, seed=7).select(view).weight
    rule = RandomSkip(keep=0.5, seed=7)
    rule.select(view)  # advances the generator
    state = rule.state_dict()
    state["generator_state"] = {"device": "cuda", "state": state["generator_state"]["state"]}
    real = torch.Generator

    def generator(device="cpu"):
        if torch.device(device).type == "cuda":
            raise RuntimeError("no CUDA device in this process")
        return real(device=device)

    monkeypatch.setattr(torch, "Generator", generator)
    again = RandomSkip(keep=0.5, seed=7)
    with pytest.warns(UserWarning, match=r"capskip_fx: RandomSkip cannot restore its generator state.*seed=7"):
        again.load_state_dict(state)
    assert torch.equal(again.select(view).weight, fresh), "after the warning the rule should draw as a fresh one"


# ---------------------------------------------------------------------------------------------
# random baseline


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 50), keep=st.floats(0.001, 1.0))
def test_random_exact_count(seed, n, keep):
    sel = RandomSkip(keep=keep, seed=seed).select(make_view(seed, n=n))
    assert int((sel.weight > 0).sum()) == max(1, round(keep * n)), (
        f"random keep={keep} of {n} should keep round(keep*n) >= 1 = {max(1, round(keep * n))!r} rows, kept "
        f"{int((sel.weight > 0).sum())!r}")
    assert set(sel.weight.unique().tolist()) <= {0.0, 1.0}, f"random skip (biased) should weight rows 0 or 1 only, got {sel.weight.unique().tolist()}"


def test_random_uniform_marginals():
    n, k, draws = 6, 2, mc_draws(3000)
    rule = RandomSkip(keep=k / n, seed=3)
    view = make_view(0, n=n)
    freq = torch.stack([rule.select(view).weight for _ in range(draws)]).mean(0)
    p = k / n
    assert ((freq - p).abs() <= Z * math.sqrt(p * (1 - p) / draws)).all(), (
        f"every row should be kept with probability {p:.3f} (binomial CI); frequencies {freq.tolist()}")


@pytest.mark.parametrize("matched", [lambda: CAPSkip(budget=0.3), lambda: SelectiveBackprop(beta=2.0),
                                     lambda: KABENA(tau=0.5), lambda: UpperBoundIS(b=4, tau_th=0.0)])
def test_random_match_count(matched):
    rule = RandomSkip(match=matched(), unbiased=False, seed=4)
    for t in range(8):
        view = make_view(50 + t, n=20, scale=4.0)
        sel = rule.select(view)
        other = sel.info["matched"]
        assert int((sel.weight > 0).sum()) == int((other.weight > 0).sum()), (
            f"step {t}: random match should keep as many rows as the matched rule ({int((other.weight > 0).sum())!r}), "
            f"kept {int((sel.weight > 0).sum())!r}")
    hts = RandomSkip(match=matched(), unbiased=True, seed=4).select(make_view(50, n=20, scale=4.0))
    k = int((hts.weight > 0).sum())
    if k:
        assert torch.allclose(hts.weight[hts.weight > 0], torch.full((k,), 20 / k, dtype=torch.float64)), (
            f"unbiased random match should weight each of its {k} kept rows N/k = {20 / k:.3f}, got "
            f"{hts.weight[hts.weight > 0].tolist()}")


# ---------------------------------------------------------------------------------------------
# determinism, equivariance, finiteness, state


def _random_rules():
    return [lambda: RandomSkip(keep=0.4), lambda: RandomSkip(match=CAPSkip(budget=0.2)),
            lambda: SelectiveBackprop(beta=2.0, history=64), lambda: SelectiveBackprop(keep=0.4, sample=True),
            lambda: StaleSB(history=64), lambda: KABENA(tau=0.5, pi_min=0.1),
            lambda: UpperBoundIS(tau_th=0.0), lambda: UpperBoundIS(b=0.5),
            lambda: RandomSkip(match=SelectiveBackprop(history=32), unbiased=True)]


@pytest.mark.parametrize("factory", _random_rules())
def test_deterministic_given_generator(factory):
    a, b = factory(), factory()
    for t in range(4):
        ga, gb = torch.Generator().manual_seed(t), torch.Generator().manual_seed(t)
        wa = a.select(make_view(t, n=12, generator=ga)).weight
        wb = b.select(make_view(t, n=12, generator=gb)).weight
        assert torch.equal(wa, wb), f"step {t}: two rules given equally seeded generators should select the same rows"
    # the rule's own seeded generator, when the runtime passes none
    a, b = factory(), factory()
    for t in range(4):
        assert torch.equal(a.select(make_view(t, n=12)).weight, b.select(make_view(t, n=12)).weight), (
            f"step {t}: two rules with their own default seeds should select the same rows")


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 24))
def test_permutation_equivariance(seed, n):
    view = make_view(seed, n=n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    pv = permuted(view, perm)
    # deterministic: the decision itself (losses are distinct with continuous logits)
    top = dict(keep=0.5, sample=False, start=0.0, end=1.0, interrupt=0)
    assert (torch.equal(SelectiveBackprop(**top).select(pv).weight,
                       SelectiveBackprop(**top).select(view).weight[perm])), (
        "deterministic SB on permuted rows should keep the permuted rows (its choice follows the losses, not positions)")
    # randomised: the inclusion probabilities / kept count
    for factory in [lambda: SelectiveBackprop(beta=2.0, prime_epochs=0), lambda: KABENA(tau=0.5), lambda: UpperBoundIS()]:
        a, b = factory().select(view), factory().select(pv)
        torch.testing.assert_close(b.info["prob"], a.info["prob"][perm], rtol=1e-10, atol=1e-15)
    a, b = KABENA(tau=0.5).select(view), KABENA(tau=0.5).select(pv)
    assert int(a.info["K"]) == int(b.info["K"]), (
        f"KABENA's K should not depend on the row order: {int(a.info['K'])!r} vs {int(b.info['K'])!r} permuted")
    ra, rb = RandomSkip(match=CAPSkip(budget=0.3)), RandomSkip(match=CAPSkip(budget=0.3))
    assert int(ra.select(view).weight.sum()) == int(rb.select(pv).weight.sum()), (
        "random matching CAPSkip should keep as many rows whatever the row order")


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 32), scale=st.sampled_from([0.0, 1.0, 8.0, 40.0]),
       dtype=st.sampled_from([torch.float32, torch.float64]), explicit=st.booleans())
def test_weights_finite_nonnegative(seed, n, scale, dtype, explicit):
    view = make_view(seed, n=n, scale=scale, dtype=dtype, explicit_targets=explicit)
    for factory in _random_rules():
        w = factory().select(view).weight
        assert w.shape == (n,), f"{factory().name}: the weights should be one per row ({n}), got shape {tuple(w.shape)!r}"
        assert w.dtype == dtype, f"{factory().name}: the weights should have the logits' dtype {dtype}, got {w.dtype!r}"
        assert torch.isfinite(w).all(), f"{factory().name}: a weight is not finite (scale {scale}): {w.tolist()}"
        assert (w >= 0).all(), f"{factory().name}: a weight is negative: {w.tolist()}"
        kept = w[w != 0]
        assert (kept > 0).all(), f"{factory().name}: a kept row must have a positive weight: {w.tolist()}"


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("factory", _random_rules() + [lambda: UpperBoundIS(b=3)])
def test_state_dict_roundtrip_mid_run(factory):
    rule = factory()
    for t in range(5):
        rule.select(make_view(t, n=10, epoch=t // 2))
    state = _roundtrip(rule.state_dict())
    after = [rule.select(make_view(100 + t, n=10, epoch=3)).weight for t in range(5)]
    fresh = factory()
    fresh.load_state_dict(state)
    again = [fresh.select(make_view(100 + t, n=10, epoch=3)).weight for t in range(5)]
    for x, y in zip(after, again):
        assert torch.equal(x, y), "a rule restored from its state_dict mid-run should select exactly as the original does from there"


def test_sb_history_is_a_ring():
    rule = SelectiveBackprop(history=10, prime_epochs=0)
    for t in range(3):
        rule.select(make_view(t, n=4))
    assert rule.hist_pos == 2, f"3 batches of 4 into a history of 10 should wrap the ring's position to 12 mod 10 = 2, got {rule.hist_pos!r}"
    assert int((~torch.isnan(rule.history)).sum()) == 10, (
        f"12 losses into a ring of 10 should fill it, filled {int((~torch.isnan(rule.history)).sum())!r}")
    big = SelectiveBackprop(history=3, prime_epochs=0)
    v = make_view(9, n=7)
    big.select(v)
    loss = per_example_ce(v.z, v.targets)
    torch.testing.assert_close(big.history, loss[-3:])  # only the last R of an oversized batch
