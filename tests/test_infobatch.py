"""InfoBatch (capskip_fx/train/infobatch.py, ``--rule infobatch`` / ``capskip+infobatch``) against the
reference's logic, and end to end through capskip-train.

The reference is NUS-HPC-AI-Lab/InfoBatch, ``infobatch/infobatch.py`` at commit
8bbb012c256c9eb4de3bb209f8a5e73899de8d02.  ``Ref`` below transcribes its InfoBatch class
(lines 73-83 ``__init__``, 92-109 ``update``, 119-136 ``prune``, 145-148 ``no_prune``, 159-164
``stop_prune`` / ``reset_weights``), its IBSampler (lines 167-200) and the body of
DistributedIBSampler.__iter__ (lines 248-289, the DDP sharding); only the Dataset wrapping, the
DataLoader hook and the all-gather are left out."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from capskip_fx import train
from capskip_fx.train import loop
from capskip_fx.train.infobatch import InfoBatchSampler
from helpers.runs import assert_resumed_exactly, run_killed_at_evaluation
from helpers.examples import examples

torch.set_num_threads(1)


# ---------------------------------------------------------------- the reference, transcribed

class Ref:
    """InfoBatch + IBSampler of the reference (line numbers of infobatch/infobatch.py)."""

    def __init__(self, n, num_epochs, prune_ratio=0.5, delta=0.875):
        self.n = n
        self.keep_ratio = min(1.0, max(1e-1, 1.0 - prune_ratio))  # l. 76
        self.num_epochs, self.delta = num_epochs, delta
        self.scores = torch.ones(n) * 3  # l. 81
        self.weights = torch.ones(n)  # l. 82
        self.num_pruned_samples = 0
        # IBSampler.__init__ (l. 168-174): iterations = 0, then reset() once
        self.iterations = 0
        self.sample_indices = None
        self.reset()

    def update(self, index, values):  # l. 92-109, cur_batch_index passed in, no all-gather
        weights = self.weights[index]
        loss_val = values.detach().clone()
        self.scores[index.long()] = loss_val
        values = values.clone()
        values.mul_(weights)
        return values.mean()

    def prune(self):  # l. 119-136
        well_learned_mask = (self.scores < self.scores.mean()).numpy()
        well_learned_indices = np.where(well_learned_mask)[0]
        remained_indices = np.where(~well_learned_mask)[0].tolist()
        selected_indices = np.random.choice(well_learned_indices, int(
            self.keep_ratio * len(well_learned_indices)), replace=False)
        self.weights[:] = 1  # reset_weights()
        if len(selected_indices) > 0:
            self.weights[selected_indices] = 1 / self.keep_ratio
            remained_indices.extend(selected_indices)
        self.num_pruned_samples += self.n - len(remained_indices)
        np.random.shuffle(remained_indices)
        return remained_indices

    def no_prune(self):  # l. 145-148
        samples_indices = list(range(self.n))
        np.random.shuffle(samples_indices)
        return samples_indices

    @property
    def stop_prune(self):  # l. 159-161
        return self.num_epochs * self.delta

    def reset(self):  # IBSampler.reset, l. 179-190
        np.random.seed(self.iterations)
        if self.iterations > self.stop_prune:
            if self.iterations == self.stop_prune + 1:
                self.weights[:] = 1
            self.sample_indices = self.no_prune()
        else:
            self.sample_indices = self.prune()
        self.iterations += 1

    def epoch(self):  # IBSampler.__iter__ (l. 198-200): reset, then the plan
        self.reset()
        return [int(i) for i in self.sample_indices]


def ref_shard(plan, num_replicas, rank, epoch, seed=0, drop_last=True):
    """DistributedIBSampler.__iter__ (l. 248-289) on the plan IBSampler made (shuffle=True; the epoch
    is the one ``set_epoch`` gave, examples/cifar_example.py l. 261)."""
    if drop_last and len(plan) % num_replicas != 0:
        num_samples = math.ceil((len(plan) - num_replicas) / num_replicas)
    else:
        num_samples = math.ceil(len(plan) / num_replicas)
    total_size = num_samples * num_replicas
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    indices = torch.randperm(len(plan), generator=g).tolist()
    if not drop_last:
        indices += indices[:total_size - len(indices)]
    else:
        indices = indices[:total_size]
    assert len(indices) == total_size, (
        f"the reference's DDP wrapper pads or cuts to total_size, got {len(indices)!r} vs {total_size!r}")
    indices = indices[rank:total_size:num_replicas]
    return [plan[i] for i in indices]


@pytest.fixture(autouse=True)
def _keep_numpy_state():
    """The transcribed reference seeds numpy's global generator; put it back."""
    state = np.random.get_state()
    yield
    np.random.set_state(state)


