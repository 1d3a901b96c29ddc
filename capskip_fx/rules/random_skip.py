"""Random skipping: the "does the rule beat chance?" baseline (arXiv 2312.05021).

``RandomSkip(keep=f)`` keeps exactly ``max(1, round(f * N))`` rows, a uniformly random subset.
``RandomSkip(match=rule)`` runs ``rule`` on the same view and keeps a uniformly random subset of
the SAME size as ``rule`` kept (0 included), so a rule and its random twin skip equally many rows
on every step.  Kept rows weigh 1 with the loss's 1/N (``normalize="batch"``, the default, like
CAPSkip), or ``N / k`` with ``normalize="kept"`` (the mean over the kept rows, as SB's and Composer's
steps are; for a uniform subset it is also Horvitz-Thompson for inclusion probability ``k / N``,
hence the older spelling ``unbiased=True``, which is the same thing).  To compare with ``sb`` at
its default normalisation, use ``normalize="kept"``.

Invariants (tests/test_rules_literature.py):
  * the kept count is exact (``match=``: equal to the matched rule's count, step by step);
  * every subset of that size is equally likely; the count does not depend on the batch order;
  * with the same generator state the decision is the same.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from .base import HeadView, Rule, SeededRule, Selection, check_normalize, selection_dtype
from .registry import rule_spec


def random_ranks(u: Tensor) -> Tensor:
    """Rank of each key among ``u`` (0 = smallest): a uniformly random permutation for iid keys."""
    return torch.argsort(torch.argsort(u))


class RandomSkip(SeededRule):
    """Keep a uniformly random subset: ``keep`` fraction, or as many rows as ``match`` keeps."""

    name = "random"
    _state_keys = ("generator_state", "match_state")

    def __init__(self, keep: Optional[float] = None, match: Union[None, str, Rule] = None,
                 unbiased: bool = False, seed: Optional[int] = None, normalize: Optional[str] = None):
        super().__init__(seed)
        if normalize is None:
            normalize = "kept" if unbiased else "batch"
        elif unbiased and normalize != "kept":
            raise ValueError("random: unbiased=True is normalize='kept'; do not combine it with normalize='batch'")
        self.normalize = check_normalize(normalize, "random")
        if match is not None and keep is not None:
            raise ValueError("random: give either keep= or match=, not both")
        if match is None:
            keep = 0.5 if keep is None else float(keep)
            if not (0.0 < keep <= 1.0):
                raise ValueError(f"random keep fraction must be in (0, 1], got {keep!r}")
        elif isinstance(match, str):  # a registered name (rules/__init__.py registers them all on import)
            match = rule_spec(match, standalone=True).factory()
        elif not isinstance(match, Rule):
            raise TypeError(f"random match= must be a Rule or a rule name, got {type(match).__name__}")
        self.keep = keep
        self.match = match
        self.unbiased = self.normalize == "kept"

    @property
    def needs_labels(self) -> bool:
        """A random twin reads labels only through the rule it matches."""
        return self.match is not None and self.match.needs_labels

    @property
    def reads_gradient(self) -> bool:
        """Likewise dL/dz: a fixed fraction reads none."""
        return self.match is not None and self.match.reads_gradient

    @property
    def reads_logits(self) -> bool:
        """And the logits."""
        return self.match is not None and self.match.reads_logits

    journaled = True  # its generator is noted where it draws; the matched rule keeps its own transaction

    def begin_step(self) -> None:
        super().begin_step()
        if self.match is not None:
            self.match.begin_step()

    def commit_step(self) -> None:
        super().commit_step()
        if self.match is not None:
            self.match.commit_step()

    def undo_step(self) -> None:
        if self.match is not None:
            self.match.undo_step()
        super().undo_step()

    @property
    def match_state(self) -> Optional[dict[str, Any]]:
        return None if self.match is None else self.match.state_dict()

    @match_state.setter
    def match_state(self, value: Optional[dict[str, Any]]) -> None:
        if self.match is not None and value is not None:
            self.match.load_state_dict(value)

    def select(self, view: HeadView) -> Selection:
        n = view.n
        dt = selection_dtype(view.z)
        info: dict[str, Any] = {}
        if self.match is None:  # the host knows k
            count = min(n, max(1, round(self.keep * n)))
            keep = random_ranks(self.uniform(view, n, dt)) < count
            info["n_keep"] = count
            info["prob"] = torch.full((n,), count / max(n, 1), dtype=dt, device=view.z.device)
            return self.finish(Selection(weight=keep.to(dt), info=info, count=count))
        other = self.match.select(view)
        k = (other.weight > 0).sum()  # stays on the device: no host sync
        info["matched"] = other
        keep = random_ranks(self.uniform(view, n, dt)) < k
        info["n_keep"] = k
        info["prob"] = (k.to(dt) / max(n, 1)).expand(n)
        return self.finish(Selection(weight=keep.to(dt), info=info))

    def __repr__(self) -> str:
        what = f"match={self.match!r}" if self.match is not None else f"keep={self.keep}"
        return f"RandomSkip({what}, unbiased={self.unbiased}, seed={self.seed})"
