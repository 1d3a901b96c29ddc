"""Data side of Stale-SB: decide which examples to forward at all, from the rule's loss cache.

:class:`StaleBatchFilter` takes a batch's dataset indices and the epoch and returns a bool mask of
the rows to forward (see :mod:`capskip_fx.rules.stale_sb` for the rule): rows whose cached loss
is fresh and whose draw says "skip" are dropped before the forward; the others are forwarded.  It
counts the forwards saved.  Apply the mask to the batch in the main process, after the loader::

    keep = filt(index, epoch)
    x, y, index = x[keep], y[keep], index[keep]

That gives variable batch sizes.  :class:`StaleBatchSampler` instead wraps a sampler and refills:
it yields fixed-size batches of forwarded indices (the authors' queue), which suits compiled
models.  Both must run in the main process (they read and write the rule's cache); a batch
sampler does (DataLoader workers only receive its index lists).  With prefetching the sampler
runs a few batches ahead of training, so decisions use slightly older losses.

Wiring into a training loop (what a loader needs; the rule keeps the staleness clock, see
:mod:`capskip_fx.rules.stale_sb`):
  * ONE ``StaleSB`` object shared by the compiled model and the filter, built with
    ``num_examples=len(dataset)`` (preallocated cache, no host sync to grow it);
  * a dataset whose items carry the dataset index (``ImageDataset`` yields ``(x, y, index)``), and
    ``cm(x, capskip_index=index)`` on every forward so the rule pairs losses with examples;
  * ``DataLoader(ds, batch_sampler=StaleBatchSampler(sampler, StaleBatchFilter(rule), batch_size))``
    (the batch sampler runs in the main process; workers only receive index lists);
  * the same epoch on both sides: ``batch_sampler.set_epoch(e)`` (also forwarded to a
    ``DistributedSampler``) and ``cm.set_epoch(e)`` on the compiled model; once the filter has run,
    the rule stamps its clock with the filter's epoch, and priming (``prime_epochs``) reads it too;
  * ``filt.state_dict()`` next to the model's in checkpoints (the rule's cache is in the model's);
  * epoch length varies (fewer forwards after priming): an LR schedule keyed to steps must count
    the batches actually yielded.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import Tensor

from .stale_sb import StaleSB


class StaleBatchFilter:
    """Forward mask for a batch of dataset indices, drawn from ``rule``'s cache."""

    def __init__(self, rule: StaleSB, seed: int = 0):
        if not isinstance(rule, StaleSB):
            raise TypeError(f"StaleBatchFilter needs a StaleSB rule, got {type(rule).__name__}")
        self.rule = rule
        self.seed = int(seed)
        self._generator: Optional[torch.Generator] = None
        self.n_seen = 0
        self.n_forwarded = 0

    @property
    def n_saved(self) -> int:
        """Forwards skipped so far."""
        return self.n_seen - self.n_forwarded

    def _uniform(self, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        g = self._generator
        if g is None or g.device.type != device.type:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generator = g
        return torch.rand(n, generator=g, device=device, dtype=dtype)

    def __call__(self, index: Tensor, epoch: int) -> Tensor:
        """(n,) bool on ``index``'s device: True = forward this row."""
        index = torch.as_tensor(index)
        n = index.shape[0]
        c = self.rule.cache_loss  # None until the rule has seen a batch: then no draws are made
        u = None if c is None else self._uniform(n, c.device, c.dtype)
        forward = self.rule.plan_forward(index, epoch, u)[0].to(index.device)
        self.n_seen += n
        self.n_forwarded += int(forward.sum())  # the loader needs the mask on the host anyway
        return forward

    def unforward(self, index: Tensor) -> None:
        """Rows this filter passed that will not be forwarded after all (a dropped tail): not counted
        as forwarded, and their pre-selection cleared (see :meth:`StaleSB.unplan`)."""
        index = torch.as_tensor(index)
        self.rule.unplan(index)
        self.n_forwarded -= int(index.shape[0])

    def state_dict(self) -> dict[str, Any]:
        g = self._generator
        return {"n_seen": self.n_seen, "n_forwarded": self.n_forwarded,
                "generator_state": None if g is None else {"device": str(g.device), "state": g.get_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n_seen = int(state.get("n_seen", 0))
        self.n_forwarded = int(state.get("n_forwarded", 0))
        gs = state.get("generator_state")
        if gs is None:
            self._generator = None
        else:
            g = torch.Generator(device=gs["device"])
            g.set_state(gs["state"].clone())
            self._generator = g

    def __repr__(self) -> str:
        return f"StaleBatchFilter(rule={self.rule!r}, seed={self.seed}, saved={self.n_saved}/{self.n_seen})"


class StaleBatchSampler:
    """Batch sampler: pulls indices from ``sampler`` in chunks of ``batch_size``, filters them, and
    yields batches of exactly ``batch_size`` forwarded indices, then the shorter rest (as the
    reference flushes its queues at each epoch's end, ``lib/trainer.py`` 175-182, 251-254).  With
    ``drop_last`` the rest is dropped instead and handed back to the filter
    (:meth:`StaleBatchFilter.unforward`): not counted as forwarded, pre-selections cleared; those rows
    miss this epoch's training and, if they were due a scoring forward, are scored the next time they
    come up (a deviation from the reference; the harness does not drop).  ``epoch`` advances by one
    after each full pass; ``set_epoch`` sets it."""

    def __init__(self, sampler: Iterable[int], filt: StaleBatchFilter, batch_size: int,
                 drop_last: bool = False, epoch: int = 0):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.sampler = sampler
        self.filter = filt
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """An upper bound: the batches of a pass that forwards every row (fewer once rows are dropped)."""
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _filtered(self, chunk: list[int]) -> list[int]:
        keep = self.filter(torch.tensor(chunk, dtype=torch.long), self.epoch)
        return [i for i, k in zip(chunk, keep.tolist()) if k]

    def __iter__(self) -> Iterator[list[int]]:
        out: list[int] = []
        chunk: list[int] = []
        for i in self.sampler:
            chunk.append(int(i))
            if len(chunk) == self.batch_size:
                out.extend(self._filtered(chunk))
                chunk = []
                while len(out) >= self.batch_size:
                    yield out[: self.batch_size]
                    out = out[self.batch_size:]
        if chunk:
            out.extend(self._filtered(chunk))
        while len(out) >= self.batch_size:
            yield out[: self.batch_size]
            out = out[self.batch_size:]
        if out and not self.drop_last:
            yield out
        elif out:
            self.filter.unforward(torch.tensor(out, dtype=torch.long))
        self.epoch += 1
