"""Selective-Backprop (Jiang et al. 2019, arXiv 1910.00762), on the forward we already ran.

Defaults are the authors' code (angelajiang/SelectiveBackprop, algorithms.md §2):
per example: loss ``L_i`` (cross-entropy of the logits), keep probability
``p_i = max(p_min, F_R(L_i) ** beta)`` with ``F_R`` the fraction of the last ``R`` recorded
losses strictly below ``L_i``; the current batch is recorded BEFORE the percentiles are taken
(``BatchedRelativeProbabilityCalculator``).  ``beta=3`` (``prob_pow`` in ``examples/train.py``),
``R=1024``, ``p_min=0``.  One Bernoulli draw per row; no ``1/p`` reweighting (commented out
upstream).  With iid losses ``F_R`` is ~uniform, so the expected kept fraction is
``E[U ** beta] = 1 / (beta + 1)`` (1/4 at beta = 3).

Priming (``prime_epochs=1``, upstream's ``PrimedSelector`` over ``num_training_images``): during
the first epochs every row is kept and the loss history is NOT touched (upstream's
``BaselineSelector`` never calls the probability calculator), so the percentiles start from the
first post-priming batch.  ``prime_epochs=0`` disables priming.

Step scale (``normalize``): upstream queues the selected examples until ``batch_size`` of them are
selected and takes one optimizer step on their MEAN loss; Composer also trains on the mean of its
subset.  ``normalize="kept"`` (default) gives that: each kept row weighs ``N / k``, so the step is
the kept rows' mean.  ``normalize="batch"`` keeps the loss's 1/N (step = ``k/N`` of that).
Deliberate difference: we select among the batch already forwarded and step once per batch (no
queue), so a step averages over the ``k`` rows this batch kept, not over ``batch_size`` selected
rows gathered from several batches.

Composer's variant (``keep=f``; mosaicml/composer ``selective_backprop.py``, algorithms.md §2.6):
  * schedule (``should_selective_backprop``): active when the elapsed fraction of training is in
    ``[start, end)`` (defaults 0.5, 0.9) and ``interrupt == 0`` or ``(batch_in_epoch + 1) %
    interrupt != 0`` (default 2: SB steps alternate with full-batch steps).  The elapsed fraction is
    ``view.step / total_steps`` (Composer with ``max_duration`` in batches) or
    ``view.epoch / total_epochs`` (``max_duration`` in epochs: constant within an epoch).  Without
    either the window cannot be placed: a warning, and the window counts as open.  ``batch_in_epoch``
    is counted by the rule (steps since it first saw ``view.epoch``'s value).  An inactive step keeps
    every row (weight 1).  ``start=0, end=1, interrupt=0``: every step.
  * draw (``sample=True``, the default with ``keep=``): exactly ``int(keep * N)`` rows without
    replacement, with weights ``((r + 0.5) / N) ** (1/keep - 1)`` by ascending-loss rank ``r``
    (Efraimidis-Spirakis keys: the same distribution as sequential draws, i.e.
    ``np.random.choice(N, k, replace=False, p)``).  ``sample=False``: the ``k`` highest losses
    (deterministic top-k; ties: batch order).
  * ``int(keep * N) == 0``: Composer then trains on an empty batch (a zero-gradient step); so do we
    (every weight 0).  ``min_keep=1`` keeps at least one row instead.
  * no history; ``keep == 1``: dense (Composer never activates for ``keep >= 1``).

Unlike the original code there is no second forward (selection reuses the training forward, in
train mode), so a kept row's loss is exactly the one it was selected on.  Rows without a label
(loss NaN) are always kept; they occupy history slots as empty (NaN) entries.

Invariants (tests/test_rules_literature.py, tests/test_rules_parity.py): decisions are equivariant
under batch permutation (probabilities exactly, fixed-count decisions exactly for distinct losses);
deterministic given the generator state; ``state_dict`` round-trips the history ring and the
generator; keep probabilities, priming and Composer's schedule and draw match re-derivations of the
references.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from .base import HeadView, SeededRule, Selection, check_normalize, positions, selection_dtype, view_losses


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
    key = torch.nan_to_num(loss, nan=math.inf, posinf=math.inf, neginf=-math.inf)
    order = torch.argsort(key, descending=True, stable=True)
    keep_sorted = positions(loss.shape[0], loss.device) <= k
    return keep_sorted.scatter(0, order, keep_sorted)  # order is a permutation: every row written


def composer_sample_mask(loss: Tensor, k: int, keep: float, u: Tensor) -> Tensor:
    """Composer's draw: ``k`` rows without replacement, weight ``((r+0.5)/N)^(1/keep-1)`` by
    ascending-loss rank ``r``; Efraimidis-Spirakis keys ``log(u) / w``, top k."""
    n = loss.shape[0]
    key = torch.nan_to_num(loss, nan=math.inf, posinf=math.inf, neginf=-math.inf)
    rank = torch.argsort(torch.argsort(key, stable=True))
    w = ((rank.to(loss.dtype) + 0.5) / n).pow(1.0 / keep - 1.0)
    es = torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)) / w
    return top_loss_mask(es, k)


class SelectiveBackprop(SeededRule):
    """Keep row i with probability ``percentile(L_i) ** beta`` (or Composer's ``keep`` fraction)."""

    name = "sb"
    needs_labels = True  # per-example CE
    _state_keys = ("history", "hist_pos", "generator_state", "epoch_start")
    journaled = True  # a step notes the slots it writes: undone in O(N), whatever R

    def __init__(self, beta: float = 3.0, history: int = 1024, keep: Optional[float] = None,
                 p_min: float = 0.0, sample: Optional[bool] = None, prime_epochs: int = 1, seed: Optional[int] = None,
                 normalize: str = "kept", start: float = 0.5, end: float = 0.9, interrupt: int = 2,
                 total_steps: Optional[int] = None, total_epochs: Optional[int] = None, min_keep: int = 0):
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
        if not (0.0 <= float(start) <= float(end) <= 1.0):
            raise ValueError(f"sb needs 0 <= start <= end <= 1, got start={start!r}, end={end!r}")
        if int(interrupt) < 0:
            raise ValueError(f"sb interrupt must be >= 0, got {interrupt!r}")
        for nm, v in (("total_steps", total_steps), ("total_epochs", total_epochs)):
            if v is not None and int(v) < 1:
                raise ValueError(f"sb {nm} must be >= 1, got {v!r}")
        if int(min_keep) < 0:
            raise ValueError(f"sb min_keep must be >= 0, got {min_keep!r}")
        self.beta = beta
        self.R = int(history)
        self.keep = None if keep is None else float(keep)
        self.p_min = float(p_min)
        self.sample = True if sample is None else bool(sample)
        self.prime_epochs = int(prime_epochs)
        self.normalize = check_normalize(normalize, self.name)
        self.start, self.end, self.interrupt = float(start), float(end), int(interrupt)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.total_epochs = None if total_epochs is None else int(total_epochs)
        self.min_keep = int(min_keep)
        self.history: Optional[Tensor] = None  # (R,) ring buffer of losses, NaN = empty slot
        self.hist_pos = 0  # next slot to write (host int: advances by N, no sync)
        self.epoch_start: Optional[tuple[int, int]] = None  # (epoch, its first step): batch_in_epoch
        self._warned_duration = False

    def _history(self, like: Tensor) -> Tensor:
        if self.history is None:
            self.note_attr("history")
            self.history = torch.full((self.R,), math.nan, dtype=like.dtype, device=like.device)
        elif self.history.dtype != like.dtype or self.history.device != like.device:
            self.note_attr("history")
            self.history = self.history.to(device=like.device, dtype=like.dtype)
        return self.history

    def record(self, loss: Tensor) -> None:
        """Append losses to the ring (only the last R if more); NaN entries count as empty."""
        hist = self._history(loss)
        m = min(loss.shape[0], self.R)
        if m == 0:
            return
        pos = (self.hist_pos + torch.arange(m, device=hist.device)) % self.R
        self.note_rows(hist, pos)
        hist.index_copy_(0, pos, loss[loss.shape[0] - m:].to(hist.dtype))
        self.note_attr("hist_pos")
        self.hist_pos = (self.hist_pos + m) % self.R

    def keep_prob(self, loss: Tensor) -> Tensor:
        return sb_keep_prob(loss, self._history(loss), self.beta, self.p_min)

    def priming(self, epoch: int) -> bool:
        return epoch < self.prime_epochs

    # -- Composer's schedule ------------------------------------------------------------------
    def elapsed(self, view: HeadView) -> Optional[float]:
        """Composer's elapsed duration in [0, 1]: step / total_steps, else epoch / total_epochs."""
        if self.total_steps is not None:
            return view.step / self.total_steps
        if self.total_epochs is not None:
            return view.epoch / self.total_epochs
        return None

    def batch_in_epoch(self, view: HeadView) -> int:
        if self.epoch_start is None or self.epoch_start[0] != view.epoch:
            self.note_attr("epoch_start")
            self.epoch_start = (view.epoch, view.step)
        return view.step - self.epoch_start[1]

    def composer_active(self, view: HeadView) -> bool:
        """Composer's ``should_selective_backprop`` (and its ``keep < 1`` gate)."""
        b = self.batch_in_epoch(view)
        if self.keep is None or self.keep >= 1.0:
            return False
        el = self.elapsed(view)
        if el is None:
            if not self._warned_duration and (self.start > 0.0 or self.end < 1.0):
                warnings.warn("capskip_fx: sb keep=: Composer's schedule needs total_steps= or total_epochs= to place "
                              f"its [start, end) = [{self.start}, {self.end}) window; without them the window "
                              "counts as open (pass start=0, end=1 to silence this)", stacklevel=2)
                self._warned_duration = True
            in_window = True
        else:
            in_window = self.start <= el < self.end
        return in_window and (self.interrupt == 0 or (b + 1) % self.interrupt != 0)

    def select(self, view: HeadView) -> Selection:
        n = view.n
        dt = selection_dtype(view.delta)
        loss = view_losses(view, dt)
        if self.keep is not None:
            active = self.composer_active(view)
            u = self.uniform(view, n, dt)  # drawn on every step: the stream does not depend on the schedule
            if not active:
                return self.finish(Selection(weight=torch.ones_like(loss), info={"loss": loss, "active": False},
                                             count=n))
            k = min(n, max(self.min_keep, int(self.keep * n)))
            keep = composer_sample_mask(loss, k, self.keep, u) if self.sample else top_loss_mask(loss, k)
            return self.finish(Selection(weight=keep.to(dt), info={"loss": loss, "active": True}, count=k))
        u = self.uniform(view, n, dt)  # drawn even when priming: the stream stays aligned
        if self.priming(view.epoch):  # upstream's BaselineSelector: keep all, history untouched
            p = torch.ones_like(loss)
        else:
            self.record(loss)
            p = self.keep_prob(loss)
        return self.finish(Selection(weight=(u < p).to(dt), info={"prob": p, "loss": loss}))

    def __repr__(self) -> str:
        if self.keep is not None:
            return (f"SelectiveBackprop(keep={self.keep}, sample={self.sample}, start={self.start}, "
                    f"end={self.end}, interrupt={self.interrupt}, total_steps={self.total_steps}, "
                    f"total_epochs={self.total_epochs}, normalize={self.normalize!r}, seed={self.seed})")
        return (f"SelectiveBackprop(beta={self.beta}, history={self.R}, p_min={self.p_min}, "
                f"prime_epochs={self.prime_epochs}, normalize={self.normalize!r}, seed={self.seed})")
