"""Upper-bound importance sampling (Katharopoulos & Fleuret 2018, arXiv 1803.00942; algorithms.md §5).

Reference: idiap/importance-sampling ``ImportanceTraining`` (``ConditionalStartSampler`` around a
``ModelSampler``, ``VarianceReductionCondition``, ``BiasedReweightingPolicy(k=1)``).

Presample (deliberate difference): the reference draws a presample of ``B = 3b`` examples
uniformly with replacement from the dataset and forwards it for scoring; we select among the N
rows of the batch already forwarded (the library never runs an extra forward), so the batch IS
the presample, ``B = N``, and ``b`` defaults to ``round(N / 3)`` (upstream's presample ratio 3).

Score ``s_i = ||delta_i||``, the norm of dL/dz_i: ``||softmax(z_i) - y_i||`` up to the common 1/N (and
loss-scale) factor, which cancels in ``p``.  ``smooth > 0`` uses ``s_i + smooth * mean(s)`` (a
relative, scale-free version of the authors' additive smoothing: every row stays drawable and
each draw's weight ``1 / (b p_i)`` is at most ``N (1 + smooth) / (smooth b)``).

Sampler on: draw b indices WITH replacement, ``P(i) = p_i = s_i / sum(s)``; ``c_i`` = how often row i
was drawn (``c ~ Multinomial(b, p)``, ``E[c_i] = b p_i``).  Weight
    ``w_i = c_i / (b p_i)``   (0 for rows never drawn),
so ``E[w_i] = 1`` and ``E[sum_i w_i g_i] = sum_i g_i``: with the loss's own 1/N the applied gradient
``sum_i w_i grad(l_i) / N`` is unbiased for the mean-loss gradient.  This is the authors'
``1/(B p_i)`` per draw (``BiasedReweightingPolicy``, k=1) averaged over the b draws (the Keras loss
is the mean over the b-row training batch): ``(1/b) sum_draws l_j / (N p_j)``
``= (1/N) sum_i [c_i / (b p_i)] l_i``.  A row drawn twice is back-propagated once with twice the
weight.  Rows with ``p_i = 0`` have ``delta_i = 0`` (zero gradient) and get weight 0.

Sampler off (``off="uniform"``, the reference's default): upstream's ``ConditionalStartSampler``
trains on b uniform draws with replacement, each with weight 1 (uniform scores give
``S / (B s) = 1``), i.e. on the mean over the b draws: here ``w_i = c_i N / b`` with
``c ~ Multinomial(b, 1/N)`` (the on-formula at ``p = 1/N``).  ``off="dense"`` trains on all N rows
with weight 1 instead (exact, b-independent; our earlier behaviour).

Switch-on (``VarianceReductionCondition``): ``tau = 1 / sqrt(1 - ||g - u||^2 / ||g||^2)`` with ``g``
the normalised scores and ``u = 1/|g|``, which equals ``sqrt(n * sum g_i^2)`` (>= 1; the equivalent
batch-size gain).  An EMA (momentum 0.9, starting at 0) of tau is kept; a step samples only if the
EMA BEFORE this step's update exceeds ``tau_th``.  As upstream, the EMA is updated once per step:
from the presample's scores while on, from the scores of the b rows trained on while off (with
``off="uniform"``: the drawn rows, duplicates counted; with ``off="dense"``: all N rows).
``tau_th`` defaults to 2.0, upstream's ``(B + 3b) / (3b)`` at its ``B = 3b``; ``tau_th=None``
evaluates that formula with ``B = N`` and our b (1.992 at N = 128); ``tau_th <= 0`` samples from the
first step.  The switch is re-evaluated every step, as upstream (no latch).  The draw is made on every
step, so the random stream does not depend on the switch.

``b``: None = round(N/3); a float in (0, 1] = that fraction of N; an int >= 1 = that many draws.
At least one draw.  ``normalize``: ``"batch"`` (default; the weights above) or ``"kept"``
(self-normalised: ``w * N / sum(w)``).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .base import HeadView, SeededRule, Selection, check_normalize, selection_dtype


def ub_probs(delta: Tensor, smooth: float = 0.0) -> Tensor:
    """(N,) sampling probabilities from ``||delta_i||`` (uniform when every score is 0).  Token-shaped
    delta (N, T, C): the sequence's norm over all its tokens (ignored tokens have delta 0)."""
    dt = selection_dtype(delta)
    s = torch.linalg.vector_norm(delta.to(dt).flatten(1), dim=1)
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


