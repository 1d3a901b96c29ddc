"""K-ABENA: loss-based exclusion of the K easiest rows, compensated by Horvitz-Thompson weights.

This is OUR READING of a one-line public description ("compensated loss-based sample exclusion with
unbiased gradient estimation via Horvitz-Thompson reweighting", algorithms.md §3); the paper's
exact inclusion rule, its K controller and its convergence claim are not public.

The rule, per batch (losses ``l``, per-example last-layer gradients ``g_i = delta_i (x) [h_i; 1]``):
  * sort the rows by ascending loss (rows without a label never take part); the K lowest are the
    candidates for exclusion, and ``l_ref = l_(K+1)``, the lowest loss NOT excluded (for K = all,
    the largest loss);
  * candidate ``i`` gets inclusion probability ``pi_i = clip(l_i / l_ref, pi_min, 1)``: easier rows
    are dropped more often, and pi is continuous at the boundary; every other row has ``pi_i = 1``;
  * the added variance of the HT estimator is ``V(K) = sum_i (1 - pi_i) / pi_i * ||g_i||^2`` with
    ``||g_i||^2 = (delta_i . delta_i)(h_i . h_i + 1)``; K is the largest value with
    ``V(K) <= tau * ||G||^2``, ``||G||^2 = ||sum_i g_i||^2 = 1^T K 1``, ``K = (D D^T) * (H H^T + 1)``
    (computed as ``||D^T [H, 1]||_F^2``, the same number without the N x N Gram).  Raising K
    raises ``l_ref`` and so lowers every candidate's pi: ``V`` is non-decreasing in K and the
    largest admissible K is found by scanning all of them at once (an (N, N) table);
  * draw ``m_i ~ Bernoulli(pi_i)``; weight ``m_i / pi_i``.  So ``E[sum_i w_i g_i] = sum_i g_i``
    (unbiased, conditional on the batch: pi depends only on it), the added variance is ``V(K)``,
    the expected backward fraction is ``mean(pi)``, and weights are at most ``1 / pi_min``.
K thus adapts every step: many rows are excluded when the easy rows' gradients are small next to
the batch gradient, few when they are not.  ``tau`` is scale invariant (1/N and loss scale cancel).  Without a head bias (``bias=False``, or
``view.head_bias`` False) the ``+1`` terms are dropped.  Token-shaped logits (N, T, C): rows are
sequences, ``l`` their per-sequence losses and ``g_i`` their head gradients (base.head_gram: exact, or
sketched for a vocabulary-sized C, whose V(K) is then an unbiased estimate).  A cosine head: ``g_i`` its
weight's per-example gradients (base.cosine_gram).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .base import HeadView, SeededRule, Selection, check_normalize, head_gram, is_cosine, selection_dtype, view_losses


def kabena_probs(loss: Tensor, delta: Tensor, h: Tensor, tau: float, pi_min: float, bias: bool = True,
                 sketch: Optional[int] = None, generator: Optional[torch.Generator] = None):
    """Pure tensor core (no host sync).  Returns ``(pi, K, ratio)``: (N,) inclusion probabilities,
    the number of excluded candidates (0-dim int64) and ``V(K) / ||G||^2`` (0 when G = 0)."""
    dt = selection_dtype(delta)
    d = delta.to(dt)
    loss = loss.to(dt)
    n = d.shape[0]
    if d.dim() == 3 or is_cosine(d, h):  # sequences (exact or sketched) or a cosine head: base.head_gram
        K, gn2, _ = head_gram(d, h, bias, sketch, generator)
        total = K.sum()
    else:
        x = h.to(dt)
        sq_h = (x * x).sum(1) + (1.0 if bias else 0.0)
        gn2 = (d * d).sum(1) * sq_h  # ||g_i||^2
        xh = torch.cat([x, torch.ones_like(x[:, :1])], 1) if bias else x
        total = (d.T @ xh).square().sum()  # ||G||^2
    valid = ~torch.isnan(loss)
    key = torch.where(valid, loss, torch.full_like(loss, math.inf))
    order = torch.argsort(key, stable=True)
    ls = key[order].clamp_min(0)
    gs = gn2[order]
    m = valid.sum()  # rows that can be candidates
    ar = torch.arange(n, device=d.device)
    ks = torch.arange(n + 1, device=d.device)  # K = 0..N
    ref = ls[torch.minimum(ks, m - 1).clamp_min(0)] if n > 0 else ls.new_zeros(n + 1)
    ratio = ls[None, :] / ref[:, None].clamp_min(torch.finfo(dt).tiny)
    cand = ar[None, :] < ks[:, None]  # row K: the first K sorted rows are candidates
    pi_tab = torch.where(cand, ratio.clamp(min=pi_min, max=1.0), torch.ones_like(ratio))
    var = ((1 - pi_tab) / pi_tab * gs[None, :]).sum(1)  # V(K), K = 0..N
    ok = (var <= tau * total) & (ks <= m)
    k = (ks * ok).max()  # V is non-decreasing in K, so this is the admissible prefix's end
    kk = k.reshape(1)  # index_select, not t[k]: a 0-dim device index may be read on the host
    pi_sorted = pi_tab.index_select(0, kk).squeeze(0)
    pi = torch.empty_like(pi_sorted).index_put((order,), pi_sorted)
    v = var.index_select(0, kk).squeeze(0)
    rel = torch.where(total > 0, v / total.clamp_min(torch.finfo(dt).tiny), torch.zeros_like(v))
    return pi, k, rel


class KABENA(SeededRule):
    """Exclude up to K lowest-loss rows with probability ``1 - pi``; kept rows weigh ``1/pi``."""

    name = "kabena"
    needs_labels = True  # per-example CE
    _state_keys = ("generator_state",)
    journaled = True  # its one state, the generator, is noted where it draws (SeededRule.generator)

    def __init__(self, tau: float = 0.1, pi_min: float = 0.1, bias: bool = True, seed: Optional[int] = None,
                 normalize: str = "batch"):
        super().__init__(seed)
        self.normalize = check_normalize(normalize, "kabena")  # "batch": HT with the 1/N denominator
        tau, pi_min = float(tau), float(pi_min)
        if not (tau >= 0.0 and math.isfinite(tau)):
            raise ValueError(f"kabena tau must be a finite number >= 0, got {tau!r}; "
                             "it bounds the added gradient variance relative to ||G||^2")
        if not (0.0 < pi_min <= 1.0):
            raise ValueError(f"kabena pi_min must be in (0, 1], got {pi_min!r}; it caps weights at 1/pi_min")
        self.tau = tau
        self.pi_min = pi_min
        self.bias = bool(bias)

    def select(self, view: HeadView) -> Selection:
        dt = selection_dtype(view.delta)
        loss = view_losses(view, dt)
        pi, k, rel = kabena_probs(loss, view.delta, view.h, self.tau, self.pi_min,
                                  self.bias and view.head_bias, generator=self.generator(view))
        u = self.uniform(view, view.n, dt)
        w = torch.where(u < pi, 1.0 / pi, torch.zeros_like(pi))
        return self.finish(Selection(weight=w, info={"prob": pi, "K": k, "var_ratio": rel}))

    def __repr__(self) -> str:
        return f"KABENA(tau={self.tau}, pi_min={self.pi_min}, bias={self.bias}, seed={self.seed})"
