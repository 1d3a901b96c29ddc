"""Selective-Backprop (Jiang et al. 2019, arXiv 1910.00762), on the forward we already ran.

Per example: loss ``L_i`` (cross-entropy of the logits), keep probability
``p_i = max(p_min, F_R(L_i) ** beta)`` with ``F_R`` the fraction of the last ``R`` recorded
losses strictly below ``L_i``; the current batch is recorded BEFORE the percentiles are taken
(as the authors' code does).  One Bernoulli draw per row; kept rows weigh 1 (the authors dropped
the ``1/p`` reweighting).  With iid losses ``F_R`` is ~uniform, so the expected kept fraction is
``E[U ** beta] = 1 / (beta + 1)``.

``keep=f`` gives the fixed-count variant (Composer): exactly ``max(1, floor(f * N))`` rows, the
highest losses of the batch (ties: batch order); no history.  ``sample=True`` draws that many rows
without replacement with Composer's rank weights ``((r + 0.5) / N) ** (1/f - 1)`` instead.

Unlike the original code there is no second forward (selection reuses the training forward, in
train mode), so a kept row's loss is exactly the one it was selected on.  Rows without a label
(loss NaN) are always kept; they occupy history slots as empty (NaN) entries.  ``prime_epochs``
keeps everything (history still recorded) during the first epochs, like the authors' priming.

Invariants (tests/test_rules_literature.py): decisions are equivariant under batch permutation
(probabilities exactly, fixed-count decisions exactly for distinct losses); deterministic given the
generator state; ``state_dict`` round-trips the history ring and the generator.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .base import HeadView, Selection, selection_dtype
from .labels import infer_targets, per_example_ce
from .random_skip import SeededRule


def view_losses(view: HeadView, dtype: torch.dtype) -> Tensor:
    """Per-example CE in ``dtype``; NaN where the label is unknown."""
    targets = infer_targets(view.delta) if view.targets is None else view.targets.to(view.z.device).long()
    return per_example_ce(view.z, targets).to(dtype)


def percentile_below(loss: Tensor, history: Tensor) -> Tensor:
    """Fraction of the non-NaN ``history`` entries strictly below each loss (0 if history is empty)."""
    h = torch.where(torch.isnan(history), torch.full_like(history, math.inf), history)
    sorted_h = torch.sort(h).values
    below = torch.searchsorted(sorted_h, loss.contiguous(), side="left")
    count = (~torch.isnan(history)).sum()  # empty (NaN) slots sort as +inf: never "below"
    return below.to(loss.dtype) / count.clamp_min(1).to(loss.dtype)


def sb_keep_prob(loss: Tensor, history: Tensor, beta: float, p_min: float = 0.0) -> Tensor:
    """SB's keep probability; 1 for rows without a loss."""
    p = percentile_below(loss, history).pow(beta).clamp(min=p_min, max=1.0)
    return torch.where(torch.isnan(loss), torch.ones_like(p), p)


def top_loss_mask(loss: Tensor, k: int) -> Tensor:
    """Exactly ``k`` rows with the highest loss (NaN counts as highest; ties: batch order)."""
    key = torch.where(torch.isnan(loss), torch.full_like(loss, math.inf), loss)
    order = torch.argsort(key, descending=True, stable=True)
    keep_sorted = torch.arange(loss.shape[0], device=loss.device) < k
    return torch.zeros_like(keep_sorted).index_put((order,), keep_sorted)


def composer_sample_mask(loss: Tensor, k: int, keep: float, u: Tensor) -> Tensor:
    """Composer's draw: ``k`` rows without replacement, weight ``((r+0.5)/N)^(1/keep-1)`` by
    ascending-loss rank ``r``; Efraimidis-Spirakis keys ``log(u) / w``, top k."""
    n = loss.shape[0]
    key = torch.where(torch.isnan(loss), torch.full_like(loss, math.inf), loss)
    rank = torch.argsort(torch.argsort(key, stable=True))
    w = ((rank.to(loss.dtype) + 0.5) / n).pow(1.0 / keep - 1.0)
    es = torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)) / w
    return top_loss_mask(es, k)


class SelectiveBackprop(SeededRule):
    """Keep row i with probability ``percentile(L_i) ** beta`` (or the top ``keep`` fraction)."""

    name = "sb"
    _state_keys = ("history", "hist_pos", "generator_state")

    def __init__(self, beta: float = 2.0, history: int = 1024, keep: Optional[float] = None,
                 p_min: float = 0.0, sample: bool = False, prime_epochs: int = 0, seed: int = 0):
        super().__init__(seed)
        beta = float(beta)
        if not (beta >= 0.0 and math.isfinite(beta)):
            raise ValueError(f"sb beta must be a finite number >= 0, got {beta!r}")
        if int(history) < 1:
            raise ValueError(f"sb history must be >= 1, got {history!r}")
        if keep is not None and not (0.0 < float(keep) <= 1.0):
            raise ValueError(f"sb keep fraction must be in (0, 1], got {keep!r}")
        if not (0.0 <= float(p_min) <= 1.0):
            raise ValueError(f"sb p_min must be in [0, 1], got {p_min!r}")
        self.beta = beta
        self.R = int(history)
        self.keep = None if keep is None else float(keep)
        self.p_min = float(p_min)
        self.sample = bool(sample)
        self.prime_epochs = int(prime_epochs)
        self.history: Optional[Tensor] = None  # (R,) ring buffer of losses, NaN = empty slot
        self.hist_pos = 0  # next slot to write (host int: advances by N, no sync)

    def _history(self, like: Tensor) -> Tensor:
        if self.history is None:
            self.history = torch.full((self.R,), math.nan, dtype=like.dtype, device=like.device)
        elif self.history.dtype != like.dtype or self.history.device != like.device:
            self.history = self.history.to(device=like.device, dtype=like.dtype)
        return self.history

    def record(self, loss: Tensor) -> None:
        """Append losses to the ring (only the last R if more); NaN entries count as empty."""
        hist = self._history(loss)
        m = min(loss.shape[0], self.R)
        if m == 0:
            return
        pos = (self.hist_pos + torch.arange(m, device=hist.device)) % self.R
        hist.index_copy_(0, pos, loss[loss.shape[0] - m:].to(hist.dtype))
        self.hist_pos = (self.hist_pos + m) % self.R

    def keep_prob(self, loss: Tensor) -> Tensor:
        return sb_keep_prob(loss, self._history(loss), self.beta, self.p_min)

    def select(self, view: HeadView) -> Selection:
        n = view.n
        dt = selection_dtype(view.delta)
        loss = view_losses(view, dt)
        if self.keep is not None:
            k = max(1, math.floor(self.keep * n))
            if self.sample:
                keep = composer_sample_mask(loss, k, self.keep, self.uniform(view, n, dt))
            else:
                keep = top_loss_mask(loss, k)
            return Selection(weight=keep.to(dt), info={"loss": loss}, count=min(n, k))
        self.record(loss)
        p = self.keep_prob(loss)
        u = self.uniform(view, n, dt)  # drawn even when priming: the stream stays aligned
        if view.epoch < self.prime_epochs:
            p = torch.ones_like(p)
        return Selection(weight=(u < p).to(dt), info={"prob": p, "loss": loss})

    def __repr__(self) -> str:
        if self.keep is not None:
            return f"SelectiveBackprop(keep={self.keep}, sample={self.sample}, seed={self.seed})"
        return (f"SelectiveBackprop(beta={self.beta}, history={self.R}, p_min={self.p_min}, "
                f"prime_epochs={self.prime_epochs}, seed={self.seed})")
