"""Keep every row: the reference.  The backward runs un-gathered (no gather, no padding)."""
from __future__ import annotations

from .base import HeadView, Rule, Selection, check_normalize


class Dense(Rule):
    name = "dense"
    needs_labels = False
    reads_gradient = False
    reads_logits = False

    def __init__(self, normalize: str = "batch"):  # every row kept: both modes give weight 1
        self.normalize = check_normalize(normalize, "dense")

    def select(self, view: HeadView) -> Selection:
        return Selection(weight=view.z.new_ones(view.n), count=view.n)  # the host knows k: no read
