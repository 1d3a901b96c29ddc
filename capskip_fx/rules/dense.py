"""Keep every row: the reference.  The backward runs un-gathered (no gather, no padding)."""
from __future__ import annotations

from .base import HeadView, Rule, Selection


class Dense(Rule):
    name = "dense"

    def select(self, view: HeadView) -> Selection:
        return Selection(weight=view.delta.new_ones(view.n))
