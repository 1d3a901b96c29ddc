"""CAPSkip against a brute-force reference that builds every per-example last-layer gradient."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from capskip_fx.rules import CAPSkip, HeadView
from capskip_fx.rules.base import prefix_diagonal, prefix_route, prefix_sq_norms
from capskip_fx.rules.capskip import capskip_weights
from capskip_fx.rules.labels import correct_mask, infer_targets
from helpers.examples import examples

REL = 1e-9  # float64 rounding allowance at the budget boundary


def per_example_grads(delta, h, bias=True):
    hh = torch.cat([h, torch.ones(h.shape[0], 1, dtype=h.dtype)], 1) if bias else h
    return torch.einsum("nc,nd->ncd", delta, hh).flatten(1)  # row i = vec(delta_i (x) [h_i; 1])


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    c = draw(st.sampled_from([2, 3, 7, 50]))
    d = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, c, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.5, 3.0]))
    y = torch.randint(0, c, (n,), generator=g)
    mode = draw(st.sampled_from(["random", "all_correct", "none_correct"]))
    if mode == "all_correct":
        y = z.argmax(1)
    elif mode == "none_correct":
        y = (z.argmax(1) + 1) % c
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, c).double()) / n
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    if n >= 2 and draw(st.booleans()):  # exact duplicates: equal norms
        j = draw(st.integers(1, n - 1))
        delta[j], h[j], z[j], y[j] = delta[0], h[0], z[0], y[0]
    if n >= 2 and draw(st.booleans()):  # an exactly cancelling pair (same h, opposite delta)
        delta[1], h[1] = -delta[0], h[0]
    if draw(st.booleans()):  # a zero-gradient row
        delta[n - 1] = 0
    b = draw(st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.7, 1.0]))
    return delta, h, z, y, b


def reference_check(delta, h, correct, b, weight):
    G = per_example_grads(delta, h)
    norms = G.norm(dim=1)
    total = G.sum(0).norm()
    skipped = weight == 0
    # only correct rows are skipped
    assert not (skipped & ~correct).any(), f"CAPSkip skipped a misclassified row: {torch.nonzero(skipped & ~correct).flatten().tolist()}"
    cand = torch.nonzero(correct).flatten().tolist()
    order = sorted(cand, key=lambda i: (norms[i].item(), i))
    # ties beyond exact duplicates would make the order ambiguous between the two formulas
    for a, c in zip(order, order[1:]):
        assume(norms[a] == norms[c] or abs(norms[a] - norms[c]) > 1e-9 * max(norms[c].item(), 1e-300))
    k = int(skipped.sum())
    # the skip set is the length-k prefix (up to exact norm ties)
    assert (set(torch.nonzero(skipped).flatten().tolist()) == set(order[:k]) or \
        sorted(norms[skipped].tolist()) == sorted(norms[order[:k]].tolist())), (
        f"the {k} skipped rows should be the {k} correct rows of smallest gradient norm {sorted(order[:k])} (up to "
        f"exact ties), skipped {torch.nonzero(skipped).flatten().tolist()}")
    prefix = [G[order[:j]].sum(0).norm().item() if j else 0.0 for j in range(len(order) + 1)]
    if b == 0:
        assert all(norms[i] == 0 for i in torch.nonzero(skipped).flatten().tolist()), (
            f"budget 0 allows skipping only zero-gradient rows; skipped norms {norms[skipped].tolist()}")
        return k
    thr = b * total.item()
    assert prefix[k] <= thr * (1 + REL) + 1e-300, (
        f"the skipped rows' summed gradient {prefix[k]!r} exceeds the budget b ||G|| = {thr!r}")
    for j in range(k + 1, len(order) + 1):  # no longer prefix fits
        assume(abs(prefix[j] - thr) > REL * max(thr, 1e-300))
        assert prefix[j] > thr, f"skipping {j} rows (> k={k}) would also fit the budget ({prefix[j]!r} <= {thr!r}): the prefix is not maximal"
    return k


ROUTES = [(None, None), ("gram", None), ("running", 1), ("running", 2), ("running", 3), ("running", 5)]


@settings(max_examples=examples(300), deadline=None)
@given(batches(), st.sampled_from(ROUTES))
def test_capskip_matches_bruteforce(batch, route):
    """Every prefix-norm route (the Gram; running sums over blocks of 1, 2, 3, 5 rows, so several blocks and a
    padded last one) against the explicit per-example gradients."""
    delta, h, z, y, b = batch
    correct = correct_mask(delta, z, y)
    w, bound, n_skip = capskip_weights(delta, h, correct, b, route=route[0], block=route[1])
    assert torch.isfinite(w).all(), f"CAPSkip's weights should be finite, got {w.tolist()}"
    assert set(w.unique().tolist()) <= {0.0, 1.0}, f"CAPSkip weights rows 0 (skipped) or 1 only, got {w.unique().tolist()}"
    k = reference_check(delta, h, correct, b, w)
    assert int(n_skip) == k, f"the reported skip count {int(n_skip)!r} should equal the rows weighted 0, {k!r}"
    G = per_example_grads(delta, h)
    tot = G.sum(0).norm()
    if k and tot > 0:
        assert math.isclose(bound.item(), (G[w == 0].sum(0).norm() / tot).item(), rel_tol=1e-9, abs_tol=1e-12), (
            f"the reported bound {bound.item()!r} should be ||S_k|| / ||G|| of the skipped rows, "
            f"{(G[w == 0].sum(0).norm() / tot).item()!r}")
        assert bound.item() <= b * (1 + REL), (
            f"the reported bound {bound.item()!r} exceeds the budget b = {b!r}")


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(1, 10), st.integers(2, 6), st.integers(0, 10**6))
def test_budget_one_with_all_correct_skips_everything(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, c, generator=g, dtype=torch.float64)
    y = z.argmax(1)
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, c).double()) / n
    h = torch.randn(n, 4, generator=g, dtype=torch.float64)
    w, bound, k = capskip_weights(delta, h, correct_mask(delta, z, y), 1.0)
    assert int(k) == n, f"budget 1 with every row correct should skip all {n} rows, skipped {int(k)!r}"
    assert (w == 0).all(), f"budget 1 with every row correct should weight every row 0, got {w.tolist()}"


def test_budget_zero_keeps_every_nonzero_row():
    z = torch.tensor([[3.0, 0.0], [3.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, 2).double()) / 3
    delta[1] = 0  # zero gradient row: free
    w, _, k = capskip_weights(delta, torch.randn(3, 2, dtype=torch.float64), correct_mask(delta, z, y), 0.0)
    assert w.tolist() == [1.0, 0.0, 1.0], f"budget 0 should skip only the zero-gradient row 1 and keep the others, got weights {w.tolist()!r}"
    assert int(k) == 1, f"budget 0 should count the one zero-gradient row as skipped, got {int(k)!r}"


def test_nonmonotone_prefix_found():
    """An exactly cancelling pair: the 1-prefix violates the budget, the 2-prefix meets it."""
    h = torch.tensor([[1.0], [1.0], [2.0]], dtype=torch.float64)
    delta = torch.tensor([[0.1, -0.1], [-0.1, 0.1], [0.5, -0.5]], dtype=torch.float64)
    correct = torch.tensor([True, True, False])
    w, bound, k = capskip_weights(delta, h, correct, 0.05)
    assert w.tolist() == [0.0, 0.0, 1.0], f"the cancelling pair (rows 0, 1) should be skipped together, got weights {w.tolist()!r}"
    assert bound.item() == 0.0, f"an exactly cancelling pair sums to zero gradient: the bound should be 0, got {bound.item()!r}"
    # stopping at the first violation would have skipped nothing
    first = (per_example_grads(delta, h)[0].norm() / per_example_grads(delta, h).sum(0).norm()).item()
    assert first > 0.05, f"the test needs a 1-prefix that breaks the budget 0.05 on its own, it has {first!r}"


def test_large_num_classes_and_single_row():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 1000, generator=g, dtype=torch.float64)
    y = z.argmax(1)
    y[:10] = (y[:10] + 1) % 1000
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, 1000).double()) / 64
    h = torch.randn(64, 8, generator=g, dtype=torch.float64)
    correct = correct_mask(delta, z, y)
    w, _, _ = capskip_weights(delta, h, correct, 0.2)
    reference_check(delta, h, correct, 0.2, w)
    w1, _, k1 = capskip_weights(delta[:1], h[:1], correct[:1], 0.5)
    assert w1.shape == (1,), f"a single-row batch should get one weight, got shape {tuple(w1.shape)!r}"


def test_label_inference_and_rule_object():
    z = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    y = torch.tensor([0, 2, 2])
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, 3).float()) / 3
    assert infer_targets(delta).tolist() == [0, 2, 2], f"the label is the class whose gradient is negative: expected [0, 2, 2], inferred {infer_targets(delta).tolist()}"
    assert correct_mask(delta, z, None).tolist() == [True, False, True], (
        f"rows 0 and 2 predict their inferred label, row 1 does not; mask {correct_mask(delta, z, None).tolist()}")
    assert infer_targets(torch.zeros(1, 3)).tolist() == [-1], (
        f"a zero-gradient row has no inferable label (-1), inferred {infer_targets(torch.zeros(1, 3)).tolist()}")
    sel = CAPSkip(budget=1.0).select(HeadView(delta=delta, h=torch.randn(3, 4), z=z))
    assert sel.weight[1] == 1, f"the misclassified row must never be skipped, even at budget 1; weight {sel.weight[1]!r}"  # misclassified: never skipped


def test_float32_inputs_use_float32():
    z = torch.randn(8, 4)
    delta = z.softmax(1) / 8
    delta[torch.arange(8), z.argmax(1)] -= 1 / 8
    w, bound, _ = capskip_weights(delta, torch.randn(8, 3), correct_mask(delta, z, None), 0.3)
    assert w.dtype == torch.float32, f"float32 inputs should give float32 weights (no silent float64), got {w.dtype!r}"
    assert bound.dtype == torch.float32, (
        f"float32 inputs should give a float32 bound, got {bound.dtype!r}")


@pytest.mark.parametrize("b", [-0.1, 1.5, float("nan")])
def test_budget_out_of_range(b):
    with pytest.raises(ValueError, match="budget"):
        CAPSkip(budget=b)


def _view_with_misclassified_rows(n: int) -> HeadView:
    """A float32 head view of N rows, C = 5, d = 6, every 4th row misclassified (seeded by n)."""
    g = torch.Generator().manual_seed(n)
    z = torch.randn(n, 5, generator=g)
    y = z.argmax(1)
    y[::4] = (y[::4] + 1) % 5
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, 5).float()) / n
    return HeadView(delta=delta, h=torch.randn(n, 6, generator=g), z=z)


@pytest.mark.parametrize("route", [None, "running"])
def test_compiled_selection_equals_eager(route):
    """compile=True: the selection runs as one Inductor graph (dynamic N; the running sums with static shapes,
    a compile per N) with the same decisions."""
    from torch._dynamo.utils import counters

    eager, comp = CAPSkip(budget=0.3, compile=False, route=route), CAPSkip(budget=0.3, compile=True, route=route)
    graphs = counters["stats"]["unique_graphs"]
    for n in ((8, 13, 32) if route is None else (40, 70)):  # running: two blocks of 32, the last padded
        view = _view_with_misclassified_rows(n)
        a, b = eager.select(view), comp.select(view)
        assert torch.equal(a.weight, b.weight), f"batch {n}: the compiled selection should skip the same rows as eager ({a.weight.tolist()} vs {b.weight.tolist()})"
        assert torch.allclose(a.bound, b.bound, rtol=1e-5), f"batch {n}: the compiled bound {b.bound!r} should match eager's {a.bound!r}"
    assert counters["stats"]["unique_graphs"] > graphs, f"route {route}: no selection was compiled"


@pytest.mark.parametrize("route", [None, "running"])
def test_compiled_selection_past_the_recompile_limit_runs_eagerly(route):
    """compile=True compiles a variant per budget (dynamic N) or per batch size (running sums, static shapes);
    with fullgraph=True, Dynamo's recompile limit is a hard error.  Past it the selection runs eagerly, with
    the same decisions: more budgets / batch sizes than the limit never raise."""
    import torch._dynamo

    cases = ([(16, b) for b in (0.1, 0.2, 0.3, 0.4, 0.5)] if route is None else
             [(n, 0.3) for n in (33, 40, 47, 54, 61)])
    with torch._dynamo.config.patch(recompile_limit=3):
        for n, b in cases:
            view = _view_with_misclassified_rows(n)
            a = CAPSkip(budget=b, compile=False, route=route).select(view)
            c = CAPSkip(budget=b, compile=True, route=route).select(view)
            assert torch.equal(a.weight, c.weight), f"n {n}, budget {b}: compiled or eager past the limit, the rows differ"


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 9), st.integers(1, 12), st.integers(0, 2**31 - 1),
       st.booleans(), st.booleans())
def test_prefix_norms_every_route_equals_bruteforce(n, c, e, block, seed, cancel, bias):
    """||S_k||^2 for every k, both routes, against the cumulative sum of the explicit rank-one rows (float64);
    cancelling rows make some prefixes (near) zero, where the running route's three terms cancel (the
    pairs share x and flip d, so the ones column cancels too).  ``bias``: the implicit ones column against an
    explicitly padded x."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, c, generator=g, dtype=torch.float64)
    x = torch.randn(n, e, generator=g, dtype=torch.float64)
    if cancel and n >= 2:
        d[1::2], x[1::2] = -d[0:n - 1:2], x[0:n - 1:2]
    xe = torch.nn.functional.pad(x, (0, 1), value=1.0) if bias else x
    rows = torch.einsum("nc,ne->nce", d, xe).flatten(1)
    ref = rows.cumsum(0).square().sum(1)
    scale = rows.abs().sum(0).square().sum() + 1e-300  # the size of the terms any route adds
    for route, blk in (("gram", None), ("running", block), (None, None)):
        got, used = prefix_sq_norms(d, x, route, blk, bias)
        assert used in ("gram", "running"), f"prefix_sq_norms should name the route it used, got {used!r}"
        err = (got - ref).abs().max().item()
        assert err <= 1e-12 * scale.item(), (
            f"route {route!r} (block {blk}, used {used!r}, bias {bias}): ||S_k||^2 differs from the brute force "
            f"by {err!r} (n={n}, C={c}, e={e})")


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_prefix_diagonal_is_the_2d_cumsum_diagonal(b, n, seed):
    """The contiguous-scan form equals the diagonal of the 2-D cumulative sum, batched, in float64."""
    K = torch.randn(b, n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = K.cumsum(1).cumsum(2).diagonal(dim1=1, dim2=2)
    got = prefix_diagonal(K)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12 * n * n), (
        f"prefix_diagonal differs from the 2-D cumsum's diagonal by {(got - ref).abs().max().item()!r} (n={n})")


