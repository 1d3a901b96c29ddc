"""Math and controller of VCAS (capskip_fx/vcas/; spec shared/research/algorithms.md §4).

Pure CPU, float64, fixed seeds.  Statistical checks use tolerances derived from the number of draws
(standard errors), and every Hypothesis test is derandomized so the file is deterministic.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capskip_fx.vcas.controller import VCAS, ProbeResult, VcasController, find_top_sum
from capskip_fx.vcas.sampling import bernoulli_keep, closed_form_var, ht_scale, soft_topk, systematic_keep
from helpers.examples import derandomize, examples

FAST = settings(max_examples=examples(200), deadline=None, derandomize=derandomize(),
                suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=examples(15), deadline=None, derandomize=derandomize(),
               suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------------
# 1. soft_topk
# ---------------------------------------------------------------------------------------------------

# nonnegative scores with plenty of zeros and ties (values drawn from a small set) next to generic floats
_score = st.one_of(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 3.0]),
                   st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False))


@st.composite
def scores_and_k(draw):
    a = draw(st.lists(_score, min_size=1, max_size=40))
    n = len(a)
    # k in (0, n]; k >= 1e-6 keeps c*a clear of float underflow (k = 5e-324 gives p = 0 for a > 0)
    k = draw(st.one_of(st.floats(min_value=1e-6, max_value=float(n), allow_nan=False),
                       st.integers(min_value=1, max_value=n).map(float)))
    return torch.tensor(a, dtype=torch.float64), k


def _check_water_filling(a: torch.Tensor, k: float, p: torch.Tensor) -> None:
    n = a.shape[0]
    nnz = int((a > 0).sum())
    assert p.shape == (n,), f"soft_topk must give one keep probability per row; got shape {p.shape!r} for {n} rows"
    assert p.dtype == torch.float64, (
        f"keep probabilities must be float64 so the HT weights 1/p are exact enough; got {p.dtype!r}")
    assert torch.isfinite(p).all(), "keep probabilities must be finite (a nan/inf would poison the HT weights)"
    assert (p >= 0).all(), "keep probabilities must be nonnegative"
    assert (p <= 1).all(), "keep probabilities must not exceed 1"
    assert (p[a == 0] == 0).all(), "a row with zero score carries no gradient and must never be kept"
    # budget: sum p == min(k, #nonzero)
    target = min(k, nnz)
    assert abs(float(p.sum()) - target) <= 1e-9 * max(1.0, target), (
        f"the probabilities must spend exactly the budget min(k, #nonzero) = {target!r}; got sum {float(p.sum())!r}")
    # every positive score gets a positive probability (needed for unbiasedness)
    assert (p[a > 0] > 0).all(), "every row with a positive score needs p > 0, or the HT estimate is biased"
    # monotone in the score
    ai, aj = a[:, None], a[None, :]
    pi, pj = p[:, None], p[None, :]
    assert not ((ai >= aj) & (pi < pj - 1e-12)).any(), (
        "soft_topk must be monotone: a larger score may not get a smaller keep probability")
    # optimality: unclipped entries share one ratio c = p/a, clipped ones have c*a >= 1
    free = (p > 0) & (p < 1)
    if free.any():
        ratios = p[free] / a[free]
        c = float(ratios.mean())
        assert torch.allclose(ratios, torch.full_like(ratios, c), rtol=1e-9, atol=0), (
            "water-filling optimality: unclipped rows must share one ratio p/score")
        clipped = p == 1
        assert (c * a[clipped] >= 1 - 1e-9).all(), (
            "water-filling optimality: a row clipped at p = 1 must have c * score >= 1")
    if k >= nnz:
        assert torch.equal(p, (a > 0).double()), (
            "with budget >= #nonzero rows every nonzero row must be kept for sure (p = 1), zeros dropped")


@FAST
@given(scores_and_k())
def test_soft_topk_water_filling(ak):
    a, k = ak
    _check_water_filling(a, k, soft_topk(a, k))


@FAST
@given(scores_and_k())
def test_soft_topk_tensor_k_and_float32_input(ak):
    a, k = ak
    p = soft_topk(a, torch.tensor(k, dtype=torch.float64))
    assert torch.equal(p, soft_topk(a, k)), "a tensor budget must give the same probabilities as the equal float budget"
    # float32 input: computed in float64 from the float32 values
    a32 = a.float()
    _check_water_filling(a32.double(), k, soft_topk(a32, k))


@FAST
@given(scores_and_k(), st.floats(min_value=0.0, max_value=1.0))
def test_soft_topk_monotone_in_budget(ak, frac):
    a, k = ak
    k2 = k + frac * (a.shape[0] - k)  # k <= k2 <= n
    p1, p2 = soft_topk(a, k), soft_topk(a, k2)
    assert (p1 <= p2 + 1e-12).all(), "raising the budget must never lower a row's keep probability"


@FAST
@given(st.lists(_score, min_size=1, max_size=40), st.floats(min_value=0.0, max_value=5.0))
def test_soft_topk_budget_at_least_nonzero_count(a, extra):
    a = torch.tensor(a, dtype=torch.float64)
    nnz = int((a > 0).sum())
    k = max(nnz + extra, 1e-3)  # k >= #nonzero (may exceed n)
    assert torch.equal(soft_topk(a, k), (a > 0).double()), (
        "a budget at least the nonzero count must keep every nonzero row surely and drop the zeros")


def test_soft_topk_examples():
    a = torch.tensor([3.0, 3.0, 1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    # k small: nothing clipped, p proportional to a, c = k / sum(a)
    torch.testing.assert_close(soft_topk(a, 2.0), a * (2.0 / 8.5), rtol=1e-12, atol=0)
    # k = 4: top two clipped, c = 2 / 2.5
    torch.testing.assert_close(soft_topk(a, 4.0), torch.tensor([1, 1, 0.8, 0.8, 0, 0.4], dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)
    assert soft_topk(torch.zeros(0), 1.0).shape == (0,), "an empty score vector must give an empty probability vector"
    assert torch.equal(soft_topk(torch.zeros(3), 2.0), torch.zeros(3, dtype=torch.float64)), (
        "all-zero scores must give all-zero keep probabilities (nothing carries gradient)")


# ---------------------------------------------------------------------------------------------------
# 2. unbiasedness of Bernoulli + Horvitz-Thompson for a weight gradient
# ---------------------------------------------------------------------------------------------------

def _problem(T: int, d_out: int, d_in: int, seed: int, zero_rows: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # heterogeneous row scales so that some rows are clipped and some sampled
    scale = torch.exp(1.5 * torch.randn(T, 1, generator=gen, dtype=torch.float64))
    g = torch.randn(T, d_out, generator=gen, dtype=torch.float64) * scale
    x = torch.randn(T, d_in, generator=gen, dtype=torch.float64)
    if zero_rows:
        g[torch.randperm(T, generator=gen)[:zero_rows]] = 0.0
    return g, x


def _draws(g, x, p, n_draws: int, seed: int):
    """n_draws independent HT estimates of g.T @ x, as one batched contraction: (D, out, in)."""
    gen = torch.Generator().manual_seed(seed)
    pb = p.expand(n_draws, -1)
    keep = bernoulli_keep(pb, generator=gen)
    w = ht_scale(pb, keep)
    assert torch.equal(w == 0, ~keep), "HT weight must be zero exactly on the dropped rows (and nonzero on kept ones)"
    return torch.einsum("dt,to,ti->doi", w, g, x), keep


def _elementwise_var(g, x, p):
    """Var of each entry of the HT estimate: sum_t (1/p_t - 1) (g_to x_ti)^2 over p_t > 0."""
    f = torch.where(p > 0, 1.0 / p.clamp_min(1e-300) - 1.0, torch.zeros_like(p))
    return torch.einsum("t,to,ti->oi", f, g * g, x * x)


def _check_unbiased(g, x, nu, n_draws, seed, n_se):
    T = g.shape[0]
    q = g.norm(dim=1) * x.norm(dim=1)
    p = soft_topk(q, nu * T)
    exact = g.T @ x
    est, keep = _draws(g, x, p, n_draws, seed)
    # rows with q = 0 are never kept, rows with p = 1 always
    assert not keep[:, q == 0].any(), "a row with zero score (p = 0) was kept; it carries no gradient"
    assert keep[:, p == 1].all(), "a row with p = 1 was dropped; it must be kept in every draw"
    mean = est.mean(0)
    var = _elementwise_var(g, x, p)
    se = (var / n_draws).sqrt()
    tol = n_se * se + 1e-10 * exact.abs().max().clamp_min(1.0)
    assert ((mean - exact).abs() <= tol).all(), float(((mean - exact).abs() / se.clamp_min(1e-300)).max())
    # in norm: E||mean - exact||^2 = closed_form_var / n_draws
    v = float(closed_form_var(q, p))
    assert float(((mean - exact) ** 2).sum()) <= 16 * v / n_draws + 1e-18, (
        f"the HT mean's squared error exceeds 16x its closed-form expectation, so the estimate looks biased; got {float(((mean - exact) ** 2).sum())!r}, allowed {16 * v / n_draws + 1e-18!r}")
    return p, est


@FEW
@given(T=st.integers(2, 24), d_out=st.integers(1, 5), d_in=st.integers(1, 5),
       nu=st.floats(min_value=0.05, max_value=1.0), zero_frac=st.floats(0.0, 0.5), seed=st.integers(0, 2**31 - 1))
def test_ht_estimator_unbiased_hypothesis(T, d_out, d_in, nu, zero_frac, seed):
    g, x = _problem(T, d_out, d_in, seed, zero_rows=int(zero_frac * T))
    _check_unbiased(g, x, nu, n_draws=3000, seed=seed + 1, n_se=5.0)


def test_ht_estimator_unbiased_seeded():
    g, x = _problem(64, 6, 5, seed=1234, zero_rows=4)
    p, est = _check_unbiased(g, x, 0.3, n_draws=20000, seed=99, n_se=4.5)
    assert ((p > 0) & (p < 1)).any(), "the seeded example must have rows sampled with 0 < p < 1 (the sampled regime)"
    assert (p == 1).any(), (
        "the seeded example must have rows clipped at p = 1 (the sure-keep regime)")  # the example exercises both regimes
    # realised keep count has mean k = nu*T
    # (sum p = k exactly, checked in the soft_topk tests; here: the sampler's frequencies match p)
    gen = torch.Generator().manual_seed(7)
    keep = bernoulli_keep(p.expand(20000, -1), generator=gen).double()
    freq_se = (p * (1 - p) / 20000).sqrt()
    assert ((keep.mean(0) - p).abs() <= 4.5 * freq_se + 1e-12).all(), (
        "Bernoulli keep frequencies must match the probabilities p within 4.5 standard errors")


def test_bernoulli_keep_and_ht_scale_edges():
    p = torch.tensor([0.0, 1.0, 0.5, 1e-300], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    keep = bernoulli_keep(p.expand(1000, -1), generator=gen)
    assert not keep[:, 0].any(), "a row with p = 0 was kept by bernoulli_keep"
    assert keep[:, 1].all(), "a row with p = 1 was dropped by bernoulli_keep"
    w = ht_scale(p.expand(1000, -1), keep)
    assert torch.isfinite(w).all(), "HT weights must stay finite even for p as small as 1e-300"
    assert (w[:, 0] == 0).all(), "a never-kept row (p = 0) must get HT weight 0"
    assert (w[:, 1] == 1).all(), "a surely-kept row (p = 1) must get HT weight exactly 1"
    assert set(w[:, 2].unique().tolist()) <= {0.0, 2.0}, (
        f"a row with p = 0.5 must get HT weight 0 (dropped) or 1/p = 2 (kept); got {set(w[:, 2].unique().tolist())!r}")
    # same seed, same masks
    k1 = bernoulli_keep(p, generator=torch.Generator().manual_seed(5))
    k2 = bernoulli_keep(p, generator=torch.Generator().manual_seed(5))
    assert torch.equal(k1, k2), "bernoulli_keep must be reproducible: the same seed must give the same mask"


def _systematic_draws(p: torch.Tensor, k: int, n_draws: int, seed: int) -> torch.Tensor:
    """(n_draws, n) HT weights of n_draws systematic samples of size k."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.zeros(n_draws, p.shape[0], dtype=torch.float64)
    for d in range(n_draws):
        idx, hit = systematic_keep(p, k, gen)
        assert idx.shape == (k,), f"systematic_keep must return exactly k = {k} slots; got shape {idx.shape!r}"
        assert idx.unique().numel() == k, (
            "systematic_keep slots must be distinct rows (no row counted twice)")  # k distinct slots
        w[d, idx] = torch.where(hit, 1.0 / p[idx].clamp_min(1e-300), 0.0)
    return w


