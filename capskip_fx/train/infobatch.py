"""InfoBatch (Qin et al., ICLR 2024) as the harness's data side: prune well-learned samples at the sampler.

Each epoch the sampler plans the indices to forward: a sample whose last loss (its *score*) is below
the mean score is "well learned", and a random fraction ``prune_ratio`` of those is dropped for the
epoch; the kept well-learned samples get loss weight ``1 / (1 - prune_ratio)`` so the expected
gradient stays that of the full data.  Scores start equal (3.0), so the first epoch keeps every
sample; after ``delta * epochs`` epochs every sample is trained on at weight 1 (annealing).  Scores
are updated from the per-sample loss of the samples forwarded (:meth:`InfoBatchSampler.update`).

Wiring (what ``capskip-train --rule infobatch`` / ``capskip+infobatch`` does):
  * ``DataLoader(ds, batch_size=B, sampler=InfoBatchSampler(len(ds), epochs))`` with a dataset whose
    items carry their index; ``sampler.set_epoch(e)`` before each epoch (0-based);
  * ``per = F.cross_entropy(logits, y, reduction="none")``, ``loss = (per * sampler.weights_for(idx)).mean()``,
    ``sampler.update(idx, per.detach())`` (under DDP: all-gather ``idx`` and the losses first, so every
    rank holds the same scores and plans the same epoch);
  * ``state_dict()`` in the checkpoint: the draws are a function of (seed, epoch) and the state, so a
    resumed run plans the same epochs.

Deviations from the reference (``infobatch/infobatch.py`` of NUS-HPC-AI-Lab/InfoBatch), each on purpose:
  * draws come from ``numpy.random.RandomState`` seeded with the epoch counter (seed 0: the same
    stream as the reference's ``np.random.seed(iterations)``, so the same plans), offset by ``seed``
    so seeds differ, instead of reseeding numpy's global generator;
  * in the annealing epochs the weights are 1 always; the reference resets them only when
    ``delta * epochs`` is a whole number (its ``iterations == stop_prune + 1`` test), otherwise
    its full-data epochs keep the last pruned epoch's 1/(1 - r) weights.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import Tensor

#: the reference's initial score (``torch.ones(n) * 3``): all equal, so the first plan prunes nothing
INITIAL_SCORE = 3.0
_SEED_STRIDE = 100_003  # seed s, epoch e draws from RandomState(e + 1 + s * stride): seed 0 is the reference's


class InfoBatchSampler(torch.utils.data.Sampler):
    """Yields this epoch's planned dataset indices (shuffled); see the module docstring.

    ``num_replicas`` / ``rank``: DDP sharding of the plan, as the reference's ``DistributedIBSampler``
    (a permutation seeded ``seed + epoch``, the tail cut to a multiple of ``num_replicas``, then
    every ``num_replicas``-th position from ``rank``)."""

    def __init__(self, num_examples: int, epochs: int, prune_ratio: float = 0.5, delta: float = 0.875,
                 seed: int = 0, num_replicas: int = 1, rank: int = 0):
        if int(num_examples) < 1 or int(epochs) < 1:
            raise ValueError(f"InfoBatch needs num_examples >= 1 and epochs >= 1, got {num_examples}, {epochs}")
        if not 0.0 <= float(prune_ratio) < 1.0:  # also rejects NaN
            raise ValueError(f"InfoBatch prune_ratio must be in [0, 1), got {prune_ratio!r} "
                             f"(--infobatch-ratio; the reference's default is 0.5)")
        if not 0.0 <= float(delta) <= 1.0:
            raise ValueError(f"InfoBatch delta must be in [0, 1], got {delta!r} (--infobatch-delta; the "
                             f"fraction of epochs that prune, the reference's default is 0.875)")
        if not 0 <= int(rank) < int(num_replicas):
            raise ValueError(f"rank {rank} not in [0, num_replicas={num_replicas})")
        self.n = int(num_examples)
        self.epochs = int(epochs)
        self.prune_ratio = float(prune_ratio)
        # the reference clamps the keep ratio to [0.1, 1]
        self.keep_ratio = min(1.0, max(0.1, 1.0 - self.prune_ratio))
        self.delta = float(delta)
        self.seed = int(seed)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.scores = torch.full((self.n,), INITIAL_SCORE)
        self.weights = torch.ones(self.n)
        self.epoch = 0
        self.plan: Optional[list[int]] = None  # this epoch's indices (this rank's shard), once iterated
        self._plan_epoch: Optional[int] = None
        self.n_seen = 0  # rows a full-data run would have drawn: n per planned epoch (this rank's share)
        self.n_planned = 0  # rows planned (forwarded unless a short last batch is dropped)
        self.n_pruned = 0  # as the reference's num_pruned_samples

    @property
    def stop_prune(self) -> float:
        """Epochs (counted from 1) after which the full data is used: ``epochs * delta``."""
        return self.epochs * self.delta

    def prunes(self, epoch: int) -> bool:
        """Whether 0-based ``epoch`` prunes (the reference's ``iterations`` is epoch + 1 at that reset)."""
        return epoch + 1 <= self.stop_prune

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _rng(self, epoch: int) -> np.random.RandomState:
        return np.random.RandomState(epoch + 1 + self.seed * _SEED_STRIDE)

    def _prune(self, rng: np.random.RandomState) -> list[int]:
        """One pruned plan: all samples at or above the mean score, and a random ``keep_ratio`` share of
        those below it (weight 1 / keep_ratio), shuffled."""
        low = (self.scores < self.scores.mean()).numpy()
        low_idx = np.where(low)[0]
        kept = np.where(~low)[0].tolist()
        chosen = rng.choice(low_idx, int(self.keep_ratio * len(low_idx)), replace=False)
        self.weights[:] = 1
        if len(chosen) > 0:
            self.weights[chosen] = 1 / self.keep_ratio
            kept.extend(chosen)
        self.n_pruned += self.n - len(kept)
        rng.shuffle(kept)
        return [int(i) for i in kept]

    def _full(self, rng: np.random.RandomState) -> list[int]:
        self.weights[:] = 1
        order = list(range(self.n))
        rng.shuffle(order)
        return order

    def _shard(self, plan: list[int], epoch: int) -> list[int]:
        """This rank's share of ``plan`` (drop_last=True, shuffle=True, as DistributedIBSampler)."""
        r = self.num_replicas
        if r == 1:
            return plan
        n = len(plan)
        per = math.ceil((n - r) / r) if n % r != 0 else math.ceil(n / r)
        total = per * r
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        pos = torch.randperm(n, generator=g).tolist()[:total]
        return [plan[p] for p in pos[self.rank:total:r]]

    def plan_epoch(self, epoch: int) -> list[int]:
        """The indices of 0-based ``epoch`` (planned once; later calls return the same list)."""
        if self._plan_epoch != epoch:
            rng = self._rng(epoch)
            whole = self._prune(rng) if self.prunes(epoch) else self._full(rng)
            self.plan = self._shard(whole, epoch)
            self._plan_epoch = epoch
            self.n_seen += -(-self.n // self.num_replicas) if self.num_replicas > 1 else self.n
            self.n_planned += len(self.plan)
        return self.plan

    def __iter__(self) -> Iterator[int]:
        return iter(self.plan_epoch(self.epoch))

    def __len__(self) -> int:
        """This epoch's planned length once iterated; before that an upper bound (the whole data)."""
        return len(self.plan) if self._plan_epoch == self.epoch and self.plan is not None else self.n

    def weights_for(self, index: Tensor) -> Tensor:
        """Loss weights of the samples ``index`` (1, or 1 / keep_ratio for kept low-score samples)."""
        return self.weights[torch.as_tensor(index).cpu().long()]

    def update(self, index: Tensor, loss: Tensor) -> None:
        """Set the scores of ``index`` to their (unweighted, per-sample) ``loss``."""
        index, loss = torch.as_tensor(index), torch.as_tensor(loss)
        if index.shape != loss.shape or index.dim() != 1:
            raise ValueError(f"update needs one loss per index (per-sample, reduction='none'): index "
                             f"{tuple(index.shape)}, loss {tuple(loss.shape)}")
        self.scores[index.cpu().long()] = loss.detach().float().cpu()

    def state_dict(self) -> dict[str, Any]:
        return {"scores": self.scores.clone(), "weights": self.weights.clone(), "epoch": self.epoch,
                "plan_epoch": self._plan_epoch, "plan": None if self.plan is None else torch.tensor(self.plan),
                "n_seen": self.n_seen, "n_planned": self.n_planned, "n_pruned": self.n_pruned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["scores"].shape) != (self.n,):
            raise ValueError(f"InfoBatch state for {state['scores'].shape[0]} samples, this dataset has {self.n}: "
                             f"resume with the dataset and --train-subset of the run that saved it")
        self.scores = state["scores"].clone().float()
        self.weights = state["weights"].clone().float()
        self.epoch = int(state["epoch"])
        self._plan_epoch = state["plan_epoch"]
        self.plan = None if state["plan"] is None else [int(i) for i in state["plan"].tolist()]
        self.n_seen, self.n_planned, self.n_pruned = int(state["n_seen"]), int(state["n_planned"]), int(state["n_pruned"])

    def __repr__(self) -> str:
        return (f"InfoBatchSampler(n={self.n}, epochs={self.epochs}, prune_ratio={self.prune_ratio}, "
                f"delta={self.delta}, seed={self.seed}, pruned={self.n_pruned})")
