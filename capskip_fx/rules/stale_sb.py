"""Stale-SB (Jiang et al. 2019, arXiv 1910.00762 §Stale-SB): Selective-Backprop that also skips
forwards, by deciding on a cached loss while that loss is fresh enough.

The rule keeps, per dataset index (``view.index``), the last loss it saw and the epoch it was seen
in.  A cached loss is *fresh* at epoch ``e`` when ``0 <= e - cached_epoch < staleness``
(``staleness=2``: a loss seen in epoch e is reused in epoch e+1 and refreshed in e+2; ``1``: never
reused, i.e. plain SB).  The data side (:class:`capskip_fx.rules.stale_sb_filter.StaleBatchFilter`) looks
at each incoming example BEFORE its forward:
  * stale or never seen: forward it; the rule decides on its fresh loss as SB does;
  * fresh: draw ``u < F_R(L_cached) ** beta`` (percentile against the SB history, to which the
    batch's cached losses are appended first); on "skip" the example is not forwarded at all (the
    forward saved); on "keep" it is forwarded and marked pre-selected, and the rule keeps it with
    weight 1 (no second draw, which would keep it with probability ``p**2``).
The SB history gets the loss each decision used, at decision time, as the reference's
(``lib/fp_selectors.py`` 62 hands the cached loss to the selector, ``lib/trainer.py`` 233 marks the
whole forward batch, ``lib/calculators.py`` 77-80 appends its losses before ranking): a fresh row's
cached loss by the filter, dropped or kept; a forwarded-for-scoring row's fresh loss by the rule.  A
pre-selected row's training forward is not recorded again, but its loss refreshes the cached VALUE
(``lib/backproppers.py`` 71-76).  Measured against a transcription of the reference loop
(250 examples, batch 16, 64 seeds; ``tests/test_rules_parity.py`` runs 16): back-propagated fraction in the
cached epochs within 1.5 standard errors (+0.006 at staleness 2, +0.003 at 3); recording the kept
rows' fresh losses later instead kept 0.065 more.  Remaining difference, deliberate: the filter ranks
each sampler chunk of ``batch_size`` rows, the reference each forward batch it queues (up to
``4 * batch_size`` + one loader batch).
Losses are paired with examples through ``view.index``, never by position (the defect of the
authors' ``forward_pass``, algorithms.md §2.5).

The staleness clock is the reference's (``StaleSelector`` + ``CutoutForwardpropper``): it counts
epochs since the example's last SELECTION forward.  A row forwarded because its cache was stale (or
empty) restarts the clock; a pre-selected row (fresh cache, drew "keep") is forwarded only to be
trained on: its loss refreshes the cached value (upstream's backpropper writes ``metadata["loss"]``)
but not the clock (upstream resets ``epochs_since_update`` only in the selection forward).  So a row
kept every epoch is still re-scored every ``staleness`` epochs.

Defaults as upstream: ``beta=3``, ``staleness=2`` (the ``SelectiveBackpropper`` signature; its
``examples/train.py`` CLI passes 3), one primed epoch during which everything is forwarded and
kept and the SB history is not touched, ``normalize="kept"`` (see
:mod:`capskip_fx.rules.selective_backprop`).

Epochs: once a filter has run, losses are stamped with the epoch the data side gave it (the
runtime's ``view.epoch`` need not be maintained; a prefetching sampler may stamp the last batches
of an epoch with the next one); before that, with ``view.epoch``.

Without ``view.index`` the rule is plain SB.  Pass ``num_examples`` (the dataset size) to
preallocate the cache; otherwise it grows on demand, which reads ``index.max()`` (a host sync when
the index lives on an accelerator).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from .base import HeadView, Selection, selection_dtype, view_losses
from .selective_backprop import SelectiveBackprop

#: ``cache_epoch`` of an index never seen (far enough below any epoch to never be fresh)
NEVER = -(2 ** 62)


class StaleSB(SelectiveBackprop):
    """SB with a per-index loss cache reused for ``staleness`` epochs (see module docstring)."""

    name = "stale_sb"
    _state_keys = ("history", "hist_pos", "generator_state", "cache_loss", "cache_epoch", "presel",
                   "data_epoch")
    journaled = True  # a step notes the cache rows of its batch: undone in O(N), whatever the dataset's size

    def __init__(self, beta: float = 3.0, history: int = 1024, staleness: int = 2,
                 num_examples: Optional[int] = None, p_min: float = 0.0, prime_epochs: int = 1,
                 seed: Optional[int] = None, normalize: str = "kept"):
        super().__init__(beta=beta, history=history, p_min=p_min, prime_epochs=prime_epochs, seed=seed,
                         normalize=normalize)
        if int(staleness) < 0:
            raise ValueError(f"stale_sb staleness must be >= 0 epochs, got {staleness!r}")
        self.staleness = int(staleness)
        self.num_examples = None if num_examples is None else int(num_examples)
        self.cache_loss: Optional[Tensor] = None  # (M,) last loss seen per dataset index
        self.cache_epoch: Optional[Tensor] = None  # (M,) int64 epoch of the last SELECTION forward, NEVER if none
        self.presel: Optional[Tensor] = None  # (M,) bool: pre-selected by the filter, not yet seen
        self.data_epoch: Optional[int] = None  # the epoch the data side last gave plan_forward
        self._warned_no_index = False

    # -- cache ------------------------------------------------------------------------------
    def _rebind_cache(self) -> None:
        for name in ("cache_loss", "cache_epoch", "presel"):
            self.note_attr(name)

    def _ensure_cache(self, idx: Tensor, like: Tensor) -> None:
        if self.cache_loss is None:
            self._rebind_cache()
            if self.num_examples is not None:
                size = self.num_examples
            else:
                size = int(idx.max()) + 1 if idx.numel() else 1
            self.cache_loss = torch.full((size,), math.nan, dtype=like.dtype, device=like.device)
            self.cache_epoch = torch.full((size,), NEVER, dtype=torch.long, device=like.device)
            self.presel = torch.zeros(size, dtype=torch.bool, device=like.device)
        elif self.cache_loss.device != like.device or self.cache_loss.dtype != like.dtype:
            self._rebind_cache()
            self.cache_loss = self.cache_loss.to(device=like.device, dtype=like.dtype)
            self.cache_epoch = self.cache_epoch.to(like.device)
            self.presel = self.presel.to(like.device)
        if self.num_examples is None and idx.numel():
            need = int(idx.max()) + 1
            size = self.cache_loss.shape[0]
            if need > size:
                extra = max(need, 2 * size) - size  # doubling: amortised O(1) growth
                self._rebind_cache()
                self.cache_loss = torch.cat([self.cache_loss, self.cache_loss.new_full((extra,), math.nan)])
                self.cache_epoch = torch.cat([self.cache_epoch, self.cache_epoch.new_full((extra,), NEVER)])
                self.presel = torch.cat([self.presel, self.presel.new_zeros(extra)])

    def fresh(self, idx: Tensor, epoch: int) -> Tensor:
        """(n,) bool: each index's last selection forward is less than ``staleness`` epochs old."""
        if self.cache_loss is None:
            return torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
        size = self.cache_loss.shape[0]
        inside = (idx >= 0) & (idx < size)
        age = epoch - self.cache_epoch[idx.clamp(0, size - 1)]
        return inside & (age >= 0) & (age < self.staleness)

    def plan_forward(self, index: Tensor, epoch: int, u: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """Data-side decision for a batch of dataset indices, BEFORE its forward.

        ``u``: (n,) U[0,1) draws on the cache device (may be None while nothing is cached).
        Returns ``(forward, fresh)``, (n,) bool on the cache device.  Records the dropped rows'
        cached losses in the history and marks the fresh rows that drew "keep" as pre-selected
        for :meth:`select`.
        """
        if self.presel is not None and self.data_epoch is not None and int(epoch) != self.data_epoch:
            # the reference flushes its queues at each epoch's end (lib/trainer.py 175-182, 251-254):
            # no pre-selection outlives its epoch, whatever a loader did with the rows
            self.presel.zero_()
        self.data_epoch = int(epoch)
        if self.cache_loss is None:  # nothing cached yet: forward everything
            ones = torch.ones(index.shape, dtype=torch.bool, device=index.device)
            return ones, ~ones
        idx = index.to(self.cache_loss.device).long()
        self._ensure_cache(idx, self.cache_loss)  # grow now: clamped out-of-range rows would alias
        fresh = self.fresh(idx, epoch)
        if epoch < self.prime_epochs:
            fresh = torch.zeros_like(fresh)
        safe = idx.clamp(0, self.cache_loss.shape[0] - 1)
        cached = torch.where(fresh, self.cache_loss[safe], torch.full_like(self.cache_loss[safe], math.nan))
        # every cached loss a decision uses enters the history now, kept or dropped, before ranking
        # (reference lib/calculators.py 77-80); a kept row's later forward is not recorded again
        self.record(cached[fresh])
        chosen = fresh & (u.to(cached.device) < self.keep_prob(cached))
        self.presel[safe] = chosen | self.presel[safe]
        return ~fresh | chosen, fresh

    def unplan(self, index: Tensor) -> None:
        """Rows planned for a forward that will not happen (a batch sampler's dropped tail): clear
        their pre-selection, so a later scoring forward draws and restarts the clock.  Their clocks
        and cached losses stay as they were (the rows were not forwarded)."""
        if self.presel is None or not len(index):
            return
        idx = torch.as_tensor(index).to(self.presel.device).long()
        self.presel[idx[(idx >= 0) & (idx < self.presel.shape[0])]] = False

    # -- rule -------------------------------------------------------------------------------
    def epoch_of(self, view: HeadView) -> int:
        """The epoch losses are stamped with: the data side's when a filter runs (the two clocks
        must agree for freshness to mean anything), else ``view.epoch``."""
        return view.epoch if self.data_epoch is None else self.data_epoch

    def select(self, view: HeadView) -> Selection:
        if view.index is None:
            if not self._warned_no_index:
                warnings.warn("capskip_fx: stale_sb got no dataset indices (view.index is None): acting as plain sb; "
                              "pass the batch's dataset indices as model(x, capskip_index=idx) for stale losses", stacklevel=2)
                self._warned_no_index = True
            return super().select(view)
        n = view.n
        dt = selection_dtype(view.delta)
        loss = view_losses(view, dt)
        idx = view.index.to(loss.device).long()
        self._ensure_cache(idx, loss)
        epoch = self.epoch_of(view)
        pre = self.presel[idx]
        if self.priming(epoch):  # upstream's primed selectors: keep all, history untouched
            p = torch.ones_like(loss)
        else:
            # pre-selected rows were recorded with their cached loss when the filter decided; only
            # the rows scored by this forward enter now (rows decided only after a filter has run, so
            # the mask, a host sync, is taken only then)
            self.record(loss if self.data_epoch is None else loss[~pre])
            p = torch.where(pre, torch.ones_like(loss), self.keep_prob(loss))
        u = self.uniform(view, n, dt)
        seen = ~torch.isnan(loss)
        for t in (self.cache_loss, self.cache_epoch, self.presel):
            self.note_rows(t, idx)
        self.cache_loss[idx] = torch.where(seen, loss.to(self.cache_loss.dtype), self.cache_loss[idx])
        # the clock restarts on selection forwards only (not on a pre-selected row's training forward)
        scored = seen & ~pre
        self.cache_epoch[idx] = torch.where(scored, torch.full_like(idx, epoch), self.cache_epoch[idx])
        self.presel[idx] = False
        return self.finish(Selection(weight=(u < p).to(dt), info={"prob": p, "loss": loss, "preselected": pre}))

    def __repr__(self) -> str:
        return (f"StaleSB(beta={self.beta}, history={self.R}, staleness={self.staleness}, "
                f"num_examples={self.num_examples}, p_min={self.p_min}, "
                f"prime_epochs={self.prime_epochs}, normalize={self.normalize!r}, seed={self.seed})")