@FEW
@given(T=st.integers(2, 24), frac=st.floats(min_value=0.05, max_value=0.95), zero_frac=st.floats(0.0, 0.6),
       seed=st.integers(0, 2**31 - 1))
def test_systematic_keep_inclusion_probabilities_and_size(T, frac, zero_frac, seed):
    """Exactly k slots; P(row kept) = p_i (z-test over draws); kept count = sum p when sum p = k (every
    draw), fewer (padding, weight 0) when fewer than k rows have p > 0; p = 0 never, p = 1 always."""
    g, x = _problem(T, 3, 2, seed, zero_rows=int(zero_frac * T))
    q = g.norm(dim=1) * x.norm(dim=1)
    k = max(1, int(frac * T))
    p = soft_topk(q, k)
    w = _systematic_draws(p, k, 2000, seed + 1)
    keep = w > 0
    freq_se = (p * (1 - p) / 2000).sqrt()
    assert ((keep.double().mean(0) - p).abs() <= 5 * freq_se + 1e-12).all(), (
        "systematic sampling must keep each row with probability p (keep frequencies within 5 standard errors)")
    assert not keep[:, p == 0].any(), "systematic sampling kept a row with p = 0; it carries no gradient"
    assert keep[:, p == 1].all(), "systematic sampling dropped a row with p = 1; it must be kept in every draw"
    npos = int((q > 0).sum())
    counts = keep.sum(1)
    if npos >= k:
        assert (counts == k).all(), (
            f"when at least k rows have p > 0 every draw must keep exactly k = {k} rows; got counts {counts.unique().tolist()!r}")
    else:
        assert (counts == npos).all(), (
            f"with fewer than k rows having p > 0 every draw must keep all {npos} of them; got counts {counts.unique().tolist()!r}")