def vr_tau(scores: Tensor, mult: Optional[Tensor] = None) -> Tensor:
    """Upstream's variance-reduction ``1/sqrt(1 - ||g-u||^2/||g||^2) = sqrt(n sum g^2)`` of the
    (multi)set of ``scores`` (``mult``: multiplicities, n = their sum); 1 when every score is 0."""
    m = torch.ones_like(scores) if mult is None else mult.to(scores.dtype)
    n = m.sum()
    tot = (m * scores).sum()
    sq = (m * scores.square()).sum()
    tau = (n * sq).sqrt() / tot.clamp_min(torch.finfo(scores.dtype).tiny)
    return torch.where(tot > 0, tau, torch.ones_like(tau))


def ub_weights(p: Tensor, counts: Tensor, b: int) -> Tensor:
    """``c_i / (b p_i)``; rows with p_i = 0 (zero gradient) weigh 0."""
    pos = p > 0
    w = counts / (b * torch.where(pos, p, torch.ones_like(p)))
    return torch.where(pos, w, torch.zeros_like(w))


class UpperBoundIS(SeededRule):
    """Importance-sample b rows with replacement by ``||delta_i||``; weights ``c_i / (b p_i)``."""

    name = "ub"
    needs_labels = True  # reads no label, but its scores need a real dL/dz: the runtime's zero / softmax checks
    _state_keys = ("tau_ema", "generator_state")
    journaled = True
    reads_logits = False  # its scores are ||dL/dz_i||

    def __init__(self, b: Union[None, int, float] = None, tau_th: Optional[float] = 2.0,
                 momentum: float = 0.9, smooth: float = 0.0, seed: Optional[int] = None, off: str = "uniform",
                 normalize: str = "batch"):
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
        if off not in ("uniform", "dense"):
            raise ValueError(f"ub off must be 'uniform' (the reference) or 'dense', got {off!r}")
        self.b = b
        self.tau_th = None if tau_th is None else float(tau_th)
        self.momentum = float(momentum)
        self.smooth = float(smooth)
        self.off = off
        self.normalize = check_normalize(normalize, "ub")
        self.tau_ema: Optional[Tensor] = None  # 0-dim, on the device: the switch needs no host sync

    def draws(self, n: int) -> int:
        if self.b is None:
            return max(1, round(n / 3))
        if isinstance(self.b, float):
            return max(1, round(self.b * n))
        return int(self.b)

    def threshold(self, n: int, b: int) -> float:
        return (n + 3 * b) / (3 * b) if self.tau_th is None else self.tau_th

    def select(self, view: HeadView) -> Selection:
        n = view.n
        dt = selection_dtype(view.delta)
        if n == 0:
            return Selection(weight=view.delta.new_zeros(0, dtype=dt))
        b = self.draws(n)
        p = ub_probs(view.delta, self.smooth)
        s = torch.linalg.vector_norm(view.delta.to(dt).flatten(1), dim=1)
        ema = self.tau_ema
        ema = p.new_zeros(()) if ema is None else ema.to(device=p.device, dtype=dt)
        th = self.threshold(n, b)
        on = (ema > th) if th > 0 else torch.ones((), dtype=torch.bool, device=p.device)
        u = self.uniform(view, b, dt)
        counts = ub_counts(p, u)
        if self.off == "uniform":
            uni = torch.full_like(p, 1.0 / n)
            counts_off = ub_counts(uni, u)  # same draws u, uniform inverse CDF
            w_off = ub_weights(uni, counts_off, b)
            tau_off = vr_tau(s, counts_off)  # upstream: the trained batch's scores
        else:
            counts_off = torch.ones_like(p)
            w_off = torch.ones_like(p)
            tau_off = vr_tau(s)
        tau = torch.where(on, vr_tau(p), tau_off)  # on: the presample's (smoothed) scores
        self.note_attr("tau_ema")
        self.tau_ema = self.momentum * ema + (1 - self.momentum) * tau
        w = torch.where(on, ub_weights(p, counts, b), w_off)
        counts = torch.where(on, counts, counts_off)
        return self.finish(Selection(weight=w, info={"prob": p, "counts": counts, "on": on, "tau": tau,
                                                     "tau_ema": self.tau_ema, "b": b}))

    def __repr__(self) -> str:
        return (f"UpperBoundIS(b={self.b!r}, tau_th={self.tau_th!r}, momentum={self.momentum}, "
                f"smooth={self.smooth}, off={self.off!r}, seed={self.seed})")
