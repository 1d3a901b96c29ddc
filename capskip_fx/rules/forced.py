"""Keep a given set of rows: for tests, benchmarks and externally decided selections.

``keep`` is either a fraction in (0, 1] (the first ``round(keep * N)`` rows are kept, at least
one) or a callable ``(N) -> index tensor or bool mask``.
"""
from __future__ import annotations

from typing import Callable, Union

import torch

from .base import HeadView, Rule, Selection, check_normalize


class Forced(Rule):
    name = "forced"
    needs_labels = False
    reads_gradient = False
    reads_logits = False

    def __init__(self, keep: Union[float, Callable[[int], torch.Tensor]] = 1.0, normalize: str = "batch"):
        self.normalize = check_normalize(normalize, "forced")
        if not callable(keep) and not (0.0 < float(keep) <= 1.0):
            raise ValueError(f"forced keep fraction must be in (0, 1], got {keep!r}")
        self.keep = keep

    def select(self, view: HeadView) -> Selection:
        n = view.n
        if callable(self.keep):
            w = view.z.new_zeros(n)
            sel = torch.as_tensor(self.keep(n), device=w.device)
            if sel.dtype == torch.bool:
                w[sel] = 1
            else:
                w[sel.long()] = 1
            return self.finish(Selection(weight=w))
        count = min(n, max(1, round(float(self.keep) * n)))  # the host knows k
        # two ops (each runs eagerly every step); the row numbers in a dtype that holds them exactly
        dt = view.z.dtype if view.z.dtype in (torch.float32, torch.float64) else torch.float32
        w = torch.arange(n, device=view.z.device, dtype=dt).lt_(count)
        return self.finish(Selection(weight=w, count=count))

    def __repr__(self) -> str:
        return f"Forced(keep={self.keep!r})"