def _run_both(n, epochs, r, delta, losses_seed=0, **kw):
    """Both samplers through ``epochs`` epochs with the same per-sample losses; yields per epoch
    (ours, ref) after planning, before the scores update."""
    ours, ref = InfoBatchSampler(n, epochs, r, delta, **kw), Ref(n, epochs, r, delta)
    g = torch.Generator().manual_seed(losses_seed)
    for e in range(epochs):
        ours.set_epoch(e)
        plan = list(ours)
        ref_plan = ref.epoch()
        yield e, ours, ref, plan, ref_plan
        idx = torch.tensor(ref_plan, dtype=torch.long)
        loss = torch.rand(len(ref_plan), generator=g) * 4  # each sample's loss this epoch
        ours.update(idx, loss)
        ref.update(idx, loss)


# ---------------------------------------------------------------- parity with the reference

@pytest.mark.parametrize("n, epochs, r, delta", [(200, 8, 0.5, 0.875), (97, 16, 0.3, 0.875), (64, 4, 0.7, 0.5)])
def test_plans_weights_and_counts_match_the_reference(n, epochs, r, delta):
    pruned_epochs = 0
    for e, ours, ref, plan, ref_plan in _run_both(n, epochs, r, delta):
        assert plan == ref_plan, f"epoch {e}: planned indices differ from the reference's"
        assert torch.equal(ours.weights, ref.weights), f"epoch {e}: weights differ"
        assert ours.n_pruned == ref.num_pruned_samples, (
            f"epoch {e}: the pruned-sample count should match the reference's, "
            f"got {ours.n_pruned!r} vs {ref.num_pruned_samples!r}")
        pruned_epochs += len(plan) < n
    # epoch 1 is full (equal initial scores), the last (1 - delta) of the epochs too
    assert pruned_epochs == math.floor(epochs * delta) - 1, (
        "only epochs 2..floor(epochs * delta) should prune (epoch 1 has equal scores, the annealing tail is full), "
        f"got {pruned_epochs!r} pruned epochs")


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 120), r=st.floats(0.0, 0.95), epoch=st.integers(1, 6), seed=st.integers(0, 2**16),
       ties=st.booleans())
def test_pruned_fraction_and_weights_property(n, r, epoch, seed, ties):
    """Any scores: every sample at or above the mean is planned; int(keep * #below) of those below, each
    at weight 1/keep, the rest at 1; no duplicates; the same plan as the reference."""
    ours, ref = InfoBatchSampler(n, 100, r), Ref(n, 100, r)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (n,), generator=g).float() if ties else torch.rand(n, generator=g)
    ours.scores, ref.scores = scores.clone(), scores.clone()
    ref.iterations = epoch + 1  # the reference's counter at 0-based epoch ``epoch``'s reset
    ours.set_epoch(epoch)
    plan = list(ours)
    assert plan == ref.epoch(), f"for any scores the plan should be the reference's, got {plan!r}"
    low = scores < scores.mean()
    keep = min(1.0, max(0.1, 1 - r))
    assert len(set(plan)) == len(plan), (
        f"a plan must not repeat a sample, got {len(set(plan))!r} distinct of {len(plan)!r}")
    planned = torch.zeros(n, dtype=torch.bool)
    planned[plan] = True
    assert planned[~low].all(), "every sample at or above the mean score must be planned"
    assert int(planned[low].sum()) == int(keep * int(low.sum())), (
        "int(keep * #below-mean) of the well-learned samples should be kept, "
        f"got {int(planned[low].sum())!r} vs {int(keep * int(low.sum()))!r}")
    assert torch.equal(ours.weights, torch.where(planned & low, torch.tensor(1 / keep), torch.tensor(1.0))), (
        f"kept well-learned samples should weigh 1/keep = {1 / keep!r}, all others 1, got {ours.weights!r}")
    assert ours.n_pruned == n - len(plan), (
        f"the pruned count should be the samples left out of the plan, got {ours.n_pruned!r} vs {n - len(plan)!r}")