def test_systematic_ht_unbiased_and_not_noisier_than_bernoulli():
    """The fixed-size draw's HT estimate of g.T @ x is unbiased, and its variance (Monte Carlo) is at most
    the independent Bernoulli draw's closed form (what the controller budgets with)."""
    g, x = _problem(64, 6, 5, seed=1234, zero_rows=4)
    q = g.norm(dim=1) * x.norm(dim=1)
    exact = g.T @ x
    for nu in (0.1, 0.3, 0.6):
        k = int(nu * 64)
        p = soft_topk(q, k)
        w = _systematic_draws(p, k, 4000, seed=int(nu * 100))
        est = torch.einsum("dt,to,ti->doi", w, g, x)
        se = (_elementwise_var(g, x, p) / 4000).sqrt()
        assert ((est.mean(0) - exact).abs() <= 5 * se + 1e-10 * exact.abs().max()).all(), (
            f"systematic HT estimate looks biased at nu = {nu}: its mean is more than 5 standard errors from g.T @ x")
        mc_var = float(((est - exact) ** 2).sum((1, 2)).mean())
        assert mc_var <= 1.05 * float(closed_form_var(q, p)), nu


def test_systematic_keep_edges_and_seeding():
    p = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.0], dtype=torch.float64)
    for seed in range(50):
        idx, hit = systematic_keep(p, 2, torch.Generator().manual_seed(seed))
        kept = set(idx[hit].tolist())
        assert 1 in kept, f"the row with p = 1 must be kept in every systematic draw; got kept = {kept!r}"
        assert len(kept) == 2, (
            f"a draw of size 2 over rows whose p sums to 2 must keep exactly 2 rows; got kept = {kept!r}")
        assert kept <= {1, 2, 3}, f"only rows with p > 0 (1, 2, 3) may be kept; got kept = {kept!r}"
    # more slots than rows with p > 0: padded with distinct unkept rows
    idx, hit = systematic_keep(p, 4, torch.Generator().manual_seed(0))
    assert idx.unique().numel() == 4, "padding slots must be distinct rows when k exceeds the rows with p > 0"
    assert int(hit.sum()) == 2, (
        f"only the 2 rows with p > 0 may count as kept, padding has weight 0; got {int(hit.sum())!r}")
    a = systematic_keep(p, 2, torch.Generator().manual_seed(5))
    b = systematic_keep(p, 2, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]), "systematic_keep must be reproducible: same seed, same slots"
    assert torch.equal(a[1], b[1]), "systematic_keep must be reproducible: same seed, same kept flags"