def test_routes_give_the_same_selection_on_a_large_batch():
    """Auto picks the running sums here (N = 600 against C e / (C + e) ~ 7), over several blocks and a padded
    last one; its kept set is the Gram's and the brute force's, ties and misclassified rows included."""
    n, c, d = 600, 10, 20
    assert prefix_route(n, c, d + 1) == ("running", 64), (
        "the cost model should pick running sums in 64-row blocks at N = 600, C = 10, d = 20 (the exclusive "
        f"prefix over 32-row blocks costs as much as the block sums from about 512 rows), got {prefix_route(n, c, d + 1)}")
    assert prefix_route(256, 10, 513) == ("running", 32), "32-row blocks below 512 rows (faster at N = 256)"
    assert prefix_route(64, 1000, 769)[0] == "gram", "the cost model should pick the Gram at N = 64, C = 1000, d = 768"
    # measured faster there on 1 and 2 threads (docs/benchmarks.md, Selection cost): RUNNING_MAC_COST
    assert prefix_route(256, 100, 769)[0] == "gram", "the cost model should pick the Gram at N = 256, C = 100, d = 768"
    g = torch.Generator().manual_seed(3)
    z = torch.randn(n, c, generator=g, dtype=torch.float64) * 3
    y = z.argmax(1)
    y[::7] = (y[::7] + 1) % c  # misclassified rows, never skipped
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, c).double()) / n
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    delta[5], h[5] = delta[4], h[4]  # an exact tie
    delta[9], h[9] = -delta[8], h[8]  # a cancelling pair
    correct = correct_mask(delta, z, y)
    G = per_example_grads(delta, h)
    norms = G.norm(dim=1)
    order = sorted(torch.nonzero(correct).flatten().tolist(), key=lambda i: (norms[i].item(), i))
    prefix = torch.cat([G.new_zeros(1), G[order].cumsum(0).norm(dim=1)])  # ||S_j||, j = 0..m
    total = G.sum(0).norm()
    for b in (0.05, 0.3):
        fits = prefix <= b * total
        k = int(torch.nonzero(fits).max())
        margin = ((prefix - b * total).abs() / (b * total)).min().item()
        assert 0 < k < n and margin > 1e-9, f"budget {b}: the test wants an unambiguous skip of some rows (k={k}, margin {margin})"
        for route, block in ((None, None), ("gram", None), ("running", 32), ("running", 7)):
            w, bound, _ = capskip_weights(delta, h, correct, b, route=route, block=block)
            skipped = torch.nonzero(w == 0).flatten().tolist()
            assert sorted(skipped) == sorted(order[:k]), (
                f"budget {b}, route {route} (block {block}): skipped {len(skipped)} rows, the brute force's prefix "
                f"has {k}; they differ in {sorted(set(skipped) ^ set(order[:k]))[:10]}")
            assert math.isclose(bound.item(), (prefix[k] / total).item(), rel_tol=1e-9), (
                f"budget {b}, route {route}: bound {bound.item()!r} vs the brute force's {(prefix[k] / total).item()!r}")