def test_annealing_uses_all_data_at_weight_one():
    """delta x epochs not whole (10 x 0.875 = 8.75): epochs 9 and 10 use all data.  The reference resets
    its weights only when ``iterations == stop_prune + 1`` (l. 183), never here, so its last two epochs
    keep the 1/(1-r) weights of epoch 8; ours are 1 (a deliberate deviation, infobatch.py's docstring)."""
    for e, ours, ref, plan, ref_plan in _run_both(100, 10, 0.5, 0.875):
        assert plan == ref_plan, f"epoch {e}: the plan should be the reference's, got {plan!r} vs {ref_plan!r}"
        if e >= 8:
            assert sorted(plan) == list(range(100)), f"annealing epoch {e} should use all data, got {sorted(plan)!r}"
            assert bool((ours.weights == 1).all()), (
                f"annealing epoch {e} should weigh every sample 1, got {ours.weights!r}")
            assert bool((ref.weights == 2).any()), (
                "the reference keeps epoch 8's stale 1/(1-r) weights here (the documented deviation)")
        else:
            assert torch.equal(ours.weights, ref.weights), f"epoch {e}: pruning weights should match the reference's"
            assert ours.prunes(e), f"epoch {e} is before the annealing tail and should prune"


@pytest.mark.parametrize("replicas", [2, 3])
def test_ddp_shards_match_the_reference_wrapper(replicas):
    n, epochs = 101, 6
    shards = [InfoBatchSampler(n, epochs, num_replicas=replicas, rank=k) for k in range(replicas)]
    ref = Ref(n, epochs)
    g = torch.Generator().manual_seed(1)
    for e in range(epochs):
        plan = ref.epoch()
        got = []
        for k, s in enumerate(shards):
            s.set_epoch(e)
            mine = list(s)
            assert mine == ref_shard(plan, replicas, k, e), f"epoch {e} rank {k}"
            got += mine
        # the ranks split the plan, cut to a multiple of the replica count: disjoint, nothing repeated
        assert len(set(got)) == len(got) == len(plan) - len(plan) % replicas, (
            "the ranks should split the plan disjointly, cut to a multiple of the replica count; "
            f"got {len(set(got))!r} distinct of {len(got)!r}, plan {len(plan)!r}")
        assert set(got) <= set(plan), f"the ranks may only hand out planned samples, got extra {set(got) - set(plan)!r}"
        # every rank gathers every rank's losses (the reference's all-gather, l. 102-106)
        idx = torch.tensor(plan)
        loss = torch.rand(len(plan), generator=g)
        ref.update(idx, loss)
        for s in shards:
            s.update(idx, loss)


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(1, 200), replicas=st.integers(1, 5), epoch=st.integers(0, 50), seed=st.integers(0, 99))
def test_shards_partition_the_plan_property(n, replicas, epoch, seed):
    """Any plan length and replica count: equal shard sizes, disjoint, their union the plan cut to a
    multiple of the replicas, each the reference wrapper's (seed + epoch permutation)."""
    plan = torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[:n].tolist()
    shards = []
    for k in range(replicas):
        s = InfoBatchSampler(1000, 4, seed=seed, num_replicas=replicas, rank=k)
        shards.append(s._shard(plan, epoch))
        assert shards[-1] == (ref_shard(plan, replicas, k, epoch, seed=seed) if replicas > 1 else plan), (
            f"rank {k}'s shard should be the reference wrapper's (seed + epoch permutation), got {shards[-1]!r}")
    flat = [i for sh in shards for i in sh]
    assert len({len(sh) for sh in shards}) == 1, (
        f"every rank should get the same number of samples, got sizes {[len(sh) for sh in shards]!r}")
    assert len(set(flat)) == len(flat), f"the shards must be disjoint, got {len(set(flat))!r} distinct of {len(flat)!r}"
    assert set(flat) <= set(plan), f"the shards may only hold planned samples, got extra {set(flat) - set(plan)!r}"
    assert len(flat) == n - n % replicas, (
        "the shards' union should be the plan cut to a multiple of the replicas, "
        f"got {len(flat)!r} vs {n - n % replicas!r}")