# ---------------------------------------------------------------------------------------------------
# 3. closed-form variance
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nu,seed", [(0.1, 0), (0.3, 1), (0.6, 2)])
def test_closed_form_var_matches_monte_carlo(nu, seed):
    g, x = _problem(40, 5, 4, seed=seed, zero_rows=3)
    T = g.shape[0]
    q = g.norm(dim=1) * x.norm(dim=1)
    p = soft_topk(q, nu * T)
    v = float(closed_form_var(q, p))
    assert v > 0, f"the example must have positive sampling variance to test against; got {v!r}"
    n_draws = 5000
    est, _ = _draws(g, x, p, n_draws, seed=100 + seed)
    sq = ((est - g.T @ x) ** 2).sum(dim=(1, 2))  # per-draw squared error
    emp = float(sq.mean())
    se = float(sq.std()) / math.sqrt(n_draws)
    assert abs(emp - v) <= 5 * se, (emp, v, se)
    assert se < 0.1 * v, (
        f"the Monte Carlo standard error must be small beside the variance for the check to mean anything; got se {se!r} vs variance {v!r}")  # the interval is informative


def test_closed_form_var_formula_and_edges():
    q = torch.tensor([2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    p = torch.tensor([0.5, 0.0, 0.25, 1.0], dtype=torch.float64)
    # (1/0.5 - 1)*4 + (1/0.25 - 1)*1 + 0 = 4 + 3
    assert float(closed_form_var(q, p)) == pytest.approx(7.0, rel=1e-12), (
        f"closed_form_var must equal sum (1/p - 1) q^2 = 7 on the hand example; got {float(closed_form_var(q, p))!r}")
    # q = 0 rows with p = 0 contribute nothing (no inf / nan)
    assert float(closed_form_var(torch.zeros(3), torch.zeros(3))) == 0.0, (
        "rows with q = 0 and p = 0 must contribute zero variance (no inf / nan from 1/p)")


def test_closed_form_var_zero_at_full_budget_and_decreasing_in_nu():
    g, x = _problem(50, 4, 3, seed=3, zero_rows=5)
    T = g.shape[0]
    q = g.norm(dim=1) * x.norm(dim=1)
    assert float(closed_form_var(q, soft_topk(q, 1.0 * T))) == 0.0, (
        "at full budget every row is kept surely, so the sampling variance must be 0")
    assert torch.equal(soft_topk(q, 1.0 * T), (q > 0).double()), (
        "at full budget soft_topk must keep every nonzero row with p = 1")
    nus = [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.85]
    vs = [float(closed_form_var(q, soft_topk(q, nu * T))) for nu in nus]
    assert all(v1 > v2 > 0 for v1, v2 in zip(vs, vs[1:])), vs
    # at k = #nonzero the variance is 0 as well
    assert float(closed_form_var(q, soft_topk(q, float((q > 0).sum())))) == 0.0, (
        "with budget equal to the nonzero count every nonzero row is kept surely, so the variance must be 0")


@FAST
@given(scores_and_k(), st.floats(min_value=0.0, max_value=1.0))
def test_closed_form_var_non_increasing_in_budget(ak, frac):
    a, k = ak
    k2 = k + frac * (a.shape[0] - k)
    v1 = float(closed_form_var(a, soft_topk(a, k)))
    v2 = float(closed_form_var(a, soft_topk(a, k2)))
    assert v2 <= v1 * (1 + 1e-9) + 1e-12, (
        f"raising the budget must not raise the sampling variance; got {v2!r} at the larger budget vs {v1!r}")


# ---------------------------------------------------------------------------------------------------
# 4. find_top_sum
# ---------------------------------------------------------------------------------------------------

def _brute_top_sum(norms: list, share: Fraction) -> Fraction:
    srt = sorted(norms, reverse=True)
    total = sum(Fraction(v) for v in srt)
    n = len(srt)
    for m in range(1, n + 1):
        if sum(Fraction(v) for v in srt[:m]) >= share * total:
            return Fraction(m, n)
    raise AssertionError("unreachable")


@FAST
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(0, 1000))
def test_find_top_sum_brute_force_exact(norms, share_milli):
    share = Fraction(share_milli, 1000)
    got = find_top_sum(torch.tensor(norms, dtype=torch.float32), float(share))
    want = _brute_top_sum(norms, share)
    assert got == pytest.approx(float(want), abs=1e-15), (got, want)


@FAST
@given(st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=1, max_size=40),
       st.floats(min_value=0.0, max_value=1.0))
def test_find_top_sum_brute_force_float(norms, share):
    n = len(norms)
    f = find_top_sum(torch.tensor(norms, dtype=torch.float64), share)
    m = round(f * n)
    assert 1 <= m <= n, f"the kept fraction must cover between 1 and all {n} rows; got {m} rows (fraction {f!r})"
    assert f == m / n, f"find_top_sum must return a whole number of rows over n; got {f!r}, nearest {m}/{n}"
    srt = sorted(norms, reverse=True)
    total = math.fsum(srt)
    need = share * total
    assert math.fsum(srt[:m]) >= need * (1 - 1e-9) - 1e-300, (
        f"the top {m} rows must hold at least the requested share {share!r} of the total norm")
    if m > 1:
        assert math.fsum(srt[:m - 1]) < need * (1 + 1e-9) + 1e-300 or total == 0, (
            f"the top {m} rows are not minimal: the top {m - 1} already reach the share {share!r}")


