"""Upper-bound importance sampling (Katharopoulos & Fleuret 2018, arXiv 1803.00942; algorithms.md §5).

The batch of N rows is the "presample" (already forwarded, so scoring is free).  Score
``s_i = ||delta_i||``, the norm of dL/dz_i: ``||softmax(z_i) - y_i||`` up to the common 1/N (and
loss-scale) factor, which cancels in ``p``.  ``smooth > 0`` uses ``s_i + smooth * mean(s)`` (a
relative, scale-free version of the authors' additive smoothing: every row stays drawable and
each draw's weight ``1 / (b p_i)`` is at most ``N (1 + smooth) / (smooth b)``).

Draw b indices WITH replacement, ``P(i) = p_i = s_i / sum(s)``; ``c_i`` = how often row i was drawn
(``c ~ Multinomial(b, p)``, ``E[c_i] = b p_i``).  Weight
    ``w_i = c_i / (b p_i)``   (0 for rows never drawn),
so ``E[w_i] = 1`` and ``E[sum_i w_i g_i] = sum_i g_i``: with the loss's own 1/N the applied gradient
``sum_i w_i grad(l_i) / N`` is unbiased for the mean-loss gradient.  This is the authors'
``1/(B p_i)`` per draw averaged over the b draws (B = N): ``(1/b) sum_draws l_j / (N p_j)``
``= (1/N) sum_i [c_i / (b p_i)] l_i``.  A row drawn twice is back-propagated once with twice the
weight.  Rows with ``p_i = 0`` have ``delta_i = 0`` (zero gradient) and get weight 0.

Switch-on (the authors' ``VarianceReductionCondition``): ``tau = 1 / sqrt(1 - ||g - u||^2 / ||g||^2)``
with ``g = p`` and ``u = 1/N``, which equals ``sqrt(N * sum p_i^2)`` (>= 1; the equivalent batch-size
gain).  An EMA (momentum 0.9, starting at 0) of tau is kept; a step samples only if the EMA BEFORE
this step's update exceeds ``tau_th``, otherwise every row is kept with weight 1 (the draw is still
made so the random stream does not depend on the switch).  ``tau_th=None`` uses the authors'
default ``(B + 3b) / (3b)`` with B = N (2 for b = N/3); ``tau_th <= 0`` samples from the first step.
The switch is re-evaluated every step, as upstream (no latch).

``b``: None = round(N/3) (upstream's presample ratio 3); a float in (0, 1] = that fraction of N;
an int >= 1 = that many draws.  At least one draw.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .base import HeadView, Selection, selection_dtype
from .random_skip import SeededRule


def ub_probs(delta: Tensor, smooth: float = 0.0) -> Tensor:
    """(N,) sampling probabilities from ``||delta_i||`` (uniform when every score is 0)."""
    dt = selection_dtype(delta)
    s = torch.linalg.vector_norm(delta.to(dt), dim=1)
    if smooth > 0:
        s = s + smooth * s.mean()
    tot = s.sum()
    uniform = torch.full_like(s, 1.0 / max(s.shape[0], 1))
    return torch.where(tot > 0, s / tot.clamp_min(torch.finfo(dt).tiny), uniform)


def ub_counts(p: Tensor, u: Tensor) -> Tensor:
    """Multinomial counts of ``len(u)`` draws with replacement by inverse CDF (no host sync)."""
    n = p.shape[0]
    cdf = p.cumsum(0)
    idx = torch.searchsorted(cdf, (u * cdf[-1]).contiguous(), right=True).clamp_max(n - 1)
    return torch.zeros_like(p).index_add_(0, idx, torch.ones_like(u))


def ub_weights(p: Tensor, counts: Tensor, b: int) -> Tensor:
    """``c_i / (b p_i)``; rows with p_i = 0 (zero gradient) weigh 0."""
    pos = p > 0
    w = counts / (b * torch.where(pos, p, torch.ones_like(p)))
    return torch.where(pos, w, torch.zeros_like(w))


class UpperBoundIS(SeededRule):
    """Importance-sample b rows with replacement by ``||delta_i||``; weights ``c_i / (b p_i)``."""

    name = "ub"
    _state_keys = ("tau_ema", "generator_state")

    def __init__(self, b: Union[None, int, float] = None, tau_th: Optional[float] = None,
                 momentum: float = 0.9, smooth: float = 0.0, seed: int = 0):
        super().__init__(seed)
        if isinstance(b, bool):
            raise TypeError("ub b must be None, an int count or a float fraction")
        if isinstance(b, float) and not (0.0 < b <= 1.0):
            raise ValueError(f"ub b as a fraction must be in (0, 1], got {b!r} (use an int for a count)")
        if isinstance(b, int) and b < 1:
            raise ValueError(f"ub b as a count must be >= 1, got {b!r}")
        if not (0.0 <= float(momentum) < 1.0):
            raise ValueError(f"ub momentum must be in [0, 1), got {momentum!r}")
        if float(smooth) < 0 or not math.isfinite(float(smooth)):
            raise ValueError(f"ub smooth must be a finite number >= 0, got {smooth!r}")
        self.b = b
        self.tau_th = None if tau_th is None else float(tau_th)
        self.momentum = float(momentum)
        self.smooth = float(smooth)
        self.tau_ema: Optional[Tensor] = None  # 0-dim, on the device: the switch needs no host sync

    def draws(self, n: int) -> int:
        if self.b is None:
            return max(1, round(n / 3))
        if isinstance(self.b, float):
            return max(1, round(self.b * n))
        return int(self.b)

    def select(self, view: HeadView) -> Selection:
        n = view.n
        dt = selection_dtype(view.delta)
        if n == 0:
            return Selection(weight=view.delta.new_zeros(0, dtype=dt))
        b = self.draws(n)
        p = ub_probs(view.delta, self.smooth)
        tau = (n * p.square().sum()).sqrt()
        ema = self.tau_ema
        ema = p.new_zeros(()) if ema is None else ema.to(device=p.device, dtype=dt)
        th = (n + 3 * b) / (3 * b) if self.tau_th is None else self.tau_th
        on = (ema > th) if th > 0 else torch.ones((), dtype=torch.bool, device=p.device)
        self.tau_ema = self.momentum * ema + (1 - self.momentum) * tau
        counts = ub_counts(p, self.uniform(view, b, dt))
        w = torch.where(on, ub_weights(p, counts, b), torch.ones_like(p))
        return Selection(weight=w, info={"prob": p, "counts": counts, "on": on, "tau": tau,
                                         "tau_ema": self.tau_ema, "b": b})

    def __repr__(self) -> str:
        return (f"UpperBoundIS(b={self.b!r}, tau_th={self.tau_th!r}, momentum={self.momentum}, "
                f"smooth={self.smooth}, seed={self.seed})")