def test_weighted_loss_and_scores_match_update():
    """The harness's loss ``mean(weights_for(idx) * per)`` and score update are the reference's update()."""
    for e, ours, ref, plan, _ in _run_both(50, 4, 0.5, 0.875):
        if e == 2:
            idx = torch.tensor(plan[:16])
            per = torch.rand(16, dtype=torch.float64) + 0.1
            want = ref.update(idx, per.float())
            got = (per.float() * ours.weights_for(idx)).mean()
            ours.update(idx, per)
            assert got == want, (
                f"the harness's weighted loss should equal the reference's update() loss, got {got!r} vs {want!r}")
            assert torch.equal(ours.scores, ref.scores), "the score update should match the reference's update()"
            assert bool((ours.weights_for(idx) > 1).any()), (
                "the batch should hold a reweighted sample, or the check would not test the weights")


def test_state_dict_continues_the_same_plans():
    a = InfoBatchSampler(80, 6, seed=3)
    b = None
    g = torch.Generator().manual_seed(0)
    for e in range(6):
        if e == 3:  # resume from a's state after epoch 3's checkpoint
            b = InfoBatchSampler(80, 6, seed=3)
            b.load_state_dict(a.state_dict())
        for s in (a, b) if b is not None else (a,):
            s.set_epoch(e)
        plan = list(a)
        if b is not None:
            assert list(b) == plan, (
                f"epoch {e}: the resumed sampler should plan as the original, got {list(b)!r} vs {plan!r}")
            assert torch.equal(a.weights, b.weights), f"epoch {e}: the resumed sampler should weigh as the original"
        loss = torch.rand(len(plan), generator=g)
        for s in (a, b) if b is not None else (a,):
            s.update(torch.tensor(plan), loss)
    assert a.n_seen == b.n_seen == 6 * 80, (
        f"both samplers should count every row of 6 epochs as seen, got {a.n_seen!r} and {b.n_seen!r} of {6 * 80!r}")
    assert a.n_planned == b.n_planned < 6 * 80, (
        "both should count the same planned rows, fewer than all, "
        f"got {a.n_planned!r} and {b.n_planned!r} of {6 * 80!r}")
    c = InfoBatchSampler(80, 6, seed=4)  # another seed draws another plan
    c.load_state_dict({**a.state_dict(), "plan_epoch": None})
    c.set_epoch(2)
    a.set_epoch(2)
    a._plan_epoch = None
    assert list(c) != list(a), f"another seed should draw another plan, got the same {list(c)!r}"


def test_bad_input_fails_early():
    with pytest.raises(ValueError, match="prune_ratio must be in"):
        InfoBatchSampler(10, 4, prune_ratio=1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        InfoBatchSampler(10, 4, delta=1.5)
    s = InfoBatchSampler(10, 4)
    with pytest.raises(ValueError, match="one loss per index"):
        s.update(torch.arange(4), torch.ones(()))
    with pytest.raises(ValueError, match="12 samples, this dataset has 10: resume with"):
        InfoBatchSampler(10, 4).load_state_dict(InfoBatchSampler(12, 4).state_dict())
    with pytest.raises(SystemExit, match="infobatch_ratio must be in"):
        train.run([*TINY, "--rule", "infobatch", "--infobatch-ratio", "1.5", "--out", "/nonexistent/x"])


# ---------------------------------------------------------------- end to end

TINY = ["--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--embed-dim", "16",
        "--num-heads", "2", "--batch-size", "32", "--train-subset", "192", "--eval-subset", "64",
        "--threads", "1", "--warmup-epochs", "0", "--lr", "1e-2", "--backend", "eager"]


def _summary(out: Path) -> list[dict]:
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]