@FAST
@given(st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=40))
def test_find_top_sum_share_one_all_positive(norms):
    assert find_top_sum(torch.tensor(norms), 1.0) == 1.0, (
        "share 1 with all norms positive must keep every row (fraction 1.0)")


def test_find_top_sum_share_one_keeps_a_tiny_row():
    """Issue 23: the relative tolerance (1e-12 of the total) dropped a row smaller than it at share 1;
    the reference (vcas/layers/utils.py 42-48) counts every positive row there."""
    assert find_top_sum(torch.tensor([1.0] * 9 + [1e-14], dtype=torch.float64), 1.0) == 1.0, (
        "share 1 must keep a tiny positive row too (issue 23), not drop it under a relative tolerance")
    assert find_top_sum(torch.tensor([1.0, 1e-13, 0.0], dtype=torch.float64), 1.0) == pytest.approx(2 / 3), (
        "share 1 must keep both positive rows (2 of 3), the 1e-13 one included, and only the zero dropped")


def test_find_top_sum_examples():
    assert find_top_sum(torch.tensor([1.0, 1.0, 2.0]), 0.5) == pytest.approx(1 / 3), (
        "share 0.5 of [1, 1, 2] is reached by the top row alone: fraction 1/3")
    assert find_top_sum(torch.tensor([1.0, 1.0, 2.0]), 0.51) == pytest.approx(2 / 3), (
        "share 0.51 of [1, 1, 2] needs the top two rows: fraction 2/3")
    assert find_top_sum(torch.ones(25), 0.28) == pytest.approx(0.28), (
        "share 0.28 of 25 equal rows needs 7 rows despite 0.28*25 rounding to 7.000000000000001")  # 0.28*25 is 7.000000000000001 in floats
    assert find_top_sum(torch.ones(2, 5), 0.6) == pytest.approx(0.6), (
        "find_top_sum must flatten any shape: share 0.6 of 10 equal rows is 6 rows")  # any shape, flattened
    assert find_top_sum(torch.zeros(0), 0.5) == 1.0, "no rows at all must count as keeping everything (fraction 1.0)"


# ---------------------------------------------------------------------------------------------------
# 5. VcasController
# ---------------------------------------------------------------------------------------------------

def _probe(sgd=1.0, act=0.0, w_var=(), w_sgd=(), norms=()):
    return ProbeResult(sgd_var=sgd, act_var=act, w_var=list(w_var), w_sgd_var=list(w_sgd), norms=list(norms))


def _ctrl(boundaries=2, matmuls=2, **cfg):
    c = VcasController(VCAS(**cfg))
    c.ensure(boundaries, matmuls)
    return c


def test_controller_ensure():
    c = _ctrl(3, 4)
    assert c.rho == [1.0] * 3, (
        f"ensure must start every boundary's activation keep ratio rho at 1 (dense); got {c.rho!r}")
    assert c.nu == [1.0] * 4, f"ensure must start every matmul's weight keep ratio nu at 1 (dense); got {c.nu!r}"
    assert c.s == 1.0, f"ensure must start the norm share s at 1 (keep all); got {c.s!r}"
    c.rho = [0.5, 0.4, 0.3]
    c.ensure(3, 4)
    assert c.rho == [0.5, 0.4, 0.3], (
        f"ensure with unchanged sizes must keep the learned rho; got {c.rho!r}")  # same sizes: kept
    c.ensure(2, 4)
    assert c.rho == [1.0, 1.0], f"ensure with a new boundary count must reset rho to dense; got {c.rho!r}"


def test_controller_s_direction_and_clamps():
    norms = [torch.ones(8), torch.ones(8)]
    c = _ctrl(2, 0, tau_act=0.1, s_step=0.05)
    c.s = 0.5
    c.update(_probe(sgd=1.0, act=0.2, norms=norms))  # over budget -> keep more mass
    assert c.s == pytest.approx(0.55), (
        f"activation variance over budget must raise s by s_step (0.5 -> 0.55); got {c.s!r}")
    c.update(_probe(sgd=1.0, act=0.05, norms=norms))  # under budget -> keep less
    assert c.s == pytest.approx(0.5), (
        f"activation variance under budget must lower s by s_step (0.55 -> 0.5); got {c.s!r}")
    c.update(_probe(sgd=1.0, act=0.1, norms=norms))  # exactly at tau counts as under
    assert c.s == pytest.approx(0.45), (
        f"activation variance exactly at tau counts as under budget (0.5 -> 0.45); got {c.s!r}")
    c.s = 0.98
    c.update(_probe(sgd=1.0, act=1.0, norms=norms))
    assert c.s == 1.0, f"s must be clamped at 1 when raised past it; got {c.s!r}"
    c.s = 0.02
    c.update(_probe(sgd=1.0, act=0.0, norms=norms))
    assert c.s == 0.0, f"s must be clamped at 0 when lowered past it; got {c.s!r}"
    assert c.probes_done == 5, f"each update is one probe; after 5 updates got probes_done = {c.probes_done!r}"
    assert c.last["act_ratio"] == 0.0, (
        f"the last probe's activation ratio act_var/sgd_var must be recorded (0/1 = 0); got {c.last['act_ratio']!r}")
    assert c.last["sgd_var"] == 1.0, f"the last probe's SGD variance must be recorded; got {c.last['sgd_var']!r}"


