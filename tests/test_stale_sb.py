"""Stale-SB: the per-index loss cache, staleness expiry, and the data-side filter / batch sampler.

A toy "dataset" holds fixed logits per index, so the loss a rule records for index i is known.
"""
from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from capskip_fx.rules.stale_sb_filter import StaleBatchFilter, StaleBatchSampler
from capskip_fx.rules import HeadView, StaleSB
from capskip_fx.rules.labels import per_example_ce
from capskip_fx.rules.stale_sb import NEVER
from helpers.examples import examples

torch.set_num_threads(1)
M, C, D = 40, 5, 3


class Toy:
    def __init__(self, seed: int = 0, m: int = M):
        g = torch.Generator().manual_seed(seed)
        self.z = 2 * torch.randn(m, C, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, C, (m,), generator=g)
        self.h = torch.randn(m, D, generator=g, dtype=torch.float64)
        self.loss = per_example_ce(self.z, self.y)

    def view(self, idx: torch.Tensor, epoch: int = 0, with_index: bool = True) -> HeadView:
        z, y = self.z[idx], self.y[idx]
        delta = (z.softmax(1) - torch.nn.functional.one_hot(y, C).double()) / max(len(idx), 1)
        return HeadView(delta=delta, h=self.h[idx], z=z, targets=y,
                        index=idx if with_index else None, epoch=epoch)


def run_epoch(rule, filt, toy, epoch, batch=8, seed=0):
    """Shuffle, filter, forward the kept rows; returns (masks, weights) per batch."""
    order = torch.randperm(toy.z.shape[0], generator=torch.Generator().manual_seed(1000 * seed + epoch))
    out = []
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        fwd = filt(idx, epoch) if filt is not None else torch.ones(len(idx), dtype=torch.bool)
        sub = idx[fwd]
        w = rule.select(toy.view(sub, epoch)).weight if len(sub) else torch.zeros(0)
        out.append((idx, fwd, sub, w))
    return out


def test_cache_by_index_not_by_position():
    toy = Toy()
    rule = StaleSB(num_examples=M)
    idx = torch.tensor([7, 3, 31, 12])
    rule.select(toy.view(idx, epoch=0))
    torch.testing.assert_close(rule.cache_loss[idx], toy.loss[idx])
    assert (rule.cache_epoch[idx] == 0).all(), (
        "the rows selected in epoch 0 should be stamped epoch 0 at their own index")
    others = torch.ones(M, dtype=torch.bool)
    others[idx] = False
    assert torch.isnan(rule.cache_loss[others]).all(), (
        "rows never seen must have no cached loss (NaN), not a neighbour's")
    assert (rule.cache_epoch[others] == NEVER).all(), (
        "rows never seen must be stamped NEVER, so they are always forwarded")


def test_cache_grows_on_demand():
    toy = Toy(m=100)
    rule = StaleSB()
    rule.select(toy.view(torch.tensor([0, 2])))
    rule.select(toy.view(torch.tensor([90, 5])))
    assert rule.cache_loss.shape[0] >= 91, (
        f"the cache should grow to hold index 90, got {rule.cache_loss.shape[0]!r} slots")
    torch.testing.assert_close(rule.cache_loss[torch.tensor([0, 2, 90, 5])], toy.loss[torch.tensor([0, 2, 90, 5])])


def test_filtered_batches_record_the_right_losses():
    """Dropping rows before the forward must not shift losses onto other examples (SB §2.5 defect)."""
    toy = Toy(1)
    rule = StaleSB(beta=3.0, num_examples=M)
    filt = StaleBatchFilter(rule, seed=1)
    for epoch in range(4):
        run_epoch(rule, filt, toy, epoch)
        seen = rule.cache_epoch != NEVER
        torch.testing.assert_close(rule.cache_loss[seen], toy.loss[seen])
    assert filt.n_saved > 0, (
        f"with beta 3 the filter should drop some fresh rows before the forward, got {filt.n_saved!r} saved")


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_staleness_expiry(staleness):
    """Every row is seen once per epoch: it may be skipped only when its loss is < staleness epochs old."""
    toy = Toy(2)
    rule = StaleSB(beta=1.0, staleness=staleness, num_examples=M)
    filt = StaleBatchFilter(rule, seed=2)
    for epoch in range(6):
        before = rule.cache_epoch.clone() if rule.cache_epoch is not None else None
        for idx, fwd, sub, w in run_epoch(rule, filt, toy, epoch):
            if before is None:
                assert fwd.all(), "in the first epoch nothing is cached, so every row must be forwarded"
                continue
            age = epoch - before[idx]
            fresh = (age >= 0) & (age < staleness)
            assert fwd[~fresh].all(), "stale or unseen rows must be forwarded"
            # the clock counts epochs since the last SELECTION forward (the reference's): rows forwarded
            # because they were stale restart it; fresh rows (dropped, or pre-selected and forwarded only
            # to be trained on) keep their old stamp
            assert (rule.cache_epoch[idx[~fresh]] == epoch).all(), (
                "rows forwarded because they were stale or unseen should restart their clock at this epoch")
            assert torch.equal(rule.cache_epoch[idx[fresh]], before[idx[fresh]]), (
                "fresh rows (dropped or pre-selected) must keep their old epoch stamp")
        if staleness <= 1:
            assert filt.n_saved == 0, (
                f"with staleness {staleness} no row is ever fresh, so nothing may be dropped, "
                f"got {filt.n_saved!r} saved")
    if staleness >= 2:
        assert filt.n_saved > 0, (
            f"with staleness {staleness} fresh rows exist and some should be dropped, got {filt.n_saved!r} saved")