@pytest.mark.parametrize("rule", [["--rule", "infobatch"], ["--rule", "capskip+infobatch", "--budget", "0.5"]])
def test_cli_prunes_forwards_and_resumes_exactly(tmp_path, monkeypatch, rule):
    argv = [*TINY, *rule, "--epochs", "4", "--check-every", "1"]
    full = train.run([*argv, "--out", str(tmp_path / "full")])
    rows = _summary(tmp_path / "full")
    per_epoch = [int(r["rows"]) - (int(p["rows"]) if p else 0) for r, p in zip(rows, [None, *rows[:-1]])]
    # epoch 1 all 192 rows; epochs 2-3 pruned (delta 0.875 of 4 = 3.5); epoch 4 all rows again
    assert per_epoch[0] == per_epoch[3] == 192, per_epoch
    assert per_epoch[1] < 192, per_epoch
    assert per_epoch[2] < 192, per_epoch
    assert [int(r["rows_seen"]) for r in rows] == [192, 384, 576, 768], (
        "rows_seen should count all 192 rows every epoch, pruned or not, "
        f'got {[int(r["rows_seen"]) for r in rows]!r}')
    assert full["forward_frac"] < 1, (
        f'pruning should forward less than all the data, got forward_frac {full["forward_frac"]!r}')
    assert full["steps"] < 4 * 6, (
        f'pruned epochs should take fewer steps than 4 full epochs of 6, got {full["steps"]!r}')
    assert float(rows[-1]["lr"]) == pytest.approx(1e-5), (
        f'the schedule should anneal fully over the shorter epochs, got final lr {float(rows[-1]["lr"])!r}')
    checks = _jsonl(tmp_path / "full" / "checks.jsonl")
    assert len(checks) == full["steps"], (
        f'--check-every 1 should check every step, got {len(checks)!r} checks for {full["steps"]!r} steps')
    assert full["violations"] == 0, f'no step may break its bound, got {full["violations"]!r} violations'
    steps = _jsonl(tmp_path / "full" / "steps.jsonl")
    if rule[1] == "infobatch":  # dense model: the weighted training gradient is the weighted dense one
        assert max(c["rel_l2_all"] for c in checks) < 1e-5, (
            "plain InfoBatch's weighted gradient should equal the weighted dense one, "
            f'rel err {max(c["rel_l2_all"] for c in checks)!r}')
    else:  # the bound is on the weighted loss's head gradient, as measured
        assert any(s["kept"] < s["n"] for s in steps), "capskip+infobatch should skip some rows' backward in some step"
        for c in checks:
            assert c["rel_l2_head"] == pytest.approx(c["bound"], abs=1e-5), (
                "the measured head-gradient error should equal the certified bound, "
                f'got {c["rel_l2_head"]!r} vs bound {c["bound"]!r}')
            assert c["rel_l2_head"] <= 0.5 + 1e-4, (
                f'the head-gradient error must stay within the budget 0.5, got {c["rel_l2_head"]!r}')

    # killed in epoch 3, after epoch 2's checkpoint
    run_killed_at_evaluation(monkeypatch, loop, 3, lambda: train.run([*argv, "--out", str(tmp_path / "cut")]))
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ck["epoch"] == 2, f'a run killed in epoch 3 should leave epoch 2\'s checkpoint, got epoch {ck["epoch"]!r}'
    assert ck["infobatch"]["scores"].shape == (192,), (
        "the checkpoint should carry InfoBatch's score of every training row, "
        f'got shape {ck["infobatch"]["scores"].shape!r}')
    res = train.run(["--resume", str(tmp_path / "cut" / "checkpoint.pt")])
    assert_resumed_exactly(rows, _summary(tmp_path / "cut"), full, res)
    sa, sb = steps, _jsonl(tmp_path / "cut" / "steps.jsonl")
    assert [(s["step"], s["loss"], s["kept"]) for s in sa] == [(s["step"], s["loss"], s["kept"]) for s in sb], (
        "the resumed run should replay the same steps, losses and kept counts as the uninterrupted one; "
        f'got {[(s["step"], s["loss"], s["kept"]) for s in sa]!r} '
        f'vs {[(s["step"], s["loss"], s["kept"]) for s in sb]!r}')


def test_weighted_step_gradient_matches_float64_reference(tmp_path):
    """One pruned-epoch step of the harness: the parameters' gradient is that of the reference's
    update() loss, mean(weight * per-sample CE), computed in float64 on a copy of the model."""
    import copy

    import torch.nn.functional as F

    cfg = train.parse_config([*TINY, "--rule", "infobatch", "--epochs", "4", "--check-every", "0",
                              "--out", str(tmp_path / "g")])
    run = loop.RunState(cfg)
    with run:
        for batch in run.begin_epoch(1):
            run.step(batch)
        run.end_epoch()
        it = iter(run.begin_epoch(2))
        batch = next(it)
        w = run.infobatch.weights_for(batch[2])
        assert bool((w > 1).any()), "no reweighted sample in the batch: the test would not test the weights"
        ref = copy.deepcopy(run.model).double().train()
        run.step(batch)
        grads = {n: p.grad.clone() for n, p in run.model.named_parameters()}
        x, y = batch[0].double(), batch[1]
        loss = (F.cross_entropy(ref(x), y, reduction="none") * w.double()).mean()
        loss.backward()
        for n, p in ref.named_parameters():
            assert torch.allclose(grads[n].double(), p.grad, rtol=1e-4, atol=1e-6), n