def test_sketch_on_a_classifier_head_stays_near_the_budget():
    """sketch=k on (N, C) logits: delta P in the prefix norms (P drawn from the view's generator; the order stays
    exact).  Only correct rows are skipped, the same generator state gives the same rows, and the true
    ||S_k|| / ||G|| of the skipped rows stays within 5 of the sketch's relative standard deviations of b."""
    n, c, d, k, b = 200, 400, 6, 256, 0.3
    g = torch.Generator().manual_seed(5)
    z = torch.randn(n, c, generator=g, dtype=torch.float64) * 4
    y = z.argmax(1)
    y[::5] = (y[::5] + 1) % c
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, c).double()) / n
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    correct = correct_mask(delta, z, y)
    G = per_example_grads(delta, h)
    rule = CAPSkip(budget=b, sketch=k)
    for seed in range(8):
        view = HeadView(delta=delta, h=h, z=z, targets=y, generator=torch.Generator().manual_seed(seed))
        w = rule.select(view).weight
        again = rule.select(HeadView(delta=delta, h=h, z=z, targets=y, generator=torch.Generator().manual_seed(seed))).weight
        assert torch.equal(w, again), f"draw {seed}: the same generator state should skip the same rows"
        skipped = w == 0
        assert not (skipped & ~correct).any(), f"draw {seed}: the sketch skipped a misclassified row"
        assert skipped.any(), f"draw {seed}: the test wants rows skipped"
        true = (G[skipped].sum(0).norm() / G.sum(0).norm()).item()
        assert true <= b * (1 + 5 * math.sqrt(2 / k)), f"draw {seed}: true bound {true!r} far above b = {b} (k = {k})"


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_correct_mask_equals_its_argmax_definition(n, c, seed, with_targets, specials):
    """correct_mask (max's indices, ``~any``) against its definition (``argmax``, ``(== 0).all``): ties in z
    (the first maximal entry), NaN in z, rows of zeros and -0.0 in delta, unknown labels (-1)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-2, 3, (n, c), generator=g).double()  # small integers: ties are common
    delta = torch.randint(-1, 2, (n, c), generator=g).double() * torch.rand(n, c, generator=g, dtype=torch.float64)
    if specials:
        z[0, -1] = math.nan
        delta[-1] = -0.0
        delta[0, 0] = math.nan
    y = torch.randint(-1, c, (n,), generator=g) if with_targets else None
    zero = (delta == 0).all(1)
    if y is not None:
        ref = (z.argmax(1) == y) | zero
    else:
        mn, arg = delta.min(-1)
        ref = torch.where(mn < 0, z.argmax(1) == arg, zero)
    got = correct_mask(delta, z, y)
    assert torch.equal(got, ref), f"correct_mask {got.tolist()} differs from its argmax definition {ref.tolist()}"