def test_fresh_rows_are_stale_after_staleness_epochs():
    toy = Toy(3)
    rule = StaleSB(staleness=2, num_examples=M)
    idx = torch.arange(M)
    rule.select(toy.view(idx, epoch=0))
    assert rule.fresh(idx, 0).all(), "a loss recorded in epoch 0 is fresh in epoch 0"
    assert rule.fresh(idx, 1).all(), "with staleness 2, a loss from epoch 0 is still fresh in epoch 1"
    assert not rule.fresh(idx, 2).any(), "with staleness 2, a loss from epoch 0 is stale by epoch 2"
    # all stale at epoch 2: the filter forwards everything and saves nothing
    filt = StaleBatchFilter(rule)
    assert filt(idx, 2).all(), "when every row is stale the filter must forward all of them"
    assert filt.n_saved == 0, f"when every row is stale the filter saves nothing, got {filt.n_saved!r} saved"


def test_filter_counts_and_preselected_rows_are_kept():
    toy = Toy(4)
    rule = StaleSB(beta=2.0, staleness=2, num_examples=M)
    filt = StaleBatchFilter(rule, seed=3)
    run_epoch(rule, filt, toy, 0)
    assert (filt.n_seen, filt.n_forwarded, filt.n_saved) == (M, M, 0), (
        "in the first epoch every row is seen and forwarded, none saved; "
        f"got (seen, forwarded, saved) = {(filt.n_seen, filt.n_forwarded, filt.n_saved)!r} for M={M}")
    res = run_epoch(rule, filt, toy, 1)
    fwd_total = sum(int(f.sum()) for _, f, _, _ in res)
    assert filt.n_seen == 2 * M, (
        f"after two epochs the filter should have seen every row twice, got {filt.n_seen!r} of {2 * M!r}")
    assert filt.n_forwarded == M + fwd_total, (
        "the forwarded count should be epoch 0's M plus the rows forwarded in epoch 1, "
        f"got {filt.n_forwarded!r} vs {M + fwd_total!r}")
    assert filt.n_saved == M - fwd_total > 0, (
        "the saved count should be epoch 1's dropped rows, and some should be dropped; "
        f"got saved={filt.n_saved!r}, dropped={M - fwd_total!r}")
    # every row fresh at epoch 1: each forwarded row was pre-selected, so it is kept with weight 1
    for _, _, sub, w in res:
        assert torch.equal(w, torch.ones(len(sub), dtype=torch.float64)), (
            f"every forwarded row was pre-selected in a fresh epoch and must be kept with weight 1, got {w!r}")
    assert not rule.presel.any(), "no pre-selection should survive once the pre-selected rows were trained on"
    sd = filt.state_dict()
    assert sd["n_seen"] == 2 * M, f'the filter state should carry its seen count, got {sd["n_seen"]!r} vs {2 * M!r}'


def test_p_min_one_saves_nothing():
    toy = Toy(5)
    rule = StaleSB(p_min=1.0, num_examples=M)
    filt = StaleBatchFilter(rule)
    for epoch in range(3):
        run_epoch(rule, filt, toy, epoch)
    assert filt.n_saved == 0, f"p_min=1 forwards every row, so nothing may be saved, got {filt.n_saved!r}"
    assert filt.n_forwarded == 3 * M, (
        f"p_min=1 should forward every row in all 3 epochs, got {filt.n_forwarded!r} of {3 * M!r}")


def test_history_gets_each_example_once_per_pass():
    toy = Toy(6)
    rule = StaleSB(beta=2.0, history=10_000, num_examples=M, prime_epochs=0)  # priming leaves it empty
    filt = StaleBatchFilter(rule, seed=4)
    for epoch in range(3):
        run_epoch(rule, filt, toy, epoch)
        assert int((~torch.isnan(rule.history)).sum()) == (epoch + 1) * M, (
            "the loss history should gain each example exactly once per pass, dropped or not; "
            f"got {int((~torch.isnan(rule.history)).sum())!r} entries after epoch {epoch}, want {(epoch + 1) * M!r}")
    assert filt.n_saved > 0, f"with beta 2 some fresh rows should be dropped, got {filt.n_saved!r} saved"