def test_controller_s_increases_when_sgd_var_zero_but_act_var_positive():
    c = _ctrl(1, 1)
    c.s = 0.5
    c.update(_probe(sgd=0.0, act=1.0, w_var=[1.0], w_sgd=[0.0], norms=[torch.ones(4)]))
    assert c.nu == [pytest.approx(1 / 0.95)], (
        f"weight variance > 0 with zero SGD variance is over budget, so nu must grow by 1/w_mul; got {c.nu!r}")  # weight branch: w_var > 0 with zero SGD variance is over budget
    assert c.s > 0.5, (
        f"the activation branch must treat act_var > 0 with zero SGD variance as over budget and raise s; got {c.s!r}")  # activation branch should behave the same way


def test_controller_zero_variances_count_as_under_budget():
    c = _ctrl(1, 1)
    c.s, c.nu = 0.5, [0.5]
    c.update(_probe(sgd=0.0, act=0.0, w_var=[0.0], w_sgd=[0.0], norms=[torch.ones(4)]))
    assert c.s == pytest.approx(0.49), (
        f"zero activation and SGD variance counts as under budget, so s must fall by s_step (0.5 -> 0.49); got {c.s!r}")
    assert c.nu == [pytest.approx(0.475)], (
        f"zero weight and SGD variance counts as under budget, so nu must shrink by w_mul (0.5 -> 0.475); got {c.nu!r}")


def test_controller_nu_direction_and_clamps():
    c = _ctrl(1, 4, tau_w=0.1, w_mul=0.5, nu_min=0.01)
    c.nu = [0.2, 0.2, 0.8, 0.015]
    c.update(_probe(w_var=[1.0, 0.01, 1.0, 0.0], w_sgd=[1.0, 1.0, 1.0, 1.0], norms=[torch.ones(3)]))
    assert c.nu == [pytest.approx(0.4), pytest.approx(0.1), pytest.approx(1.6), 0.01], (
        f"nu must grow by 1/w_mul over budget, shrink by w_mul under it, clamp at nu_min, and not be capped at 1; got {c.nu!r}")  # no cap at 1 (reference)
    assert c.last["w_ratio"] == [1.0, 0.01, 1.0, 0.0], (
        f"the per-matmul weight ratio w_var/w_sgd_var must be recorded; got {c.last['w_ratio']!r}")
    # exactly at tau counts as under; sgd = 0 and w_var > 0 counts as over
    c.nu = [0.5, 0.5, 0.5, 0.5]
    c.update(_probe(w_var=[0.1, 1.0, 0.0, 0.3], w_sgd=[1.0, 0.0, 0.0, 1.0], norms=[torch.ones(3)]))
    assert c.nu == [pytest.approx(0.25), 1.0, pytest.approx(0.25), 1.0], (
        f"w ratio exactly at tau is under budget, and w_var > 0 with zero SGD variance is over; got {c.nu!r}")
    capped = _ctrl(1, 2, tau_w=0.1, w_mul=0.5, nu_max=1.0)  # our earlier cap, as an option
    capped.nu = [0.8, 0.8]
    capped.update(_probe(w_var=[1.0, 0.0], w_sgd=[1.0, 1.0], norms=[torch.ones(3)]))
    assert capped.nu == [1.0, pytest.approx(0.4)], (
        f"with nu_max = 1 an over-budget nu must be capped at 1; got {capped.nu!r}")


def test_controller_rho_uses_new_s_and_ema():
    # equal norms: find_top_sum(s) = ceil(n s) / n, so s_old = 0.5 and s_new = 0.6 / 0.4 differ
    n = 100
    norms = [torch.ones(n), torch.ones(n), torch.ones(n)]
    for act, s_new in ((1.0, 0.6), (0.0, 0.4)):
        c = _ctrl(3, 0, tau_act=0.5, s_step=0.1, rho_decay=0.6)
        c.s = 0.5
        old = [0.9, 0.8, 0.7]
        c.rho = list(old)
        c.update(_probe(sgd=1.0, act=act, norms=norms))
        assert c.s == pytest.approx(s_new), (
            f"s must move by s_step in the direction of the activation budget; got {c.s!r}, expected {s_new!r}")
        assert find_top_sum(norms[0], s_new) != find_top_sum(norms[0], 0.5), (
            "the test needs s_new to change the top-sum fraction, or rho could not show which s it used")
        want = [0.6 * o + 0.4 * s_new for o in old]
        assert c.rho == [pytest.approx(w, abs=1e-12) for w in want], (
            f"rho must be the EMA of the old rho and the top-sum fraction at the new s; got {c.rho!r}")


def test_controller_rho_raised_from_the_bottom():
    # raw per-boundary fractions at s: top concentrated (small), lower ones spread (large)
    n = 10
    top = torch.tensor([100.0] + [1.0] * (n - 1))
    mid = torch.ones(n)
    low = torch.tensor([5.0] * 5 + [1.0] * 5)
    c = _ctrl(3, 0, tau_act=1e9, s_step=0.01, rho_decay=0.0)  # act under budget: s = 1.0 -> 0.99
    c.update(_probe(sgd=1.0, act=0.0, norms=[mid, top, low]))
    s = c.s
    raw = [find_top_sum(t, s) for t in (mid, top, low)]
    assert raw[1] < raw[2], (
        f"the example needs the raw fraction to rise below the top boundary; got {raw[1]!r} vs {raw[2]!r}")  # the raw schedule increases below the top one ...
    # ... and, as the reference, each boundary is raised to the max of those below it (rho is top first)
    want = [max(raw), max(raw[1], raw[2]), raw[2]]
    assert c.rho == [pytest.approx(w) for w in want], (
        f"each boundary's rho must be raised to the max of the raw fractions below it; got {c.rho!r}")
    assert all(a >= b for a, b in zip(c.rho, c.rho[1:])), (
        f"rho must be non-increasing from the top boundary down; got {c.rho!r}")