@settings(max_examples=examples(10), deadline=None)
@given(seed=st.integers(0, 1000), beta=st.floats(0.5, 4.0))
def test_drop_probability_matches_sb(seed, beta):
    """A fresh row is forwarded with SB's probability of its cached loss (checked via the rule's own
    percentile, recomputed here from the history the filter saw)."""
    toy = Toy(seed)
    rule = StaleSB(beta=beta, num_examples=M, prime_epochs=0)
    rule.select(toy.view(torch.arange(M), epoch=0))
    hist = rule.history.clone()
    idx = torch.arange(M)
    cached = rule.cache_loss[idx]
    allh = torch.cat([hist, cached])
    allh = allh[~torch.isnan(allh)]
    p = ((allh[None, :] < cached[:, None]).sum(1).double() / len(allh)) ** beta
    u = torch.rand(M, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    fwd, fresh = rule.plan_forward(idx, 1, u)
    assert fresh.all(), "every row scored in epoch 0 is fresh in epoch 1"
    assert torch.equal(fwd, u < p), (
        "a fresh row should be forwarded with SB's probability (percentile of its cached loss) ** beta")


def test_without_index_acts_as_sb():
    toy = Toy(7)
    rule = StaleSB(seed=5)
    from capskip_fx.rules import SelectiveBackprop
    ref = SelectiveBackprop(seed=5)
    idx = torch.arange(16)
    with pytest.warns(UserWarning, match="plain sb"):
        a = rule.select(toy.view(idx, with_index=False))
    assert torch.equal(a.weight, ref.select(toy.view(idx, with_index=False)).weight), (
        "without example indices StaleSB should select exactly as plain SB with the same seed")


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_state_roundtrip_rule_and_filter():
    toy = Toy(8)
    rule = StaleSB(beta=2.0, num_examples=M, seed=6)
    filt = StaleBatchFilter(rule, seed=7)
    for epoch in range(2):
        run_epoch(rule, filt, toy, epoch)
    rs, fs = _roundtrip(rule.state_dict()), _roundtrip(filt.state_dict())
    later = [run_epoch(rule, filt, toy, e) for e in (2, 3)]
    rule2 = StaleSB(beta=2.0, num_examples=M, seed=6)
    rule2.load_state_dict(rs)
    filt2 = StaleBatchFilter(rule2, seed=7)
    filt2.load_state_dict(fs)
    again = [run_epoch(rule2, filt2, toy, e) for e in (2, 3)]
    for ea, eb in zip(later, again):
        for (_, fa, _, wa), (_, fb, _, wb) in zip(ea, eb):
            assert torch.equal(fa, fb), "after a state round trip the filter should make the same forward decisions"
            assert torch.equal(wa, wb), "after a state round trip the rule should give the same weights"
    assert filt.n_saved == filt2.n_saved > 0, (
        "the restored filter should count the same saved rows, and some were saved; "
        f"got {filt.n_saved!r} vs {filt2.n_saved!r}")


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_fixed_size_batches(drop_last):
    toy = Toy(9)
    rule = StaleSB(beta=3.0, num_examples=M)
    filt = StaleBatchFilter(rule, seed=8)
    sampler = StaleBatchSampler(range(M), filt, batch_size=8, drop_last=drop_last)
    for epoch in range(3):
        assert sampler.epoch == epoch, (
            f"the sampler should advance one epoch per pass, got {sampler.epoch!r} at pass {epoch!r}")
        before = filt.n_forwarded
        batches = list(sampler)
        for b in batches:
            rule.select(toy.view(torch.tensor(b), epoch))
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat)), (
            f"each index should appear at most once per epoch, got {len(flat)!r} rows, {len(set(flat))!r} distinct")
        assert all(len(b) == 8 for b in batches[:-1]), (
            "the sampler should refill dropped rows so every batch but the last has 8, "
            f"got {[len(b) for b in batches]!r}")
        assert not drop_last or len(batches[-1]) == 8, (
            f"with drop_last the last batch is full too, got {len(batches[-1])!r}")
        n_fwd = filt.n_forwarded - before
        assert len(flat) == n_fwd, (
            "a dropped tail is handed back, not counted as forwarded; "
            f"got {len(flat)!r} yielded vs {n_fwd!r} forwarded")
    assert filt.n_saved > 0, f"with beta 3 the sampler's filter should drop some fresh rows, got {filt.n_saved!r} saved"
    assert sampler.epoch == 3, f"after 3 passes the sampler should be at epoch 3, got {sampler.epoch!r}"