@settings(max_examples=examples(40), deadline=None, derandomize=derandomize(), suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_controller_invariants_random_probes(data):
    B = data.draw(st.integers(1, 5), label="boundaries")
    M = data.draw(st.integers(0, 4), label="matmuls")
    cfg = VCAS(tau_act=data.draw(st.floats(0.01, 1.0)), tau_w=data.draw(st.floats(0.01, 1.0)),
               s_step=data.draw(st.sampled_from([0.01, 0.05, 0.2])), w_mul=data.draw(st.floats(0.5, 0.99)),
               rho_decay=data.draw(st.floats(0.0, 1.0)), nu_min=data.draw(st.sampled_from([0.0, 1e-3, 0.1, 0.5])),
               nu_max=data.draw(st.sampled_from([1.0, 2.0, math.inf])))
    c = VcasController(cfg)
    c.ensure(B, M)
    pos = st.floats(min_value=0.0, max_value=10.0)
    for _ in range(data.draw(st.integers(1, 6), label="probes")):
        r = ProbeResult(
            sgd_var=data.draw(st.floats(1e-3, 10.0)), act_var=data.draw(pos),
            w_var=[data.draw(pos) for _ in range(M)], w_sgd_var=[data.draw(st.floats(1e-3, 10.0)) for _ in range(M)],
            norms=[torch.tensor(data.draw(st.lists(pos, min_size=1, max_size=12)), dtype=torch.float64)
                   for _ in range(B)])
        s0, rho0, nu0 = c.s, list(c.rho), list(c.nu)
        c.update(r)
        if r.act_var / r.sgd_var > cfg.tau_act:
            assert c.s == pytest.approx(min(1.0, s0 + cfg.s_step)), (
                f"activation variance over budget must raise s by s_step, clamped at 1; got {c.s!r} from {s0!r}")
        else:
            assert c.s == pytest.approx(max(0.0, s0 - cfg.s_step)), (
                f"activation variance under budget must lower s by s_step, clamped at 0; got {c.s!r} from {s0!r}")
        new = [find_top_sum(t, c.s) for t in r.norms]
        for i in range(B - 2, -1, -1):
            new[i] = max(new[i], new[i + 1])
        assert (c.rho == [pytest.approx(cfg.rho_decay * o + (1 - cfg.rho_decay) * w, abs=1e-12)
                         for o, w in zip(rho0, new)]), (
            f"rho must be the EMA of the old rho and the bottom-up-raised top-sum fractions; got {c.rho!r}")
        assert all(a >= b - 1e-12 for a, b in zip(c.rho, c.rho[1:])), (
            f"rho must be non-increasing from the top boundary down; got {c.rho!r}")
        assert all(0 < v <= 1 for v in c.rho), f"every keep ratio rho must lie in (0, 1]; got {c.rho!r}"
        for j in range(M):
            if r.w_var[j] / r.w_sgd_var[j] > cfg.tau_w:
                assert c.nu[j] == pytest.approx(min(cfg.nu_max, nu0[j] / cfg.w_mul)), (
                    f"weight variance over budget must grow nu by 1/w_mul, capped at nu_max; got {c.nu[j]!r} from {nu0[j]!r}")
            else:
                assert c.nu[j] == pytest.approx(max(cfg.nu_min, nu0[j] * cfg.w_mul)), (
                    f"weight variance under budget must shrink nu by w_mul, floored at nu_min; got {c.nu[j]!r} from {nu0[j]!r}")
            assert cfg.nu_min <= c.nu[j] <= cfg.nu_max, f"nu must stay within [nu_min, nu_max]; got {c.nu[j]!r}"
        assert 0.0 <= c.s <= 1.0, f"the norm share s must stay within [0, 1]; got {c.s!r}"
        assert 1 - 1e-12 <= c.step_units() <= 3.0 + 1e-12, (
            f"a step costs between 1 (forward only) and 3 (dense) units; got {c.step_units()!r}")
        assert c.flops_fraction() <= (3 * cfg.freq + 2 * cfg.probes) / (3 * cfg.freq) + 1e-12, (
            f"the FLOPs fraction may exceed dense only by the amortised probe cost; got {c.flops_fraction()!r}")


def test_controller_state_dict_round_trip():
    cfg = VCAS(freq=7, tau_act=0.05)
    c = VcasController(cfg)
    c.ensure(3, 2)
    c.update(_probe(sgd=1.0, act=1.0, w_var=[0.0, 1.0], w_sgd=[1.0, 1.0],
                    norms=[torch.arange(1.0, 6.0), torch.ones(5), torch.tensor([9.0, 1, 0, 0, 0])]))
    c.step = 15
    sd = c.state_dict()
    assert sd["config"] == dataclasses.asdict(cfg), (
        f"the state dict must carry the config, to rebuild the controller; got {sd['config']!r}")
    d = VcasController(cfg)
    d.load_state_dict(sd)
    assert d.state_dict() == sd, "loading a state dict and saving it again must give the same state dict"
    assert (d.s, d.rho, d.nu, d.step, d.probes_done) == (c.s, c.rho, c.nu, 15, 1), (
        f"a loaded controller must have the saved s, rho, nu, step and probe count; got {(d.s, d.rho, d.nu, d.step, d.probes_done)!r}")
    sd["rho"][0] = -1.0  # the state dict holds copies
    assert c.rho[0] != -1.0, "the state dict must hold copies: editing it changed the live controller's rho"
    # a loaded controller continues exactly like the original
    r = _probe(sgd=1.0, act=0.0, w_var=[1.0, 0.0], w_sgd=[1.0, 1.0], norms=[torch.ones(5)] * 3)
    c.update(r)
    d.update(r)
    assert c.state_dict() == d.state_dict(), (
        "a loaded controller must continue exactly like the original after the same probe")


def test_controller_loading_an_empty_state_starts_over():
    """A runner saved before it existed (a state from before the first step) loads ``{}``: the controller is
    then a fresh one, its sizes kept (rho and nu all ones, s 1, step 0)."""
    cfg = VCAS(freq=7, tau_act=0.05)
    c = VcasController(cfg)
    c.ensure(3, 2)
    fresh = c.state_dict()
    c.update(_probe(sgd=1.0, act=1.0, w_var=[0.0, 1.0], w_sgd=[1.0, 1.0],
                    norms=[torch.arange(1.0, 6.0), torch.ones(5), torch.tensor([9.0, 1, 0, 0, 0])]))
    c.step = 15
    assert c.state_dict() != fresh, "the probe should have moved the controller"
    c.load_state_dict({})
    assert c.state_dict() == fresh, f"an empty state should give a fresh controller: {c.state_dict()} vs {fresh}"


@pytest.mark.parametrize("freq", [1, 3, 100])
def test_controller_is_probe(freq):
    c = VcasController(VCAS(freq=freq))
    got = []
    for step in range(3 * freq):
        c.step = step
        got.append(c.is_probe())
    assert [i for i, v in enumerate(got) if v] == [0, freq, 2 * freq][: 3 * freq], (
        f"a probe must run on step 0 and every freq = {freq} steps after; got probe steps {[i for i, v in enumerate(got) if v]!r}")


@pytest.mark.parametrize("kw", [
    dict(tau_act=0), dict(tau_act=-0.1), dict(tau_act=math.inf), dict(tau_act=math.nan), dict(tau_act="0.1"),
    dict(tau_w=0.0), dict(tau_w=-1), dict(tau_w=math.nan),
    dict(freq=0), dict(freq=-5), dict(freq=1.5),
    dict(probes=0), dict(probes=2.0),
    dict(every=0),
    dict(w_mul=1), dict(w_mul=0), dict(w_mul=1.5), dict(w_mul=-0.5), dict(w_mul=math.nan),
    dict(rho_decay=-0.1), dict(rho_decay=1.1), dict(rho_decay=math.nan),
    dict(nu_min=-0.1), dict(nu_min=1.5), dict(nu_min=math.nan),
    dict(nu_max=0.5), dict(nu_max=math.nan),
])
def test_vcas_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        VCAS(**kw)


def test_vcas_config_accepts_edges():
    VCAS()
    VCAS(rho_decay=0.0, nu_min=1.0, nu_max=1.0, freq=1, probes=1, every=3, w_mul=0.5, tau_act=10, tau_w=1e-6)
    VCAS(rho_decay=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        VCAS().freq = 3


@pytest.mark.parametrize("s_step", [0.0, -0.01, math.nan])
def test_vcas_config_rejects_bad_s_step(s_step):
    with pytest.raises(ValueError):
        VCAS(s_step=s_step)


# ---------------------------------------------------------------------------------------------------
# 6. flops_fraction
# ---------------------------------------------------------------------------------------------------

def test_flops_fraction():
    c = _ctrl(3, 4)
    assert c.flops_fraction() == 1.0, (
        f"a dense controller (rho = nu = 1) must cost exactly the dense FLOPs; got {c.flops_fraction()!r}")
    assert c.step_units() == 3.0, f"a dense step costs 3 units (forward + two backward matmuls); got {c.step_units()!r}"
    c.rho, c.nu = [0.5] * 3, [0.5] * 4
    assert c.step_units() == pytest.approx(1 + 0.5 + 0.25), (
        f"step units must be 1 + mean rho + mean nu * mean rho = 1.75 at rho = nu = 0.5; got {c.step_units()!r}")
    # sampled step: 1 + mean rho + mean nu * mean rho (units of 3); probes amortised over freq
    c.rho, c.nu = [1.0, 0.5], [0.2, 0.4, 0.6]
    units = 1 + 0.75 + 0.4 * 0.75
    assert c.step_units() == pytest.approx(units), (
        f"step units must be 1 + mean rho + mean nu * mean rho; got {c.step_units()!r}, expected {units!r}")
    F, M = c.cfg.freq, c.cfg.probes
    assert c.flops_fraction() == pytest.approx(((F - 1) * units + 3 + M * 2 * 0.75) / (3 * F)), (
        f"FLOPs fraction must amortise one dense probe step and the probes' extra passes over freq steps; got {c.flops_fraction()!r}")
    assert c.flops_fraction("reference") == pytest.approx((units * F + 3 * M + M * M * (1 + 2 * 0.75)) / (3 * F)), (
        f"the reference FLOPs accounting must match its formula; got {c.flops_fraction('reference')!r}")
    c.nu = [2.0, 2.0, 2.0]  # nu >= 1 runs exact: counts 1 (the reference's log counts the raw nu)
    assert c.step_units() == pytest.approx(1 + 0.75 + 0.75), (
        f"nu >= 1 runs the weight gradient exactly, so it counts as 1; got {c.step_units()!r}")
    assert c.step_units(clip_nu=False) == pytest.approx(1 + 0.75 + 1.5), (
        f"with clip_nu=False the raw nu counts (as the reference logs it); got {c.step_units(clip_nu=False)!r}")
    assert VcasController(VCAS()).flops_fraction() == 1.0, (
        f"a controller with nothing registered must report dense cost 1.0; got {VcasController(VCAS()).flops_fraction()!r}")  # nothing registered yet