def test_uses_data_side_epoch_when_filtered():
    """The runtime may leave view.epoch at 0; once a filter runs, its epoch stamps the cache."""
    toy = Toy(10)
    rule = StaleSB(num_examples=M)
    filt = StaleBatchFilter(rule)
    idx = torch.arange(8)
    filt(idx, 5)
    rule.select(toy.view(idx, epoch=0))
    assert (rule.cache_epoch[idx] == 5).all(), (
        f"once a filter runs, its epoch (5) should stamp the cache, not view.epoch, got {rule.cache_epoch[idx]!r}")
    assert math.isfinite(float(rule.cache_loss[idx].sum())), "the selected rows' losses should be cached (finite)"


@pytest.mark.parametrize("drop_last", [False, True])
def test_no_preselection_outlives_its_epoch(drop_last):
    """Issue 23: rows of a dropped tail kept their pre-selected flag, so a later scoring forward kept
    them without a draw and did not restart their clock.  The reference flushes its queues every epoch
    (lib/trainer.py 175-182, 251-254): every forwarded row is consumed, every pre-selected row is kept,
    every row forwarded for scoring restarts its clock.  Without drop_last (the harness's setting),
    with staleness 2 after the primed epoch 0, odd epochs hold only pre-selected rows and even epochs
    none."""
    toy = Toy(11, m=43)  # 43 rows, batch 8: a ragged tail every epoch
    m = toy.z.shape[0]
    rule = StaleSB(beta=1.0, staleness=2, num_examples=m)
    filt = StaleBatchFilter(rule, seed=9)
    sampler = StaleBatchSampler(torch.randperm(m, generator=torch.Generator().manual_seed(0)).tolist(), filt,
                                batch_size=8, drop_last=drop_last)
    for epoch in range(6):
        before = filt.n_forwarded
        old_clock = rule.cache_epoch.clone() if rule.cache_epoch is not None else None
        batches = list(sampler)
        assert filt.n_forwarded - before == sum(len(b) for b in batches), (
            "every forwarded row should be consumed by a batch this epoch; "
            f"got {filt.n_forwarded - before!r} forwarded vs {sum(len(b) for b in batches)!r} in batches")
        for b in batches:
            idx = torch.tensor(b)
            sel = rule.select(toy.view(idx, epoch))
            pre = sel.info["preselected"]
            assert (sel.weight[pre] > 0).all(), "every pre-selected row must be kept"
            assert (rule.cache_epoch[idx[~pre]] == epoch).all(), "rows forwarded for scoring must restart their clock"
            if old_clock is not None:
                assert torch.equal(rule.cache_epoch[idx[pre]], old_clock[idx[pre]]), (
                    "pre-selected rows must keep their old epoch stamp")
            if not drop_last and epoch > 0:
                assert bool(pre.all()) if epoch % 2 == 1 else not pre.any(), (
                    f"with staleness 2, epoch {epoch} should hold {'only' if epoch % 2 else 'no'} "
                    f"pre-selected rows, got {pre!r}")
        assert not rule.presel.any(), "no pre-selection may outlive its epoch"
    assert filt.n_saved > 0, f"staleness 2 should let the filter drop some rows, got {filt.n_saved!r} saved"


def test_filter_clears_preselection_at_a_new_epoch():
    """A row planned but never forwarded (e.g. a batch of 1 that the runtime runs dense, without the
    rule) must not carry its pre-selection into the next epoch."""
    toy = Toy(12)
    rule = StaleSB(beta=0.0, staleness=3, num_examples=M)  # beta 0: every fresh row is kept
    filt = StaleBatchFilter(rule, seed=1)
    idx = torch.arange(M)
    filt(idx, 0)
    rule.select(toy.view(idx, 0))
    assert filt(idx[:5], 1).all(), "with beta 0 every fresh row is pre-selected and forwarded"
    assert rule.presel[:5].all(), "the five rows forwarded in epoch 1 should be marked pre-selected"
    filt(idx[5:10], 2)  # the five rows pre-selected in epoch 1 were never forwarded
    assert not rule.presel[:5].any(), "a new epoch must clear pre-selections of rows that were never forwarded"
    assert rule.presel[5:10].all(), "the rows planned in epoch 2 should be pre-selected"


def test_cli_stale_loader_drops_nothing():
    from capskip_fx.train.config import TrainConfig
    from capskip_fx.train.data import make_loaders

    class Bundle:
        train = torch.utils.data.TensorDataset(torch.arange(43))
        test = train

    rule = StaleSB(num_examples=43)
    loader = make_loaders(TrainConfig(batch_size=8), Bundle(), torch.device("cpu"), stale_rule=rule)[0]
    assert sum(len(b[0]) for b in loader) == 43, (
        f"the CLI's stale loader must yield every one of the 43 rows, got {sum(len(b[0]) for b in loader)!r}")
    assert not loader.batch_sampler.drop_last, "the CLI's stale loader must not drop the ragged last batch"
